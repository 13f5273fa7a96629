"""`specdec bench`: every way to generate, side by side in ONE process, alternating, with warm-up.

Modes: target-only (HF generate), HF assisted generation with the same draft (fixed k, and HF's
heuristic schedule), HF prompt lookup, and specdec (fixed k, adaptive, n-gram, tree when given; with no
draft model, n-gram at each k and adaptive, and the target's early exit at a chosen layer).
Per mode: tokens/s (median, min-max), speedup vs target-only (of the medians, and of the whole prompt
set's throughput: all tokens over all seconds, where prompts that repeat themselves weigh in), vs HF
assisted at its best setting,
alpha, tau, mean draft length, TTFT, TPOT, prefill and decode time, peak memory, and the fraction of
the ideal speedup S = (1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)) reached from measured alpha and c (both
the speedup and c against specdec's own step with nothing drafted, `specdec plain`).
Greedy modes are checked token for token against target-only output; a mismatch is reported loudly.
Beside TPOT stands the physical limit of a plain decode step on this machine: the bytes of weights one
step reads over the fastest memory bandwidth measured in the same run (copy, streaming read, matrix-vector).
"""
from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..policy import ideal_speedup


@dataclass
class ModeResult:
    name: str
    tokens_per_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # new tokens per run
    seconds: list[float] = field(default_factory=list)  # wall time per run
    stats: list = field(default_factory=list)
    mismatches: int = 0


def _hf_mode(target, n, **extra):
    def run(ids, kw):
        t0 = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **kw, **extra)
        return out, time.perf_counter() - t0, None
    return run


def _spec_mode(model, n):
    def run(ids, kw):
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, return_dict_in_generate=True, **kw)
        return out.sequences, time.perf_counter() - t0, out.stats
    return run


def _ks(k) -> list[int]:
    ks = sorted({int(k)}) if isinstance(k, int) else sorted({int(x) for x in k})
    if not ks or ks[0] < 1:
        raise ValueError(f"draft lengths k must be ints >= 1, got {k!r}")
    return ks


def _head_tree():
    from ..tree import TreeSpec

    return TreeSpec.dynamic(nodes=16, depth=5, topk=4)


def build_modes(target, draft, n: int, k, tree=None, include_hf: bool = True, exit_layer: int | None = None,
                head=None) -> dict:
    """k: one draft length or several; HF assisted and specdec's fixed-k mode run at each (best setting =
    the best of them), prompt lookup at the largest. With no draft model the n-gram drafter runs at each k
    too; tree (a TreeSpec) adds `specdec tree` (the draft model's dynamic tree) or, with no draft model,
    `specdec ngram tree`; exit_layer adds `specdec early exit` (the target's first exit_layer layers draft,
    adaptive k); a feature head (drafters.FeatureHead) adds `specdec head` at each k, adaptive, as a dynamic
    tree, and behind prompt lookup (drafters.LookupFirst, adaptive)."""
    import copy

    import specdec
    from ..drafters import LookupFirst

    ks = _ks(k)
    modes = {"target-only": _hf_mode(target, n),
             # specdec's runtime with nothing drafted: separates what the runtime gains from what speculation gains
             "specdec plain": _spec_mode(specdec.wrap(target, draft_length=0), n),
             # the same with logits bit for bit HF's (the lean loop): what the compiled step gains, side by side
             "specdec plain bitwise": _spec_mode(specdec.wrap(target, draft_length=0, step="bitwise"), n)}
    if include_hf and draft is not None:
        for kk in ks:
            fixed = copy.copy(draft)
            fixed.generation_config = copy.deepcopy(draft.generation_config)
            fixed.generation_config.num_assistant_tokens = kk
            fixed.generation_config.num_assistant_tokens_schedule = "constant"
            fixed.generation_config.assistant_confidence_threshold = 0.0
            modes[f"HF assisted k={kk}"] = _hf_mode(target, n, assistant_model=fixed)
        heur = copy.copy(draft)
        heur.generation_config = copy.deepcopy(draft.generation_config)
        heur.generation_config.num_assistant_tokens_schedule = "heuristic"
        modes["HF assisted heuristic"] = _hf_mode(target, n, assistant_model=heur)
    if include_hf:
        modes["HF prompt lookup"] = _hf_mode(target, n, prompt_lookup_num_tokens=ks[-1])
    if draft is not None:
        for kk in ks:
            modes[f"specdec k={kk}"] = _spec_mode(specdec.wrap(target, drafter=draft, draft_length=kk), n)
        modes["specdec adaptive"] = _spec_mode(specdec.wrap(target, drafter=draft), n)
        if tree is not None:
            modes["specdec tree"] = _spec_mode(specdec.wrap(target, drafter=draft, tree=tree), n)
    if draft is None:
        for kk in ks:
            modes[f"specdec ngram k={kk}"] = _spec_mode(specdec.wrap(target, drafter="ngram", draft_length=kk), n)
    modes["specdec ngram"] = _spec_mode(specdec.wrap(target, drafter="ngram"), n)
    if draft is None and tree is not None:
        modes["specdec ngram tree"] = _spec_mode(specdec.wrap(target, drafter="ngram", tree=tree), n)
    if head is not None:
        for kk in ks:
            modes[f"specdec head k={kk}"] = _spec_mode(specdec.wrap(target, drafter=head, draft_length=kk), n)
        modes["specdec head adaptive"] = _spec_mode(specdec.wrap(target, drafter=head), n)
        modes["specdec ngram+head adaptive"] = _spec_mode(specdec.wrap(target, drafter=LookupFirst(head)), n)
        modes["specdec head tree"] = _spec_mode(specdec.wrap(target, drafter=head, tree=tree or _head_tree()), n)
    if exit_layer is not None:
        from ..drafters import EarlyExit

        modes[f"specdec early exit L={exit_layer}"] = _spec_mode(
            specdec.wrap(target, drafter=EarlyExit(target, exit_layer=exit_layer)), n)
    return modes


