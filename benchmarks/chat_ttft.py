"""Chat's second-turn TTFT with the kept KV vs re-prefilling the whole history (a fresh generate).

    python benchmarks/chat_ttft.py

A conversation of held-out code is built turn by turn; at each later turn the same prompt ids are
answered both by the ChatSession (prefills only the new text) and by a fresh specdec.generate
(prefills everything), alternating; medians of TTFT and their ratio are reported.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import specdec
from specdec.chat import ChatSession

ap = argparse.ArgumentParser()
ap.add_argument("--turns", type=int, default=6)
ap.add_argument("--new-tokens", type=int, default=48)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_ttft"))
a = ap.parse_args()
torch.set_num_threads(a.threads)
target, tok = specdec.zoo.load("target")
draft, _ = specdec.zoo.load("draft-wide")
fresh = specdec.wrap(target, drafter=draft)
chat = ChatSession(target, tok, drafter=draft)
lines = [p.splitlines()[-1] + "\n" for p in specdec.zoo.prompts(a.turns)]
rows = []
for i, text in enumerate(lines):
    ids = chat._prompt_ids(text)
    out = fresh.generate(torch.tensor([ids]), max_new_tokens=a.new_tokens, return_dict_in_generate=True)
    chat.send(text, max_new_tokens=a.new_tokens)
    s = chat.last_stats
    if i > 0:
        rows.append({"turn": i + 1, "history_tokens": len(ids), "prefilled_by_chat": s.prompt_tokens - s.reused_prompt_tokens,
                     "chat_ttft_ms": s.ttft_s * 1e3, "fresh_ttft_ms": out.stats.ttft_s * 1e3})
ratio = statistics.median(r["fresh_ttft_ms"] / r["chat_ttft_ms"] for r in rows)
Path(a.out + ".json").write_text(json.dumps({"rows": rows, "median_ratio": ratio}, indent=2))
lines_md = ["| turn | history tokens | prefilled by chat | chat TTFT ms | re-prefill TTFT ms |", "|---|---|---|---|---|"]
lines_md += [f"| {r['turn']} | {r['history_tokens']} | {r['prefilled_by_chat']} | {r['chat_ttft_ms']:.1f} | "
             f"{r['fresh_ttft_ms']:.1f} |" for r in rows]
lines_md += ["", f"Median TTFT ratio, re-prefill / kept KV: {ratio:.2f}x"]
Path(a.out + ".md").write_text("# Chat TTFT: kept KV vs re-prefill\n\n`python benchmarks/chat_ttft.py " +
                               " ".join(sys.argv[1:]) + "`\n\n" + "\n".join(lines_md) + "\n")
print("\n".join(lines_md))
