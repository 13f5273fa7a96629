"""Batched speculative decoding on a real model: total tokens/s for B = 1, 2, 4, 8 left-padded prompts.

Side by side in one process, alternating method by method within each batch after a warm-up, greedy:

    HF batched generate() (no speculation: HF's only batched option)  ·  specdec batched (one target
    forward per step for every live row, the n-gram drafter, planned by the batch planner)  ·  specdec
    looping over the rows (the single-sequence engine, same drafter)

Prompts: benchmarks/prompts/chat.jsonl and code_edit.jsonl alternating (no training run or test uses them),
in the target's chat template; for the zoo target (no chat template) the zoo's held-out prompts
(specdec.zoo.prompts: function openings from modules it never trained on). The first 8 are cut into groups of B, so every B generates for the same 8
prompts. Throughput counts each row's real new tokens (up to and including its EOS) over the wall time of
the batch. specdec's rows must equal the loop's (each row's own unpadded generation); HF's padded
batch may differ from them where left padding changes a row's float rounding, counted as `differs`.

    python benchmarks/batches.py [--target smollm2-135m-instruct] [--drafter ngram | ZOO_DRAFT | ZOO_HEAD]
        [--sizes 1 2 4 8] [--max-new-tokens 64] [--rounds 2] [--out ...]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specdec  # noqa: E402
from specdec.cli.bench import load_prompts  # noqa: E402
from specdec.files import write_text  # noqa: E402
from specdec.generation_config import eos_ids  # noqa: E402
from specdec.hf.linear import machine  # noqa: E402
from specdec.rows import left_pad  # noqa: E402


def real_new(seq: torch.Tensor, T: int, eos: set[int], n: int) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS."""
    out = []
    for row in seq[:, T:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:min(cut, n)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="ngram", help="'ngram', a zoo draft model's name or a zoo head's")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/real_batches"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, tok = specdec.zoo.load(a.target)
    n = a.max_new_tokens
    eos = set(eos_ids(target.generation_config.eos_token_id, target))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    if tok.chat_template:
        files = ",".join(str(ROOT / "benchmarks/prompts" / f) for f in ("chat.jsonl", "code_edit.jsonl"))
        prompts = load_prompts(tok, files, 4, chat=True, alternate=True)
        source = "the same 8 prompts (chat and code editing, alternating)"
    else:
        prompts = load_prompts(tok, None, 8)
        source = "the zoo's 8 held-out prompts"
    rows = [p[0].tolist() for p in prompts]
    if a.drafter == "ngram":
        drafter = a.drafter
    elif a.drafter in specdec.zoo.heads():  # a feature head for this target
        from specdec.drafters import FeatureHead

        drafter = FeatureHead.from_pretrained(specdec.zoo.path(a.drafter), target)
    else:
        drafter = specdec.zoo.load(a.drafter)[0]
    batched = specdec.wrap(target, drafter=drafter)
    looped = specdec.wrap(target, drafter=drafter)

    def hf(ids, mask):
        return target.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad), None

    planned: dict[int, list[int]] = {}  # B -> every planned per-row length of the batched runs

    def spec_batch(ids, mask):
        planner = batched.engine.batch_planner
        before = len(planner.history) if planner is not None else 0
        out = batched.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                               return_dict_in_generate=True)
        planner = batched.engine.batch_planner
        if planner is not None and ids.shape[0] > 1:
            planned.setdefault(ids.shape[0], []).extend(k for ks in planner.history[before:] for k in ks)
        return out.sequences, out.stats if isinstance(out.stats, list) else [out.stats]

    def spec_loop(ids, mask):
        seqs, stats = [], []
        for row, m in zip(ids, mask):
            own = row[m.bool()][None]
            out = looped.generate(own, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                                  return_dict_in_generate=True)
            seqs.append(out.sequences[0, own.shape[1]:])
            stats.append(out.stats)
        width = max(s.numel() for s in seqs)
        new = torch.full((len(seqs), width), pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            new[i, :s.numel()] = s
        return torch.cat([ids, new], 1), stats

    methods = {"HF batched": hf, "specdec batched": spec_batch, "specdec row loop": spec_loop}
    warm_ids, warm_mask = left_pad([r[:16] for r in rows[:2]], pad)
    for run in methods.values():
        run(warm_ids, warm_mask)
    result = {B: {m: {"tokens": 0, "seconds": 0.0, "stats": [], "differs": 0} for m in methods} for B in a.sizes}
    for rnd in range(a.rounds):
        for B in a.sizes:
            for g in range(0, 8, B):
                ids, mask = left_pad(rows[g:g + B], pad)
                T = ids.shape[1]
                order = list(methods) if (rnd + g // B) % 2 == 0 else list(reversed(methods))
                outs = {}
                for name in order:
                    if B == 1 and name == "specdec row loop":
                        continue  # the same single-sequence engine as 'specdec batched' at B = 1
                    t0 = time.perf_counter()
                    seq, stats = methods[name](ids, mask)
                    dt = time.perf_counter() - t0
                    new = real_new(seq, T, eos, n)
                    outs[name] = new
                    r = result[B][name]
                    r["tokens"] += sum(len(x) for x in new)
                    r["seconds"] += dt
                    r["stats"] += stats or []
                ref = outs.get("specdec row loop", outs["specdec batched"])
                for name, new in outs.items():
                    result[B][name]["differs"] += sum(x != y for x, y in zip(new, ref))
                print(f"round {rnd} B={B} group {g // B}: " + ", ".join(
                    f"{m} {result[B][m]['tokens'] / max(1e-9, result[B][m]['seconds']):.1f} tok/s" for m in outs),
                    flush=True)
    lines = [f"# Batched speculative decoding: {a.target}, drafter {a.drafter}", "",
             f"`python benchmarks/batches.py --target {a.target} --drafter {a.drafter} --sizes "
             f"{' '.join(map(str, a.sizes))} --max-new-tokens {n} --rounds {a.rounds}`", "",
             f"float32, greedy, {source} in groups of B, up to {n} new "
             f"tokens, {a.threads} threads, {a.rounds} rounds, methods alternating within each group after a warm-up. "
             f"Total tokens/s over all groups; specdec drafts with {a.drafter} (adaptive). Planned: the batch "
             "planner's length per live row and step; drafted: what the drafter proposed (a lookup may find less).", "",
             f"Machine: {machine()}.", "",
             "| B | HF batched tok/s | specdec batched tok/s | vs HF batched | specdec row loop tok/s | batched vs loop "
             "| planned draft length per row-step | drafted per row-step | acceptance | rows differing from their own generation |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for B in a.sizes:
        r = result[B]
        tps = {m: r[m]["tokens"] / max(1e-9, r[m]["seconds"]) for m in methods if r[m]["seconds"]}
        st = r["specdec batched"]["stats"]
        drafted = sum(s.drafted_tokens for s in st)
        k = drafted / max(1, sum(s.target_forwards for s in st))
        acc = sum(s.accepted_tokens for s in st) / max(1, drafted)
        loop = tps.get("specdec row loop")
        spec = tps["specdec batched"]
        loop_tps, vs_loop = ("", "") if loop is None else (f"{loop:.1f}", f"{spec / loop:.2f}x")
        ks = planned.get(B)
        plan = f"{sum(ks) / len(ks):.2f}" if ks else "(single-sequence policy)"
        lines.append(f"| {B} | {tps['HF batched']:.1f} | {tps['specdec batched']:.1f} | "
                     f"{spec / tps['HF batched']:.2f}x | {loop_tps} | {vs_loop} | {plan} | {k:.2f} | {acc:.2f} | "
                     f"HF {r['HF batched']['differs']}, specdec {r['specdec batched']['differs']} |")
    md = "\n".join(lines) + "\n"
    print(md)
    write_text(Path(a.out + ".md"), md)


if __name__ == "__main__":
    main()
