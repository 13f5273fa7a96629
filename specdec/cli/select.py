"""`specdec select-draft`: which draft, which k, for this target? Predict from measured acceptance and
costs, then check the prediction against measured speedups.

Per draft and temperature: per-position acceptance alpha_j (censoring-free), alpha, tau, c (draft time
per token / plain decoding time per token), the predicted speedup

    S(k) = (P_plain + (N - 1) T_plain) / (P_spec + (N - 1) / tau(k) * T_step(k))

with tau(k) from alpha_j, T_plain the engine's plain decoding time per token, P the prefill times, and
T_step(k) = a + b k the engine's whole time per speculation step (draft, verify, bookkeeping) measured in
place by short probe runs at k = 1, max_k / 2 and max_k and fitted as a line: costs measured in
isolation miss how draft and target evict each other's weights from the caches when they alternate,
which on a CPU is most of the difference. Then the measured speedup at each k (specdec vs plain
decoding, interleaved prompt by prompt), the best k and the ranking. A draft whose best predicted speedup is clearly
below 1 is not swept (stopped early). Writes report.json, report.md and PNG plots.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ..files import save_figure, write_text
from ..policy import expected_tokens
from ..stats import SpecStats


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b k through {k: y} (b = 0 for a single point)."""
    ks = list(points)
    if len(ks) == 1:
        return points[ks[0]], 0.0
    mk, my = statistics.mean(ks), statistics.mean(points.values())
    b = sum((k - mk) * (y - my) for k, y in points.items()) / sum((k - mk) ** 2 for k in ks)
    return my - b * mk, b


