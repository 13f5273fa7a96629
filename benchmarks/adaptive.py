"""Adaptive draft length vs every fixed k vs HF's heuristic, side by side, on prompt sets of different
predictability; and with a useless (random-weight) drafter, adaptive vs target-only decoding.

    python benchmarks/adaptive.py

Prompt sets (all from held-out zoo modules): "copy" (a function shown twice, then its third copy begins:
the continuation is highly predictable), "code" (held-out function openings), "prose" (docstring and
comment text, which a code model predicts worse). Greedy, 128 new tokens. Modes alternate per prompt.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import specdec
from specdec.zoo import corpus


def prompt_sets(tok, n):
    code = specdec.zoo.prompts(n)
    copy = []
    for p in specdec.zoo.prompts(3 * n)[n:]:
        body = p.strip("\n")
        if len(body) > 120:
            copy.append(body + "\n\n" + body + "\n\n" + body[: len(body) // 3])
        if len(copy) == n:
            break
    prose = []
    for text in corpus.read_texts("heldout"):
        start = text.find('"""')
        end = text.find('"""', start + 3)
        if start >= 0 and end - start > 300:
            prose.append(text[start:start + 300].rsplit(" ", 1)[0])
        if len(prose) == n:
            break
    return {"copy": copy, "code": code, "prose": prose}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="draft-wide")
    ap.add_argument("--draft-dtype", choices=("float32", "int8"), default="int8",
                    help="int8: weight-only int8 draft (specdec.int8_draft), as the CLI runs it by default")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="0,1,2,3,4,6,8", help="fixed draft lengths (0 = plain decoding)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sets", default="copy,code,prose", help="prompt sets to run (comma-separated)")
    ap.add_argument("--no-useless", action="store_true", help="skip the useless-drafter comparison")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "adaptive"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, tok = specdec.zoo.load("target")
    as_run = specdec.int8_draft if a.draft_dtype == "int8" else (lambda m: m)
    draft = as_run(specdec.zoo.load(a.draft)[0])
    N = a.new_tokens
    ks = [int(k) for k in a.ks.split(",")]
    modes = {f"k={k}": k for k in ks}
    modes.update({"heuristic": "heuristic", "adaptive": "adaptive"})
    sets = {k: v for k, v in prompt_sets(tok, a.prompts).items() if k in a.sets.split(",")}
    results = {}

    def spec(drafter, mode, ids):
        out = specdec.generate(target, ids, drafter=drafter, draft_length=mode, max_new_tokens=N, min_new_tokens=N,
                               return_dict_in_generate=True)
        return out.stats

    def served(model, ids):  # a wrapped model: the policy's estimates carry over from one prompt to the next
        return model.generate(ids, max_new_tokens=N, min_new_tokens=N, return_dict_in_generate=True).stats

    spec(draft, 4, tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids)  # warm-up
    for name, texts in sets.items():
        tps = {m: [] for m in modes}
        adaptive = specdec.wrap(target, drafter=draft)  # fresh per prompt set, warm within it
        for rep in range(a.repeats):
            for text in texts:
                ids = tok(text, return_tensors="pt").input_ids
                order = list(modes.items())
                if rep % 2:
                    order.reverse()  # alternate the order too: no mode always runs first
                for m, mode in order:
                    if mode == "adaptive":
                        s = served(adaptive, ids)
                    else:  # k = 0 is plain decoding: no drafter at all
                        s = spec(draft if mode != 0 else None, mode, ids)
                    tps[m].append(s.tokens_per_s)
        med = {m: statistics.mean(v) for m, v in tps.items()}
        best_fixed = max((m for m in modes if m.startswith("k=")), key=lambda m: med[m])
        results[name] = {"tokens_per_s": med, "best_fixed": best_fixed,
                         "adaptive_vs_best_fixed": med["adaptive"] / med[best_fixed],
                         "adaptive_vs_heuristic": med["adaptive"] / med["heuristic"]}
        print(name, json.dumps(results[name]), file=sys.stderr)
    if not a.no_useless:  # useless drafter: random weights, same shape as the draft, on the code prompts
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        junk = as_run(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(specdec.zoo.path(a.draft))).eval())
        plain, adapt = [], []
        useless = specdec.wrap(target, drafter=junk)
        for _ in range(a.repeats):
            for text in specdec.zoo.prompts(a.prompts):
                ids = tok(text, return_tensors="pt").input_ids
                plain.append(spec(None, 0, ids).tokens_per_s)
                adapt.append(served(useless, ids).tokens_per_s)
        results["useless_drafter"] = {"target_only_tokens_per_s": statistics.mean(plain),
                                      "adaptive_tokens_per_s": statistics.mean(adapt),
                                      "ratio": statistics.mean(adapt) / statistics.mean(plain)}
    Path(a.out + ".json").write_text(json.dumps(results, indent=2))
    lines = ["| prompt set | " + " | ".join(modes) + " | best fixed | adaptive / best fixed | adaptive / heuristic |",
             "|---|" + "---|" * (len(modes) + 3)]
    for name in sets:
        r = results[name]
        lines.append(f"| {name} | " + " | ".join(f"{r['tokens_per_s'][m]:.1f}" for m in modes) +
                     f" | {r['best_fixed']} | {r['adaptive_vs_best_fixed']:.3f} | {r['adaptive_vs_heuristic']:.3f} |")
    u = results.get("useless_drafter")
    if u:
        lines += ["", f"Useless (random-weight) drafter: adaptive {u['adaptive_tokens_per_s']:.1f} tokens/s vs plain "
                  f"decoding {u['target_only_tokens_per_s']:.1f} (ratio {u['ratio']:.3f})."]
    cmd = "python benchmarks/adaptive.py " + " ".join(sys.argv[1:])
    Path(a.out + ".md").write_text(f"# Adaptive draft length\n\n`{cmd}`\n\nTokens/s (mean over {a.prompts} prompts x "
                                   f"{a.repeats} repeats per set, {N} new tokens, greedy, drafter {a.draft} ({a.draft_dtype}); adaptive "
                                   "is one wrapped model per prompt set, so its estimates carry over from prompt to "
                                   "prompt as when serving; fixed k and heuristic are stateless).\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
