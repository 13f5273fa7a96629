"""How long a fresh process takes to be ready to answer, with inductor's on-disk cache warm (a cached start,
issue 45): import, model load, warm-up with the compiled step built before returning (`warm_up()`, what
demo and bench do) or in a background thread (`warm_up(background_compile=True)`, what chat and serve do),
then the first answer to a held-out chat prompt. Each variant runs in its own fresh process, alternating,
after one unmeasured process that fills the cache.

    python benchmarks/cached_start.py [--runs 3] [--max-new-tokens 64] [--out benchmarks/results/cached_start.md]

SmolLM2-135M-Instruct float32, its default chat drafter (prompt lookup + the shipped head), 2 threads.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-instruct"

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
args = json.loads(sys.argv[1])
import torch, specdec
from specdec import zoo
from specdec.cli.models import _default_drafter, _drafter_arg
torch.set_num_threads(2)
t_import = time.perf_counter()
target, tok = zoo.load(args["target"])
drafter = _drafter_arg(_default_drafter(args["target"], "chat"), tok, target=target)
model = specdec.wrap(target, drafter=drafter)
t_load = time.perf_counter()
model.warm_up(background_compile=args["background"])
t_ready = time.perf_counter()
ids = tok.apply_chat_template([{"role": "user", "content": args["prompt"]}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
out = model.generate(ids, max_new_tokens=args["new"], do_sample=False, return_dict_in_generate=True)
t_answer = time.perf_counter()
print(json.dumps({"import": t_import - t0, "load": t_load - t_import, "warm_up": t_ready - t_load,
                  "ready": t_ready - t0, "answer": t_answer - t_ready, "step": out.stats.step,
                  "tokens": out.stats.new_tokens, "ids": out.sequences[0].tolist()}))
"""


def child(background: bool, prompt: str, new: int) -> dict:
    args = json.dumps({"target": TARGET, "background": background, "prompt": prompt, "new": new})
    done = subprocess.run([sys.executable, "-c", CHILD, args], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cached_start.md"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from specdec.files import write_text
    from specdec.hf.linear import machine

    prompt = json.loads((ROOT / "benchmarks/prompts/chat.jsonl").read_text().splitlines()[0])["prompt"]
    child(False, prompt, 4)  # fills inductor's cache (a first compile); not measured
    runs = {False: [], True: []}
    for _ in range(a.runs):
        for background in (False, True):
            runs[background].append(child(background, prompt, a.max_new_tokens))
    ids = {tuple(r["ids"]) for rs in runs.values() for r in rs}
    lines = ["| warm-up | import s | load s | warm-up s | ready s | first answer s | ready + answer s | step of the "
             "first answer |", "|---|---|---|---|---|---|---|---|"]
    for background, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("import", "load", "warm_up", "ready", "answer")}
        total = statistics.median(r["ready"] + r["answer"] for r in rs)
        lines.append(f"| {'background compile' if background else 'compile, then return'} | {med['import']:.1f} | "
                     f"{med['load']:.1f} | {med['warm_up']:.1f} | {med['ready']:.1f} | {med['answer']:.1f} | "
                     f"{total:.1f} | {rs[0]['step']} |")
    cmd = f"python benchmarks/cached_start.py --runs {a.runs} --max-new-tokens {a.max_new_tokens}"
    md = (f"# Cached start: a fresh process ready to answer\n\n`{cmd}`\n\n{TARGET} float32 with its chat drafter, "
          f"2 threads, inductor's on-disk cache warm (one unmeasured process filled it); medians of {a.runs} fresh "
          f"processes per variant, alternating; the first answer: {a.max_new_tokens} tokens, greedy, to the first "
          f"prompt of benchmarks/prompts/chat.jsonl. Every process's tokens equal: "
          f"{'yes' if len(ids) == 1 else 'NO'}. Machine: {machine()}.\n\n" + "\n".join(lines) + "\n")
    print(md)
    write_text(a.out, md)


if __name__ == "__main__":
    main()
