"""Draft-length policies replayed on recorded acceptance: a noise-free comparison, in seconds not minutes.

    python benchmarks/policy_replay.py

Why: fixed-k rows of `adaptive.py` move +-7 % between runs on a shared CPU, more than the differences
between good policies. But under greedy decoding the outcome of a step is a function of where it starts:
a step from position t that drafts k tokens accepts n = min(L_t, k), where L_t is the number of draft
tokens that would match the target's greedy continuation from t on. L_t comes from ONE draft forward over
the target's greedy output (while the draft matches, it sees the true prefix), so every policy can be
replayed on the same texts with the same costs, and two policies differ only by their decisions.

Recorded here: the target's greedy continuation of each prompt of `adaptive.py`'s sets, L_t for every
position, and the costs the engine measures on this machine (seconds per draft token, T_verify(n) for
n = 1..max_k + 1, from fixed-k generations; the draft's catch-up per token after plain steps). Replayed:
every fixed k, HF's heuristic in both schedules and the adaptive policy, each fed the recorded costs (with
10 % noise, as measured step times have) through the same observe() the engine calls. What a replay does
not see: costs that change with the context length and per-step overheads; `adaptive.py` measures those.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import specdec  # noqa: E402
from adaptive import prompt_sets  # noqa: E402
from specdec.policy import ConstantPolicy, make_policy  # noqa: E402


def run_lengths(target, draft, ids, new_tokens):
    """[new_tokens] L_t: draft tokens from position t on that equal the target's greedy continuation."""
    out = specdec.generate(target, ids, drafter=None, draft_length=0, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens)
    with torch.no_grad():
        guess = draft(out).logits[0].argmax(-1)  # [T + N] the draft's next token after each prefix
    T = ids.shape[1]
    match = (guess[T - 1:-1] == out[0, T:]).tolist()  # [N] does the draft predict new token t?
    L, run = [0] * len(match), 0
    for t in range(len(match) - 1, -1, -1):
        run = run + 1 if match[t] else 0
        L[t] = run
    return L


def measure_costs(target, draft, ids, max_k, repeats=2):
    """Seconds per drafted token and T_verify(n), n = 1..max_k + 1, as the engine's cost model sees them."""
    t_draft, t_verify = [], {}
    for _ in range(repeats):
        for k in range(max_k + 1):
            policy = ConstantPolicy(k)
            specdec.generate(target, ids, drafter=draft if k else None, draft_length=policy, max_new_tokens=64,
                             min_new_tokens=64)
            if k:
                t_draft.append(policy.costs.t_draft)
            t_verify.setdefault(k + 1, []).append(policy.costs.t_verify(k + 1))
    return statistics.median(t_draft), {n: statistics.median(v) for n, v in t_verify.items()}


def catch_up_cost(draft, ids, tokens=16, repeats=5):
    """Seconds per token a draft forward over several tokens adds: the catch-up after plain steps."""
    with torch.no_grad():
        draft(ids)
        t0 = time.perf_counter()
        for _ in range(repeats):
            draft(ids[:, -tokens:], logits_to_keep=1)
        many = (time.perf_counter() - t0) / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            draft(ids[:, -1:], logits_to_keep=1)
        one = (time.perf_counter() - t0) / repeats
    return max(0.0, many - one) / (tokens - 1)


