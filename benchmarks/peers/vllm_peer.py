"""vLLM's CPU build and specdec on the same machine, prompts and weights (float32, or `--dtype bfloat16`),
single stream.

vLLM lives in its own virtual environment (benchmarks/peers/make_vllm_venv.sh: it pins an older
transformers), so each engine runs in its own process and writes what it measured; `--compare` renders
the side-by-side table. One engine run = its load and warm-up (not timed), then `--repeats` rounds over
the prompts, every generation timed alone. Run the engines alternately, twice each, on a quiet machine:

    bash benchmarks/peers/make_vllm_venv.sh .venv-vllm
    for i in 1 2; do
      .venv-vllm/bin/python benchmarks/peers/vllm_peer.py --engine vllm --out /tmp/peer/vllm_$i.json
      python benchmarks/peers/vllm_peer.py --engine specdec --out /tmp/peer/specdec_$i.json
    done
    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python benchmarks/peers/vllm_peer.py --engine vllm \
        --out /tmp/peer/vllm_iomp.json      # vLLM's advice for speculation on a CPU: measured both ways
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 .venv-vllm/bin/python benchmarks/peers/vllm_peer.py --engine vllm \
        --out /tmp/peer/vllm_2cores.json    # both cores computing (its default keeps one for the front end)
    python benchmarks/peers/vllm_peer.py --compare /tmp/peer/*.json --out benchmarks/results/vllm_peer.md

Modes: vLLM target-only and n-gram (k = 4); specdec plain with its default step (step="auto": which
step ran is in the table) and with the compiled step, the shipped head adaptive and n-gram + head (for a
`--target` no head ships for: prompt lookup, adaptive); HF generate() as the common yardstick. `--target`:
any real zoo target both engines load (default SmolLM2-135M-Instruct; `gemma3-270m` too). With `--eagle3 DIR` (an EAGLE-3 head `specdec export-head` wrote: the
shipped one is `specdec export-head smollm2-135m-instruct-eagle3-head --target smollm2-135m-instruct --out
DIR`; the default shipped head is of the older kind, which vLLM has no layout for), both engines also draft
with that head: vLLM a chain of `--k`, specdec the same chain and adaptive. Tau and acceptance by position are counted
the same way for both engines (vLLM's counters: per step that drafted), per timed generation.
Prompts: benchmarks/prompts/chat.jsonl in the model's chat template, as plain text where it has none (no training
run used them).
Greedy output is compared token for token with HF's. No engine reuses a prompt's KV from an earlier call: vLLM's
prefix caching is off (runs before 2026-12-07 left it on, its default, so a repeated prompt's prefill was cached
in vLLM's later rounds: a small advantage to vLLM beside 96 decoded tokens); specdec and HF keep no cache.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from ttft_prompts import read, render  # noqa: E402
TARGET = "smollm2-135m-instruct"  # the default --target

# vLLM's CPU backend otherwise reserves 92 % of the machine's memory and refuses to start where other processes
# hold more than 8 % (a test suite's second worker, seen here): an explicit KV budget, ample for one sequence of
# 1024 tokens (SmolLM2: 47 MB), takes that check away and changes nothing in how vLLM computes
KV_CACHE_BYTES = 1 << 30

def prompts(tok, n: int) -> list[list[int]]:
    """The first n chat prompts as token ids, the same for both engines: in the tokenizer's chat template, or as
    plain text where it has none (a base model: Gemma 3 270M; ttft_prompts.render)."""
    return [render(tok, text) for text in read("chat.jsonl")[:n]]


def model_dir(target: str) -> str:
    """The zoo's converted folder of a real target (`specdec zoo get TARGET` made it): both engines load it."""
    home = Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache/specdec"))
    folder = home / "models" / target
    if not (folder / "config.json").exists():
        raise SystemExit(f"{folder} holds no model: run `specdec zoo get {target}` first")
    return str(folder)


def run_vllm(a) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(model_dir(a.target))
    ids = prompts(tok, a.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=a.max_new_tokens, ignore_eos=False)
    # vLLM asks for Intel's OpenMP preloaded for speculative decoding on a CPU, and by default keeps one of
    # two cores for its front end (VLLM_CPU_NUM_OF_RESERVED_CPU=0: both compute): each setting its own mode
    settings = (["libiomp5 preloaded"] if "libiomp5" in os.environ.get("LD_PRELOAD", "") else []) + \
        ([f"{os.environ['VLLM_CPU_NUM_OF_RESERVED_CPU']} CPUs reserved"] if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ else [])
    preloaded = f" ({', '.join(settings)})" if settings else ""
    out = {}
    modes = [("vLLM target-only" + preloaded, None),
             ("vLLM ngram k=4" + preloaded, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                             "prompt_lookup_min": 2})]
    if a.eagle3:
        modes.append((f"vLLM eagle3 k={a.k}" + preloaded,
                      {"method": "eagle3", "model": a.eagle3, "num_speculative_tokens": a.k}))
    for mode, spec in modes:
        llm = LLM(model=model_dir(a.target), dtype=a.dtype, max_model_len=1024, max_num_seqs=1, seed=0,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=False,
                  speculative_config=spec, disable_log_stats=False)
        llm.generate([TokensPrompt(prompt_token_ids=ids[0][:16])], params, use_tqdm=False)  # warm-up
        out[mode] = []
        for _ in range(a.repeats):
            for p in ids:
                before = vllm_acceptance(llm) if spec else None  # read outside the timed span
                t0 = time.perf_counter()
                res = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
                row = {"tokens": list(res.outputs[0].token_ids), "seconds": time.perf_counter() - t0}
                if spec:  # this generation's drafting: the counters' growth over it, as specdec's rows record it
                    after = vllm_acceptance(llm)
                    row["acceptance"] = {"drafting_steps": after[0] - before[0],
                                         "accepted_by_position": [x - y for x, y in zip(after[1], before[1] + [0] * len(after[1]))]}
                out[mode].append(row)
        del llm
    return out


