"""Which zoo draft should this target use, and with which k? Predicted vs measured speedups.

    python examples/select_draft.py [--max-new-tokens 32] [--out /tmp/specdec_select]
"""
import argparse
from pathlib import Path

import specdec
from specdec.cli.bench import load_prompts
from specdec.cli.select import select_draft, write_report

ap = argparse.ArgumentParser()
ap.add_argument("--max-new-tokens", type=int, default=32)
ap.add_argument("--max-k", type=int, default=4)
ap.add_argument("--out", default="/tmp/specdec_select")
a = ap.parse_args()

target, tok = specdec.zoo.load("target")
drafts = {n: specdec.zoo.load(n)[0] for n in specdec.zoo.names() if n.startswith("draft")}
report = select_draft(target, drafts, load_prompts(tok, None, 2), (0.0,), a.max_k, a.max_new_tokens)
write_report(report, Path(a.out), (0.0,))
print("ranking:", " > ".join(report["ranking"]))
print((Path(a.out) / "report.md").read_text())
