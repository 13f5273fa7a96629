"""Drafters that need no second model, on input-grounded prompts: specdec prompt lookup vs HF's
prompt_lookup_num_tokens vs target-only; and early-exit self-speculation at several exit layers.

    python benchmarks/no_second_model.py

Input-grounded prompts: a held-out function, then a comment asking for it again, then its first line:
the answer copies from the context, as in editing or "repeat/modify this function" work.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import specdec
from specdec.drafters import EarlyExit

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=4)
ap.add_argument("--new-tokens", type=int, default=96)
ap.add_argument("--k", type=int, default=4)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "no_second_model"))
a = ap.parse_args()
torch.set_num_threads(a.threads)
target, tok = specdec.zoo.load("target")
texts = []
for p in specdec.zoo.prompts(4 * a.prompts):
    body = p.strip("\n")
    first = body.splitlines()[0]
    if len(body) > 200:
        texts.append(body + "\n\n# The same code again, unchanged:\n" + first + "\n")
    if len(texts) == a.prompts:
        break
prompts = [tok(t, return_tensors="pt").input_ids for t in texts]
N = a.new_tokens


def hf(ids, **kw):
    t0 = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                          do_sample=False, **kw)
    return out, time.perf_counter() - t0, None


def spec(model):
    def run(ids):
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=N, min_new_tokens=N, return_dict_in_generate=True)
        return out.sequences, time.perf_counter() - t0, out.stats
    return run


modes = {"target-only (HF)": lambda ids: hf(ids),
         f"HF prompt lookup k={a.k}": lambda ids: hf(ids, prompt_lookup_num_tokens=a.k),
         f"specdec ngram k={a.k}": spec(specdec.wrap(target, drafter="ngram", draft_length=a.k)),
         "specdec ngram adaptive": spec(specdec.wrap(target, drafter="ngram"))}
for e in (1, 2, 3):
    modes[f"specdec early-exit E={e} adaptive"] = spec(specdec.wrap(target, drafter=EarlyExit(target, e)))
for share in (True, False):  # what sharing layers < E saves: draft prefill, and E layers of every verification
    modes[f"specdec early-exit E=3 k=2 {'shared KV' if share else 'own pages'}"] = spec(
        specdec.wrap(target, drafter=EarlyExit(target, 3, share_kv=share), draft_length=2))
for run in modes.values():
    run(prompts[0])
rows = {m: {"tps": [], "tau": [], "alpha": [], "equal": True} for m in modes}
refs = {}
for rep in range(2):
    for i, ids in enumerate(prompts):
        for m, run in modes.items():
            seq, dt, st = run(ids)
            rows[m]["tps"].append(N / dt)
            if m.startswith("target-only"):
                refs[i] = seq
            rows[m]["equal"] &= torch.equal(seq, refs[i])
            if st is not None:
                rows[m]["tau"].append(st.mean_accepted_length)
                rows[m]["alpha"].append(st.alpha)
base = statistics.median(rows["target-only (HF)"]["tps"])
res = {m: {"tokens_per_s": statistics.median(r["tps"]), "speedup": statistics.median(r["tps"]) / base,
           "tau": statistics.mean(r["tau"]) if r["tau"] else None,
           "alpha": statistics.mean(r["alpha"]) if r["alpha"] else None, "greedy_equal": r["equal"]}
       for m, r in rows.items()}
Path(a.out + ".json").write_text(json.dumps(res, indent=2))
lines = ["| mode | tokens/s (median) | speedup | alpha | tau | == target greedy |", "|---|---|---|---|---|---|"]
for m, r in res.items():
    alpha = "" if r["alpha"] is None else f"{r['alpha']:.2f}"
    tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
    lines.append(f"| {m} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {alpha} | {tau} | "
                 f"{'yes' if r['greedy_equal'] else 'NO'} |")
Path(a.out + ".md").write_text("# No second model: prompt lookup and early exit\n\n`python benchmarks/no_second_model.py " +
                               " ".join(sys.argv[1:]) + f"`\n\n{len(prompts)} input-grounded prompts x 2 repeats, {N} new "
                               "tokens, greedy, zoo target.\n\n" + "\n".join(lines) + "\n")
print("\n".join(lines))
