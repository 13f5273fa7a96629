"""`specdec train-head`, `head-card` and `train-draft`: train a feature head or a plain draft for a target
(the command lines of head_trainer.train_head and draft_trainer.train_draft)."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ..training.draft_trainer import DraftTrainArgs
from ..training.head_trainer import HeadTrainArgs


def add_train_head_parser(sub) -> None:
    t = sub.add_parser("train-head", help="train a feature head (EAGLE family) for a target; resumable")
    t.add_argument("--target", required=True, help="zoo or real model name, or a local HF folder")
    t.add_argument("--out", required=True, help="the head's folder (must not exist)")
    t.add_argument("--work", default=None, help="data, checkpoint and log (default: OUT.work); rerun to resume")
    t.add_argument("--export-checkpoint", action="store_true",
                   help="do not train: save the head of the run in --work as it stands to --out (marked partial)")
    defaults = HeadTrainArgs(target="", out=Path(), work=Path())
    for f in fields(HeadTrainArgs):
        if f.name in ("target", "out", "work"):
            continue
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "resume_from":
            t.add_argument(flag, type=Path, default=None, help="a saved head to continue from (no checkpoint in --work)")
        elif isinstance(value, bool):
            t.add_argument(flag, action="store_true")
        else:
            t.add_argument(flag, type=type(value) if value is not None else int, default=value)


def cmd_train_head(a) -> None:
    from ..training.head_trainer import export_checkpoint, load_target, train_head

    out = Path(a.out)
    work = Path(a.work) if a.work else out.with_name(out.name + ".work")
    if a.export_checkpoint:
        print(f"head saved to {export_checkpoint(work, out, load_target(a.target)[0])}")
        return
    kw = {f.name: getattr(a, f.name) for f in fields(HeadTrainArgs) if f.name not in ("target", "out", "work")}
    done = train_head(HeadTrainArgs(target=a.target, out=out, work=work, **kw))
    print(f"head saved to {done}" if done else f"stopped at step {a.stop_at}; rerun the same command to resume "
          f"(checkpoint in {work})")


def add_head_card_parser(sub) -> None:
    c = sub.add_parser("head-card", help="measure a feature head and write its card (card.json, CARD.md)")
    c.add_argument("--head", required=True, help="the head's folder or a shipped head's name")
    c.add_argument("--target", required=True)
    c.add_argument("--num-prompts", type=int, default=8)
    c.add_argument("--new-tokens", type=int, default=96)
    c.add_argument("--threads", type=int, default=2)


def cmd_head_card(a) -> None:
    import torch

    from .. import zoo
    from ..training.head_card import measure_head, to_markdown, write_card
    from ..training.head_trainer import load_target

    torch.set_num_threads(a.threads)
    head_dir = zoo.path(a.head) if a.head in zoo.heads() else Path(a.head)
    target, tok = load_target(a.target)
    card = measure_head(head_dir, target, tok, a.num_prompts, a.new_tokens)
    write_card(head_dir, card)
    print(to_markdown(card))


def add_train_draft_parser(sub) -> None:
    t = sub.add_parser("train-draft", help="distil a plain draft model (a few of the target's layers, its "
                                           "embedding shared) from a feature-head run's data; resumable")
    t.add_argument("--target", required=True, help="zoo or real model name, or a local HF folder")
    t.add_argument("--data", required=True, help="a `specdec train-head` work folder (its data/ shards)")
    t.add_argument("--out", required=True, help="the draft's folder (must not exist)")
    t.add_argument("--work", default=None, help="checkpoint and log (default: OUT.work); rerun to resume")
    defaults = DraftTrainArgs(target="", data=Path(), out=Path(), work=Path())
    for f in fields(DraftTrainArgs):
        if f.name in ("target", "data", "out", "work"):
            continue
        value = getattr(defaults, f.name)
        t.add_argument("--" + f.name.replace("_", "-"), type=type(value) if value is not None else int, default=value)


def cmd_train_draft(a) -> None:
    from ..training.draft_trainer import train_draft

    out = Path(a.out)
    work = Path(a.work) if a.work else out.with_name(out.name + ".work")
    kw = {f.name: getattr(a, f.name) for f in fields(DraftTrainArgs) if f.name not in ("target", "data", "out", "work")}
    done = train_draft(DraftTrainArgs(target=a.target, data=Path(a.data), out=out, work=work, **kw))
    print(f"draft saved to {done}" if done else f"stopped at step {a.stop_at}; rerun the same command to resume "
          f"(checkpoint in {work})")
