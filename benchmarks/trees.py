"""Token trees vs chains at equal target cost (the same number of tokens in each verification forward).

    python benchmarks/trees.py

Chain k drafts k tokens (target verifies k+1); a tree with k nodes also makes the target verify k+1
tokens, but spends them on alternatives where the draft is unsure. Reported per configuration: tau
(tokens per target forward), acceptance, tokens/s, and greedy equality with target-only output.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import specdec

ap = argparse.ArgumentParser()
ap.add_argument("--draft", default="draft-wide")
ap.add_argument("--prompts", type=int, default=4)
ap.add_argument("--new-tokens", type=int, default=96)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trees"))
a = ap.parse_args()
torch.set_num_threads(a.threads)
target, tok = specdec.zoo.load("target")
draft, _ = specdec.zoo.load(a.draft)
prompts = [tok(p, return_tensors="pt").input_ids for p in specdec.zoo.prompts(a.prompts)]
specs = [("chain", 4), specdec.TreeSpec.static([2, 1]), ("chain", 8), specdec.TreeSpec.static([2, 1, 1, 1]),
         specdec.TreeSpec.dynamic(nodes=8, depth=5, topk=2), ("chain", 16),
         specdec.TreeSpec.dynamic(nodes=16, depth=6, topk=3)]
configs = {}
for spec in specs:
    if isinstance(spec, tuple):
        configs[f"chain k={spec[1]}"] = dict(draft_length=spec[1], max_draft_length=max(8, spec[1]))
    else:
        label = (f"tree static {list(spec.branching)}" if spec.kind == "static" else
                 f"tree dynamic depth {spec.depth}, topk {spec.topk}")
        fixed = {} if spec.kind == "static" else {"draft_length": spec.nodes}  # equal cost: the full budget
        configs[f"{label} ({spec.nodes} nodes)"] = dict(tree=spec, **fixed)
# and the adaptive policy sizing the largest dynamic tree each step (up to its 16 nodes)
configs["tree dynamic depth 6, topk 3 (adaptive budget <= 16)"] = dict(tree=specs[-1])
models = {name: specdec.wrap(target, drafter=draft, **cfg) for name, cfg in configs.items()}
refs = [target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=a.new_tokens, do_sample=False)
        for p in prompts]
for m in models.values():
    m.generate(prompts[0], max_new_tokens=8)  # warm-up
rows = {n: {"tps": [], "tau": [], "acc": [], "equal": True} for n in models}
for i, p in enumerate(prompts):
    for name, m in models.items():
        out = m.generate(p, max_new_tokens=a.new_tokens, return_dict_in_generate=True)
        r = rows[name]
        r.setdefault("verified", []).append(1 + out.stats.drafted_tokens / max(1, out.stats.target_forwards))
        r["tps"].append(out.stats.tokens_per_s)
        r["tau"].append(out.stats.mean_accepted_length)
        r["acc"].append(out.stats.acceptance_rate)
        r["equal"] &= torch.equal(out.sequences, refs[i])
res = {n: {"tokens_per_s": statistics.mean(r["tps"]), "tau": statistics.mean(r["tau"]),
           "acceptance": statistics.mean(r["acc"]), "greedy_equal": r["equal"],
           "tokens_verified_per_forward": statistics.mean(r["verified"])} for n, r in rows.items()}
Path(a.out + ".json").write_text(json.dumps(res, indent=2))
lines = ["| configuration | tokens verified per forward (mean) | tau | acceptance (accepted/drafted) | tokens/s | == target greedy |",
         "|---|---|---|---|---|---|"]
for name, cfg in configs.items():
    r = res[name]
    lines.append(f"| {name} | {r['tokens_verified_per_forward']:.1f} | {r['tau']:.2f} | {r['acceptance']:.2f} | {r['tokens_per_s']:.1f} | "
                 f"{'yes' if r['greedy_equal'] else 'NO'} |")
Path(a.out + ".md").write_text("# Trees vs chains at equal target cost\n\n`python benchmarks/trees.py " +
                               " ".join(sys.argv[1:]) + f"`\n\nzoo target + {a.draft}, {len(prompts)} held-out prompts, "
                               f"{a.new_tokens} new tokens, greedy.\n\n" + "\n".join(lines) + "\n")
print("\n".join(lines))
