"""Adaptive draft length vs every fixed k vs HF's heuristic, side by side, on prompt sets of different
predictability; and with a useless (random-weight) drafter, adaptive vs target-only decoding. HF's
heuristic runs in both of its schedules: "heuristic" (its budget carries over from call to call, as HF
keeps it) and "heuristic_transient" (restarts at 4 on every call). Adaptive likewise: "adaptive" is one
policy whose estimates carry over (what `specdec.generate` keeps for a target and drafter, and what a
`wrap()`ed model and the chat session keep), "adaptive_transient" a fresh one per call (a first call).

    python benchmarks/adaptive.py

Prompt sets (all from held-out zoo modules): "copy" (a function shown twice, then its third copy begins:
the continuation is highly predictable), "code" (held-out function openings), "prose" (docstring and
comment text, which a code model predicts worse). Greedy, 128 new tokens. Every prompt runs every mode,
the order rotating from prompt to prompt; ratios come with a 90 % bootstrap interval over the paired runs.

Throughput of a prompt set is its tokens over the time its generations took (sum of tokens / sum of each
generation's wall time): every generation emits the same number of tokens, so this is the harmonic mean
of the per-generation rates, the rate at which the whole set is served. The arithmetic mean of the
per-generation rates is reported beside it; it weights each fast generation's rate as much as a slow one's
although the slow one takes longer, so a policy that loses a little on easy texts and wins a lot on hard
ones looks worse by it than it is. Per generation, the geometric mean of the paired speed ratios and
how often adaptive was faster say whether it wins on most generations or on the slow ones.

The JSON keeps every generation's seconds; `--render results/adaptive.json` rewrites the markdown from it,
and `--pool A.json B.json --out results/pooled` pools runs of the same settings (one run resolves about
+-4 % on a shared 2-core machine; differences between policies are often smaller).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

import specdec
from specdec.policy import make_policy
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


def _bootstrap_ratio(num, den, rng, draws=2000):
    """90 % bootstrap interval of mean(num) / mean(den) over paired units (prompt x repeat)."""
    idx = torch.randint(len(num), (draws, len(num)), generator=rng)
    n, d = torch.tensor(num)[idx].mean(1), torch.tensor(den)[idx].mean(1)
    r = (n / d).sort().values
    return float(r[int(0.05 * draws)]), float(r[int(0.95 * draws) - 1])


def throughput(seconds, tokens):
    """Tokens per second of a set of generations: total tokens / total wall time."""
    return tokens * len(seconds) / sum(seconds)


def mean_of_rates(seconds, tokens):
    """The arithmetic mean of the per-generation tokens/s (this benchmark's metric before 2026-12-01)."""
    return statistics.mean(tokens / x for x in seconds)


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
    ap.add_argument("--render", metavar="RUN.json", help="only rewrite RUN.md from a recorded run's RUN.json")
    ap.add_argument("--pool", nargs="+", metavar="RUN.json",
                    help="only pool recorded runs of the same settings into OUT.json / OUT.md (every ratio over all "
                         "their generations; the useless drafter when every run recorded its seconds)")
    a = ap.parse_args()
    if a.render:
        print(render(json.loads(Path(a.render).read_text()), a.render.removesuffix(".json")))
        return
    if a.pool:
        results = pool([json.loads(Path(p).read_text()) for p in a.pool])
        results["run"]["command"] = "python benchmarks/adaptive.py " + " ".join(sys.argv[1:])
        Path(a.out + ".json").write_text(json.dumps(results, indent=2))
        print(render(results, a.out))
        return
    torch.set_num_threads(a.threads)
    target, tok = specdec.zoo.load("target")
    as_run = specdec.int8_draft if a.draft_dtype == "int8" else (lambda m: m)
    draft = as_run(specdec.zoo.load(a.draft)[0])
    N = a.new_tokens
    ks = [int(k) for k in a.ks.split(",")]
    modes = [f"k={k}" for k in ks] + ["heuristic", "heuristic_transient", "adaptive", "adaptive_transient"]
    sets = {k: v for k, v in prompt_sets(tok, a.prompts).items() if k in a.sets.split(",")}
    set_secs = {}  # prompt set -> mode -> [prompt x repeat] wall seconds per generation

    def run(drafter, policy, ids):
        """Wall seconds of one generation of exactly N new tokens (prefill included)."""
        out = specdec.generate(target, ids, drafter=drafter, draft_length=policy, max_new_tokens=N,
                               min_new_tokens=N, return_dict_in_generate=True)
        return out.stats.total_s

    run(draft, 4, tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids)  # warm-up
    for name, texts in sets.items():
        # stateful policies, one per prompt set, as when serving: adaptive's estimates and HF's "heuristic"
        # budget (HF keeps num_assistant_tokens across generate calls) carry over from prompt to prompt;
        # "heuristic_transient" (HF's other schedule) restarts at 4 on every call and "adaptive_transient" is a fresh
        # policy per call (what a first call gets); fixed k are stateless
        keep = {"adaptive": make_policy("adaptive"), "heuristic": make_policy("heuristic")}
        secs = {m: [] for m in modes}
        for rep in range(a.repeats):
            for i, text in enumerate(texts):
                ids = tok(text, return_tensors="pt").input_ids
                shift = (rep * len(texts) + i) % len(modes)
                for m in modes[shift:] + modes[:shift]:  # rotate: no mode always runs first or after another
                    if m in keep:
                        policy = keep[m]
                    elif m == "heuristic_transient":
                        policy = make_policy("heuristic")
                    elif m == "adaptive_transient":
                        policy = make_policy("adaptive")
                    else:
                        policy = int(m[2:])
                    secs[m].append(run(draft if policy != 0 else None, policy, ids))
        set_secs[name] = secs
        print(name, {m: round(throughput(v, N), 1) for m, v in secs.items()}, file=sys.stderr)  # progress
    useless_secs = None
    if not a.no_useless:  # useless drafter: random weights, same shape as the draft, on the code prompts
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        junk = as_run(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(specdec.zoo.path(a.draft))).eval())
        useless_secs = {"plain": [], "adaptive": [], "adaptive_transient": [], "heuristic_transient": []}
        useless = make_policy("adaptive")
        for rep in range(a.repeats):
            for text in specdec.zoo.prompts(a.prompts):
                ids = tok(text, return_tensors="pt").input_ids
                pair = [("plain", None, 0), ("adaptive", junk, useless),
                        ("adaptive_transient", junk, make_policy("adaptive")),
                        ("heuristic_transient", junk, make_policy("heuristic"))]
                for m, drafter, policy in (pair if rep % 2 == 0 else pair[::-1]):
                    useless_secs[m].append(run(drafter, policy, ids))
    results = summarize(set_secs, useless_secs, N, modes)
    results["run"] = {"command": "python benchmarks/adaptive.py " + " ".join(sys.argv[1:]), "prompts": a.prompts,
                      "repeats": a.repeats, "new_tokens": N, "draft": a.draft, "draft_dtype": a.draft_dtype,
                      "modes": modes, "sets": list(sets)}
    Path(a.out + ".json").write_text(json.dumps(results, indent=2))
    print(render(results, a.out))


