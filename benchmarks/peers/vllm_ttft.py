"""Time to the first token: vLLM's CPU build, specdec and HF generate() on the same machine, prompts and weights.

What a chat user waits for before the first word: a prompt's prefill and its first token. Each engine runs in its
own process (vLLM's venv: benchmarks/peers/make_vllm_venv.sh) and writes what it measured; `--compare` renders
the table. Run the engines alternately on a quiet machine:

    for i in 1 2; do
      python benchmarks/peers/vllm_ttft.py --engine specdec --dtype bfloat16 --out /tmp/ttft/specdec_$i.json
      .venv-vllm/bin/python benchmarks/peers/vllm_ttft.py --engine vllm --dtype bfloat16 --out /tmp/ttft/vllm_$i.json
    done
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 .venv-vllm/bin/python benchmarks/peers/vllm_ttft.py --engine vllm \
        --dtype bfloat16 --out /tmp/ttft/vllm_2cores.json   # both cores computing (its default keeps one)
    python benchmarks/peers/vllm_ttft.py --compare /tmp/ttft/*.json --out benchmarks/results/vllm_ttft_bf16.md

Prompts: benchmarks/ttft_prompts.py's (chat and code edits, 44-712 tokens on SmolLM2). An engine run loads,
generates one token for every prompt once untimed (the same warm-up for every engine and mode: shapes, buckets,
kernels), then times `--repeats` rounds of one-token generations, each alone. No engine reuses a prompt's KV from
an earlier call: vLLM's prefix caching is turned off (its default would answer a repeated prompt from cache),
specdec keeps no cache between calls (keep_cache=False, its default), HF generate() keeps none. The first token
of every engine is compared with HF's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from ttft_prompts import ttft_prompts  # noqa: E402
from vllm_peer import KV_CACHE_BYTES, ROOT, TARGET, model_dir  # noqa: E402


def timed(first, prompts: list[list[int]], repeats: int) -> list[dict]:
    """first(ids) -> the first token; one warm-up call per prompt, then `repeats` rounds, every call timed
    alone. Returns per prompt {"tokens": n, "seconds": [..], "first_token": t}."""
    rows = [{"tokens": len(p), "seconds": [], "first_token": int(first(p))} for p in prompts]
    for _ in range(repeats):
        for row, p in zip(rows, prompts):
            t0 = time.perf_counter()
            token = int(first(p))
            row["seconds"].append(time.perf_counter() - t0)
            if token != row["first_token"]:
                raise SystemExit(f"the first token changed between calls on a {len(p)}-token prompt: {token} vs "
                                 f"{row['first_token']}")
    return rows


def run_vllm(a, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    mode = "vLLM" + (f" ({reserved} CPUs reserved)" if reserved is not None else "")
    llm = LLM(model=model_dir(a.target), dtype=a.dtype, max_model_len=1024, max_num_seqs=1, seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1)

    def first(p):
        return llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0].outputs[0].token_ids[0]

    return {mode: timed(first, prompts, a.repeats)}


def run_specdec(a, prompts: list[list[int]]) -> dict:
    import torch

    import specdec
    from specdec import zoo

    torch.set_num_threads(a.threads)
    target, _ = zoo.load(a.target, dtype=getattr(torch, a.dtype))
    plain = specdec.wrap(target, draft_length=0)

    def hf(p):
        ids = torch.tensor([p])
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)[0, -1]

    def spec(p):
        return plain.generate(torch.tensor([p]), max_new_tokens=1, do_sample=False)[0, -1]

    modes = {"HF generate": hf, "specdec": spec}
    out = {m: timed(f, prompts, 0) for m, f in modes.items()}  # warm-up: every prompt once, each mode
    for _ in range(a.repeats):  # modes alternating round by round
        for mode, f in modes.items():
            for row, more in zip(out[mode], timed(f, prompts, 1)):
                row["seconds"] += more["seconds"]
    return out


def compare(files: list[str]) -> str:
    """The table: per prompt, each mode's median seconds over all its runs, its ratio to HF's, and whether its
    first token equals HF's."""
    runs: dict[str, list[list[dict]]] = {}
    for f in files:
        for mode, rows in json.loads(Path(f).read_text())["modes"].items():
            runs.setdefault(mode, []).append(rows)
    if "HF generate" not in runs:
        raise SystemExit("no run holds HF generate()'s times: run the specdec engine at least once")
    hf = runs["HF generate"]
    kinds = [row.get("kind", "") for row in hf[0]]
    modes = ["HF generate"] + [m for m in runs if m != "HF generate"]
    head = " | ".join(f"{m} ms" for m in modes)
    lines = [f"| prompt | tokens | {head} | " + " | ".join(f"{m} vs HF" for m in modes[1:]) + " | first token == HF |",
             "|---|---|" + "---|" * (2 * len(modes)) ]
    for i, kind in enumerate(kinds):
        ms = {m: 1e3 * statistics.median(s for rows in runs[m] for s in rows[i]["seconds"]) for m in modes}
        same = all(rows[i]["first_token"] == hf[0][i]["first_token"] for m in modes for rows in runs[m])
        lines.append(f"| {kind} | {hf[0][i]['tokens']} | " + " | ".join(f"{ms[m]:.0f}" for m in modes) + " | "
                     + " | ".join(f"{ms['HF generate'] / ms[m]:.2f}x" for m in modes[1:])
                     + f" | {'yes' if same else '**no**'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["vllm", "specdec"])
    ap.add_argument("--compare", nargs="+", default=None, help="engine JSON files to render side by side")
    ap.add_argument("--target", default=TARGET, help="a real zoo target (its `specdec zoo get` folder)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.compare:
        runs = [json.loads(Path(f).read_text()) for f in a.compare]
        settings = sorted({(r["args"]["target"], r["args"]["dtype"]) for r in runs})
        if len(settings) > 1:
            raise SystemExit(f"runs of different targets or dtypes cannot share a table: {settings}")
        table = compare(a.compare)
        sys.path.insert(0, str(ROOT))
        from specdec.files import write_text
        from specdec.hf.linear import machine

        engines = [r["engine"] for r in runs]
        write_text(out, f"# Time to the first token: vLLM CPU, specdec and HF side by side\n\n"
                        f"`python benchmarks/peers/vllm_ttft.py --compare {' '.join(Path(f).name for f in a.compare)}`"
                        f" over engine runs of `vllm_ttft.py --engine vllm|specdec --target {settings[0][0]} --dtype "
                        f"{settings[0][1]} --repeats {runs[0]['args']['repeats']}` (module docstring: the loop that "
                        f"alternates them; {engines.count('specdec')} specdec runs, {engines.count('vllm')} vLLM runs)."
                        f"\n\n{settings[0][0]} {settings[0][1]}, single stream, one new token; medians over every "
                        f"timed call of every run. specdec and HF compute on both cores (2 torch threads); vLLM by its "
                        f"default on one (the other reserved for its front end) unless the mode says 0 CPUs "
                        f"reserved.\n\nMachine: {machine()}.\n\n{table}\n")
        print(table)
        return
    from transformers import AutoTokenizer

    named = ttft_prompts(AutoTokenizer.from_pretrained(model_dir(a.target)))
    prompts = [ids for _, ids in named]
    modes = run_vllm(a, prompts) if a.engine == "vllm" else run_specdec(a, prompts)
    for rows in modes.values():
        for row, (kind, _) in zip(rows, named):
            row["kind"] = kind
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"engine": a.engine, "args": vars(a), "modes": modes}))
    tmp.replace(out)
    for mode, rows in modes.items():
        print(mode, ", ".join(f"{r['tokens']} tokens {1e3 * statistics.median(r['seconds']):.0f} ms" for r in rows))


if __name__ == "__main__":
    main()
