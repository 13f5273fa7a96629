"""Distil a plain draft model for a target that has none: `specdec train-draft` and `train_draft()`.

A real small model such as SmolLM2-135M-Instruct has no smaller sibling with its tokenizer, so HF's
assisted generation has nothing to run and no comparison with it is on equal terms. This trainer makes
one: a Llama with the target's sizes and vocabulary but only a few decoder layers (started from the
target's own layers, by default its first and last), whose embedding and LM head ARE the target's
(frozen, never stored in the draft's files: zoo/derived.py rebuilds the full model from the target on
first use). Loss: cross-entropy of the draft's next-token distribution against the target's own, which
is the target's LM head over its stored top feature.

Data: the feature head trainer's shards (training/head_data.py: the target's self-distilled answers and
standard-library text, with top features); pass the head run's work folder as `data`. Seeded and
resumable through the head trainer's loop (training/loop.py). Output: `draft_config.json` (the model's config, the target's name and weight fingerprint,
what training did) and `draft.safetensors` (fp16; every weight but the shared embedding and LM head).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from ..drafters.head_model import fingerprint
from ..files import refuse_existing, staged_folder
from ..zoo import derived
from . import head_data, loop
from .head_trainer import check_target, load_target


@dataclass
class DraftTrainArgs:
    target: str                  # a zoo / real model name or a local HF folder
    data: Path                   # a head trainer's work folder (its data/ shards)
    out: Path
    work: Path
    layers: int = 2
    steps: int = 600
    batch: int = 4
    seq_len: int = 256
    lr: float = 3e-4
    warmup: int = 30
    seed: int = 0
    threads: int = 2
    precision: str = "auto"      # auto | fp32 | bf16: bf16 autocast where bf16 is native (training/loop.py)
    ckpt_minutes: float = 5.0
    log_every: int = 10
    eval_every: int = 200
    heldout_seqs: int = 24       # held-out answers each periodic evaluation reads (0 = all); the saved draft's
                                 # record always reads all of them
    stop_at: int | None = None   # checkpoint at this step and return None; run again to continue
    resume_from: Path | None = None  # no checkpoint in work: start from this saved draft (its layers and step;
                                     # AdamW starts afresh, warming up again) - how a run moves to a new machine


def init_layers(num_target_layers: int, layers: int) -> list[int]:
    """Which target layers start the draft's: the first and last, then evenly between (0-based)."""
    if layers < 1 or layers >= num_target_layers:
        raise ValueError(f"a draft has 1 to {num_target_layers - 1} layers (fewer than its target), got {layers}")
    if layers == 1:
        return [num_target_layers - 1]
    return [round(i * (num_target_layers - 1) / (layers - 1)) for i in range(layers)]


def build_draft(target, layers: int) -> nn.Module:
    """A Llama-family model with the target's config but `layers` decoder layers, started from the target's
    layers (init_layers) and final norm, its embedding and LM head the target's own tensors (shared)."""
    from transformers import AutoModelForCausalLM

    from ..hf.layer_views import decoder_of

    cfg = target.config.get_text_config()
    if type(target).__name__ not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        raise ValueError(f"train-draft builds Llama-family drafts; {type(target).__name__} is not one")
    picks = init_layers(cfg.num_hidden_layers, layers)
    dcfg = cfg.__class__.from_dict({**cfg.to_dict(), "num_hidden_layers": layers})
    if getattr(dcfg, "layer_types", None):
        dcfg.layer_types = [cfg.layer_types[i] for i in picks]
    draft = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
    src, dst = decoder_of(target), decoder_of(draft)
    with torch.no_grad():
        for d, i in zip(dst.layers, picks):
            d.load_state_dict(src.layers[i].state_dict())
        dst.norm.load_state_dict(src.norm.state_dict())
    share_embeddings(draft, target)
    return draft.eval()


def share_embeddings(draft, target) -> None:
    """Point the draft's input embedding and LM head at the target's tensors (no copy)."""
    draft.get_input_embeddings().weight = target.get_input_embeddings().weight
    if not draft.config.tie_word_embeddings:
        draft.get_output_embeddings().weight = target.get_output_embeddings().weight
    else:
        draft.tie_weights()


