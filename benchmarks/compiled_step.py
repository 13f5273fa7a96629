"""Where a target step's time goes, before and after the compiled step (hf/compiled.py).

For each dtype and forward size n (a decode step n = 1, a verification n = 4 or 8), after a 200-token
prefix, alternating the two paths: the lean loop (hf/lean.py, what step="bitwise" runs) and the compiled
step. Beside each: the time of the step's weight products alone (the same products, in the same form
each path uses, over the same weights: the step's 'weights' share; the rest is norms, RoPE, attention,
residuals and dispatch) and the memory-bandwidth line (weight bytes over the streaming-read bandwidth of a
sum timed in every round beside the steps: a shared host's bandwidth moves within minutes, so a line taken
once at the start, as before 2026-12-07, could sit far from the moment of the steps). Median of `--repeats`
rounds.

    python benchmarks/compiled_step.py --target smollm2-135m-instruct --dtypes float32 bfloat16 \
        --out benchmarks/results/compiled_step.md
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdec import zoo
from specdec.cache.pool import BlockTable, PagePool
from specdec.cli.bench import weight_bytes_per_step
from specdec.files import write_text
from specdec.hf import compiled, compiled_graphs
from specdec.kernels import cpu_rows
from specdec.hf.attention import specdec_attention
from specdec.hf.compiled import CompiledRunner, bucket_for
from specdec.hf.lean import LeanRunner
from specdec.hf.linear import machine

PREFIX = 200
# the compiled step twice where its layer kernel runs (kernels/cpu_layer.py, forwards of up to 32 tokens): as it
# runs by default, and through its inductor graphs (with the attention kernel between them), as it runs
# where the layer kernel does not
GRAPHS = "compiled, graphs"


def products(model, form: tuple, lean: LeanRunner | None):
    """A function of x [n, H] running every weight product of one forward over n rows, in the path's
    form: the lean loop's bound linears (lean given), else the compiled graphs' (compiled_graphs._product,
    itself compiled)."""
    weights = [p for layer in model.model.layers for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                                     layer.self_attn.v_proj.weight, layer.self_attn.o_proj.weight,
                                                     layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight,
                                                     layer.mlp.down_proj.weight)] + [model.lm_head.weight]
    if lean is not None:
        linears = [f for L in lean.layers for f in (L.q, L.k, L.v, L.o, L.gate, L.up, L.down)] + [lean.head]
        return lambda xs: [f(xs[w.shape[1]]) for f, w in zip(linears, weights)]
    if form[0] > 0:  # the row kernel's products (what the layer kernel and the graphs call), called directly
        return lambda xs: [cpu_rows.rows_linear(xs[w.shape[1]], w) for w in weights]
    fn = torch.compile(lambda x, w: compiled_graphs._product(x, w, None, form), dynamic=False)
    return lambda xs: [fn(xs[w.shape[1]], w) for w in weights]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model, n: int, repeats: int, stream: torch.Tensor) -> dict:
    """Median seconds per path (and its weight products alone) for forwards of n tokens; 'read': a sum over
    stream (far larger than any cache) timed in every round beside them, the memory's pace at that moment."""
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (PREFIX,), generator=gen)
    step_tokens = torch.randint(0, vocab, (n,), generator=gen)
    probe = CompiledRunner.for_model(model, PagePool(1, 16), None)  # the path the step takes for n tokens
    paths = ("lean", "compiled") + ((GRAPHS,) if probe.layer_kernel_runs(n) else ())
    runners = {}
    for name in paths:
        pool = PagePool(32, 16)
        table = BlockTable(pool, "cpu")
        runner = LeanRunner.for_model(model, pool, table, exact=True) if name == "lean" else \
            CompiledRunner.for_model(model, pool, table)
        if name == GRAPHS:
            runner.layer_kernel = False  # its own buckets: the graphs compile on its prepare
            runner.steps = compiled.CompiledSteps(model)
        if name != "lean":
            runner.prepare(n)
        with specdec_attention(model):
            runner.forward(prefix, logits_rows=1)
        runners[name] = (runner, table)

    def step(name):
        runner, table = runners[name]
        runner.forward(step_tokens, logits_rows=n)
        runner.rollback(PREFIX)
        table.truncate(PREFIX)

    dt = next(model.parameters()).dtype
    hidden = {w: torch.randn(n, w, dtype=dt) for w in {model.config.hidden_size, model.config.intermediate_size}}
    g = compiled.product_form(model.lm_head.weight)
    prods = {"lean": products(model, g, runners["lean"][0]), "compiled": products(model, g, None)}
    rounds = {k: [] for k in (*paths, "lean weights", "compiled weights", "read")}
    with torch.no_grad(), specdec_attention(model):
        for name in paths:  # warm
            step(name)
        for name in prods:
            prods[name](hidden)
        for _ in range(repeats):
            for name in paths:
                rounds[name].append(timed(lambda: step(name), 3))
                if name in prods:
                    rounds[name + " weights"].append(timed(lambda: prods[name](hidden), 3))
            rounds["read"].append(timed(stream.sum, 3))
    for runner, table in runners.values():
        table.release()
    return {k: statistics.median(v) for k, v in rounds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    # the host's memory bandwidth moves within minutes (25-56 GB/s on one shared EPYC): the line is taken from a
    # read timed in every round beside the steps, not from one measurement at the start
    stream = torch.ones(1 << 26)  # 256 MB
    rows = ["| dtype | n (bucket) | lean ms | its weights ms | other ms | compiled ms | its weights ms | other ms | "
            "compiled / lean | compiled through its graphs ms | bandwidth line ms (read bandwidth) | compiled / line |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bandwidths = []
    for name in a.dtypes:
        dt = getattr(torch, name)
        model, _ = zoo.load(a.target, dtype=dt)
        for n in a.sizes:
            r = measure(model, n, a.repeats, stream)
            ms = {k: v * 1e3 for k, v in r.items()}
            read_bw = stream.numel() * stream.element_size() / r["read"]
            line = weight_bytes_per_step(model) / read_bw * 1e3
            bandwidths.append(read_bw)
            rows.append(f"| {name} | {n} ({bucket_for(n)}) | {ms['lean']:.1f} | {ms['lean weights']:.1f} | "
                        f"{ms['lean'] - ms['lean weights']:.1f} | {ms['compiled']:.1f} | {ms['compiled weights']:.1f} | "
                        f"{ms['compiled'] - ms['compiled weights']:.1f} | {ms['compiled'] / ms['lean']:.2f} | " +
                        (f"{ms[GRAPHS]:.1f} | " if GRAPHS in ms else "- | ") + f"{line:.1f} ({read_bw / 1e9:.0f} GB/s) | "
                        f"{ms['compiled'] / line:.2f} |")
            print(rows[-1], flush=True)
    cmd = "python benchmarks/compiled_step.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(a).items() if k != "out" and v is not None)
    md = (f"# The compiled step: where a target step's time goes\n\n`{cmd}`\n\n{a.target}, a {PREFIX}-token prefix, "
          f"{a.threads} threads, median of {a.repeats} rounds (each the median of 3 steps), lean and compiled "
          f"alternating. 'its weights': the step's weight products alone, in the path's own form; 'other' = the "
          f"step minus that (approximate: the products timed alone miss the step's other cache traffic and "
          f"fusions, so it can come out below zero). 'compiled': the step as it runs by default, here one call of "
          f"specdec's CPU layer kernel a layer for up to 32 tokens (kernels/cpu_layer.py); 'compiled through its "
          f"graphs': the same step through its inductor graphs with the CPU attention kernel between them, as "
          f"where the layer kernel does not run. Bandwidth line: weight bytes / streaming-read bandwidth, a sum "
          f"over 256 MB timed in every round beside the steps (median per row; {min(bandwidths) / 1e9:.0f}-"
          f"{max(bandwidths) / 1e9:.0f} GB/s over this run).\n\nMachine: {machine()}.\n\n" + "\n".join(rows) + "\n")
    print(md)
    if a.out:
        write_text(a.out, md)


if __name__ == "__main__":
    main()
