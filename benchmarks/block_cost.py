"""What does one target forward cost as its block grows? The verification step's cost curve, and where it goes.

    python benchmarks/block_cost.py --target smollm2-135m-instruct

Speculation pays only while verifying k + 1 tokens costs about as much as decoding one. This times one
forward of the target over a block of n new tokens after a 128-token context (HF modules, KV cache, all
block sizes alternating round by round, medians), and profiles the matrix products of one forward per
block size by weight shape (torch.profiler, `aten::mm` self time), which shows whether a block size
falls onto a slow GEMM kernel. On this project's 2-core CPU, SmolLM2's 3-token block cost more than
its 5-token one (results/block_cost.md).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import specdec

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="smollm2-135m-instruct")
ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 17])
ap.add_argument("--context", type=int, default=128)
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "block_cost"))
a = ap.parse_args()
torch.set_num_threads(a.threads)
model, tok = specdec.zoo.load(a.target)
vocab = model.config.get_text_config().vocab_size
g = torch.Generator().manual_seed(0)
context = torch.randint(0, vocab, (1, a.context), generator=g)


def forward(n: int) -> float:
    """Seconds for one forward of n new tokens over the cached context (the cache is prefilled first)."""
    with torch.no_grad():
        past = model(input_ids=context, use_cache=True).past_key_values
        block = torch.randint(0, vocab, (1, n), generator=g)
        t0 = time.perf_counter()
        model(input_ids=block, past_key_values=past, use_cache=True)
        return time.perf_counter() - t0


for n in a.sizes:  # warm-up
    forward(n)
times: dict[int, list[float]] = {n: [] for n in a.sizes}
for _ in range(a.rounds):
    for n in a.sizes:
        times[n].append(forward(n))
med = {n: statistics.median(ts) for n, ts in times.items()}

mm: dict[int, dict[str, float]] = {}
with torch.no_grad():
    for n in a.sizes:
        past = model(input_ids=context, use_cache=True).past_key_values
        block = torch.randint(0, vocab, (1, n), generator=g)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model(input_ids=block, past_key_values=past, use_cache=True)
        rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"]
        mm[n] = {"x".join(map(str, e.input_shapes[1])): e.self_cpu_time_total / 1000 for e in rows}

shapes = sorted({s for d in mm.values() for s in d}, key=lambda s: -max(d.get(s, 0) for d in mm.values()))[:4]
lines = ["# Target forward cost by block size", "", f"`python benchmarks/block_cost.py {' '.join(sys.argv[1:])}`", "",
         f"{a.target} (float32, HF modules), {a.threads} threads, {a.context}-token cached context, {a.rounds} rounds "
         "alternating block sizes, medians; `aten::mm` self time of one profiled forward by weight shape.", "",
         "| block (tokens) | forward ms | vs 1 token | all mm ms | " + " | ".join(f"mm {s} ms" for s in shapes) + " |",
         "|---|---|---|---|" + "---|" * len(shapes)]
for n in a.sizes:
    lines.append(f"| {n} | {med[n] * 1e3:.1f} | {med[n] / med[a.sizes[0]]:.2f}x | {sum(mm[n].values()):.1f} | "
                 + " | ".join(f"{mm[n].get(s, 0):.1f}" for s in shapes) + " |")
Path(a.out).parent.mkdir(parents=True, exist_ok=True)
Path(a.out + ".md").write_text("\n".join(lines) + "\n")
Path(a.out + ".json").write_text(json.dumps({"target": a.target, "threads": a.threads, "context": a.context,
                                             "forward_s": med, "mm_ms": mm}, indent=1))
print("\n".join(lines))