def vllm_acceptance(llm) -> tuple[int, list[int]]:
    """vLLM's speculative counters so far: (steps that drafted, accepted drafts at each position)."""
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return (int(drafts.value) if drafts else 0), ([int(v) for v in per_pos.values] if per_pos else [])


def specdec_acceptance(stats) -> dict:
    """One generation's drafting as vLLM counts it: steps that drafted, accepted drafts at each position."""
    return {"drafting_steps": sum(1 for d in stats.draft_lengths if d > 0),
            "accepted_by_position": list(stats.accepted_by_position)}


def run_specdec(a) -> dict:
    import torch

    import specdec
    from specdec import zoo
    from specdec.drafters import FeatureHead, LookupFirst

    torch.set_num_threads(a.threads)
    target, tok = zoo.load(a.target, dtype=getattr(torch, a.dtype))
    ids = [torch.tensor([p]) for p in prompts(tok, a.num_prompts)]

    def hf(p):
        return target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=a.max_new_tokens, do_sample=False)

    def spec(model):
        return lambda p: model.generate(p, max_new_tokens=a.max_new_tokens, do_sample=False,
                                        return_dict_in_generate=True)

    modes = {"HF generate": hf,
             "specdec plain (step auto)": spec(specdec.wrap(target, draft_length=0)),
             "specdec plain (step compiled)": spec(specdec.wrap(target, draft_length=0, step="compiled"))}
    if zoo.head_for(a.target):  # the shipped head, alone and behind prompt lookup (the library's default)
        head = FeatureHead.from_pretrained(zoo.path(zoo.head_for(a.target)), target)
        modes["specdec head adaptive"] = spec(specdec.wrap(target, drafter=head))
        modes["specdec ngram+head adaptive"] = spec(specdec.wrap(target, drafter=LookupFirst(head)))
    else:  # no head ships for it: prompt lookup, the drafter vLLM's n-gram mode compares with
        modes["specdec ngram adaptive"] = spec(specdec.wrap(target, drafter="ngram"))
    if a.eagle3:  # the exported EAGLE-3 head vLLM drafts with, read back by specdec's importer
        eagle3 = FeatureHead.from_pretrained(a.eagle3, target)
        modes[f"specdec eagle3 k={a.k}"] = spec(specdec.wrap(target, drafter=eagle3, draft_length=a.k))
        modes["specdec eagle3 adaptive"] = spec(specdec.wrap(target, drafter=eagle3))
    for run in modes.values():  # warm-up: compiles the step's buckets, probes, packs
        run(ids[0][:, :16])
    out = {m: [] for m in modes}
    for _ in range(a.repeats):
        for p in ids:
            for mode, run in modes.items():
                t0 = time.perf_counter()
                got = run(p)
                row = {"seconds": time.perf_counter() - t0}
                if mode == "HF generate":
                    row["tokens"] = got[0, p.shape[1]:].tolist()
                else:
                    row.update(tokens=got.sequences[0, p.shape[1]:].tolist(), step=got.stats.step,
                               acceptance=specdec_acceptance(got.stats))
                out[mode].append(row)
    return out


def compare(files: list[str]) -> str:
    runs: dict[str, list[dict]] = {}
    for f in files:
        for mode, rows in json.loads(Path(f).read_text())["modes"].items():
            runs.setdefault(mode, []).append({"file": Path(f).name, "rows": rows})
    ref = runs["HF generate"][0]["rows"]
    lines = ["| engine, mode | tokens/s per run (all tokens / all seconds) | median | vs HF generate | greedy == HF | "
             "tau (1 + accepted / drafting steps) | acceptance at positions 1, 2, 3, 4 |", "|---|---|---|---|---|---|---|"]
    hf_tps = statistics.median(sum(len(r["tokens"]) for r in run["rows"]) / sum(r["seconds"] for r in run["rows"])
                               for run in runs["HF generate"])
    for mode, group in runs.items():
        tps = [sum(len(r["tokens"]) for r in run["rows"]) / sum(r["seconds"] for r in run["rows"]) for run in group]
        same = all(r["tokens"][:len(h["tokens"])] == h["tokens"] for run in group for r, h in zip(run["rows"], ref))
        tau, by_pos = acceptance([r for run in group for r in run["rows"]])
        steps = sorted({r["step"] for run in group for r in run["rows"] if "step" in r})
        label = mode + (f" [ran: {', '.join(steps)}]" if steps else "")
        lines.append(f"| {label} | {', '.join(f'{t:.1f}' for t in tps)} | {statistics.median(tps):.1f} | "
                     f"{statistics.median(tps) / hf_tps:.2f} | {'yes' if same else '**no**'} | {tau} | {by_pos} |")
    return "\n".join(lines)