def summarize(set_secs, useless_secs, N, modes):
    """Every ratio, from the wall seconds alone (so recorded runs can be pooled): set_secs[set][mode] and
    useless_secs[mode] (or None) are lists of per-generation seconds, paired by index across modes."""
    rng = torch.Generator().manual_seed(0)
    results = {}
    fresh = "adaptive_transient" in modes
    for name, secs in set_secs.items():
        tput = {m: throughput(v, N) for m, v in secs.items()}
        per_run_mean = {m: mean_of_rates(v, N) for m, v in secs.items()}
        best_fixed = max((m for m in modes if m.startswith("k=")), key=lambda m: tput[m])
        best_fixed_mean = max((m for m in modes if m.startswith("k=")), key=lambda m: per_run_mean[m])
        r = {"tokens_per_s": tput, "best_fixed": best_fixed, "seconds": secs,
             "mean_of_per_run_tokens_per_s": per_run_mean, "best_fixed_by_mean_of_rates": best_fixed_mean}
        comparisons = [("adaptive", (best_fixed, "heuristic", "heuristic_transient"))]
        comparisons += [("adaptive_transient", (best_fixed, "heuristic_transient"))] if fresh else []
        for mine, others in comparisons:
            for other in others:
                key = "best_fixed" if other == best_fixed else other
                # throughput ratio = time ratio: other's total seconds / mine, resampled over paired runs
                r[f"{mine}_vs_{key}"] = tput[mine] / tput[other]
                r[f"{mine}_vs_{key}_ci90"] = _bootstrap_ratio(secs[other], secs[mine], rng)
        for other in (best_fixed_mean, "heuristic"):
            key = "best_fixed" if other == best_fixed_mean else other
            r[f"mean_of_rates_adaptive_vs_{key}"] = per_run_mean["adaptive"] / per_run_mean[other]
        results[name] = r
    if len(set_secs) > 1:  # all sets as one workload: every (set, prompt, repeat) a paired unit
        pooled = {m: [x for secs in set_secs.values() for x in secs[m]] for m in modes}
        pairs = [("adaptive", "heuristic"), ("adaptive", "heuristic_transient")]
        pairs += [("adaptive_transient", "heuristic_transient")] if fresh else []
        results["all_sets"] = {}
        for mine, other in pairs:
            results["all_sets"][f"{mine}_vs_{other}"] = sum(pooled[other]) / sum(pooled[mine])
            results["all_sets"][f"{mine}_vs_{other}_ci90"] = _bootstrap_ratio(pooled[other], pooled[mine], rng)
    if useless_secs:
        u = useless_secs
        results["useless_drafter"] = {"target_only_tokens_per_s": throughput(u["plain"], N),
                                      "adaptive_tokens_per_s": throughput(u["adaptive"], N),
                                      "heuristic_transient_tokens_per_s": throughput(u["heuristic_transient"], N),
                                      "ratio": throughput(u["adaptive"], N) / throughput(u["plain"], N),
                                      "ratio_ci90": _bootstrap_ratio(u["plain"], u["adaptive"], rng),
                                      "mean_of_rates_ratio": mean_of_rates(u["adaptive"], N) / mean_of_rates(u["plain"], N),
                                      "seconds": u}
        if "adaptive_transient" in u:
            results["useless_drafter"].update(
                adaptive_transient_tokens_per_s=throughput(u["adaptive_transient"], N),
                transient_ratio=throughput(u["adaptive_transient"], N) / throughput(u["plain"], N),
                transient_ratio_ci90=_bootstrap_ratio(u["plain"], u["adaptive_transient"], rng))
    return results