def select_draft(target, drafts: dict, prompts: list[torch.Tensor], temperatures=(0.0,), max_k: int = 6,
                 new_tokens: int = 64, progress: bool = True) -> dict:
    """drafts: {name: draft model, Drafter or "ngram"}. prompts: [1, T] int64 each. Returns the report dict."""
    from tqdm import tqdm
    from transformers import PreTrainedModel

    import specdec

    from ..drafters.model import vocab_size_of

    report = {"drafts": {}, "skipped": {}}
    ok = {}
    for name, model in drafts.items():
        if isinstance(model, PreTrainedModel) and vocab_size_of(model) != vocab_size_of(target):
            report["skipped"][name] = (f"vocabulary size {vocab_size_of(model)} differs from the target's "
                                       f"{vocab_size_of(target)}")
        else:
            ok[name] = model
    bar = tqdm(total=len(ok) * len(temperatures), desc="select-draft", disable=not progress)
    for name, model in ok.items():
        per_temp = {}
        for temp in temperatures:
            sampling = {"do_sample": temp > 0, **({"temperature": temp} if temp > 0 else {})}
            plain = specdec.wrap(target, drafter=None, draft_length=0)
            length = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            fixed = dict(length, return_dict_in_generate=True)
            # probe runs at a few k, alternating with plain decoding prompt by prompt (so both see the same
            # machine): acceptance by position (from the longest) and the engine's own time per step measured
            # in place (drafting, verification, bookkeeping, with the caches as they are when draft and target
            # alternate), fitted as a line in k
            probes = {k: specdec.wrap(target, drafter=model, draft_length=k)
                      for k in sorted({1, (max_k + 1) // 2, max_k})}
            plain_stats, runs = [], {k: [] for k in probes}
            for p in prompts:
                plain_stats.append(plain.generate(p, **fixed, **sampling).stats)
                for k, m in probes.items():
                    runs[k].append(m.generate(p, **fixed, **sampling).stats)
            stats = runs[max_k]
            pooled = SpecStats.combine(stats)  # drafts and acceptance by position summed over the prompts
            alphas = (pooled.per_position_acceptance + [0.0] * max_k)[:max_k]
            t_draft = pooled.draft_s / max(1, pooled.drafted_tokens)
            t_plain = sum(s.decode_s for s in plain_stats) / max(1, sum(s.new_tokens - 1 for s in plain_stats))
            step_s = {k: sum(s.decode_s for s in st) / max(1, sum(s.target_forwards for s in st))
                      for k, st in runs.items()}
            a0, b0 = _line(step_s)
            prefill_plain = statistics.mean(s.prefill_s for s in plain_stats)
            prefill_spec = statistics.mean(s.prefill_s for st in runs.values() for s in st)
            emitted = new_tokens - 1  # the first token comes from the prefill
            predicted = {0: 1.0}
            for k in range(1, max_k + 1):
                spec_s = prefill_spec + emitted / expected_tokens(alphas, k) * (a0 + b0 * k)
                predicted[k] = (prefill_plain + emitted * t_plain) / spec_s
            rec = {"per_position_acceptance": alphas, "alpha": pooled.alpha,
                   "tau": statistics.mean(s.mean_accepted_length for s in stats), "c": t_draft / t_plain,
                   "t_plain_s": t_plain, "step_s_measured": step_s, "step_s_line": [a0, b0],
                   "predicted_speedup": predicted}
            best_pred = max(predicted, key=predicted.get)
            if max(predicted[k] for k in range(1, max_k + 1)) < 0.9:
                rec["stopped_early"] = "predicted speedup below 0.9 at every k >= 1: not swept"
                rec["measured_speedup"] = {}
            else:
                # every k and plain decoding on each prompt in turn (the k order rotating), so a slow spell
                # on the machine hits all of them alike; speedup = total plain time / total time at k
                specs = {k: specdec.wrap(target, drafter=model, draft_length=k) for k in range(1, max_k + 1)}
                plain_total, spec_total = 0.0, {k: 0.0 for k in specs}
                for i, p in enumerate(prompts):
                    order = list(specs)[i % max_k:] + list(specs)[:i % max_k]
                    torch.manual_seed(0)
                    t0 = time.perf_counter()
                    plain.generate(p, **length, **sampling)
                    plain_total += time.perf_counter() - t0
                    for k in order:
                        torch.manual_seed(0)
                        t0 = time.perf_counter()
                        specs[k].generate(p, **length, **sampling)
                        spec_total[k] += time.perf_counter() - t0
                measured = {k: plain_total / t for k, t in spec_total.items()}
                rec["measured_speedup"] = measured
            rec["best_k_predicted"] = best_pred
            if rec["measured_speedup"]:
                rec["best_k_measured"] = max(rec["measured_speedup"], key=rec["measured_speedup"].get)
                errs = [abs(predicted[k] - m) / m for k, m in rec["measured_speedup"].items()]
                rec["prediction_error_max"] = max(errs)
                rec["prediction_error_mean"] = statistics.mean(errs)
            per_temp[str(temp)] = rec
            bar.update(1)
        report["drafts"][name] = per_temp
    bar.close()

    def score(name):
        rec = report["drafts"][name][str(temperatures[0])]
        return max(rec["measured_speedup"].values()) if rec["measured_speedup"] else max(rec["predicted_speedup"].values())

    report["ranking"] = sorted(report["drafts"], key=score, reverse=True)
    return report


def write_report(report: dict, out_dir: Path, temperatures, command: str | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "report.json", json.dumps(report, indent=2, default=str))
    lines = ["# Draft selection", ""] + ([f"`{command}`", ""] if command else [])
    lines += ["| rank | draft | temperature | alpha | tau@max_k | c | best k (pred / meas) | predicted best | "
              "measured best | prediction error (mean / max over k) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rank, name in enumerate(report["ranking"], 1):
        for temp, r in report["drafts"][name].items():
            pb = max(r["predicted_speedup"].values())
            mb = max(r["measured_speedup"].values()) if r["measured_speedup"] else None
            err = r.get("prediction_error_max")
            err_txt = "" if err is None else f"{100 * r['prediction_error_mean']:.0f} / {100 * err:.0f} %"
            lines.append(f"| {rank} | {name} | {temp} | {r['alpha']:.3f} | {r['tau']:.2f} | {r['c']:.3f} | "
                         f"{r['best_k_predicted']} / {r.get('best_k_measured', '-')} | {pb:.2f} | "
                         f"{'stopped early' if mb is None else f'{mb:.2f}'} | "
                         f"{err_txt} |")
    for name, why in report["skipped"].items():
        lines.append(f"\nSkipped {name}: {why}")
    files = [out_dir / "report.json", out_dir / "report.md"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines.append("\n(plots skipped: `pip install specdec[plot]` for matplotlib)")
    else:
        t0 = str(temperatures[0])
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in report["ranking"]:
            a = report["drafts"][name][t0]["per_position_acceptance"]
            ax.plot(range(1, len(a) + 1), a, marker="o", label=name)
        ax.set(xlabel="draft position", ylabel="acceptance (censoring-free)", title="Acceptance by position",
               ylim=(0, 1))
        ax.legend()
        fig.tight_layout()
        save_figure(fig, out_dir / "acceptance_by_position.png", dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, name in enumerate(report["ranking"]):
            r = report["drafts"][name][t0]
            color = f"C{i}"
            ks = sorted(int(k) for k in r["predicted_speedup"])
            ax.plot(ks, [r["predicted_speedup"][k] for k in ks], "--", color=color, label=f"{name} predicted")
            if r["measured_speedup"]:
                mk = sorted(int(k) for k in r["measured_speedup"])
                ax.plot(mk, [r["measured_speedup"][k] for k in mk], "-o", color=color, label=f"{name} measured")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xlabel="draft length k", ylabel="speedup vs plain decoding", title="Speedup vs k")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save_figure(fig, out_dir / "speedup_vs_k.png", dpi=100)
        plt.close(fig)
        files += [out_dir / "acceptance_by_position.png", out_dir / "speedup_vs_k.png"]
        lines += ["", "![acceptance](acceptance_by_position.png)", "", "![speedup](speedup_vs_k.png)"]
    write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    return files
