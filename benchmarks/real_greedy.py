"""Greedy equality on a real model for every drafter kind, as a benchmark run (the Qwen model is too big
for CI): plain, n-gram (k = 2, adaptive), the model drafting for itself (alpha = 1; k = 3, 6), early exit
(chain and dynamic tree), a static tree, and with --cross-draft a model of another tokenizer drafting in
text and intersection mode. Each output is compared token for token with the model's own
`generate(do_sample=False)`; the markdown records the command, the outcome and the lean runner's verdict.

    python benchmarks/real_greedy.py --target qwen2.5-coder-1.5b-instruct --cross-draft smollm2-135m-instruct \
        --out benchmarks/results/real_greedy_qwen2.5-coder
"""
import argparse
import sys
import time
from pathlib import Path

import torch

import specdec
from specdec.drafters import EarlyExit
from specdec.hf import lean

PROMPTS = ["Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
           "What is the difference between a list and a tuple in Python?"]


def drafters(model):
    n = model.config.num_hidden_layers
    return {"plain": dict(draft_length=0), "ngram k=2": dict(drafter="ngram", draft_length=2),
            "ngram adaptive": dict(drafter="ngram"), "self k=3": dict(drafter=model, draft_length=3),
            "self k=6": dict(drafter=model, draft_length=6),
            "early exit k=2": dict(drafter=EarlyExit(model, exit_layer=n // 2), draft_length=2),
            "self static tree [2,2,1]": dict(drafter=model, tree=specdec.TreeSpec.static([2, 2, 1])),
            "early exit dynamic tree": dict(drafter=EarlyExit(model, exit_layer=3 * n // 4),
                                            tree=specdec.TreeSpec.dynamic(nodes=8, depth=4, topk=2))}


def cross_drafters(draft, draft_tok, tok):
    """A draft with its own tokenizer, in both modes (HF's keywords)."""
    pair = dict(drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok)
    return {"cross text k=3": dict(pair, cross_tokenizer="text", draft_length=3),
            "cross intersection k=3": dict(pair, cross_tokenizer="intersection", draft_length=3),
            "cross text k=6": dict(pair, cross_tokenizer="text", draft_length=6),
            "cross text adaptive": dict(pair, cross_tokenizer="text")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cross-draft", default=None, help="a zoo model with another tokenizer to draft across tokenizers")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the target's weights; the reference is its own greedy output in that dtype")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = specdec.zoo.load(a.target)
    dtype = getattr(torch, a.dtype)
    model = model.to(dtype)
    extra = {}
    if a.cross_draft:
        draft, draft_tok = specdec.zoo.load(a.cross_draft)
        extra = cross_drafters(draft, draft_tok, tok)
    rows, failures = [], 0
    for p in PROMPTS:
        ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens, do_sample=False)
        for label, options in {**drafters(model), **extra}.items():
            t0 = time.perf_counter()
            out = specdec.generate(model, ids, max_new_tokens=a.max_new_tokens, return_dict_in_generate=True, **options)
            same = torch.equal(out.sequences, ref)
            failures += not same
            rows.append(f"| {p[:40]}... | {label} | {'yes' if same else '**NO**'} | {out.stats.acceptance_rate:.2f} | "
                        f"{out.stats.mean_accepted_length:.2f} | {time.perf_counter() - t0:.1f} |")
            print(rows[-1], flush=True)
    verdict = lean._verdicts.get(model, {}).get((dtype, torch.device("cpu")), "not probed")
    md = (f"# Greedy equality on {a.target}\n\n`python {' '.join(sys.argv)}`\n\n{a.dtype}, {a.max_new_tokens} new tokens per "
          f"generation, chat template; reference: the model's own `generate(do_sample=False)`. Lean runner "
          f"verdict on this model: **{verdict}** (exact = its logits are the HF modules' bit for bit, so it is "
          f"used).\n\n| prompt | drafter | output == greedy | acceptance | tau | seconds |\n|---|---|---|---|---|---|\n"
          + "\n".join(rows) + f"\n\n{len(rows) - failures} of {len(rows)} generations equal the model's own greedy output.\n")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / (out.name + ".md.tmp")
    tmp.write_text(md)
    tmp.rename(out.parent / (out.name + ".md"))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
