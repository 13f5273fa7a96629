"""A feature head's card: what it was trained on and how it drafts, measured on prompts it never saw.

card.json (and CARD.md) beside head_config.json: the training facts (tokens, steps, seconds, held-out
acceptance by position from the trainer), then, from greedy generations on held-out prompts (the
trainer's held-out chat prompts for a chat target, what the benchmark asks; the zoo's held-out prompts
otherwise): acceptance by position and tau at each fixed k, adaptive and a dynamic tree; c (the draft's
seconds per drafted token over plain decoding's seconds per token on the same prompt, run just before
it, averaged over prompts: a ratio, not a speed claim), and a sample output.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..drafters import FeatureHead
from ..files import write_text
from ..stats import SpecStats
from ..tree import TreeSpec


def card_prompts(tok, n: int, kind: str = "chat") -> list[torch.Tensor]:
    """n held-out prompts [1, T] of one kind ("chat" or "code") for a chat target; zoo prompts otherwise."""
    from .. import zoo
    from . import head_data, prompts

    if getattr(tok, "chat_template", None):
        held = [p for p in prompts.build(4000, seed=0) if prompts.is_heldout(p) and p["kind"] == kind][:n]
        return [torch.tensor([head_data.render(tok, p)]) for p in held]
    return [tok(p, return_tensors="pt").input_ids for p in zoo.prompts(n)]


@torch.no_grad()
def measure_head(head_dir: Path, target, tok, num_prompts: int = 8, new_tokens: int = 96,
                 ks=(1, 2, 3, 4, 5, 6)) -> dict:
    import specdec

    head = FeatureHead.from_pretrained(head_dir, target)
    ids_list = card_prompts(tok, num_prompts)
    modes = {f"k={k}": dict(draft_length=k) for k in ks}
    modes["adaptive"] = {}
    modes["tree dynamic(16, 5, 4), 16 nodes"] = dict(tree=TreeSpec.dynamic(nodes=16, depth=5, topk=4), draft_length=16)
    modes["tree dynamic(16, 5, 4), adaptive"] = dict(tree=TreeSpec.dynamic(nodes=16, depth=5, topk=4))
    runs: dict[str, list[SpecStats]] = {name: [] for name in modes}
    c: dict[str, list[float]] = {name: [] for name in modes}
    sample = None
    for ids in ids_list:  # prompt by prompt, plain decoding then every mode: c's two times are taken together
        def run(drafter, **kw):
            return specdec.generate(target, ids, drafter=drafter, max_new_tokens=new_tokens, do_sample=False,
                                    return_dict_in_generate=True, **kw)

        plain_tpot = run(None, draft_length=0).stats.tpot_s
        for name, kw in modes.items():
            out = run(head, **kw)
            st = out.stats
            if sample is None and name == "adaptive":
                sample = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
            runs[name].append(st)
            if st.drafted_tokens:
                c[name].append(st.draft_s / st.drafted_tokens / plain_tpot)
    rows = {name: {"tau": round(sum(s.mean_accepted_length for s in stats) / len(stats), 3),
                   "accept_by_position": [round(a, 3) for a in SpecStats.combine(stats).per_position_acceptance],
                   "c": round(sum(c[name]) / len(c[name]), 4) if c[name] else None} for name, stats in runs.items()}
    cfg = json.loads((Path(head_dir) / "head_config.json").read_text())
    return {"head": Path(head_dir).name, "trained": cfg.get("trained", {}), "draft_vocab": cfg.get("draft_vocab"),
            "feature_layers": cfg["feature_layers"], "params": sum(p.numel() for p in head.net.parameters()),
            "measured_on": f"{len(ids_list)} held-out {'chat ' if getattr(tok, 'chat_template', None) else ''}"
                           f"prompts, {new_tokens} new tokens, greedy",
            "modes": rows, "sample": sample, "measured": time.strftime("%Y-%m-%d")}


def to_markdown(card: dict) -> str:
    t = card["trained"]
    held = t.get("heldout") or {}
    lines = [f"# {card['head']}", "",
             f"Feature head (EAGLE family), {card['params'] / 1e6:.2f} M parameters, feature layers "
             f"{card['feature_layers']}, draft vocabulary {card['draft_vocab'] or 'full'}.", "",
             f"Trained {t.get('steps')} steps{' (partial run)' if t.get('partial') else ''} on "
             f"{t.get('train_tokens', '?')} tokens of the target's own answers and standard-library text, "
             f"{t.get('train_seconds', '?')} s of training"
             + (f" (its first {t['continued_from']['steps']} steps were a head trained on "
                f"{t['continued_from']['train_tokens']} tokens of earlier data, continued with --resume-from)"
                if t.get("continued_from") else "")
             + "; held-out acceptance by position (trainer): "
             f"{held.get('accept')}, tau {held.get('tau')}.", "",
             f"Measured: {card['measured_on']}.", "", "| mode | tau | acceptance by position | c |", "|---|---|---|---|"]
    for name, r in card["modes"].items():
        lines.append(f"| {name} | {r['tau']} | {r['accept_by_position']} | {r['c']} |")
    lines += ["", "Sample (adaptive, first held-out prompt):", "", "```", (card.get("sample") or "").strip(), "```", ""]
    return "\n".join(lines)


def write_card(head_dir: Path, card: dict) -> None:
    head_dir = Path(head_dir)
    write_text(head_dir / "card.json", json.dumps(card, indent=1))
    write_text(head_dir / "CARD.md", to_markdown(card))