def body(draft) -> nn.ModuleDict:
    """The draft's own weights (what trains and what is saved): its decoder layers and final norm."""
    from ..hf.layer_views import decoder_of

    dec = decoder_of(draft)
    return nn.ModuleDict({"layers": dec.layers, "norm": dec.norm})


def make_batch(data: head_data.Dataset, step: int, args: DraftTrainArgs):
    """Batch `step`: windows of at most seq_len tokens -> tokens [B, T], the target's top features at those
    positions [B, T, H] (each predicts the following token) and mask [B, T] (positions whose next token is
    the target's answer, or text)."""
    rows = [(toks[s:s + w], feats[s:s + w], max(0, loss_from - 1 - s))
            for toks, feats, loss_from, s, w in data.windows(step, args.seed, args.batch, args.seq_len, lead=1)]
    T = max(len(r[0]) for r in rows)
    H = rows[0][1].shape[-1]
    toks = torch.zeros(len(rows), T, dtype=torch.long)
    feats = torch.zeros(len(rows), T, H)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, (t, f, first) in enumerate(rows):
        toks[b, :len(t)] = t
        feats[b, :len(f)] = f.float()
        mask[b, first:len(t)] = True
    return toks, feats, mask


def loss_and_agreement(draft, target_head: torch.Tensor, toks, top_feats, mask):
    """Cross-entropy of the draft against the target's distribution (target_head [V, H] over the top
    features), and how often their argmaxes agree, over mask."""
    logq = torch.log_softmax(draft(input_ids=toks, use_cache=False).logits.float(), -1)
    with torch.no_grad(), torch.autocast(toks.device.type, enabled=False):  # the target's own numbers, in fp32
        p = torch.softmax(torch.nn.functional.linear(top_feats, target_head).float(), -1)
    denom = mask.sum().clamp_min(1)
    ce = (-(p * logq).sum(-1) * mask).sum() / denom
    agree = ((logq.argmax(-1) == p.argmax(-1)) & mask).sum() / denom
    return ce, agree


@torch.no_grad()
def heldout_agreement(draft, target_head: torch.Tensor, data: head_data.Dataset, max_seqs: int | None = None) -> float:
    """Teacher-forced argmax agreement with the target on held-out answers (the first max_seqs; None = all):
    about alpha at k = 1."""
    hits = total = 0
    for toks, feats, loss_from in data.heldout[:max_seqs]:
        logits = draft(input_ids=toks[None], use_cache=False).logits[0]
        want = torch.nn.functional.linear(feats.float(), target_head).argmax(-1)
        start = max(0, loss_from - 1)
        hits += int((logits.argmax(-1)[start:] == want[start:]).sum())
        total += len(toks) - start
    return round(hits / max(1, total), 4)


def load_saved_draft(path: Path, draft, target_fingerprint: str) -> tuple[int, float]:
    """Load a saved draft's own weights (save_draft) into `draft`; returns its (steps, training seconds).
    Refuses a draft trained for another target or with another number of layers."""
    cfg = json.loads((Path(path) / "draft_config.json").read_text())
    info = cfg.get("specdec", {})
    if info.get("target_fingerprint") != target_fingerprint:
        raise ValueError(f"--resume-from {path}: that draft was trained for another target (fingerprint "
                         f"{info.get('target_fingerprint')}, this target's is {target_fingerprint})")
    if cfg.get("num_hidden_layers") != draft.config.num_hidden_layers:
        raise ValueError(f"--resume-from {path}: that draft has {cfg.get('num_hidden_layers')} layers, this run "
                         f"builds {draft.config.num_hidden_layers} (--layers)")
    derived.load_layers(draft, path)
    trained = info.get("trained", {})
    return int(trained.get("steps", 0)), float(trained.get("train_seconds", 0.0))