def run_bench(target, draft, prompts: list[torch.Tensor], n: int = 128, k=4, repeats: int = 3,
              sampling: dict | None = None, tree=None, include_hf: bool = True, progress: bool = True,
              exit_layer: int | None = None, head=None) -> dict:
    """prompts: list of [1, T] int64. Returns the report dict (also what `specdec bench` writes as JSON)."""
    from tqdm import tqdm

    kw = dict(sampling or {"do_sample": False})
    greedy = not kw.get("do_sample", False)
    modes = build_modes(target, draft, n, k, tree, include_hf, exit_layer, head)
    for run in modes.values():  # warm-up: first calls pay one-off costs
        run(prompts[0][:, :16], kw)
    results = {name: ModeResult(name) for name in modes}
    refs = {}
    bar = tqdm(total=repeats * len(prompts) * len(modes), desc="bench", disable=not progress, dynamic_ncols=True)
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            for name, run in modes.items():
                torch.manual_seed(1000 * r + i)
                seq, dt, stats = run(ids, kw)
                res = results[name]
                res.tokens_per_s.append((seq.shape[1] - ids.shape[1]) / dt)
                res.tokens.append(seq.shape[1] - ids.shape[1])
                res.seconds.append(dt)
                if stats is not None:
                    res.stats.append(stats)
                if greedy:
                    if name == "target-only":
                        refs[i] = seq
                    elif not torch.equal(seq, refs[i]):
                        res.mismatches += 1
                bar.update(1)
    bar.close()
    report = summarise(results, _ks(k), greedy)
    report["decode_limit"] = decode_limit(report, weight_bytes_per_step(target), memory_bandwidth())
    return report


