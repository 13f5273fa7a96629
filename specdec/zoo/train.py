"""Reproducible, resumable training of the zoo: tokenizer -> target -> distilled drafts.

Seeded end to end: batch i is drawn from a generator seeded by (seed, i), so a run interrupted and
resumed from its checkpoint sees exactly the batches an uninterrupted run would have seen.
Work files (token arrays, checkpoints, logs) live in a work directory; finished models are written
with `save_pretrained` (safetensors, fp16) plus the tokenizer, one directory per model.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..files import write_text
from .corpus import EOS, read_texts

# name -> (layers, hidden, heads, kv_heads, intermediate, teacher)  teacher: None | "target" | "target+init"
ARCHS = {
    "target": (6, 384, 6, 2, 1024, None),
    "draft-tiny": (2, 128, 2, 1, 384, None),
    "draft-small": (1, 256, 4, 2, 768, "target"),
    "draft-wide": (1, 384, 6, 2, 1024, "target+init"),
}
VOCAB = 4096
SEQ_LEN = 256
# training tokens per model: the target ~0.6 epoch of the ~8.9M-token training split (what fits a CPU
# afternoon); drafts are cheap, so the distilled ones get more tokens than their size suggests.
DEFAULT_TOKENS = {"target": 5_400_000, "draft-tiny": 1_800_000, "draft-small": 2_100_000, "draft-wide": 12_000_000}


@dataclass
class TrainArgs:
    name: str
    work: Path
    out: Path
    tokens: int            # total training tokens (sets the LR schedule)
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0
    threads: int = 2
    ckpt_minutes: float = 3.0
    log_every: int = 10
    agree_every: int = 100  # steps between teacher-forced agreement checks against the target (drafts only)


def llama_config(name: str):
    from transformers import LlamaConfig

    layers, hidden, heads, kv, inter, _ = ARCHS[name]
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
                       tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)


def prepare_corpus(work: Path, vocab_size: int = VOCAB):
    """Train the tokenizer and write train/heldout token arrays (uint16) into work/. Idempotent."""
    from transformers import AutoTokenizer

    from .tokenizer import train_tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(tok_dir, vocab_size)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.convert_tokens_to_ids(EOS)
    for split in ("train", "heldout"):
        path = work / f"{split}.npy"
        if path.exists():
            continue
        ids: list[int] = []
        for enc in tok(read_texts(split), add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
        tmp = work / f"{split}.tmp.npy"
        np.save(tmp, np.asarray(ids, dtype=np.uint16))
        os.replace(tmp, path)
    return tok


def batch_at(data: np.ndarray, step: int, seed: int, batch: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Deterministic batch number `step`: [batch, seq_len + 1] int64."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([data[s:s + seq_len + 1].astype(np.int64) for s in starts]))


def lr_at(step: int, total: int, base: float, warmup: int = 100) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def heldout_loss(model, data: np.ndarray, windows: int = 64, seq_len: int = SEQ_LEN) -> float:
    """Mean next-token loss on fixed, evenly spaced held-out windows."""
    was_training = model.training
    model.eval()
    starts = np.linspace(0, len(data) - seq_len - 1, windows).astype(np.int64)
    total = 0.0
    for s in starts:
        x = torch.from_numpy(data[s:s + seq_len + 1].astype(np.int64))[None]
        logits = model(x[:, :-1]).logits
        total += F.cross_entropy(logits[0].float(), x[0, 1:]).item()
    model.train(was_training)
    return total / windows


@torch.no_grad()
def agreement(model, windows: torch.Tensor, target_argmax: torch.Tensor) -> float:
    """Teacher-forced top-1 agreement with the target. windows: [n, SEQ_LEN]; target_argmax: [n, SEQ_LEN]."""
    was_training = model.training
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = model(windows).logits.argmax(-1)
    model.train(was_training)
    return (pred == target_argmax).float().mean().item()


def _load_teacher(work: Path):
    from transformers import LlamaForCausalLM

    teacher = LlamaForCausalLM(llama_config("target"))
    state = torch.load(work / "target" / "ckpt.pt", weights_only=True)["model"]
    teacher.load_state_dict(state)
    return teacher.eval()


def initial_model(args: TrainArgs, teacher=None):
    """The model a run starts from: seeded random weights (the embeddings and final norm copied from a
    same-width teacher, for the "target+init" kinds)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(llama_config(args.name))
    if ARCHS[args.name][5] == "target+init":  # same width as the target: start from its embeddings and final norm
        model.model.embed_tokens.weight.data.copy_(teacher.model.embed_tokens.weight.data)
        model.model.norm.weight.data.copy_(teacher.model.norm.weight.data)
    return model


