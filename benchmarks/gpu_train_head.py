"""A head trained on a lent GPU in one command, left as a checkpoint that a CPU resumes.

    python benchmarks/gpu_train_head.py --target smollm2-135m-instruct --work W --out HEAD --budget-s 540
    python benchmarks/gpu_train_head.py --dry --work /tmp/w --out /tmp/h      # CPU: the zoo target, seconds

A GPU is lent for minutes. Within --budget-s this script (1) grows the answer set: the composed prompts
answered by the target, --gen-batch at a time, doubling the prompt count while the data share of the
budget (--data-share) lasts (the prompt set is prefix-stable, so each round only adds shards), then
(2) trains the head until the budget is spent (train-head's --stop-after-s), checkpointing in --work.
Everything is `specdec train-head`'s own code; nothing here is GPU-only. The last line printed is the
`specdec train-head` command that resumes the run on a CPU (the same settings, the prompt count reached,
--precision bf16 as on the GPU: the manifest refuses a resume whose answers would come from another dtype).

The target's weights must be on the device machine: a real model's files do not fit this project's device
upload (64 MiB), so there the zoo target (in the repository) is what can train; see the closing notes.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdec.training.head_trainer import HeadTrainArgs, build_data, load_target, train_head  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--data-share", type=float, default=0.4, help="the part of the budget that may go to answering")
    ap.add_argument("--arch", default="eagle3", choices=("eagle", "eagle3"))
    ap.add_argument("--steps", type=int, default=20000, help="the cosine schedule's length (CPU resumes continue it)")
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dry", action="store_true", help="CPU, the zoo target, a few steps: what CI runs")
    a = ap.parse_args(argv)
    start = time.monotonic()
    if a.dry:
        a.target, a.gen_batch, a.batch, a.budget_s = "target", 4, 4, min(a.budget_s, 60.0)
    target, tok = load_target(a.target)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = target.to(device)
    args = HeadTrainArgs(target=a.target, out=a.out, work=a.work, steps=a.steps, batch=a.batch, arch=a.arch,
                         num_prompts=a.gen_batch, gen_batch=a.gen_batch, num_text_chunks=0, precision="bf16",
                         lr=2e-3, ce_weight=1.0, threads=torch.get_num_threads(), log_every=10, eval_every=200)
    if a.dry:  # three steps here, the rest (to 8) by the printed CPU command
        args = replace(args, steps=8, stop_at=3, seq_len=32, max_new_tokens=12, draft_vocab=512, eval_every=2,
                       log_every=1)
    # (1) answers: double the prompt count while the data share lasts (a round costs about what all before it did)
    rounds_s: list[float] = []
    while True:
        t0 = time.monotonic()
        _build(args, target, tok)
        rounds_s.append(time.monotonic() - t0)
        spent = time.monotonic() - start
        if (len(rounds_s) == 2) if a.dry else spent + 2.2 * rounds_s[-1] > a.data_share * a.budget_s:
            break
        args = replace(args, num_prompts=2 * args.num_prompts)
    print(f"answers: {args.num_prompts} prompts in {time.monotonic() - start:.0f} s", flush=True)
    # (2) training until the budget is spent (the final evaluation and save need a margin)
    left = a.budget_s - (time.monotonic() - start)
    args = replace(args, stop_after_s=max(1.0, 0.9 * left - 15))
    done = train_head(args, target, tok, progress=False)
    print(f"head saved to {done}" if done else f"checkpoint in {a.work}", flush=True)
    print("resume on a CPU:\n  " + resume_command(args), flush=True)
    return 0


def _build(args: HeadTrainArgs, target, tok) -> None:
    """train_head's data step alone, for args' prompt count."""
    from specdec.drafters.head_model import HeadConfig
    from specdec.training import loop

    config = HeadConfig.for_target(target, fusion=args.fusion, num_layers=args.num_layers, arch=args.arch)
    build_data(args, target, tok, config, loop.compute_dtype(args.precision, next(target.parameters()).device))


def resume_command(args: HeadTrainArgs) -> str:
    """The `specdec train-head` line that continues this run (every setting that differs from its default)."""
    default = HeadTrainArgs(target="", out=Path(), work=Path())
    parts = ["specdec train-head", f"--target {args.target}", f"--out {args.out}", f"--work {args.work}"]
    for f in fields(HeadTrainArgs):
        value = getattr(args, f.name)
        if f.name in ("target", "out", "work", "stop_at", "stop_after_s", "threads") or value == getattr(default, f.name):
            continue
        parts.append(f"--{f.name.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