def first_difference(got: list[int], ref: list[int]) -> int | None:
    """The first position where two token lists differ (None where one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), None)


def top2_gap(target, ref: torch.Tensor, length: int) -> tuple[float, float]:
    """The target's own top-2 logit gap (absolute, and relative to the top logit) for the token after ref's
    first `length` tokens (ref [1, T]; one forward): where a greedy output leaves HF's, a bfloat16 gap within a
    few epsilons is a near-tie another valid kernel may break either way."""
    with torch.no_grad():
        top = target(ref[:, :length]).logits[0, -1].float().topk(2).values
    return (top[0] - top[1]).item(), ((top[0] - top[1]) / top[0].abs()).item()


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied ones once), except an untied input
    embedding table, of which a step reads one row."""
    seen, total = set(), 0
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    for p in model.parameters():
        if p.data_ptr() in seen or (p is emb and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def memory_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> dict:
    """Bytes/s with this process's torch threads, best of `repeats`, over tensors far larger than any cache.

    'copy': a large-tensor copy, counted as read + write (write-allocate traffic uncounted, so it
    understates the memory); 'read': a sum, which only streams its tensor in; 'matvec': a float32
    matrix-vector product over an nbytes matrix (0.5 flop per byte, far from compute-bound), the access
    pattern of a decode step at the BLAS kernel's best prefetching. On this project's CPU the matvec
    streams fastest (about 1.5x the sum), so the limit uses the largest of the three."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    matrix, vector = src.view(4096, -1), torch.ones(src.numel() // 4096)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {"copy": 2 * nbytes / best(lambda: dst.copy_(src)), "read": nbytes / best(src.sum),
            "matvec": nbytes / best(lambda: matrix @ vector)}


def decode_limit(report: dict, weight_bytes: int, bandwidth: dict) -> dict:
    """The physical limit of a plain decode step (weights read per token / the fastest measured bandwidth)
    beside each mode's TPOT. target-only has no stats: its TPOT is 1 / tokens_per_s (its prefill included)."""
    limit = weight_bytes / max(bandwidth.values())
    tpot = {name: r.get("tpot_s") or 1.0 / r["tokens_per_s"] for name, r in report["modes"].items()}
    return {"weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth, "limit_tpot_s": limit,
            "tpot_over_limit": {name: t / limit for name, t in tpot.items()}}


def summarise(results: dict, k, greedy: bool) -> dict:
    base = statistics.median(results["target-only"].tokens_per_s)
    total = lambda r: sum(r.tokens) / sum(r.seconds)  # noqa: E731 - the whole prompt set's throughput
    hf_best = max((statistics.median(r.tokens_per_s) for n, r in results.items() if n.startswith("HF assisted")),
                  default=None)
    # speculation is measured against the target's own step as specdec runs it (specdec plain: no drafting),
    # not HF's slower one, so c and `% of ideal` are the draft's alone (target-only where plain did not run)
    step_rate = statistics.median(results["specdec plain"].tokens_per_s) if "specdec plain" in results else base
    step_tpot = 1.0 / step_rate
    out = {"k": k, "greedy": greedy, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "modes": {}}
    for name, res in results.items():
        tps = statistics.median(res.tokens_per_s)
        row = {"tokens_per_s": tps, "min": min(res.tokens_per_s), "max": max(res.tokens_per_s),
               "speedup": tps / base, "vs_hf_assisted_best": tps / hf_best if hf_best else None,
               "total_tokens_per_s": total(res), "total_speedup": total(res) / total(results["target-only"]),
               "mismatches": res.mismatches}
        if res.stats:
            st = res.stats
            mean = lambda f: statistics.mean(f(s) for s in st)  # noqa: E731
            alpha = mean(lambda s: s.alpha)
            drafted = sum(s.drafted_tokens for s in st)
            k_used = drafted / max(1, sum(s.target_forwards for s in st))
            c = (sum(s.draft_s for s in st) / drafted) / step_tpot if drafted else 0.0
            # a mode that drafted under half a token a step on average is, ideally, plain decoding (k = 0: 1.0)
            ideal = ideal_speedup(alpha, round(k_used), c) if drafted else None
            row.update(alpha=alpha, acceptance_rate=mean(lambda s: s.acceptance_rate),
                       tau=mean(lambda s: s.mean_accepted_length), draft_length=k_used, c=c,
                       ttft_s=mean(lambda s: s.ttft_s), tpot_s=mean(lambda s: s.tpot_s),
                       prefill_s=mean(lambda s: s.prefill_s), decode_s=mean(lambda s: s.decode_s),
                       draft_s=mean(lambda s: s.draft_s), verify_s=mean(lambda s: s.verify_s),
                       ideal_speedup=ideal, fraction_of_ideal=(tps / step_rate) / ideal if ideal else None,
                       step=" / ".join(sorted({s.step for s in st})))
        out["modes"][name] = row
    drafted = {n: r for n, r in out["modes"].items() if n.startswith("specdec") and not n.startswith("specdec plain")
               and not n.startswith(("specdec ngram", "specdec head", "specdec early exit"))}
    if drafted and hf_best:  # the headline: specdec's best mode with the draft vs HF's best with the same draft
        name = max(drafted, key=lambda n: drafted[n]["tokens_per_s"])
        plain = out["modes"].get("specdec plain")
        out["best_with_draft"] = {"mode": name, "speedup": drafted[name]["speedup"],
                                  "vs_hf_assisted_best": drafted[name]["vs_hf_assisted_best"],
                                  "fraction_of_ideal": drafted[name].get("fraction_of_ideal"),
                                  "vs_specdec_plain": drafted[name]["tokens_per_s"] / plain["tokens_per_s"]
                                  if plain else None}
    heads = {n: r for n, r in out["modes"].items() if n.startswith(("specdec head", "specdec ngram+head"))}
    hf_any = {n: r for n, r in out["modes"].items() if n.startswith("HF")}
    if heads:  # the feature head against target-only and HF's best option for this target
        name = max(heads, key=lambda n: heads[n]["tokens_per_s"])
        hf_name = max(hf_any, key=lambda n: hf_any[n]["tokens_per_s"]) if hf_any else None
        out["best_head"] = {"mode": name, "speedup": heads[name]["speedup"], "tau": heads[name].get("tau"),
                            "total_speedup": heads[name]["total_speedup"],
                            "c": heads[name].get("c"), "hf_best_mode": hf_name,
                            "vs_hf_best": heads[name]["tokens_per_s"] / hf_any[hf_name]["tokens_per_s"]
                            if hf_name else None}
    return out


def time_split(report: dict) -> str:
    """Where a speculative generation's decode time goes, per mode: drafting, verification, the rest."""
    lines = ["| mode | decode s | draft s | verify s | other s (commit, bookkeeping) | draft share |",
             "|---|---|---|---|---|---|"]
    for name, r in report["modes"].items():
        if r.get("decode_s"):
            other = r["decode_s"] - r["draft_s"] - r["verify_s"]
            lines.append(f"| {name} | {r['decode_s']:.3f} | {r['draft_s']:.3f} | {r['verify_s']:.3f} | {other:.3f} | "
                         f"{100 * r['draft_s'] / r['decode_s']:.0f} % |")
    return "\n".join(lines)


def to_markdown(report: dict) -> str:
    f = lambda v, p=2: "" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["| mode | tokens/s | min-max | speedup | all prompts: speedup | vs HF assisted (best) | alpha | tau | "
             "k used | TTFT ms | TPOT ms | prefill ms | decode s | % of ideal | greedy mismatches |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["modes"].items():
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['min']:.1f}-{r['max']:.1f} | {r['speedup']:.2f} | "
            f"{f(r.get('total_speedup'))} | "
            f"{f(r['vs_hf_assisted_best'])} | {f(r.get('alpha'))} | {f(r.get('tau'))} | {f(r.get('draft_length'), 1)} | "
            f"{f(r.get('ttft_s') and r['ttft_s'] * 1e3, 1)} | {f(r.get('tpot_s') and r['tpot_s'] * 1e3)} | "
            f"{f(r.get('prefill_s') and r['prefill_s'] * 1e3, 1)} | {f(r.get('decode_s'))} | "
            f"{f(r.get('fraction_of_ideal') and 100 * r['fraction_of_ideal'], 0)} | "
            f"{'**' + str(r['mismatches']) + '**' if r['mismatches'] else 0} |")
    steps = {r["step"] for r in report["modes"].values() if r.get("step")}
    if steps:
        lines += ["", "The target's step (hf/compiled.py; compiled once per bucket in the warm-up, before any timed run): "
                      + "; ".join(f"{step}: {', '.join(n for n, r in report['modes'].items() if r.get('step') == step)}"
                                  for step in sorted(steps)) + "."]
    head = report.get("best_head")
    if head:
        vs = (f", {head['vs_hf_best']:.2f}x HF's best option here ({head['hf_best_mode']})"
              if head.get("vs_hf_best") else "")
        lines += ["", f"Best feature-head mode: **{head['mode']}**, {head['speedup']:.2f}x target-only{vs}; "
                      f"tau {head['tau']:.2f}, c {head['c']:.3f}; over all prompts' tokens and time "
                      f"{head['total_speedup']:.2f}x target-only."]
    best = report.get("best_with_draft")
    if best:
        lines += ["", f"Best specdec mode with the draft: **{best['mode']}**, {best['speedup']:.2f}x target-only, "
                  f"{best['vs_hf_assisted_best']:.2f}x HF assisted at its best setting, "
                  f"{100 * (best['fraction_of_ideal'] or 0):.0f} % of the ideal speedup."]
        if best.get("vs_specdec_plain"):
            lines[-1] += (f" Of its speedup, {report['modes']['specdec plain']['speedup']:.2f}x is specdec's runtime "
                          f"alone (`specdec plain`: no drafting) and {best['vs_specdec_plain']:.2f}x is speculation.")
    lim = report.get("decode_limit")
    if lim:
        over = lim["tpot_over_limit"]
        best = min(over, key=over.get)
        bw = lim["bandwidth_bytes_per_s"]
        lines += ["", f"Physical limit of a plain decode step here: {lim['weight_bytes'] / 1e6:.0f} MB of weights per "
                  f"token / {max(bw.values()) / 1e9:.1f} GB/s (memory bandwidth measured in this run, the fastest of: "
                  f"large-tensor copy {bw['copy'] / 1e9:.1f} GB/s counting read + write, streaming read (sum) "
                  f"{bw['read'] / 1e9:.1f} GB/s, float32 matrix-vector product {bw['matvec'] / 1e9:.1f} GB/s) = "
                  f"**{lim['limit_tpot_s'] * 1e3:.2f} ms per token**. Plain decoding runs at "
                  f"{over['target-only']:.2f}x that line (target-only), {over.get('specdec plain', float('nan')):.2f}x "
                  f"(specdec plain); the fastest mode, {best}, at {over[best]:.2f}x"
                  + (" (below the line: speculation beats what any plain decode could reach)." if over[best] < 1
                     else ".")]
    lines += ["", "Where the decode time goes (mean per generation):", "", time_split(report),
              "", "c = draft time per drafted token / the target's own step time per token (`specdec plain`'s; "
              "target-only's where it did not run); the ideal speedup uses the measured alpha and c, and "
              "`% of ideal` is the mode's speedup over `specdec plain` against it, so below 100 is per-step "
              "overhead plus verification cost growing with k."]
    if report.get("exit_layer_choice"):
        lines += ["", "Early-exit layer choice (teacher-forced on the first prompts' target continuations; c = the "
                  "draft step's share of the weights):", "", "| layer | alpha | c | best k | predicted speedup |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['alpha']:.3f} | {r['c']:.2f} | {r['best_k']} | {r['predicted_speedup']:.3f} |"
                  for r in report["exit_layer_choice"]]
        if not any(name.startswith("specdec early exit") for name in report["modes"]):
            lines += ["", "No layer's predicted speedup reaches 1: the early-exit mode was not run."]
    return "\n".join(lines)


def load_prompts(tok, path: str | None, n: int, chat: bool = False, alternate: bool = False) -> list[torch.Tensor]:
    """[1, T] int64 per prompt: the first n of each comma-separated JSONL file (no path: the zoo's first n
    held-out prompts), file after file, or with alternate=True in turn (each file's first, then each
    file's second, ..., as far as the shortest file goes). chat: each prompt is a user message rendered by
    the tokenizer's chat template (ValueError where it has none)."""
    from .. import zoo

    paths = path.split(",") if path else []
    per_file = [[json.loads(line)["prompt"] for line in Path(p).read_text().splitlines() if line.strip()][:n]
                for p in paths]
    if not paths:
        texts = zoo.prompts(n)
    elif alternate:
        texts = [t for turn in zip(*per_file) for t in turn]
    else:
        texts = [t for prompts in per_file for t in prompts]
    if not texts:
        raise ValueError(f"no prompts found in {path}: expected JSON lines with a 'prompt' field")
    if not chat:
        return [tok(t, return_tensors="pt").input_ids for t in texts]
    if not getattr(tok, "chat_template", None):
        raise ValueError("--chat: this tokenizer has no chat template")
    return [torch.tensor([tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]]) for t in texts]