def batch_loss(model, xb: torch.Tensor, teacher=None) -> tuple[torch.Tensor, torch.Tensor]:
    """xb [B, SEQ_LEN + 1] token ids -> (the training loss, its cross-entropy part), under bf16 autocast:
    cross-entropy alone, or KL to the teacher's distribution + 0.1 x cross-entropy."""
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 master weights; 2.4x faster on AVX512-BF16
        logits = model(xb[:, :-1]).logits.float()
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(xb[:, :-1]).logits.float(), -1)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), xb[:, 1:].reshape(-1))
    if teacher is None:
        return ce, ce
    kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True, reduction="batchmean") / SEQ_LEN
    return kl + 0.1 * ce, ce


def train(args: TrainArgs) -> dict:
    """Train (or resume) one zoo model; returns its summary (also written to work/name/summary.json)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    run_dir = args.work / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    data = np.load(args.work / "train.npy", mmap_mode="r")
    heldout = np.load(args.work / "heldout.npy", mmap_mode="r")
    teacher_kind = ARCHS[args.name][5]
    has_target = args.name != "target" and (args.work / "target" / "ckpt.pt").exists()
    reference = _load_teacher(args.work) if has_target else None  # the target: teacher and/or yardstick
    teacher = reference if teacher_kind else None
    if reference is not None:  # how agreement with the target grows over training, on fixed held-out windows
        starts = np.linspace(0, len(heldout) - SEQ_LEN - 1, 8).astype(np.int64)
        agree_x = torch.from_numpy(np.stack([heldout[s:s + SEQ_LEN].astype(np.int64) for s in starts]))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            agree_y = reference(agree_x).logits.argmax(-1)

    model = initial_model(args, teacher)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    tokens_per_step = args.batch * SEQ_LEN
    total_steps = max(1, args.tokens // tokens_per_step)
    step, elapsed = 0, 0.0
    ckpt = run_dir / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        print(f"[zoo] {args.name}: resuming at step {step}/{total_steps}")

    def save_ckpt():
        tmp = run_dir / "ckpt.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
        os.replace(tmp, ckpt)

    log = open(run_dir / "log.jsonl", "a")
    bar = tqdm(total=total_steps, initial=step, desc=f"zoo {args.name}", unit="step", dynamic_ncols=True)
    last_ckpt = time.perf_counter()
    model.train()
    while step < total_steps:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total_steps, args.lr)
        loss, ce = batch_loss(model, batch_at(data, step, args.seed, args.batch), teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed += time.perf_counter() - t0
        bar.update(1)
        if step % args.log_every == 0 or step == 1:
            rec = {"step": step, "tokens": step * tokens_per_step, "loss": round(loss.item(), 4),
                   "ce": round(ce.item(), 4), "elapsed_s": round(elapsed, 1)}
            if reference is not None and (step % args.agree_every == 0 or step == total_steps):
                rec["agree"] = round(agreement(model, agree_x, agree_y), 4)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss.item():.3f}", ce=f"{ce.item():.3f}")
        if time.perf_counter() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt()
            last_ckpt = time.perf_counter()
    bar.close()
    save_ckpt()
    loss = heldout_loss(model, heldout)
    summary = {"name": args.name, "params": sum(p.numel() for p in model.parameters()),
               "train_tokens": step * tokens_per_step, "train_seconds": round(elapsed, 1),
               "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 2),
               "teacher": teacher_kind,
               "args": {k: os.path.relpath(v) if isinstance(v, Path) else str(v) for k, v in asdict(args).items()}}
    if reference is not None:
        summary["heldout_agreement"] = round(agreement(model, agree_x, agree_y), 4)
    write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    out = args.out / args.name
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(args.work / "tokenizer").save_pretrained(out)
    write_text(out / "training.json", json.dumps(summary, indent=2))
    log.close()
    shutil.copyfile(run_dir / "log.jsonl", out / "training_log.jsonl")  # the loss (and agreement) curve
    print(f"[zoo] {args.name}: held-out loss {loss:.3f} (ppl {math.exp(loss):.1f}) -> {out}")
    return summary


def train_all(work: Path, out: Path, seed: int = 0, threads: int = 2, names=None, scale: float = 1.0):
    """The whole pipeline in order: corpus + tokenizer, target, then the drafts (distilled ones need the target)."""
    prepare_corpus(work)
    for name in names or ARCHS:
        tokens = int(DEFAULT_TOKENS[name] * scale)
        train(TrainArgs(name=name, work=work, out=out, tokens=tokens, seed=seed, threads=threads))