def save_draft(draft, out: Path, target_name: str, target, target_fingerprint: str, extra: dict) -> Path:
    """draft_config.json + draft.safetensors (fp16, no shared tensors) into `out`, written beside it and
    renamed into place; refuses an existing folder."""
    cfg = draft.config.to_dict()
    cfg["specdec"] = {"embeddings_from": target_name, "target_fingerprint": target_fingerprint,
                      "target_architecture": type(target).__name__, "trained": extra}
    with staged_folder(out) as tmp:
        state = {k: v.detach().half().contiguous() for k, v in draft.state_dict().items() if k not in derived.SHARED}
        save_file(state, str(tmp / "draft.safetensors"))
        (tmp / "draft_config.json").write_text(json.dumps(cfg, indent=1))
    return out


def train_draft(args: DraftTrainArgs, target=None, tok=None, progress: bool = True) -> Path | None:
    """Train (resumable) and save the draft to args.out; None when args.stop_at ended the run early."""
    out, work = Path(args.out), Path(args.work)
    refuse_existing(out)
    shards = sorted(Path(args.data).glob("data/chat-*.safetensors")) + sorted(Path(args.data).glob("data/text-*.safetensors"))
    if not shards:
        raise ValueError(f"{args.data} has no training shards (data/*.safetensors): pass a feature-head "
                         "trainer's work folder (specdec train-head --work)")
    torch.set_num_threads(args.threads)
    if target is None:
        target, tok = load_target(args.target)
    check_target(target)
    dtype = loop.compute_dtype(args.precision, next(target.parameters()).device)
    manifest = json.loads((Path(args.data) / "manifest.json").read_text())
    target_print = fingerprint(target)
    if manifest.get("target_fingerprint") != target_print:
        raise ValueError(f"the data in {args.data} was made by another target (fingerprint "
                         f"{manifest.get('target_fingerprint')}, this target's is {target_print})")
    for p in target.parameters():
        p.requires_grad_(False)
    data = head_data.Dataset(shards)
    H = target.config.get_text_config().hidden_size
    if data.train[0][1].shape[-1] % H:
        raise ValueError(f"the shards' features are not whole multiples of the target's hidden size {H}")
    target_head = target.get_output_embeddings().weight.detach()
    torch.manual_seed(args.seed)
    draft = build_draft(target, args.layers)
    trainable = body(draft)
    opt = torch.optim.AdamW(trainable.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    work.mkdir(parents=True, exist_ok=True)
    start = loop.load_checkpoint(work, trainable, opt)
    if start.step == 0 and args.resume_from is not None:
        step, seconds = load_saved_draft(Path(args.resume_from), draft, target_print)
        start = loop.Progress(step, seconds, since=step)  # AdamW starts afresh at the saved draft's step
    if start.step == 0:
        with (work / "log.jsonl").open("a") as log:
            log.write(json.dumps({"step": 0, "heldout_agree": heldout_agreement(
                draft, target_head, data, max_seqs=args.heldout_seqs or None)}) + "\n")

    def batch_loss(i: int):
        toks, feats, mask = make_batch(data, i, args)
        loss, agree = loss_and_agreement(draft, target_head, toks, feats[..., -H:], mask)
        return loss, {"agree": round(agree.item(), 4)}, {"agree": f"{agree.item():.2f}"}

    step, seconds = loop.run(work, trainable, opt, start, args.steps, args.stop_at, lambda i: loop.cosine_lr(i, args.lr, args.warmup, args.steps, start.since),
                             batch_loss, lambda: {"heldout_agree": heldout_agreement(
                                 draft, target_head, data, max_seqs=args.heldout_seqs or None)},
                             args.log_every, args.eval_every, args.ckpt_minutes, "train-draft", progress, dtype)
    if step < args.steps:
        return None
    earlier = {}
    if args.resume_from is not None:  # what the saved draft had been trained on stays in the new record
        saved = json.loads((Path(args.resume_from) / "draft_config.json").read_text())["specdec"].get("trained", {})
        earlier["continued_from"] = loop.earlier_training("draft", Path(args.resume_from), saved, "draft.safetensors")
    return save_draft(draft, out, args.target, target, target_print, {
        "steps": step, **earlier, "train_tokens": data.num_tokens, "train_seconds": round(seconds),
        "init_layers": init_layers(target.config.get_text_config().num_hidden_layers, args.layers),
        "heldout_agree": heldout_agreement(draft, target_head, data), "seed": args.seed, "precision": str(dtype),
        "args": {k: str(v) for k, v in asdict(args).items()}})
