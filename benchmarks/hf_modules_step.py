"""Gemma 3 (or another target) through the compiled step, the lean loop, its own HF modules, and HF's generate().

In one process, per round, each prompt through: HF generate() target-only; specdec with nothing drafted as
it runs by default (for Gemma 3 since 2026-12-07 the compiled step: forwards of up to 32 tokens one CPU layer
kernel call a layer, kernels/cpu_layer.py, where it runs; else the lean loop); the same with
SPECDEC_COMPILE=0 (the lean loop, hf/lean.py with hf/lean_layer.py's form); and specdec through the target's
own HF modules (the lean loop's architecture table emptied for the run: what ran Gemma 3 before, with the
short-block products of hf/linear.py short_block_linears). Every run makes exactly --max-new-tokens tokens
(EOS ignored: what is timed is the step, not the text). Medians over rounds of tokens/s (all tokens / all
seconds of a round), the step each mode ran (stats.step), and whether every output equals HF's greedy.
Nothing drafts here: past its answer the model repeats itself, which would flatter any drafter.

    python benchmarks/hf_modules_step.py --out benchmarks/results/hf_modules_step_amd_epyc.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import specdec
from specdec import zoo
from specdec.cli.bench import load_prompts
from specdec.files import write_text
from specdec.hf import lean_layer as lean
from specdec.hf.linear import machine

FORMS = dict(lean.FORMS)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--prompts", default="benchmarks/prompts/chat.jsonl")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, tok = zoo.load(a.target)
    prompts = load_prompts(tok, a.prompts, a.num_prompts, chat=bool(getattr(tok, "chat_template", None)))
    n = a.max_new_tokens

    def hf(ids):
        return target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    steps: dict[str, set] = {}

    def spec(ids, mode: str, lean_loop: bool, compiled: bool = True):
        lean.FORMS.clear()
        lean.FORMS.update(FORMS if lean_loop else {})  # read as each generation makes its runner
        os.environ["SPECDEC_COMPILE"] = "" if compiled else "0"
        try:
            out = specdec.generate(target, ids, drafter=None, max_new_tokens=n, eos_token_id=None,
                                   do_sample=False, return_dict_in_generate=True)
        finally:
            lean.FORMS.update(FORMS)
            os.environ["SPECDEC_COMPILE"] = ""
        steps.setdefault(mode, set()).add(out.stats.step)
        return out.sequences

    modes = {"HF generate() target-only": hf,
             "specdec nothing drafted (default step)": lambda ids: spec(ids, "specdec nothing drafted (default step)", True),
             "specdec nothing drafted, lean loop": lambda ids: spec(ids, "specdec nothing drafted, lean loop", True,
                                                                    compiled=False),
             "specdec nothing drafted, HF modules": lambda ids: spec(ids, "specdec nothing drafted, HF modules", False)}
    for fn in modes.values():  # warm-up
        fn(prompts[0][:, :8])
    rates = {m: [] for m in modes}
    same = {m: True for m in modes}
    for _ in range(a.rounds):
        ref = []
        for m, fn in modes.items():
            outs, secs = zip(*(timed(lambda ids=ids: fn(ids)) for ids in prompts))
            rates[m].append(len(prompts) * n / sum(secs))
            if not ref:
                ref = [o[0] for o in outs]
            same[m] &= all(torch.equal(o[0][:len(r)], r) for o, r in zip(outs, ref))
    base = statistics.median(rates["HF generate() target-only"])
    rows = [f"| {m} | {', '.join(sorted(steps.get(m, {'HF'})))} | {', '.join(f'{r:.1f}' for r in rates[m])} | "
            f"{statistics.median(rates[m]):.1f} | {statistics.median(rates[m]) / base:.2f} | "
            f"{'yes' if same[m] else 'NO'} |" for m in modes]
    text = "\n".join([
        "# A target through the compiled step, the lean loop and its own HF modules", "",
        f"`python benchmarks/hf_modules_step.py --target {a.target} --num-prompts {a.num_prompts} "
        f"--max-new-tokens {n} --rounds {a.rounds} --threads {a.threads}`", "",
        f"{a.target} float32, greedy, {n} new tokens, the first {a.num_prompts} prompts of {a.prompts}, {a.rounds} "
        f"rounds, the modes in turn in one process. Machine: {machine()}.", "",
        "| mode | step | tokens/s per round | median | vs HF | output == HF greedy |", "|---|---|---|---|---|---|",
        *rows, ""])
    if a.out:
        write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