def pool(runs):
    """One result from several recorded runs of the same settings: their seconds concatenated, then summarize."""
    same = ("prompts", "new_tokens", "draft", "draft_dtype", "modes", "sets")
    first = runs[0]["run"]
    for r in runs[1:]:
        differ = [k for k in same if r["run"].get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"cannot pool runs whose settings differ: {', '.join(differ)}")
    modes, sets = first["modes"], first["sets"]
    set_secs = {name: {m: [x for r in runs for x in r[name]["seconds"][m]] for m in modes} for name in sets}
    useless = [r.get("useless_drafter", {}).get("seconds") for r in runs]
    useless_secs = None if not all(useless) else {m: [x for u in useless for x in u[m]] for m in useless[0]}
    results = summarize(set_secs, useless_secs, first["new_tokens"], modes)
    results["run"] = {**{k: first[k] for k in same}, "repeats": sum(r["run"]["repeats"] for r in runs),
                      "pooled_from": [r["run"]["command"] for r in runs]}
    return results


def render(results, out):
    """Write `out`.md from a run's results (the JSON main() writes); returns the table."""
    run = results["run"]
    modes, sets = run["modes"], run["sets"]

    def ratio(r, key):
        lo, hi = r[key + "_ci90"]
        return f"{r[key]:.3f} [{lo:.2f}, {hi:.2f}]"

    lines = ["| prompt set | " + " | ".join(modes) + " | best fixed | adaptive / best fixed | adaptive / heuristic "
             "| adaptive / heuristic_transient | by mean of rates: adaptive / best fixed, / heuristic |",
             "|---|" + "---|" * (len(modes) + 5)]
    per_generation = []
    for name in sets:
        r = results[name]
        lines.append(f"| {name} | " + " | ".join(f"{r['tokens_per_s'][m]:.1f}" for m in modes) +
                     f" | {r['best_fixed']} | {ratio(r, 'adaptive_vs_best_fixed')} | {ratio(r, 'adaptive_vs_heuristic')} "
                     f"| {ratio(r, 'adaptive_vs_heuristic_transient')} | {r['mean_of_rates_adaptive_vs_best_fixed']:.3f} "
                     f"({r['best_fixed_by_mean_of_rates']}), {r['mean_of_rates_adaptive_vs_heuristic']:.3f} |")
        ada, heu = r["seconds"]["adaptive"], r["seconds"]["heuristic"]
        geo = math.exp(statistics.mean(math.log(h / x) for x, h in zip(ada, heu)))
        wins = sum(h > x for x, h in zip(ada, heu))
        per_generation.append(f"{name} {geo:.3f} (faster in {wins} of {len(ada)})")
    lines += ["", "Per generation, adaptive / heuristic (geometric mean of the paired speed ratios): "
              + ", ".join(per_generation) + "."]
    if "adaptive_transient" in modes:
        lines += ["", "A fresh adaptive policy per call (adaptive_transient), per set: " + ", ".join(
            f"{name} {ratio(results[name], 'adaptive_transient_vs_best_fixed')} of the best fixed k and "
            f"{ratio(results[name], 'adaptive_transient_vs_heuristic_transient')} of heuristic_transient"
            for name in sets) + "."]
    if "all_sets" in results:
        r = results["all_sets"]
        lines += ["", f"All sets as one workload: adaptive / heuristic {ratio(r, 'adaptive_vs_heuristic')}, adaptive / "
                  f"heuristic_transient {ratio(r, 'adaptive_vs_heuristic_transient')}" + (
                      f"; adaptive_transient / heuristic_transient "
                      f"{ratio(r, 'adaptive_transient_vs_heuristic_transient')}."
                      if "adaptive_transient_vs_heuristic_transient" in r else ".")]
    u = results.get("useless_drafter")
    if u:
        lines += ["", f"Useless (random-weight) drafter: adaptive {u['adaptive_tokens_per_s']:.1f} tokens/s vs plain "
                  f"decoding {u['target_only_tokens_per_s']:.1f} (ratio {ratio(u, 'ratio')}; by mean of rates "
                  f"{u['mean_of_rates_ratio']:.3f}); HF's heuristic (transient) "
                  f"{u['heuristic_transient_tokens_per_s']:.1f}."]
        if "transient_ratio" in u:
            lines[-1] += (f" A fresh adaptive policy per call: {u['adaptive_transient_tokens_per_s']:.1f} tokens/s "
                          f"(ratio {ratio(u, 'transient_ratio')}).")
    Path(out + ".md").write_text(
        f"# Adaptive draft length\n\n`{run['command']}`\n\n"
        + ("Pooled from " + ", ".join(f"`{c}`" for c in run["pooled_from"]) + ".\n\n" if "pooled_from" in run else "")
        + f"Tokens/s of each prompt set: {run['prompts']} prompts x "
        f"{run['repeats']} repeats, {run['new_tokens']} new tokens each, greedy, drafter {run['draft']} "
        f"({run['draft_dtype']}); total tokens / total wall time (prefill included), i.e. the harmonic mean of the "
        "per-generation rates. Every prompt runs every mode in turn, the order rotating from prompt to prompt; "
        "ratios come with a 90 % bootstrap interval over the paired (prompt, repeat) runs. The last column "
        "compares arithmetic means of the per-generation rates instead (this file's metric before 2026-12-01), "
        "each against the best fixed k by that metric. adaptive and heuristic are one policy per prompt set whose "
        "state carries over from prompt to prompt (HF's \"heuristic\" schedule keeps num_assistant_tokens across "
        "generate calls); heuristic_transient restarts at 4 on every call (HF's \"heuristic_transient\"); fixed k "
        "are stateless" + ("; adaptive_transient is a fresh policy per call (what a first call gets; "
                            "specdec.generate keeps one policy per target and drafter, like adaptive here)"
                            if "adaptive_transient" in modes else "") + ".\n\n" + "\n".join(lines) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
