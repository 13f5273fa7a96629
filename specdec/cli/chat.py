"""`specdec chat`: the interactive front of ChatSession (specdec/chat.py) - streaming answers, a status
line, /reset, /stats, /quit; Ctrl-C stops an answer and keeps the session; reads piped stdin too."""
from __future__ import annotations

import sys

from ..cache.pool import PoolExhausted
from ..chat import ChatSession
from .models import _drafter_arg, _load, _sampling_kwargs, _tree_spec


def cmd_chat(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    tree = _tree_spec(a)
    target, tok = _load(a.target, "target", a.dtype)
    if not a.no_status:
        print("(warming up: the first generation's one-off setup, before the first answer)", file=sys.stderr,
              flush=True)
    session = ChatSession(target, tok, drafter=_drafter_arg(a.drafter, tok, a.draft_dtype, target),
                          system=a.system, tree=tree)
    chat_loop(session, dict(max_new_tokens=a.max_new_tokens, **_sampling_kwargs(a)), status=not a.no_status)


def chat_loop(session: ChatSession, generate_kwargs: dict, status: bool = True, stream=sys.stdout) -> None:
    """Read lines from stdin until EOF or /quit. Interactive when stdin is a terminal."""
    from transformers import TextStreamer

    interactive = sys.stdin.isatty()
    if not session.templated:
        print("(this tokenizer has no chat template: plain continuation, each line is appended to the text)",
              file=stream)
    while True:
        if interactive:
            print("> ", end="", file=stream, flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            print(file=stream)
            break
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() == "/quit":
            break
        if text.strip() == "/reset":
            session.reset()
            print("[conversation reset]", file=stream, flush=True)
            continue
        if text.strip() == "/stats":
            s = session.last_stats
            print(f"[{s.summary()}]" if s else "[no answer yet]", file=stream, flush=True)
            continue
        if not session.templated:
            text += "\n"
        streamer = TextStreamer(session.tok, skip_prompt=True, skip_special_tokens=True)
        try:
            session.send(text, streamer=streamer, **generate_kwargs)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=stream, flush=True)
            continue
        except (PoolExhausted, ValueError) as e:  # e.g. the conversation outgrew the model's positions
            session.reset()
            print(f"\n[{e}; the conversation was reset]", file=stream, flush=True)
            continue
        s = session.last_stats
        if status and s is not None:
            print(f"[{s.tokens_per_s:.1f} tok/s | acceptance {s.acceptance_rate:.2f} | tau {s.mean_accepted_length:.2f}"
                  f" | TTFT {s.ttft_s * 1e3:.1f} ms | prefilled {s.prompt_tokens - s.reused_prompt_tokens} new of "
                  f"{s.prompt_tokens} tokens]", file=stream, flush=True)
