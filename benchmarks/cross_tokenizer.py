"""Drafting across tokenizers on real models: a target, a draft with another tokenizer (default: Qwen2.5-
Coder-1.5B-Instruct drafted for by SmolLM2-135M-Instruct), greedy, float32 unless --target-dtype /
--draft-dtype say otherwise (for HF and specdec alike), side by side in one process, alternating prompt
by prompt after a warm-up (HF's tau: new tokens per target forward, counted by a hook; per prompt: tok/s
and the ratio to HF's best UAD on that prompt):

    HF target-only  ·  HF universal assisted decoding (assistant_model + tokenizer + assistant_tokenizer)
    at each --hf-k (constant schedule) and HF's default  ·  specdec plain (the runtime, nothing drafted) ·
    specdec text at each --spec-k · specdec text / intersection, adaptive; text modes at each
    --lookahead (draft tokens drafted past a proposal to tell its last target token complete) ·
    with --lookup-first: specdec prompt lookup alone and in front of text mode (adaptive, and at each --spec-k),
    and adaptive with the lookup continuing text mode's chains (LookupFirst(extend=True)) · with --tree (repeatable):
    intersection and text mode with that dynamic tree (adaptive node budget), and with --lookup-first prompt
    lookup in front of the text tree

Prompts: benchmarks/prompts/code_write.jsonl and code_edit.jsonl (or --prompt-files), alternating (no
training run or test uses them), in the target's chat template. specdec's auto mode is text under greedy decoding, so it is not run
separately.

    python benchmarks/cross_tokenizer.py [--num-prompts 2] [--skip-prompts 0] [--max-new-tokens 128]
        [--out benchmarks/results/...]

--skip-prompts leaves out the first prompts of that order: a setting chosen on some prompts is reported on
the others.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specdec  # noqa: E402
from specdec.cli.bench import first_difference, load_prompts, top2_gap  # noqa: E402
from specdec.drafters import CrossTokenizerDrafter, LookupFirst  # noqa: E402
from specdec.files import write_text  # noqa: E402
from specdec.hf.mapped_offload import mapped_offload  # noqa: E402
from specdec.quantize import int4_draft, int8_draft  # noqa: E402
from specdec.stats import SpecStats  # noqa: E402
from specdec.hf.linear import machine  # noqa: E402


def offload_last_layers(model, count: int, folder: str):
    """`model` dispatched by accelerate: its last `count` decoder layers on disk (in `folder`, loaded by their
    hooks for every forward), the rest in CPU memory."""
    from accelerate import dispatch_model

    n = model.config.get_text_config().num_hidden_layers
    if not 0 < count <= n:
        raise SystemExit(f"--offload-layers {count}: the target has {n} layers")
    dmap = {name: "cpu" for name, _ in model.named_children()}
    dmap.pop("model")
    dmap.update({f"model.{name}": "cpu" for name, _ in model.model.named_children() if name != "layers"})
    dmap.update({f"model.layers.{i}": ("disk" if i >= n - count else "cpu") for i in range(n)})
    return dispatch_model(model, dmap, offload_dir=folder)


def mismatch_gap(target, ref: torch.Tensor, seq: torch.Tensor, prompt_len: int) -> float:
    """HF's own top-2 logit gap, relative to the top logit, where seq [1, T'] first leaves the target-only output
    ref [1, T]: in bfloat16 a gap within a few epsilons is a near-tie another valid kernel may break either way;
    anything larger would be a bug (0 where one is a prefix of the other: a length difference)."""
    at = first_difference(seq[0, prompt_len:].tolist(), ref[0, prompt_len:].tolist())
    return 0.0 if at is None else top2_gap(target, ref, prompt_len + at)[1]


def gap_note(row: dict) -> str:
    return f" ({row['gap']:.2g})" if row["mismatch"] else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--skip-prompts", type=int, default=0, help="start after this many prompts (of the alternating order)")
    ap.add_argument("--prompt-files", nargs=2, default=["code_write.jsonl", "code_edit.jsonl"], metavar=("WRITING", "EDITING"),
                    help="the two prompt files in benchmarks/prompts, alternated (code_write_2.jsonl code_edit_2.jsonl: "
                         "a second set, written after the first was used to choose settings; code_write_3.jsonl "
                         "code_edit_3.jsonl: a third, written in session 35 and run without any tuning on it)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--hf-k", type=int, nargs="*", default=[4])
    ap.add_argument("--spec-k", type=int, nargs="*", default=[], help="also run text mode at these fixed k")
    ap.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the target's weights (HF and specdec alike); greedy equality is checked against HF's own "
                         "target-only output in that dtype")
    ap.add_argument("--draft-dtype", choices=["float32", "int8", "int4"], nargs="+", default=["float32"],
                    help="the draft's linears: float32, weight-only int8 (specdec.int8_draft) or int4 (specdec.int4_draft), "
                         "for HF and specdec alike; with several, every draft mode runs once per dtype")
    ap.add_argument("--lookahead", type=int, nargs="+", default=[0],
                    help="text mode's look-ahead draft tokens (CrossTokenizerDrafter(lookahead=)); each is run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--offload-layers", type=int, default=0, help="the target's last N decoder layers offloaded to "
                    "disk through accelerate's hooks (dispatch_model), for every mode alike (issue 43's offloaded case)")
    ap.add_argument("--accelerate-loading", action="store_true", help="with --offload-layers, also run every specdec "
                    "mode with accelerate's own loading of the offloaded weights (SPECDEC_MAPPED_OFFLOAD=0: a copy "
                    "per forward) beside the default (hf/mapped_offload.py: mapped once), and HF's target-only "
                    "with the offloaded weights mapped, so the mapping's share and speculation's are told apart")
    ap.add_argument("--offload-dir", default=None, help="where --offload-layers writes the offloaded weights "
                    "(default: a temporary folder, removed after)")
    ap.add_argument("--tree", type=int, nargs=3, action="append", default=None, metavar=("NODES", "DEPTH", "TOPK"),
                    help="also run intersection mode with this dynamic tree (adaptive node budget)")
    ap.add_argument("--lookup-first", action="store_true",
                    help="also run prompt lookup alone and in front of text mode (drafters.LookupFirst), adaptive and at each --spec-k")
    ap.add_argument("--only", nargs="*", default=None, help="run only the modes whose names contain one of these")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/real_cross_tokenizer"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, tok = specdec.zoo.load(a.target)
    if a.target_dtype == "bfloat16":
        target = target.to(torch.bfloat16)
    if a.offload_layers:
        import atexit
        import shutil
        import tempfile

        folder = a.offload_dir
        if folder is None:
            folder = tempfile.mkdtemp(prefix="specdec-offload-")
            atexit.register(shutil.rmtree, folder, True)
        target = offload_last_layers(target, a.offload_layers, folder)
    base_draft, dtok = specdec.zoo.load(a.draft)
    n = a.max_new_tokens
    files = ",".join(str(ROOT / "benchmarks/prompts" / f) for f in a.prompt_files)
    first = a.skip_prompts
    prompts = load_prompts(tok, files, -(-(first + a.num_prompts) // 2), chat=True, alternate=True)[first:first + a.num_prompts]
    if len(prompts) < a.num_prompts:
        raise SystemExit(f"only {len(prompts)} prompts after skipping {first}: the two files alternate as far as the shorter goes")

    calls = [0]  # the target's forward calls during an HF mode: one per verification (the prompt's included)
    target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def hf(extra=None, k=None):
        draft = extra["assistant_model"] if extra else None

        def run(ids):
            calls[0] = 0
            if k is not None:
                draft.generation_config.num_assistant_tokens = k
                draft.generation_config.num_assistant_tokens_schedule = "constant"
            elif extra:
                draft.generation_config.num_assistant_tokens = 20  # HF's defaults
                draft.generation_config.num_assistant_tokens_schedule = "constant"
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  **(extra or {}))
            dt = time.perf_counter() - t0
            return out, dt, calls[0] if extra else None
        return run

    def timed(model):
        def run(ids):
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True)
            return out.sequences, time.perf_counter() - t0, out.stats
        return run

    def accelerate_loading(run):  # a specdec mode with the offloaded weights copied per forward, as HF's are
        def unmapped(ids):
            before = os.environ.get("SPECDEC_MAPPED_OFFLOAD")
            os.environ["SPECDEC_MAPPED_OFFLOAD"] = "0"
            try:
                return run(ids)
            finally:
                if before is None:
                    del os.environ["SPECDEC_MAPPED_OFFLOAD"]
                else:
                    os.environ["SPECDEC_MAPPED_OFFLOAD"] = before
        return unmapped

    def mapped(run):  # an HF mode with the offloaded weights mapped once, as specdec's are
        def in_maps(ids):
            with mapped_offload(target):
                return run(ids)
        return in_maps

    modes = {"target-only": hf()}
    modes["specdec plain"] = timed(specdec.wrap(target))  # the runtime alone: nothing drafted
    def named(lookahead: int) -> str:
        return "" if a.lookahead == [0] else f" look-ahead {lookahead}"

    quantizers = {"float32": lambda m: m, "int8": int8_draft, "int4": int4_draft}
    for dtype in a.draft_dtype:  # every mode once per draft dtype, HF's too
        draft = quantizers[dtype](base_draft)
        tag = f" ({dtype})" if len(a.draft_dtype) > 1 else ""
        uad = dict(assistant_model=draft, tokenizer=tok, assistant_tokenizer=dtok)
        for k in a.hf_k:
            modes[f"HF UAD k={k}{tag}"] = hf(uad, k)
        modes[f"HF UAD default{tag}"] = hf(uad)

        def text(lookahead: int, draft=draft) -> CrossTokenizerDrafter:
            return CrossTokenizerDrafter(draft, dtok, tok, mode="text", lookahead=lookahead)

        for k in a.spec_k:
            for la in a.lookahead:
                modes[f"specdec text k={k}{named(la)}{tag}"] = timed(specdec.wrap(target, drafter=text(la), draft_length=k))
        for la in a.lookahead:
            modes[f"specdec text adaptive{named(la)}{tag}"] = timed(specdec.wrap(target, drafter=text(la)))
        if a.lookup_first:
            modes[f"specdec ngram+text adaptive{tag}"] = timed(specdec.wrap(target, drafter=LookupFirst(text(0))))
            modes[f"specdec ngram+text adaptive, chains extended{tag}"] = timed(specdec.wrap(
                target, drafter=LookupFirst(text(0), extend=True)))
            for k in a.spec_k:
                modes[f"specdec ngram+text k={k}{tag}"] = timed(specdec.wrap(target, drafter=LookupFirst(text(0)),
                                                                             draft_length=k))
        modes[f"specdec intersection adaptive{tag}"] = timed(specdec.wrap(
            target, drafter=draft, tokenizer=tok, assistant_tokenizer=dtok, cross_tokenizer="intersection",
            lookup_first=False))
        for nodes, depth, topk in a.tree or []:
            tree = specdec.TreeSpec.dynamic(nodes=nodes, depth=depth, topk=topk)
            modes[f"specdec intersection {tree!r} adaptive{tag}"] = timed(specdec.wrap(
                target, drafter=draft, tokenizer=tok, assistant_tokenizer=dtok, cross_tokenizer="intersection",
                tree=tree, lookup_first=False))
            modes[f"specdec text {tree!r} adaptive{tag}"] = timed(specdec.wrap(target, drafter=text(0), tree=tree))
            if a.lookup_first:
                modes[f"specdec ngram+text {tree!r} adaptive{tag}"] = timed(specdec.wrap(
                    target, drafter=LookupFirst(text(0)), tree=tree))
    if a.lookup_first:
        modes["specdec ngram adaptive"] = timed(specdec.wrap(target, drafter="ngram"))
    if a.only:
        modes = {name: run for name, run in modes.items() if name == "target-only" or any(o in name for o in a.only)}
    if a.offload_layers and a.accelerate_loading:
        for name in [m for m in modes if m.startswith("specdec")]:
            modes[f"{name} (accelerate's loading)"] = accelerate_loading(modes[name])
        modes["target-only (mapped)"] = mapped(modes["target-only"])
    for run in modes.values():  # warm-up: one-off costs (the vocabulary map, lazy inits) are paid here
        run(prompts[0][:, :24])
    rows = {name: {"tps": [], "stats": [], "hf_tau": [], "mismatch": 0, "gap": 0.0, "failed": []} for name in modes}
    for i, ids in enumerate(prompts):
        ref = None
        for name, run in modes.items():
            try:
                seq, dt, stats = run(ids)
            except RuntimeError as e:  # HF's UAD fails on some prompts (transformers 5.x: its assistant is
                # handed 0 new tokens to prefill); reported, not hidden, and the other modes go on
                if not name.startswith("HF"):
                    raise
                rows[name]["failed"].append(f"prompt {i}: {str(e).splitlines()[0][:120]}")
                rows[name]["tps"].append(float("nan"))
                print(f"prompt {i} {name}: failed ({e})", flush=True)
                continue
            rows[name]["tps"].append((seq.shape[1] - ids.shape[1]) / dt)
            if isinstance(stats, int):  # HF UAD: its target forwards
                rows[name]["hf_tau"].append((seq.shape[1] - ids.shape[1]) / stats)
            elif stats is not None:
                rows[name]["stats"].append(stats)
            if ref is None:
                ref = seq
            elif not torch.equal(seq, ref):
                rows[name]["mismatch"] += 1
                rows[name]["gap"] = max(rows[name]["gap"], mismatch_gap(target, ref, seq, ids.shape[1]))
            print(f"prompt {i} {name}: {rows[name]['tps'][-1]:.2f} tok/s", flush=True)
    def ran(tps: float) -> bool:  # a failed run's tok/s is NaN
        return not math.isnan(tps)

    def mean(xs):  # over the prompts a mode ran (an HF mode may have failed on some)
        done = [x for x in xs if ran(x)]
        return statistics.mean(done) if done else float("nan")

    base = mean(rows["target-only"]["tps"])
    # vs best HF UAD: the HF setting fastest over the prompts it ran (one that ran none is left out), every
    # mode compared with it over those same prompts
    hf_rows = [r for name, r in rows.items() if name.startswith("HF UAD") and any(ran(x) for x in r["tps"])]
    best_row = max(hf_rows, key=lambda r: mean(r["tps"]), default=None)
    both = [i for i, x in enumerate(best_row["tps"]) if ran(x)] if best_row else []  # the prompts HF's best ran

    def over_both(xs):
        return statistics.mean(xs[i] for i in both) if both else float("nan")

    best_hf = over_both(best_row["tps"]) if best_row else None
    lines = [f"# Drafting across tokenizers: {a.target} target, {a.draft} draft", "",
             f"`python benchmarks/cross_tokenizer.py --num-prompts {a.num_prompts}"
             + (f" --skip-prompts {first}" if first else "")
             + (f" --prompt-files {' '.join(a.prompt_files)}" if a.prompt_files != ap.get_default("prompt_files") else "")
             + f" --max-new-tokens {n} "
             f"--hf-k {' '.join(map(str, a.hf_k))}" + (f" --spec-k {' '.join(map(str, a.spec_k))}" if a.spec_k else "")
             + (f" --lookahead {' '.join(map(str, a.lookahead))}" if a.lookahead != [0] else "")
             + (f" --draft-dtype {' '.join(a.draft_dtype)}" if a.draft_dtype != ["float32"] else "")
             + (f" --target-dtype {a.target_dtype}" if a.target_dtype != "float32" else "")
             + (f" --offload-layers {a.offload_layers}" if a.offload_layers else "")
             + (" --accelerate-loading" if a.offload_layers and a.accelerate_loading else "")
             + "".join(f" --tree {' '.join(map(str, t))}" for t in a.tree or [])
             + (" --lookup-first" if a.lookup_first else "")
             + (f" --only {' '.join(a.only)}" if a.only else "") + "`", "",
             f"{a.target_dtype} target, {' / '.join(a.draft_dtype)} draft (the same for HF and specdec), greedy, "
             f"{len(prompts)} code prompts (writing and editing, alternating"
             + (f", after the first {first}" if first else "") + f"), {n} new tokens, "
             f"{a.threads} threads, modes alternating prompt by prompt after a warm-up."
             + (f" The target's last {a.offload_layers} decoder layers offloaded to disk (accelerate's dispatch_model "
                "and hooks), for every mode: HF's modes load them through accelerate for every forward (a copy), specdec's "
                "through maps made once (hf/mapped_offload.py)" + ("; rows marked (accelerate's loading) run specdec with "
                "accelerate's copies, the row target-only (mapped) runs HF's target-only with specdec's maps." if
                a.accelerate_loading else ".") if a.offload_layers else ""), "",
             f"Machine: {machine()}.", "",
             "| mode | tok/s | vs target-only | vs best HF UAD (prompts it ran) | acceptance | tau | k used | per-position acceptance | c "
             "| mismatches (HF's largest top-2 gap at one, relative) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        tps = mean(r["tps"])
        acc = tau = pos = c = used = ""
        s = r["stats"]
        drafted = sum(x.drafted_tokens for x in s)
        if r["hf_tau"]:  # HF's UAD: tokens per target forward, counted
            tau = f"{statistics.mean(r['hf_tau']):.2f}"
        if drafted:  # a speculative mode (target-only and specdec plain draft nothing)
            forwards = sum(x.target_forwards for x in s)
            acc = f"{sum(x.accepted_tokens for x in s) / drafted:.2f}"
            tau = f"{sum(x.new_tokens for x in s) / forwards:.2f}"
            used = f"{drafted / forwards:.1f}"
            pos = ", ".join(f"{v:.2f}" for v in SpecStats.combine(s).per_position_acceptance[:6])  # every prompt's
            # c: seconds per drafted token (the re-tokenizing included) over target-only seconds per token
            c = f"{sum(x.draft_s for x in s) / drafted * base:.3f}"
        vs_hf = f"{over_both(r['tps']) / best_hf:.2f}x" if best_hf else ""
        lines.append(f"| {name} | {tps:.2f} | {tps / base:.2f}x | {vs_hf} | {acc} | {tau} | {used} | {pos} | {c} "
                     f"| {r['mismatch']}{gap_note(r)} |")
    failures = [f"{name}: {f}" for name, r in rows.items() for f in r["failed"]]
    if failures:
        lines += ["", "Failed (an HF mode's error on a prompt; its mean is over the prompts it ran): "
                  + "; ".join(failures)]
    lines += ["", "Per prompt, tok/s (w: code writing, e: code editing) and the ratio to HF's best UAD on that prompt:", "",
              "| mode | " + " | ".join(f"{first + i} ({'we'[(first + i) % 2]})" for i in range(len(prompts))) + " |",
              "|---|" + "---|" * len(prompts)]
    best_hf_each = [max((r["tps"][i] for name, r in rows.items() if name.startswith("HF UAD") and ran(r["tps"][i])),
                        default=None)
                    for i in range(len(prompts))]
    for name, r in rows.items():
        cells = [f"{v:.2f}" + (f" ({v / b:.2f}x)" if b else "") for v, b in zip(r["tps"], best_hf_each)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    print(md)
    out = Path(a.out)
    write_text(out if out.suffix == ".md" else out.parent / (out.name + ".md"), md)  # X or X.md -> X.md


if __name__ == "__main__":
    main()