def acceptance(rows: list[dict]) -> tuple[str, str]:
    """tau (1 + accepted drafts / steps that drafted) and acceptance at positions 1-4 (accepted at position i /
    steps that drafted: vLLM's own definition, applied to both engines) over the rows that recorded them."""
    found = [r["acceptance"] for r in rows if "acceptance" in r]
    steps = sum(x["drafting_steps"] for x in found)
    if not steps:
        return "-", "-"
    width = max(len(x["accepted_by_position"]) for x in found)
    per_pos = [sum(x["accepted_by_position"][i] for x in found if i < len(x["accepted_by_position"])) / steps
               for i in range(width)]
    return f"{1 + sum(per_pos):.2f}", ", ".join(f"{v:.2f}" for v in per_pos[:4])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["vllm", "specdec"])
    ap.add_argument("--compare", nargs="+", default=None, help="engine JSON files to render side by side")
    ap.add_argument("--target", default=TARGET, help="a real zoo target (its `specdec zoo get` folder)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the weights' dtype, the same for every engine and mode")
    ap.add_argument("--eagle3", default=None, help="an EAGLE-3 head exported by `specdec export-head`: both engines "
                    "also draft with it (vLLM: method eagle3, a chain of --k; specdec: the same chain, and adaptive)")
    ap.add_argument("--k", type=int, default=3, help="the EAGLE-3 chain's length (with --eagle3)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.compare:
        table = compare(a.compare)
        runs = [json.loads(Path(f).read_text()) for f in a.compare]
        engines = [r["engine"] for r in runs]
        dtypes = sorted({r["args"].get("dtype", "float32") for r in runs})
        targets = sorted({r["args"].get("target", TARGET) for r in runs})
        if len(dtypes) > 1 or len(targets) > 1:
            raise SystemExit(f"runs of different dtypes or targets cannot share a table: {dtypes}, {targets}")
        sys.path.insert(0, str(ROOT))
        from specdec.files import write_text
        from specdec.hf.linear import machine

        target_arg = "" if targets[0] == TARGET else f" --target {targets[0]}"
        rendering = "in the chat template" if runs[0].get("chat_template", True) else "as plain text (no chat template)"

        def runs_folder(files: list) -> str:
            """Where the runs' JSON lie, relative to benchmarks/ when they lie under it."""
            folder = Path(files[0]).resolve().parent
            inside = folder.is_relative_to(ROOT / "benchmarks")
            return f"{folder.relative_to(ROOT / 'benchmarks')}/" if inside else f"{folder}/"

        write_text(out, f"# vLLM CPU and specdec side by side\n\n`python benchmarks/peers/vllm_peer.py "
                        f"--compare {' '.join(Path(f).name for f in a.compare)}` over engine runs of "
                        f"`vllm_peer.py --engine vllm|specdec{target_arg} --num-prompts {a.num_prompts} --max-new-tokens "
                        f"{a.max_new_tokens} --repeats {a.repeats}` (module docstring: the loop that alternates "
                        f"them).\n\n{targets[0]} {dtypes[0]}, benchmarks/prompts/chat.jsonl {rendering}, greedy, "
                        f"single stream. specdec computes on both cores (2 torch threads); vLLM's CPU worker, by its "
                        f"own default on a 2-core machine, computes on one and reserves the other for its front end "
                        f"(`reserve_cpu_num=1` in its log). Each engine run loads, warms up, then times every "
                        f"generation alone; the engines ran alternately ({engines.count('specdec')} specdec runs, "
                        f"{engines.count('vllm')} vLLM runs; the runs' JSON: `{runs_folder(a.compare)}`).\n\n"
                        f"Machine: {machine()}.\n\n"
                        f"{table}\n")
        print(table)
        return
    modes = run_vllm(a) if a.engine == "vllm" else run_specdec(a)
    from transformers import AutoTokenizer
    chat = bool(getattr(AutoTokenizer.from_pretrained(model_dir(a.target)), "chat_template", None))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"engine": a.engine, "args": vars(a), "chat_template": chat, "modes": modes}))
    tmp.replace(out)
    for mode, rows in modes.items():
        print(f"{mode}: {sum(len(r['tokens']) for r in rows) / sum(r['seconds'] for r in rows):.1f} tokens/s")


if __name__ == "__main__":
    main()
