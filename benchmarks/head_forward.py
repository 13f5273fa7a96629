"""The feature head's draft steps through the CPU layer kernel against its torch modules (drafters/head_forward.py).

In one process, per round and prompt, the same generation twice, the two paths alternating (SPECDEC_HEAD_KERNEL
read per call): a separate-process comparison reads this machine's shifting memory bandwidth, not the change.
Reported per head and mode: draft ms per drafted token (stats.draft_s / drafted tokens), decode tokens/s, the
median over rounds of the kernel's time over the torch path's, and whether the target's tokens were the same.

    python benchmarks/head_forward.py --out benchmarks/results/head_forward_amd_epyc.md
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

import specdec
from specdec import zoo
from specdec.cli.bench import load_prompts
from specdec.drafters.feature_head import FeatureHead
from specdec.files import write_text
from specdec.hf.linear import machine

HEADS = ("smollm2-135m-instruct-head", "smollm2-135m-instruct-eagle3-head")
MODES = {"k=3": dict(draft_length=3), "adaptive": dict()}


def run(target, head, ids, kernel: bool, max_new_tokens: int, mode: dict):
    os.environ["SPECDEC_HEAD_KERNEL"] = "1" if kernel else "0"
    out = specdec.generate(target, ids, drafter=head, max_new_tokens=max_new_tokens, do_sample=False,
                           return_dict_in_generate=True, **mode)
    s = out.stats
    return out.sequences, s.draft_s, s.drafted_tokens, s.decode_s, s.new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="benchmarks/prompts/chat.jsonl")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, tok = zoo.load(a.target)
    prompts = load_prompts(tok, a.prompts, a.num_prompts, chat=True)
    rows = []
    for name in HEADS:
        head = FeatureHead.from_pretrained(zoo.path(name), target)
        for label, mode in MODES.items():
            for kernel in (True, False):  # warm-up: the step's buckets, the kernels' first calls
                run(target, head, prompts[0], kernel, 16, mode)
            tot = {k: [0.0, 0, 0.0, 0] for k in (True, False)}
            ratios, same = [], True
            for _ in range(a.rounds):
                per = {}
                for kernel in (True, False):
                    per[kernel] = [run(target, head, ids, kernel, a.max_new_tokens, mode) for ids in prompts]
                    for seq, ds, dn, dec, new in per[kernel]:
                        t = tot[kernel]
                        t[0] += ds; t[1] += dn; t[2] += dec; t[3] += new
                same &= all(torch.equal(x[0], y[0]) for x, y in zip(per[True], per[False]))
                ratios.append(sum(r[3] for r in per[True]) / sum(r[3] for r in per[False]))
            k, t = tot[True], tot[False]
            rows.append(f"| {name} | {label} | {1e3 * k[0] / max(1, k[1]):.2f} | {1e3 * t[0] / max(1, t[1]):.2f} | "
                        f"{k[3] / k[2]:.1f} | {t[3] / t[2]:.1f} | {statistics.median(ratios):.3f} | "
                        f"{'yes' if same else 'NO'} |")
            print(rows[-1], flush=True)
    os.environ.pop("SPECDEC_HEAD_KERNEL", None)
    text = "\n".join([
        "# The head's draft steps: CPU layer kernel against torch modules", "",
        f"`python benchmarks/head_forward.py --num-prompts {a.num_prompts} --max-new-tokens {a.max_new_tokens} "
        f"--rounds {a.rounds} --threads {a.threads}`", "",
        f"{a.target} float32, greedy, the first {a.num_prompts} prompts of {a.prompts} in the chat template, "
        f"{a.rounds} rounds, the two paths alternating in one process. Machine: {machine()}.", "",
        "| head | mode | draft ms / drafted token, kernel | torch | decode tok/s, kernel | torch | "
        "decode time kernel / torch (median of rounds) | same tokens |",
        "|---|---|---|---|---|---|---|---|", *rows, ""])
    if a.out:
        write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
