"""The three ways to use specdec on a HF model, on the bundled zoo: same output as generate(), sooner.

    python examples/generate_three_ways.py [--max-new-tokens 64]
"""
import argparse

import torch

import specdec

ap = argparse.ArgumentParser()
ap.add_argument("--max-new-tokens", type=int, default=64)
a = ap.parse_args()

target, tok = specdec.zoo.load("target")
draft, _ = specdec.zoo.load("draft-wide")
ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens, do_sample=False)

# a) one call, HF keywords
out = specdec.generate(target, ids, drafter=draft, max_new_tokens=a.max_new_tokens, return_dict_in_generate=True)
print("a) specdec.generate:", out.stats.summary())
# b) wrap once, use like the model
model = specdec.wrap(target, drafter=draft)
seq_b = model.generate(ids, max_new_tokens=a.max_new_tokens)
# c) inside HF's own generate()
seq_c = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens, do_sample=False,
                        custom_generate=specdec.hf_custom_generate, drafter=draft)
assert torch.equal(out.sequences, reference) and torch.equal(seq_b, reference) and torch.equal(seq_c, reference)
print("all three equal target.generate() token for token:")
print(tok.decode(reference[0, ids.shape[1]:]))
