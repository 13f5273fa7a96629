"""Where a head's training sequences come from: `specdec train-head --data SOURCE[+SOURCE...]`.

- answers: the composed prompt set (training/prompts.py) answered greedily by the target, plus standard-
  library text chunks (self-distillation; generation is what it costs: ~250 tokens/s on two cores).
- chitchat: human conversations (the `chitchat-dataset` package, MIT, 7,168 conversations) rendered in
  the target's chat template, the first speaker as user and the second as assistant. No generation: one
  teacher-forced forward gives the target's features and, through its LM head, its own distribution at
  every position (the soft labels the trainer matches), so a CPU-hour covers many more positions.
- random: random-token user turns (EAGLE-3's open recipe for small targets) answered greedily by the
  target: its own text, drawn from prompts no user would write, so nothing of the benchmark can leak.

Every source is deterministic for a seed and prefix-stable (asking for more keeps the first items), and
a conversation or prompt sharing a five-word run with a benchmark prompt is dropped. Held-out acceptance
is always measured on the target's answers to the held-out composed prompts (prompts.is_heldout), which
no source trains on, so runs from different sources are compared on the same sequences.
"""
from __future__ import annotations

import functools
import random

from . import prompts as prompt_set

SOURCES = ("answers", "chitchat", "random")
CONVERSATION_TOKENS = 1024  # a rendered conversation is cut at the last whole turn under this many tokens


def parse(spec: str) -> tuple[str, ...]:
    """"chitchat+answers" -> ("answers", "chitchat"): the sources named, each once, in SOURCES order."""
    names = [s.strip() for s in spec.replace(",", "+").split("+") if s.strip()]
    unknown = [s for s in names if s not in SOURCES]
    if not names or unknown:
        raise ValueError(f"--data {spec!r}: expected one or more of {'+'.join(SOURCES)} joined by '+'"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return tuple(s for s in SOURCES if s in names)


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


@functools.lru_cache(maxsize=1)
def _chitchat_turns() -> tuple[tuple[tuple[int, str], ...], ...]:
    """Every conversation as turns (speaker 0 or 1, text), consecutive messages of a speaker joined; read
    once per process (its JSON takes seconds)."""
    try:
        import chitchat_dataset
    except ImportError as e:
        raise ImportError("--data chitchat reads the `chitchat-dataset` package: pip install chitchat-dataset "
                          "(or specdec's [train] extra)") from e
    out = []
    for key in sorted(data := chitchat_dataset.Dataset()):
        turns, speakers = [], {}
        for message in data[key]["messages"]:
            if not message:
                continue
            who = speakers.setdefault(message[0]["sender"], len(speakers))
            text = " ".join(u["text"].strip() for u in message if u["text"].strip())
            if text and who < 2:
                turns.append((who, text))
        if len(turns) >= 2:
            out.append(tuple(turns))
    return tuple(out)


def conversations(tok, n: int, seed: int) -> list[tuple[list[int], bool]]:
    """n conversations (fewer if the data set runs out) -> (token ids in the chat template, held out), the
    conversation order shuffled by the seed. A conversation is held out by the hash of its first turn
    (as prompts are) and kept out of training; one sharing a five-word run with a benchmark prompt is
    dropped. Each is cut after the last whole turn that fits CONVERSATION_TOKENS."""
    if not has_chat_template(tok):
        raise ValueError("--data chitchat renders conversations in the target's chat template, and this "
                         "target's tokenizer has none")
    turns = list(_chitchat_turns())
    random.Random(seed).shuffle(turns)
    bench = prompt_set.benchmark_shingles()
    out = []
    for conv in turns:
        if len(out) >= n:
            break
        if any(prompt_set._shingles(text) & bench for _, text in conv):
            continue
        msgs = [{"role": "user" if who == 0 else "assistant", "content": text} for who, text in conv]
        ids = _render(tok, msgs)
        if len(ids) > CONVERSATION_TOKENS:  # the longest opening of whole turns that fits (bisection)
            lo, hi = 2, len(msgs) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if len(_render(tok, msgs[:mid])) <= CONVERSATION_TOKENS else (lo, mid - 1)
            ids = _render(tok, msgs[:lo])
        out.append((ids[:CONVERSATION_TOKENS], prompt_set.is_heldout({"user": conv[0][1]})))
    return out


def _render(tok, msgs: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(msgs, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def random_prompts(tok, n: int, seed: int, min_tokens: int = 4, max_tokens: int = 24) -> list[list[int]]:
    """n prompts of min..max_tokens random ordinary tokens (no special ids), seeded, prefix-stable; in the
    chat template as a user turn where the tokenizer has one, else the bare tokens (a plain LM). One whose
    text shares a five-word run with a benchmark prompt is drawn again."""
    special = set(tok.all_special_ids)
    ordinary = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    bench = prompt_set.benchmark_shingles()
    out = []
    while len(out) < n:
        ids = [rng.choice(ordinary) for _ in range(rng.randint(min_tokens, max_tokens))]
        text = tok.decode(ids, skip_special_tokens=True)
        if prompt_set._shingles(text) & bench:
            continue
        if has_chat_template(tok):
            msgs = [{"role": "user", "content": text}]
            rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        out.append(ids)
    return out