def replay(policy, L, t_draft, t_verify, rng, noise=0.1, catch_up=0.0):
    """Seconds one generation takes under `policy` (the first token comes from the prefill). A model drafter
    idle during plain steps catches up on their tokens in its next forward (`catch_up` seconds per token)."""
    t, total, idle = 1, 0.0, 0
    if hasattr(policy, "begin_sequence"):
        policy.begin_sequence()
    while t < len(L):
        k = max(0, min(policy.next_length(), len(L) - t - 1, max(t_verify) - 1))
        n = min(L[t], k)
        d = (k * t_draft + (catch_up * idle if k else 0.0)) * (1 + noise * rng.gauss(0, 1))
        v = t_verify[k + 1] * (1 + noise * rng.gauss(0, 1))
        policy.observe(k, n, d, v)
        total += d + v
        idle = idle + 1 if k == 0 else 0
        t += n + 1
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="draft-wide")
    ap.add_argument("--draft-dtype", choices=("float32", "int8"), default="int8")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="passes over each prompt set")
    ap.add_argument("--seeds", type=int, default=5, help="replays with different cost noise")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "policy_replay"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, tok = specdec.zoo.load("target")
    draft = specdec.zoo.load(a.draft)[0]
    if a.draft_dtype == "int8":
        draft = specdec.int8_draft(draft)
    sets = prompt_sets(tok, a.prompts)
    traces = {name: [run_lengths(target, draft, tok(p, return_tensors="pt").input_ids, a.new_tokens) for p in texts]
              for name, texts in sets.items()}
    cost_ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    t_draft, t_verify = measure_costs(target, draft, cost_ids, a.max_k)
    catch_up = catch_up_cost(draft, cost_ids)
    modes = [f"k={k}" for k in range(a.max_k + 1)] + ["heuristic", "heuristic_transient", "adaptive"]
    results = {"t_draft_s": t_draft, "t_verify_s": t_verify, "catch_up_s_per_token": catch_up, "sets": {}}
    for name, runs in traces.items():
        secs = {m: [] for m in modes}  # replayed seconds per generation, in the order the loops run them
        for seed in range(a.seeds):
            rng = random.Random(seed)
            keep = {"adaptive": make_policy("adaptive", a.max_k), "heuristic": make_policy("heuristic", a.max_k)}
            for _ in range(a.repeats):
                for L in runs:
                    for m in modes:
                        if m in keep:
                            policy = keep[m]
                        elif m == "heuristic_transient":
                            policy = make_policy("heuristic", a.max_k)
                        else:
                            policy = ConstantPolicy(int(m[2:]))
                        secs[m].append(replay(policy, L, t_draft, t_verify, rng, catch_up=catch_up))
        # a set's throughput: its tokens over the time its generations took (see adaptive.py)
        lengths = [len(L) - 1 for _ in range(a.seeds * a.repeats) for L in runs]  # tokens per generation
        tput = {m: sum(lengths) / sum(v) for m, v in secs.items()}
        rates = {m: statistics.mean(n / x for n, x in zip(lengths, v)) for m, v in secs.items()}
        best = max((m for m in modes if m.startswith("k=")), key=tput.get)
        best_rates = max((m for m in modes if m.startswith("k=")), key=rates.get)
        results["sets"][name] = {"tokens_per_s": tput, "best_fixed": best, "mean_of_per_run_tokens_per_s": rates,
                                 "mean_of_rates_adaptive_vs_heuristic": rates["adaptive"] / rates["heuristic"],
                                 "mean_of_rates_adaptive_vs_best_fixed": rates["adaptive"] / rates[best_rates],
                                 "mean_run_length": statistics.mean(min(x, a.max_k) for L in runs for x in L)}
    Path(a.out + ".json").write_text(json.dumps(results, indent=2))
    lines = ["| prompt set | best fixed | best fixed / plain | heuristic / best fixed | heuristic_transient / best "
             "fixed | adaptive / best fixed | adaptive / heuristic | adaptive / heuristic_transient | by mean of rates: "
             "adaptive / best fixed, / heuristic |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["sets"].items():
        m = r["tokens_per_s"]
        b = m[r["best_fixed"]]
        lines.append(f"| {name} | {r['best_fixed']} | {b / m['k=0']:.3f} | {m['heuristic'] / b:.3f} | "
                     f"{m['heuristic_transient'] / b:.3f} | {m['adaptive'] / b:.3f} | {m['adaptive'] / m['heuristic']:.3f}"
                     f" | {m['adaptive'] / m['heuristic_transient']:.3f} | {r['mean_of_rates_adaptive_vs_best_fixed']:.3f}, "
                     f"{r['mean_of_rates_adaptive_vs_heuristic']:.3f} |")
    costs = ", ".join(f"{n}: {v * 1e3:.1f}" for n, v in sorted(t_verify.items()))
    cmd = "python benchmarks/policy_replay.py " + " ".join(sys.argv[1:])
    Path(a.out + ".md").write_text(
        f"# Draft-length policies replayed on recorded acceptance\n\n`{cmd}`\n\nDrafter {a.draft} ({a.draft_dtype}); "
        f"{a.prompts} prompts per set x {a.repeats} passes x {a.seeds} noise seeds, {a.new_tokens} tokens each. "
        f"Measured costs: {t_draft * 1e3:.2f} ms per draft token, {catch_up * 1e3:.3f} ms per token of catch-up; "
        f"T_verify(n) in ms: {costs}. Ratios of tokens/s, "
        "each set's tokens over its replayed time (drafting + verification only); the last column compares "
        "arithmetic means of the per-generation rates instead.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
