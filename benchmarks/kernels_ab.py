"""The CPU layer kernel of another revision against the working tree's, in one process, on a real step.

Why: kernel changes move a step by a few percent while this class of machine's memory bandwidth swings by
2x within minutes, so timings from separate runs cannot tell them apart. This builds the kernels
(specdec/kernels/*.cpp, *.h) as they were at `--baseline` under another op namespace, loads both libraries,
captures the decoder-layer calls of one real step (n new tokens after a T-token context, the pages as the
engine fills them), then replays the step's layers through each library in alternating order, round after
round: the median per-round ratio is the figure (below 1: the working tree faster). The pages are rewritten
with the same keys and values each time, so both libraries see the same caches' contents; the weights stream
through the caches between layers as in a step.

    python benchmarks/kernels_ab.py --baseline HEAD~1 --target smollm2-135m-instruct --dtype bfloat16 \
        --shapes 1x200 1x1000 8x200 8x1000 --out benchmarks/results/kernels_ab.md
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.files import write_text  # noqa: E402
from specdec.hf.linear import machine  # noqa: E402
from specdec.kernels import cpu_library  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "specdec" / "kernels"


def build_baseline(revision: str, where: Path) -> str:
    """The kernels at `revision`, their namespace renamed, built into `where`; returns the op namespace."""
    names = subprocess.run(["git", "ls-tree", "--name-only", revision, "specdec/kernels/"], capture_output=True,
                           text=True, check=True, cwd=KERNELS.parents[1]).stdout.split()
    namespace = "specdec_baseline"
    for name in names:
        if name.endswith((".cpp", ".h")):
            text = subprocess.run(["git", "show", f"{revision}:{name}"], capture_output=True, text=True, check=True,
                                  cwd=KERNELS.parents[1]).stdout
            (where / Path(name).name).write_text(re.sub(r"\bspecdec_cpu\b", namespace, text))
    sources = tuple(where / p.name for p in cpu_library.SOURCES)
    command = cpu_library._build_command(shutil.which("c++") or "c++", sources, where / "baseline.so")
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"building the kernels at {revision} failed:\n{built.stderr[-2000:]}")
    torch.ops.load_library(str(where / "baseline.so"))
    getattr(torch.ops, namespace).set_bf16_dot(torch.ops.specdec_cpu.bf16_dot())
    return namespace


def captured_step(model, n: int, context: int, seed: int = 0) -> list[tuple[tuple, dict]]:
    """The decoder-layer calls of one step of n tokens after `context` tokens, as the compiled runner makes them."""
    from specdec.cache.pool import BlockTable, PagePool
    from specdec.hf import compiled
    from specdec.hf.attention import specdec_attention
    from specdec.hf.compiled import CompiledRunner

    pool = PagePool((context + n) // 16 + 2, 16)
    table = BlockTable(pool, "cpu")
    runner = CompiledRunner.for_model(model, pool, table)
    runner.prepare(n)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    calls = []
    real = compiled.cpu_layer.decoder_layer
    with torch.no_grad(), specdec_attention(model):
        runner.forward(torch.randint(0, vocab, (context,), generator=gen), logits_rows=1)
        compiled.cpu_layer.decoder_layer = lambda *a, **k: (calls.append((a, k)), real(*a, **k))[1]
        try:
            runner.forward(torch.randint(0, vocab, (n,), generator=gen), logits_rows=n)
        finally:
            compiled.cpu_layer.decoder_layer = real
    if not calls:
        raise SystemExit("the step ran no layer through the CPU layer kernel (does this CPU have AVX2 and FMA?)")
    return calls


def compare(calls, baseline: str, rounds: int) -> dict:
    ops = {"baseline": getattr(torch.ops, baseline), "working tree": torch.ops.specdec_cpu}
    with torch.no_grad():
        outs = {k: [op.decoder_layer(*a, **kw) for a, kw in calls] for k, op in ops.items()}
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(*outs.values()))
        times = {k: [] for k in ops}
        order = list(ops)
        for r in range(rounds):
            for k in order if r % 2 else order[::-1]:
                start = time.perf_counter()
                for a, kw in calls:
                    ops[k].decoder_layer(*a, **kw)
                times[k].append(time.perf_counter() - start)
    base, new = times["baseline"], times["working tree"]
    return {"baseline ms": statistics.median(base) * 1e3, "new ms": statistics.median(new) * 1e3,
            "ratio": statistics.median(b / a for a, b in zip(base, new)), "diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision whose kernels to compare against")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--shapes", nargs="+", default=["1x200", "1x1000", "8x200", "8x1000"],
                        help="NxT: n new tokens after a T-token context")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if reason := cpu_library.load():
        raise SystemExit(f"specdec's CPU kernels are not available here: {reason}")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from specdec import zoo

    model = AutoModelForCausalLM.from_pretrained(zoo.path(args.target), dtype=getattr(torch, args.dtype)).eval()
    rows = []
    with tempfile.TemporaryDirectory() as where:
        baseline = build_baseline(args.baseline, Path(where))
        for shape in args.shapes:
            n, context = map(int, shape.split("x"))
            r = compare(captured_step(model, n, context), baseline, args.rounds)
            rows.append(f"| {n} | {context} | {r['baseline ms']:.2f} | {r['new ms']:.2f} | {r['ratio']:.3f} | "
                        f"{r['diff']:.2g} |")
            print(rows[-1], flush=True)
    command = "python benchmarks/kernels_ab.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        f"# The layer kernel at {args.baseline} against the working tree, in one process", "", f"`{command}`", "",
        f"{args.target} in {args.dtype}, {args.threads} threads: the decoder-layer calls of one step (n new tokens "
        f"after a T-token context) replayed through each library, alternating, {args.rounds} rounds; ms: median "
        "time of the step's layers; ratio: median per-round working tree / baseline; diff: the largest difference "
        "between the two libraries' layer outputs.", "", f"Machine: {machine()}.", "",
        "| n | T | baseline ms | working tree ms | ratio | diff |", "|---|---|---|---|---|---|", *rows, ""])
    if args.out:
        write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
