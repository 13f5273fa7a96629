"""Time to the first token: a prompt's prefill with its long blocks through the BLAS or through specdec's row kernel.

    python benchmarks/prefill.py --target smollm2-135m-instruct --dtypes float32 bfloat16 \
        --out benchmarks/results/prefill_amd_epyc

A prompt longer than the compiled step's buckets runs through the lean loop, whose products of more than a
short block's rows went to `F.linear`. Off Intel (hf/linear.py's rule) the row kernel now takes float32
blocks up to FLOAT32_KERNEL_ROWS rows and, where the CPU has no bfloat16 instructions (LONG_BF16_BLOCKS),
bfloat16 blocks of any length (oneDNN's emulated bfloat16 GEMM there reads about 10 GMAC/s). Both settings
run in one process, alternating prompt by prompt after a warm-up, beside HF generate() (one new token);
each time is the median over `--repeats` rounds. Prompts: benchmarks/ttft_prompts.py's (chat and code
edits, 44-712 tokens on SmolLM2; none was used by a training run). The first token of every mode must
equal HF's.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import specdec
from specdec import zoo
from specdec.files import write_text
from specdec.hf import linear
from specdec.kernels import cpu_rows
from ttft_prompts import ttft_prompts



def prompts(tok) -> list[tuple[str, torch.Tensor]]:
    return [(kind, torch.tensor([ids])) for kind, ids in ttft_prompts(tok)]


class Rule:
    """hf/linear.py's long-block rule, switched for one mode: on (as shipped) or off (F.linear past 16 rows)."""

    def __init__(self, on: bool):
        self.values = (linear.FLOAT32_KERNEL_ROWS, linear.LONG_BF16_BLOCKS) if on else (cpu_rows.MAX_ROWS, False)

    def __enter__(self):
        self.saved = (linear.FLOAT32_KERNEL_ROWS, linear.LONG_BF16_BLOCKS)
        linear.FLOAT32_KERNEL_ROWS, linear.LONG_BF16_BLOCKS = self.values

    def __exit__(self, *exc):
        linear.FLOAT32_KERNEL_ROWS, linear.LONG_BF16_BLOCKS = self.saved


def run(target_name: str, dtype: torch.dtype, repeats: int) -> tuple[list[str], tuple[int, bool]]:
    target, tok = zoo.load(target_name, dtype=dtype)
    rows = prompts(tok)
    wrapped = specdec.wrap(target, draft_length=0)
    shipped = (linear.FLOAT32_KERNEL_ROWS, linear.LONG_BF16_BLOCKS)

    def hf(ids):
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)[0, -1]

    def spec(on):
        def first(ids):
            with Rule(on):
                return wrapped.generate(ids, max_new_tokens=1)[0, -1]
        return first

    modes = {"HF generate": hf, "specdec, F.linear past 16 rows": spec(False), "specdec, row kernel (shipped rule)": spec(True)}
    for first in modes.values():  # warm-up: the step's buckets, probes, kernels
        first(rows[0][1])
    times = {(i, m): [] for i in range(len(rows)) for m in modes}
    tokens = {}
    for _ in range(repeats):
        for i, (_, ids) in enumerate(rows):
            for m, first in modes.items():
                t0 = time.perf_counter()
                tokens[i, m] = int(first(ids))
                times[i, m].append(time.perf_counter() - t0)
    dt = str(dtype).removeprefix("torch.")
    lines = [f"| {dt} prompt | tokens | HF generate ms | specdec, F.linear past 16 rows ms | specdec, row kernel ms | "
             f"row kernel / F.linear | vs HF | first token == HF |", "|---|---|---|---|---|---|---|---|"]
    for i, (kind, ids) in enumerate(rows):
        hf_ms, off_ms, on_ms = (1e3 * statistics.median(times[i, m]) for m in modes)
        same = all(tokens[i, m] == tokens[i, "HF generate"] for m in modes)
        lines.append(f"| {kind} | {ids.shape[1]} | {hf_ms:.0f} | {off_ms:.0f} | {on_ms:.0f} | {on_ms / off_ms:.2f} | "
                     f"{hf_ms / on_ms:.2f}x | {'yes' if same else '**no**'} |")
    print("\n".join(lines), flush=True)
    return lines, shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write OUT.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tables = []
    for name in a.dtypes:
        lines, shipped = run(a.target, getattr(torch, name), a.repeats)
        tables.append("\n".join(lines))
    if a.out:
        command = (f"python benchmarks/prefill.py --target {a.target} --dtypes {' '.join(a.dtypes)} --repeats {a.repeats}"
                   f" --threads {a.threads} --out {a.out}")
        write_text(Path(a.out + ".md"), f"# Time to the first token: long blocks through the BLAS or the row kernel\n\n"
                   f"`{command}`\n\n{a.target}, {a.threads} threads, draft_length=0 (the prefill and one token), "
                   f"medians of {a.repeats} rounds, modes alternating prompt by prompt after a warm-up. The shipped "
                   f"rule here: float32 blocks up to {shipped[0]} rows through the row kernel, bfloat16 "
                   f"{'of any length' if shipped[1] else f'up to {cpu_rows.MAX_ROWS} rows'}.\n\n"
                   f"Machine: {linear.machine()}.\n\n" + "\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
