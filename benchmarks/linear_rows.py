"""What a block of n tokens costs the target's forward, by how its linears multiply: do multiplying short
blocks through specdec's row kernel (specdec/kernels/cpu_rows.py) or weight-first (specdec/hf/linear.py),
and weights packed for oneDNN (specdec/hf/packed.py) pay?

    python benchmarks/linear_rows.py --target smollm2-135m-instruct

Times one forward of the target's lean loop (hf/lean.py, the path specdec's engine runs) over a block
of n new tokens after a 128-token cached context, four ways: short blocks (up to 16 rows) through
specdec's row kernel (where it builds: AVX2 and FMA and a C++ compiler), short blocks multiplied
weight-first (W @ xᵀ), blocks past hf/packed.py's row count through packed weights, and `F.linear`
throughout as HF's modules do; all settings and block sizes alternating round by round, medians; plus HF's own
modules on the same block (`model(...)` with its KV cache) for reference. The ratio column is what the
speculative engine's cost model sees: a block of n tokens against one token. The row-kernel,
weight-first and packed columns are forced on whatever this machine's rules chose (the header says what
they chose).
`--profile` adds where HF's forward spends it: the matrix products of one profiled forward per block size
by weight shape (torch.profiler, `aten::mm` self time), which shows a block size falling onto a slow GEMM
kernel (on an AMD EPYC, SmolLM2's 3-token block cost more than its 4-token one: results/block_cost.md,
written by this option's former script, block_cost.py).
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
from specdec.cache.pool import BlockTable, PagePool
from specdec.hf import linear, packed
from specdec.hf.attention import specdec_attention
from specdec.hf.lean import LeanRunner
from specdec.kernels import cpu_library, cpu_rows

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="smollm2-135m-instruct")
ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 17])
ap.add_argument("--context", type=int, default=128)
ap.add_argument("--rounds", type=int, default=9)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
ap.add_argument("--profile", action="store_true", help="add HF's matrix products by weight shape per block size")
ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "linear_rows"))
a = ap.parse_args()
torch.set_num_threads(a.threads)
model, tok = specdec.zoo.load(a.target, dtype=getattr(torch, a.dtype))
dtype = next(model.parameters()).dtype
vocab = model.config.get_text_config().vocab_size
g = torch.Generator().manual_seed(0)
context = torch.randint(0, vocab, (a.context,), generator=g)
if LeanRunner.for_model(model, PagePool(1, 16), None, exact=True) is None:
    sys.exit(f"{a.target}: the lean loop does not certify itself for this model")
# one lean runner per setting (short blocks through the row kernel or weight-first, packed weights), each
# over its own pages holding the same context; a runner fixes its linears' paths when it is made, so the
# row kernel's switch (hf/linear.py) is set around each construction
machine = linear.machine()
SETTINGS = {"lean, short blocks weight-first": (True, False, "0"), "lean, packed weights": (False, True, "0"),
            "lean, F.linear": (False, False, "0")}
kernel_off = cpu_library.load()
if kernel_off is None:
    SETTINGS = {"lean, row kernel": (True, False, "1"), **SETTINGS}
else:
    print(f"no row-kernel column: {kernel_off}")


def make_runner(short_blocks: bool, packed_weights: bool, row_kernel: str) -> LeanRunner:
    linear.ROW_KERNEL_OVERRIDE, before = row_kernel, linear.ROW_KERNEL_OVERRIDE
    try:
        pool = PagePool(64, 16)
        return LeanRunner(model, pool, BlockTable(pool), short_blocks=short_blocks, packed=packed_weights)
    finally:
        linear.ROW_KERNEL_OVERRIDE = before


runners = {s: make_runner(*s) for s in SETTINGS.values()}


def lean(n: int, setting: tuple) -> float:
    runner = runners[setting]
    block = torch.randint(0, vocab, (n,), generator=g)
    with specdec_attention(model):  # HF's own modules run outside it
        t0 = time.perf_counter()
        runner.forward(block, logits_rows=None)
        dt = time.perf_counter() - t0
    runner.rollback(a.context)
    return dt


def hf(n: int) -> float:
    past = model(input_ids=context[None], use_cache=True).past_key_values
    block = torch.randint(0, vocab, (1, n), generator=g)
    t0 = time.perf_counter()
    model(input_ids=block, past_key_values=past, use_cache=True)
    return time.perf_counter() - t0


modes = {name: (lambda n, s=s: lean(n, s)) for name, s in SETTINGS.items()}
modes["HF modules"] = hf
times = {(m, n): [] for m in modes for n in a.sizes}
with torch.no_grad():
    with specdec_attention(model):
        for runner in runners.values():
            runner.forward(context, logits_rows=1)
    for r in range(a.rounds + 1):  # the first round warms up
        for n in a.sizes:
            for m, f in modes.items():
                dt = f(n)
                if r:
                    times[(m, n)].append(dt)
    for runner in runners.values():
        runner.table.release()
med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
one = {m: med[(m, a.sizes[0])] for m in modes}
hf1 = one["HF modules"]
lines = ["# The target's forward cost by block size and how its linears multiply", "",
         f"`python benchmarks/linear_rows.py {' '.join(sys.argv[1:])}`", "",
         f"{a.target} ({str(dtype).removeprefix('torch.')}), {a.threads} threads, {a.context}-token cached context, "
         f"{a.rounds} rounds alternating modes and block sizes, medians; row-kernel column up to {cpu_rows.MAX_ROWS} rows, "
         f"weight-first column up to {linear.SHORT_BLOCK_ROWS} rows, packed column "
         f"{packed.describe().removeprefix('packed weights: ')}. Machine: {machine}. "
         f"'vs HF 1' divides by HF's own one-token forward ({hf1:.1f} ms).", "",
         "| block (tokens) | " + " | ".join(f"{m} ms | vs its 1 | vs HF 1" for m in modes) + " |",
         "|---|" + "---|---|---|" * len(modes)]
for n in a.sizes:
    lines.append(f"| {n} | " + " | ".join(f"{med[(m, n)]:.1f} | {med[(m, n)] / one[m]:.2f}x | {med[(m, n)] / hf1:.2f}x"
                                          for m in modes) + " |")
mm: dict[int, dict[str, float]] = {}
if a.profile:  # HF's modules, one profiled forward per block size: aten::mm self time by weight shape
    with torch.no_grad():
        for n in a.sizes:
            past = model(input_ids=context[None], use_cache=True).past_key_values
            block = torch.randint(0, vocab, (1, n), generator=g)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                model(input_ids=block, past_key_values=past, use_cache=True)
            rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"]
            mm[n] = {"x".join(map(str, e.input_shapes[1])): e.self_cpu_time_total / 1000 for e in rows}
    shapes = sorted({s for d in mm.values() for s in d}, key=lambda s: -max(d.get(s, 0) for d in mm.values()))[:4]
    lines += ["", "HF modules, one profiled forward per block size: `aten::mm` self time by weight shape.", "",
              "| block (tokens) | all mm ms | " + " | ".join(f"mm {s} ms" for s in shapes) + " |",
              "|---|---|" + "---|" * len(shapes)]
    lines += [f"| {n} | {sum(mm[n].values()):.1f} | " + " | ".join(f"{mm[n].get(s, 0):.1f}" for s in shapes) + " |"
              for n in a.sizes]
Path(a.out).parent.mkdir(parents=True, exist_ok=True)
Path(a.out + ".md").write_text("\n".join(lines) + "\n")
Path(a.out + ".json").write_text(json.dumps({"target": a.target, "threads": a.threads, "context": a.context,
                                             "max_rows": linear.SHORT_BLOCK_ROWS,
                                             "packed_from_rows": {str(d): n for d, n in packed.FROM_ROWS.items()},
                                             "machine": machine, "row_kernel_rows": cpu_rows.MAX_ROWS if kernel_off is None else 0,
                                             "ms": {f"{m}|{n}": v for (m, n), v in med.items()},
                                             **({"mm_ms": mm} if mm else {})}, indent=1))
print("\n".join(lines))
