"""Train a feature head (drafters/head_model.py) for a target: `specdec train-head` and `train_head()`.

Loss per unrolled step j (weight 0.8^j, training-time test over `ttt` steps): smooth-L1 between the
head's predicted top feature and the target's, plus `ce_weight` x the cross-entropy of the head's draft
distribution against the target's own (its LM head over the true feature), both on the draft vocabulary.
With --precision bf16 (the default where bf16 products are native: a GPU, or a CPU with AMX / AVX512-BF16)
the head's products run under bf16 autocast (weights, AdamW and the target's distribution stay fp32):
about 2x faster per step (2.0 -> 1.0 s for SmolLM2) on this project's 2-core AMX machine.

Seeded and resumable (training/loop.py): batch i comes from a generator seeded by (seed, i) and the
checkpoint (head, AdamW state, step) is written atomically every few minutes, so a resumed run sees
exactly the batches, and logs exactly the losses, an uninterrupted one would. work/log.jsonl has the
losses and, every eval_every steps, held-out acceptance by position.
The finished head is saved to `out` (head.safetensors in fp16, head_config.json).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..drafters.head_model import HeadConfig, HeadNet
from ..files import refuse_existing, staged_folder
from . import head_data, head_sources, loop


@dataclass
class HeadTrainArgs:
    target: str                  # a zoo / real model name or a local HF folder
    out: Path
    work: Path
    steps: int = 3000
    batch: int = 8
    seq_len: int = 256
    lr: float = 5e-4
    warmup: int = 100
    ttt: int = 3                 # unrolled steps (training-time test); 1 = EAGLE-1 teacher forcing
    ce_weight: float = 0.1
    draft_vocab: int = 8192      # 0 = the whole vocabulary
    fusion: bool = False
    num_layers: int = 1
    arch: str = "eagle"          # eagle (EAGLE-1/2 style) | eagle3 (EAGLE-3: exports for vLLM / SGLang)
    data: str = "answers"        # the sources, joined by '+': answers | chitchat | random (training/head_sources.py)
    num_prompts: int = 1200      # composed prompts: answered for the answers source; their held-out ones measure
    num_conversations: int = 7168  # --data chitchat: human conversations read (7,168 is all of them)
    num_random: int = 4000       # --data random: random-token prompts answered
    max_new_tokens: int = 160
    num_text_chunks: int = 200
    text_tokens: int = 256
    gen_batch: int = 16
    seed: int = 0
    threads: int = 2
    precision: str = "auto"      # auto | fp32 | bf16: bf16 autocast and bf16 answers where bf16 is native
    ckpt_minutes: float = 5.0
    eval_every: int = 250
    heldout_seqs: int = 24       # held-out answers each periodic evaluation reads (0 = all); the saved head's
                                 # record always reads all of them
    log_every: int = 10
    stop_at: int | None = None   # checkpoint at this step and return None (a time-boxed session); resume later
    stop_after_s: float | None = None  # ... or once training has run this many seconds (a lent GPU)
    resume_from: Path | None = None  # no checkpoint in work: start from this saved head (its weights and step;
                                     # AdamW starts afresh, warming up again) - how a run moves to a new machine


def load_target(name_or_dir: str):
    from .. import zoo

    path = Path(name_or_dir)
    if not path.is_dir():
        model, tok = zoo.load(name_or_dir)
        return model, tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def check_target(target) -> None:
    """A target the head can read features from: a decoder with `model.layers`, a final norm, an LM head."""
    from ..hf.layer_views import decoder_of

    decoder = decoder_of(target)
    if getattr(decoder, "norm", None) is None or target.get_output_embeddings() is None:
        raise ValueError(f"{type(target).__name__} has no final norm or LM head to read features from")


def loss_terms(net: HeadNet, feats, next_tokens, mask, ttt: int, ce_weight: float):
    """feats [B, T+1, F] fp32, next_tokens [B, T], mask [B, T] bool (valid targets) -> (loss, per-step stats)."""
    H = net.config.hidden_size
    inputs, top_next = feats[:, :-1], feats[:, 1:, -H:]
    with torch.no_grad(), torch.autocast(feats.device.type, enabled=False):  # the target's own numbers, in fp32
        p = torch.softmax(net.target_logits(top_next), -1)
        want = p.argmax(-1)
    outs = net.unroll(inputs, next_tokens, ttt)
    total = 0.0
    stats = []
    for j, out in enumerate(outs):
        m = mask.clone()
        m[:, :j] = False
        denom = m.sum().clamp_min(1)
        if net.eagle3:  # EAGLE-3 hands on its pre-norm hidden, not a predicted top feature: no regression
            reg = out.new_zeros(())
        else:
            reg = (F.smooth_l1_loss(out.float(), top_next, reduction="none").mean(-1) * m).sum() / denom
        logits = net.logits(out).float()
        logq = torch.log_softmax(logits, -1)
        ce = (-(p * logq).sum(-1) * m).sum() / denom
        with torch.no_grad():
            agree = ((logits.argmax(-1) == want) & m).sum() / denom
        total = total + (0.8 ** j) * (reg + ce_weight * ce)
        stats.append({"reg": reg.item(), "ce": ce.item(), "agree": agree.item()})
    return total, stats


def make_batch(data: head_data.Dataset, step: int, args: HeadTrainArgs):
    """Batch `step`: `batch` random windows of at most seq_len + 1 positions, right-padded."""
    rows = [(toks[s + 1:s + w + 1], feats[s:s + w + 1], max(0, loss_from - 2 - s))
            for toks, feats, loss_from, s, w in data.windows(step, args.seed, args.batch, args.seq_len, lead=2)]
    T = max(len(r[0]) for r in rows)
    Fdim = rows[0][1].shape[-1]
    feats = torch.zeros(len(rows), T + 1, Fdim)
    toks = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, (t, f, first) in enumerate(rows):
        feats[b, :len(f)] = f.float()
        toks[b, :len(t)] = t
        mask[b, first:len(t)] = True
    return feats, toks, mask


@torch.no_grad()
def heldout_acceptance(net: HeadNet, target, data: head_data.Dataset, depth: int = 5, max_seqs: int | None = None) -> dict:
    """Greedy chain acceptance on held-out answers (the first max_seqs of them; None = all): accept[j] =
    P(the first j + 1 drafted tokens all equal the target's argmax), from the unrolled head (drafting from
    every answer position); tau = 1 + sum."""
    head_w = target.get_output_embeddings().weight
    hits = torch.zeros(depth)
    count = 0
    device = next(net.parameters()).device
    for toks, feats, loss_from in data.heldout[:max_seqs]:
        f, toks = feats.float()[None].to(device), toks.to(device)
        n = f.shape[1]
        if n < depth + 3:
            continue
        outs = net.unroll(f[:, :-1], toks[None, 1:], depth)
        want = F.linear(f[0, 1:, -net.config.hidden_size:].to(head_w.dtype), head_w).argmax(-1)  # [n-1]
        got = [net.vocab_ids[net.logits(o[0]).argmax(-1)] for o in outs]  # step j at t: token t + 2
        lo = max(0, loss_from - 2)
        rows = torch.arange(lo, max(lo, n - 1 - depth), device=device)  # the drafting positions r
        ok = torch.ones_like(rows, dtype=torch.bool)
        for j in range(depth):  # the chain from r holds through step j
            ok &= got[j][rows + j] == want[rows + j]
            hits[j] += int(ok.sum())
        count += len(rows)
    accept = (hits / max(1, count)).tolist()  # hits counted on the host
    return {"accept": [round(a, 4) for a in accept], "tau": round(1 + sum(accept), 3), "positions": count}


def _load_saved_head(path: Path, net: HeadNet) -> tuple[int, float]:
    """Load a saved head into `net` (its weights and step), also into a bigger net computing the same function:
    - widened (a top-only head into a fusion net): the fusion projection starts as [0 | 0 | I], passing the
      top layer's feature through, so fusion training continues from everything the top-only head learned;
    - deepened (a 1-layer head into a 2-layer net): the new second layer keeps its initialisation (the
      target's top layer, `init_from_target`) but with o_proj and down_proj zero, so both its residual
      branches add nothing until training grows them."""
    cfg = json.loads((path / "head_config.json").read_text())
    saved, want = list(cfg["feature_layers"]), list(net.config.feature_layers)
    widen = saved != want and len(saved) == 1 and len(want) > 1 and saved[0] == want[-1]
    depth = cfg.get("num_layers", 1)
    deepen = depth < net.config.num_layers
    if cfg["target_fingerprint"] != net.config.target_fingerprint or (saved != want and not widen) or cfg.get(
            "draft_vocab", 0) != net.config.draft_vocab or depth > net.config.num_layers or cfg.get(
            "arch", "eagle") != net.config.arch:
        raise ValueError(f"--resume-from {path}: that head was trained for another target or with other settings")
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path / "head.safetensors")).items()}
    if widen:
        H = net.config.hidden_size
        fuse = torch.zeros(H, len(want) * H)
        fuse[:, -H:] = torch.eye(H)
        state["fuse.weight"] = fuse
    if deepen:
        for k, v in net.state_dict().items():
            if k.startswith("layers.") and int(k.split(".")[1]) >= depth:
                silent = k.endswith(("o_proj.weight", "down_proj.weight"))
                state[k] = torch.zeros_like(v) if silent else v.clone()
    net.load_state_dict(state)
    trained = cfg.get("trained", {})
    return int(trained.get("steps", 0)), float(trained.get("train_seconds", 0.0))


def export_checkpoint(work: Path, out: Path, target) -> Path:
    """Save the head of the checkpoint in `work` (a run still in progress) to `out`, marked partial."""
    work = Path(work)
    meta = json.loads((work / "checkpoint.json").read_text())
    tensors = load_file(str(work / "checkpoint.safetensors"))
    manifest = json.loads((work / "manifest.json").read_text())
    state = {k[4:]: v for k, v in tensors.items() if k.startswith("net.")}
    n_vocab = state["vocab_ids"].numel()
    eagle3 = "lm_head.weight" in state
    config = HeadConfig.for_target(target, fusion=len(manifest["feature_layers"]) > 1 and not eagle3,
                                   draft_vocab=n_vocab if n_vocab < target.config.get_text_config().vocab_size else 0,
                                   num_layers=len({k.split(".")[1] for k in state if k.startswith("layers.")}),
                                   arch="eagle3" if eagle3 else "eagle")
    if config.target_fingerprint != manifest["target_fingerprint"]:
        raise ValueError(f"the run in {work} was trained for another target")
    net = HeadNet(config)
    net.load_state_dict(state)
    log = [json.loads(l) for l in (work / "log.jsonl").read_text().splitlines()] if (work / "log.jsonl").exists() else []
    evals = [r for r in log if "heldout" in r and r["step"] <= meta["step"]]
    return save_head(net, Path(out), {"steps": meta["step"], "train_seconds": meta.get("seconds"), "partial": True,
                                      "heldout": evals[-1]["heldout"] if evals else None, **manifest})


def save_head(net: HeadNet, out: Path, extra: dict | None = None) -> Path:
    """head.safetensors (fp16) + head_config.json into `out`, written beside it and renamed into place."""
    cfg = net.config.to_dict()
    if extra:
        cfg["trained"] = {**cfg.get("trained", {}), **extra}
    with staged_folder(out) as tmp:
        state = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in net.state_dict().items()}
        save_file(state, str(tmp / "head.safetensors"))
        (tmp / "head_config.json").write_text(json.dumps(cfg, indent=1))
    return out


def build_data(args: HeadTrainArgs, target, tok, config: HeadConfig, dtype: torch.dtype, progress=None) -> list[Path]:
    """The run's data (head_data.build, resumable): its settings go to work/manifest.json, which a later run
    with other settings is refused by. dtype: the answers' (loop.compute_dtype)."""
    sources = head_sources.parse(args.data)
    data_keys = ("num_prompts", "max_new_tokens", "num_text_chunks", "text_tokens", "gen_batch", "seed")
    data_keys += ("num_conversations",) * ("chitchat" in sources) + ("num_random",) * ("random" in sources)
    manifest = {"target_fingerprint": config.target_fingerprint, "feature_layers": list(config.feature_layers),
                **({"answer_dtype": "bfloat16"} if dtype == torch.bfloat16 else {}),
                **({"data": "+".join(sources)} if sources != ("answers",) else {}),  # old folders stay resumable
                **{k: getattr(args, k) for k in data_keys}}
    return head_data.build(target, tok, Path(args.work), config.feature_layers, args.num_prompts, args.max_new_tokens,
                           args.num_text_chunks, args.text_tokens, args.gen_batch, args.seed, progress,
                           answer_dtype=dtype, manifest=manifest, sources=sources,
                           num_conversations=args.num_conversations, num_random=args.num_random)


def train_head(args: HeadTrainArgs, target=None, tok=None, progress: bool = True) -> Path | None:
    """Build the data (resumable), train (resumable), save the head to args.out. Returns args.out, or None
    when args.stop_at ended the run early (its checkpoint is in args.work; run again to continue)."""
    from tqdm.auto import tqdm

    out, work = Path(args.out), Path(args.work)
    refuse_existing(out)
    head_sources.parse(args.data)  # a bad --data is refused before the target loads
    torch.set_num_threads(args.threads)
    if target is None:
        target, tok = load_target(args.target)
        if torch.cuda.is_available():  # a GPU when there is one (data generation, features and training)
            target = target.to("cuda")
    device = next(target.parameters()).device
    check_target(target)
    for p in target.parameters():
        p.requires_grad_(False)
    config = HeadConfig.for_target(target, fusion=args.fusion, num_layers=args.num_layers, arch=args.arch)
    dtype = loop.compute_dtype(args.precision, device)
    bar = tqdm(total=1, desc="data", disable=not progress)

    def shown(i, n, _tokens):
        bar.total = n
        bar.n = i
        bar.refresh()

    paths = build_data(args, target, tok, config, dtype, shown)
    bar.close()
    data = head_data.Dataset(paths)
    vocab = config.vocab_size
    if args.resume_from is not None and not (work / "checkpoint.json").exists():
        ids = load_file(str(Path(args.resume_from) / "head.safetensors"))["vocab_ids"]  # the saved head's subset
        config.draft_vocab = ids.numel() if ids.numel() < vocab else 0
    elif args.draft_vocab and args.draft_vocab < vocab:
        counts = data.token_counts(vocab)
        ids = torch.sort(torch.topk(counts, args.draft_vocab, sorted=True).indices).values
        config.draft_vocab = args.draft_vocab
    else:
        ids = torch.arange(vocab)
    torch.manual_seed(args.seed)  # the head's random initialisation
    net = HeadNet(config)
    net.vocab_ids.copy_(ids)
    net.to(device)
    net.init_from_target(target)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = loop.load_checkpoint(work, net, opt)
    if start.step == 0 and args.resume_from is not None:
        step, seconds = _load_saved_head(Path(args.resume_from), net)
        start = loop.Progress(step, seconds, since=step)  # AdamW starts afresh at the saved head's step
    net.bind(target)  # after any load: the LM-head rows it binds are those of the vocab_ids the head keeps

    def batch_loss(i: int):
        feats, toks, mask = (t.to(device) for t in make_batch(data, i, args))
        loss, stats = loss_terms(net, feats, toks, mask, args.ttt, args.ce_weight)
        return loss, {"steps": stats}, {"agree": f"{stats[0]['agree']:.2f}"}

    step, seconds = loop.run(work, net, opt, start, args.steps, args.stop_at, lambda i: loop.cosine_lr(i, args.lr, args.warmup, args.steps, start.since),
                             batch_loss, lambda: {"heldout": heldout_acceptance(net, target, data,
                                                                                 max_seqs=args.heldout_seqs or None)},
                             args.log_every, args.eval_every, args.ckpt_minutes, "train", progress, dtype,
                             None if args.stop_after_s is None else time.monotonic() + args.stop_after_s)
    if step < args.steps:
        return None
    final = heldout_acceptance(net, target, data)  # every held-out answer
    earlier = {}
    if args.resume_from is not None:  # what the saved head had been trained on stays in the new record
        saved = json.loads((Path(args.resume_from) / "head_config.json").read_text()).get("trained", {})
        earlier["continued_from"] = loop.earlier_training("head", Path(args.resume_from), saved, "head.safetensors")
    return save_head(net, out, {"steps": step, "train_tokens": data.num_tokens, **earlier,
                                "train_seconds": round(seconds), "data_sequences": len(data.train),
                                "positions_seen": step * args.batch * args.seq_len, "seed": args.seed, "ttt": args.ttt,
                                "heldout": final, "target": args.target, "precision": str(dtype),
                                "args": {k: str(v) for k, v in asdict(args).items()}})
