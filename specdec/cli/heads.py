"""`specdec train-head`, `head-card` and `train-draft`: train a feature head or a plain draft for a target
(the command lines of head_trainer.train_head and draft_trainer.train_draft)."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ..training.draft_trainer import DraftTrainArgs
from ..training.head_trainer import HeadTrainArgs
from ..training.loop import PRECISIONS


PATHS = ("target", "data", "out", "work")  # the trainers' fields the commands set themselves
CHOICES = {"precision": PRECISIONS, "arch": ("eagle", "eagle3")}  # fields whose values argparse checks


def _add_fields(parser, args_class, special: dict | None = None) -> None:
    """One --flag per field of a trainer's args dataclass (beyond PATHS), typed and defaulted from it;
    special: {field: (type, help)} for a field whose default (None) does not say its type."""
    special = special or {}
    for f in fields(args_class):
        if f.name in PATHS:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name in special:
            kind, text = special[f.name]
            parser.add_argument(flag, type=kind, default=f.default, help=text)
        elif isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(f.default) if f.default is not None else int, default=f.default,
                                choices=CHOICES.get(f.name))


def _field_values(a, args_class) -> dict:
    return {f.name: getattr(a, f.name) for f in fields(args_class) if f.name not in PATHS}


def _report(what: str, done, a, work: Path) -> None:
    when = f"at step {a.stop_at}" if a.stop_at is not None else "at the time limit"
    print(f"{what} saved to {done}" if done else f"stopped {when}; rerun the same command to resume "
          f"(checkpoint in {work})")


def add_train_head_parser(sub) -> None:
    t = sub.add_parser("train-head", help="train a feature head (EAGLE family) for a target; resumable")
    t.add_argument("--target", required=True, help="zoo or real model name, or a local HF folder")
    t.add_argument("--out", required=True, help="the head's folder (must not exist)")
    t.add_argument("--work", default=None, help="data, checkpoint and log (default: OUT.work); rerun to resume")
    t.add_argument("--export-checkpoint", action="store_true",
                   help="do not train: save the head of the run in --work as it stands to --out (marked partial)")
    t.add_argument("--data", default="answers", help="the training sequences' sources joined by '+': answers (the "
                   "target answers composed prompts), chitchat (human conversations it reads; pip install "
                   "chitchat-dataset), random (random-token prompts it answers); default answers")
    _add_fields(t, HeadTrainArgs, {"resume_from": (Path, "a saved head to continue from (no checkpoint in --work); "
                                                         "a top-only head continues as a --fusion head"),
                                      "stop_after_s": (float, "checkpoint and stop once training has run this many "
                                                              "seconds; rerun to resume")})


def cmd_train_head(a) -> None:
    from ..training.head_trainer import export_checkpoint, load_target, train_head

    out = Path(a.out)
    work = Path(a.work) if a.work else out.with_name(out.name + ".work")
    if a.export_checkpoint:
        print(f"head saved to {export_checkpoint(work, out, load_target(a.target)[0])}")
        return
    done = train_head(HeadTrainArgs(target=a.target, out=out, work=work, data=a.data, **_field_values(a, HeadTrainArgs)))
    _report("head", done, a, work)


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


def add_export_head_parser(sub) -> None:
    e = sub.add_parser("export-head", help="write a feature head as an EAGLE-3 checkpoint vLLM / SGLang load "
                                           "(speculative_config={'method': 'eagle3', 'model': OUT})")
    e.add_argument("head", help="the head's folder or a shipped head's name (an --arch eagle3 head)")
    e.add_argument("--target", required=True, help="the target it drafts for (zoo or real name, or a local HF folder)")
    e.add_argument("--format", default="eagle3", choices=("eagle3", "eagle"),
                   help="eagle3 (vLLM's llama_eagle3 layout); eagle (EAGLE-1) is refused with the reason")
    e.add_argument("--out", required=True, help="the checkpoint's folder (must not exist)")
    e.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))


def cmd_export_head(a) -> None:
    import torch

    from .. import zoo
    from ..drafters.eagle_format import export_eagle3
    from ..drafters.feature_head import FeatureHead
    from ..training.head_trainer import load_target

    if a.format == "eagle":  # before loading anything
        raise SystemExit("--format eagle: vLLM's and SGLang's EAGLE-1 model has no bias on fc, no norm on the "
                         "layer's input and no output norm, which specdec's heads have; export an --arch eagle3 "
                         "head with --format eagle3")
    target, _ = load_target(a.target)
    head = FeatureHead.from_pretrained(zoo.path(a.head) if a.head in zoo.heads() else Path(a.head), target)
    out = export_eagle3(head.net.float(), target, Path(a.out), getattr(torch, a.dtype))  # ValueError: main's one line
    print(f"EAGLE-3 checkpoint written to {out}; in vLLM: speculative_config={{'method': 'eagle3', "
          f"'model': '{out}', 'num_speculative_tokens': 3}}")


def add_train_draft_parser(sub) -> None:
    t = sub.add_parser("train-draft", help="distil a plain draft model (a few of the target's layers, its "
                                           "embedding shared) from a feature-head run's data; resumable")
    t.add_argument("--target", required=True, help="zoo or real model name, or a local HF folder")
    t.add_argument("--data", required=True, help="a `specdec train-head` work folder (its data/ shards)")
    t.add_argument("--out", required=True, help="the draft's folder (must not exist)")
    t.add_argument("--work", default=None, help="checkpoint and log (default: OUT.work); rerun to resume")
    _add_fields(t, DraftTrainArgs, {"resume_from": (Path, "a saved draft to continue from (no checkpoint in "
                                                         "--work); same --layers")})


def cmd_train_draft(a) -> None:
    from ..training.draft_trainer import train_draft

    out = Path(a.out)
    work = Path(a.work) if a.work else out.with_name(out.name + ".work")
    done = train_draft(DraftTrainArgs(target=a.target, data=Path(a.data), out=out, work=work,
                                      **_field_values(a, DraftTrainArgs)))
    _report("draft", done, a, work)
