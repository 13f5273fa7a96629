"""How fast short blocks read a real model's weights: specdec's row kernel (specdec/kernels/cpu_rows.py)
against `F.linear` (torch's BLAS: MKL for float32, oneDNN for bfloat16) and the weight-first form of
specdec/hf/linear.py, for the 1 to 16 rows of decode, draft and verification steps.

    python benchmarks/cpu_rows.py --target smollm2-135m-instruct --out benchmarks/results/cpu_rows_amd_epyc

One pass multiplies an x of n rows by every linear weight of the target's decoder layers in model order
(q, k, v, o, gate, up, down, layer after layer: far more bytes than the caches hold, so each pass reads
the weights from memory as a step does), float32 and bfloat16 copies of the same weights; all products
and row counts alternate round by round, medians. GB/s is the layer weights' bytes over a pass's time;
the machine's streaming line (one big float32 copy, the same threads) is in the header for scale. The
weight-first form is float32 only (bfloat16 never takes it). Max |diff| is each product's largest
difference from a float64 reference on one weight, next to F.linear's own.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import specdec
from specdec.cli.bench import memory_bandwidth
from specdec.hf import linear
from specdec.kernels import cpu_library, cpu_rows

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="smollm2-135m-instruct")
ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
ap.add_argument("--rounds", type=int, default=9)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_rows"))
a = ap.parse_args()
torch.set_num_threads(a.threads)
reason = cpu_library.load()
if reason is not None:
    sys.exit(f"the row kernel does not run here: {reason}")
model, _ = specdec.zoo.load(a.target, dtype=torch.float32)
layer_weights = [m.weight.detach().contiguous() for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and ".layers." in name]
weights = {"float32": layer_weights, "bfloat16": [w.bfloat16() for w in layer_weights]}
del model
nbytes = {d: sum(w.numel() * w.element_size() for w in ws) for d, ws in weights.items()}
PRODUCTS = {"row kernel": lambda x, w: cpu_rows.rows_linear(x, w),
            "F.linear": F.linear,
            "weight-first": lambda x, w: linear.weight_first_rows(x, w, None, cpu_rows.MAX_ROWS)}
cases = [(d, p) for d in weights for p in PRODUCTS if not (p == "weight-first" and d == "bfloat16")]
g = torch.Generator().manual_seed(0)
xs = {(d, n): {k: torch.randn(n, k, generator=g).to(getattr(torch, d)) for k in {w.shape[1] for w in weights[d]}}
      for d in weights for n in a.rows}


def one_pass(dtype: str, product: str, n: int) -> float:
    f, x = PRODUCTS[product], xs[(dtype, n)]
    t0 = time.perf_counter()
    for w in weights[dtype]:
        f(x[w.shape[1]], w)
    return time.perf_counter() - t0


times = {(d, p, n): [] for d, p in cases for n in a.rows}
with torch.no_grad():
    line = memory_bandwidth(1 << 28)["copy"] / 1e9  # one big float32 copy, read + write counted, best of 5
    for r in range(a.rounds + 1):  # the first round warms up
        for n in a.rows:
            for d, p in cases:
                dt = one_pass(d, p, n)
                if r:
                    times[(d, p, n)].append(dt)
    w64 = layer_weights[4].double()  # an MLP weight
    err = {}
    for d, p in cases:
        x = torch.randn(4, w64.shape[1], generator=g).to(getattr(torch, d))  # whatever --rows measured
        ref = F.linear(x.double(), w64.to(getattr(torch, d)).double())
        err[(d, p)] = (PRODUCTS[p](x, weights[d][4]).double() - ref).abs().max().item()
med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
lines = ["# Short blocks through specdec's row kernel, F.linear and weight-first: the target's layer weights",
         "", f"`python benchmarks/cpu_rows.py {' '.join(sys.argv[1:])}`", "",
         f"{a.target}: {len(layer_weights)} layer weights, {nbytes['float32'] / 1e6:.0f} MB float32, "
         f"{nbytes['bfloat16'] / 1e6:.0f} MB bfloat16; {a.threads} threads; {a.rounds} rounds alternating products "
         f"and row counts, medians of one pass over every weight. Streaming line here: {line:.1f} GB/s (one big "
         f"float32 copy). Machine: {linear.machine()}.", "",
         "| weights | rows | " + " | ".join(f"{p} ms | GB/s" for p in PRODUCTS) + " | F.linear time / row kernel time |",
         "|---|---|" + "---|---|" * len(PRODUCTS) + "---|"]
for d in weights:
    for n in a.rows:
        cells = [f"{med[(d, p, n)]:.1f} | {nbytes[d] / med[(d, p, n)] / 1e6:.1f}" if (d, p) in err else "- | -"
                 for p in PRODUCTS]
        lines.append(f"| {d} | {n} | " + " | ".join(cells) +
                     f" | {med[(d, 'F.linear', n)] / med[(d, 'row kernel', n)]:.2f}x |")
lines += ["", "Max |difference| from a float64 product over 4 rows of one MLP weight (the inputs in each dtype): " +
          "; ".join(f"{d} {p} {e:.1e}" for (d, p), e in err.items()) + "."]
Path(a.out).parent.mkdir(parents=True, exist_ok=True)
Path(a.out + ".json").write_text(json.dumps({"target": a.target, "threads": a.threads, "machine": linear.machine(),
                                             "stream_gbs": line, "bytes": nbytes,
                                             "ms": {f"{d}|{p}|{n}": v for (d, p, n), v in med.items()},
                                             "max_abs_diff": {f"{d}|{p}": e for (d, p), e in err.items()}}, indent=1))
Path(a.out + ".md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
