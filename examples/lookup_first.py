"""Prompt lookup in front of a feature head: which source drafted, what each source's plan learned.

LookupFirst proposes the lookup's continuation where the text ends in an n-gram seen before and lets the
head draft elsewhere; the adaptive policy plans each source on its own. This runs the same prompt with
the head alone, the lookup alone and the two together, checks that every output is the target's own
greedy one, and prints tokens per target forward and what each source's plan measured.

    python examples/lookup_first.py [--target target|smollm2-135m-instruct] [--max-new-tokens 64]
"""
import argparse

import specdec
from specdec.drafters import FeatureHead, LookupFirst

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="target", help="a zoo model with a shipped head")
ap.add_argument("--max-new-tokens", type=int, default=64)
a = ap.parse_args()

target, tok = specdec.zoo.load(a.target)
head = FeatureHead.from_pretrained(specdec.zoo.path(specdec.zoo.head_for(a.target)), target)
ids = tok(specdec.zoo.prompts(4)[3], return_tensors="pt").input_ids
reference = target.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False)
both = LookupFirst(head)
for name, drafter in [("head", head), ("ngram", "ngram"), ("ngram+head", both)]:
    model = specdec.wrap(target, drafter=drafter)
    out = model.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    same = bool((out.sequences == reference).all())
    print(f"{name:10s} tau {out.stats.mean_accepted_length:.2f} tokens per target forward, "
          f"acceptance {out.stats.acceptance_rate:.2f}, output == target greedy: {same}")
print(f"ngram+head: the lookup proposed {both.lookup_steps} steps, the head {both.drafter_steps}")
for source, plan in model.engine.policy.to_dict()["sources"].items():
    rates = ", ".join(f"{r:.2f}" for r in plan["tracker"]["per_position"][:4])
    print(f"  {source:8s} plans k = {plan['plan_k']}: acceptance by position {rates}; c {plan['costs']['c']:.3f}")
