"""The trainers' shared loop (feature heads and plain drafts): what makes a run seeded and resumable.

Batch i is made by the caller from a generator seeded by (seed, i), so a run interrupted and resumed
from its checkpoint sees exactly the batches, and logs exactly the losses, an uninterrupted one would.
The checkpoint (work/checkpoint.safetensors + checkpoint.json: the trained module's state, AdamW's
state, the step, the training seconds so far) is written to a temporary name and renamed, every few
minutes and at the last step run. work/log.jsonl gets the losses every log_every steps and an
evaluation every eval_every steps and at the final step.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors.torch import load_file

from ..files import save_tensors, sha256_file, write_text


PRECISIONS = ("auto", "fp32", "bf16")


def bf16_is_native(device: torch.device) -> bool:
    """Whether bfloat16 matrix products run natively here: a CUDA GPU with bf16, or a CPU whose oneDNN
    does bf16 (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """--precision -> the dtype of training's matrix products (autocast; weights and AdamW stay fp32) and
    of the data's answer generation: bf16 for "bf16", and for "auto" where bf16 is native; else fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" or (precision == "auto" and bf16_is_native(device)):
        return torch.bfloat16
    return torch.float32


def cosine_lr(step: int, lr: float, warmup: int, steps: int, since: int = 0) -> float:
    """Linear warm-up, then a cosine from lr down to lr / 10 at `steps`.

    since: the step the optimiser's state began at (0 for a fresh run; a run continued from a saved head or
    draft starts AdamW afresh at that head's step). A continued run warms up again over `warmup` steps from
    there, into the cosine's value: a fresh AdamW's first updates are about lr per weight whatever the
    gradient's size, so jumping straight to the schedule's rate (well above where the saved run had ended
    when --steps grows) would throw away what the saved weights had learned."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    rate = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    return rate * min(1.0, (step - since + 1) / warmup) if since else rate


def earlier_training(kind: str, path: Path, trained: dict, weights: str) -> dict:
    """What a --resume-from head or draft (`kind`) at `path`, whose record is `trained`, had been trained on:
    its steps and tokens, and what it continued in turn. For the new record, whose train_tokens counts only
    the data of the run that saves it. The folder's name says where it was read from, which may be a local
    copy; `weights_sha256` (of its weights file, `weights`, first 16 hex digits) says which head or draft it
    was wherever it lay (a shipped one: the same digest as its file in the zoo)."""
    earlier = {kind: path.name, "weights_sha256": sha256_file(path / weights)[:16], "steps": trained.get("steps"),
               "train_tokens": trained.get("train_tokens")}
    if trained.get("continued_from"):
        earlier["continued_from"] = trained["continued_from"]
    return earlier


def save_checkpoint(work: Path, module: torch.nn.Module, opt, step: int, seconds: float,
                    cpu_seconds: float | None = None, since: int = 0) -> None:
    tensors = {f"net.{k}": v for k, v in module.state_dict().items()}
    state = opt.state_dict()
    for i, st in state["state"].items():
        for k, v in st.items():
            tensors[f"opt.{i}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    meta = {"step": step, "param_groups": state["param_groups"], "seconds": round(seconds, 1), "since": since,
            **({"cpu_seconds": round(cpu_seconds, 1)} if cpu_seconds is not None else {})}
    save_tensors(tensors, work / "checkpoint.safetensors")
    write_text(work / "checkpoint.json", json.dumps(meta))


class Progress(NamedTuple):
    """Where a run stands: its step, training seconds (wall) and CPU seconds (all threads) so far, across
    resumes, and the step opt's state began at (cosine_lr's `since`: a continued run's AdamW starts afresh)."""
    step: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    since: int = 0


def load_checkpoint(work: Path, module: torch.nn.Module, opt) -> Progress:
    """The Progress of the checkpoint in `work`, loaded into module and opt; Progress() if none."""
    meta_path, ten_path = work / "checkpoint.json", work / "checkpoint.safetensors"
    if not (meta_path.exists() and ten_path.exists()):
        return Progress()
    meta = json.loads(meta_path.read_text())
    tensors = load_file(str(ten_path))
    module.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("net.")})
    opt_state: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            opt_state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": opt_state, "param_groups": meta["param_groups"]})
    return Progress(int(meta["step"]), float(meta.get("seconds", 0.0)), float(meta.get("cpu_seconds", 0.0)),
                    int(meta.get("since", 0)))


def run(work: Path, module: torch.nn.Module, opt, start: Progress, steps: int, stop_at: int | None,
        lr_at: Callable[[int], float], batch_loss: Callable[[int], tuple], evaluate: Callable[[], dict],
        log_every: int, eval_every: int, ckpt_minutes: float, desc: str, progress: bool,
        compute: torch.dtype = torch.float32, deadline: float | None = None) -> tuple[int, float]:
    """Train `module` (the parameters `opt` holds) from `start` (load_checkpoint's, or a saved module's) to
    min(steps, stop_at), or until the clock (time.monotonic()) passes `deadline`: a device lent for minutes;
    the checkpoint (with start.since) is written either way.

    batch_loss(step) -> (loss tensor, the log record's fields, the progress bar's fields) for batch `step`,
    run under bf16 autocast when `compute` (compute_dtype) is bfloat16; evaluate() -> the fields of an
    evaluation record. Returns (the step reached, training seconds in all)."""
    from tqdm.auto import tqdm

    step, since = start.step, start.since
    t_start = time.monotonic() - start.seconds
    cpu_start = time.process_time() - start.cpu_seconds
    end = steps if stop_at is None else min(steps, stop_at)
    last_ckpt = time.monotonic()
    bar = tqdm(total=steps, initial=step, desc=desc, disable=not progress)
    params = [p for group in opt.param_groups for p in group["params"]]
    device = params[0].device
    with (work / "log.jsonl").open("a") as log:
        try:
            while step < end:
                lr = lr_at(step)
                for group in opt.param_groups:
                    group["lr"] = lr
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=compute == torch.bfloat16):
                    loss, record, shown = batch_loss(step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                bar.update(1)
                if step % log_every == 0 or step == 1:
                    log.write(json.dumps({"step": step, "loss": round(loss.item(), 5), "lr": float(f"{lr:.6g}"), **record,
                                          "time": round(time.time(), 1)}) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{loss.item():.3f}", **shown)
                if step % eval_every == 0 or step == steps:  # with the training's wall and CPU seconds so far
                    log.write(json.dumps({"step": step, **evaluate(), "seconds": round(time.monotonic() - t_start, 1),
                                          "cpu_seconds": round(time.process_time() - cpu_start, 1)}) + "\n")
                    log.flush()
                if time.monotonic() - last_ckpt > 60 * ckpt_minutes or step == end:
                    save_checkpoint(work, module, opt, step, time.monotonic() - t_start, time.process_time() - cpu_start, since)
                    last_ckpt = time.monotonic()
                if deadline is not None and time.monotonic() > deadline:
                    save_checkpoint(work, module, opt, step, time.monotonic() - t_start, time.process_time() - cpu_start, since)
                    break
        finally:
            bar.close()
    return step, time.monotonic() - t_start
