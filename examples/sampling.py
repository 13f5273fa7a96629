"""Sampling with temperature and top-p: speculation keeps the target's distribution exactly.

    python examples/sampling.py [--max-new-tokens 64] [--temperature 0.7] [--top-p 0.9]
"""
import argparse

import torch

import specdec

ap = argparse.ArgumentParser()
ap.add_argument("--max-new-tokens", type=int, default=64)
ap.add_argument("--temperature", type=float, default=0.7)
ap.add_argument("--top-p", type=float, default=0.9)
a = ap.parse_args()

target, tok = specdec.zoo.load("target")
draft, _ = specdec.zoo.load("draft-wide")
ids = tok(specdec.zoo.prompts(3)[2], return_tensors="pt").input_ids
for seed in (0, 1):
    # every run is an exact sample of the target's distribution; a seed reproduces its sample only with a fixed
    # draft_length (the adaptive default picks k from measured time, and k decides how the random stream is used)
    torch.manual_seed(seed)
    out = specdec.generate(target, ids, drafter=draft, do_sample=True, temperature=a.temperature, top_p=a.top_p,
                           max_new_tokens=a.max_new_tokens, return_dict_in_generate=True)
    print(f"--- seed {seed}: {out.stats.summary()}")
    print(tok.decode(out.sequences[0, ids.shape[1]:]))
