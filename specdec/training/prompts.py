"""The head trainer's prompt set: varied requests built offline from templates and the standard library.

Self-distillation needs prompts the target answers the way users will ask it; no data set is
downloaded, so they are composed: everyday tasks x topics (chat), and coding requests built from the
standard library's own function summaries (code). Deterministic for a seed. A prompt that shares any
five-word run with a benchmark prompt (benchmarks/prompts/*.jsonl, when present) is dropped, so no
training prompt can leak into a measured speedup.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
from pathlib import Path

from ..zoo.corpus import module_files
from .chat_words import wider_requests
from .prompt_words import CODE_EDITS, everyday_requests

TASKS = [
    "Explain {t} in simple terms.", "Give me three practical tips about {t}.", "Write a short poem about {t}.",
    "What are the pros and cons of {t}?", "Write a friendly email to a colleague about {t}.",
    "Tell me a short story that involves {t}.", "What are common mistakes people make with {t}?",
    "Summarise the history of {t} in a paragraph.", "How would you teach {t} to a beginner?",
    "List five interesting facts about {t}.", "Write a product description for something related to {t}.",
    "What questions should I ask an expert on {t}?", "Compare {t} with something similar and explain the differences.",
    "Give me a step-by-step plan to get started with {t}.", "Why do people care about {t}?",
    "Write a tweet announcing an event about {t}.", "Describe a typical day for someone who works with {t}.",
    "What would change in the world without {t}?", "Write a haiku about {t}.",
    "Explain {t} as if I were five years old.", "Give me a quiz with three questions about {t}.",
    "Draft a short speech about {t} for a school assembly.", "What books or resources would you recommend on {t}?",
    "Describe {t} in exactly three sentences.",
]
TOPICS = [
    "gardening on a balcony", "learning a second language", "saving money", "public transport", "the moon",
    "volcanoes", "coffee", "jazz music", "electric cars", "recycling", "the ocean", "honey bees",
    "time management", "photography", "running a marathon", "the Roman empire", "black holes", "origami",
    "board games", "vegetarian cooking", "sleep", "job interviews", "mountains", "rivers", "libraries",
    "birthday parties", "cats", "dogs", "solar panels", "the internet", "smartphones", "yoga", "painting",
    "the piano", "football", "rainforests", "deserts", "earthquakes", "penguins", "chocolate", "tea",
    "kindness", "friendship", "moving to a new city", "starting a small business", "writing a novel",
    "public speaking", "meditation", "camping by a lake", "bicycles", "trains", "airplanes", "the human heart",
    "vaccines history", "dinosaurs", "the alphabet", "mathematics", "prime numbers", "robots", "3D printing",
    "composting", "knitting", "museums", "city parks", "snow", "thunderstorms", "the sun", "Mars",
    "ancient Egypt", "the printing press", "democracy", "a healthy breakfast", "drinking water",
    "team sports", "studying for exams", "remote work", "video games", "the violin", "sharks", "forests",
    "wind energy", "budget travel", "cheese making", "bird watching", "learning to swim", "lighthouses",
    "volunteering", "the periodic table", "magnets", "rainbows", "spiders", "a good night routine",
]
CODE_TASKS = [
    "Write a Python function that does the following: {s}", "In Python, how would I {s_lower}? Show a short example.",
    "Write a small Python program that uses a function to {s_lower}.",
    "Explain, with a code example, how to {s_lower} in Python.",
]
SYSTEMS = ["", "Answer briefly.", "You are a helpful assistant."]


def benchmark_shingles(root: Path | None = None) -> set[tuple[str, ...]]:
    """Every five-word run of the benchmark prompts (lower-cased words)."""
    root = root or Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
    out: set[tuple[str, ...]] = set()
    for path in sorted(root.glob("*.jsonl")) if root.exists() else []:
        for line in path.read_text().splitlines():
            if line.strip():
                out |= _shingles(json.loads(line)["prompt"])
    return out


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + 5]) for i in range(max(0, len(words) - 4))}


def _public_functions():
    """Per module of the standard library's training split (tests and idlelib aside): (its source lines, its
    public function nodes in ast.walk order)."""
    for path in module_files("train"):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        yield text.splitlines(), [node for node in ast.walk(tree)
                                  if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]


@functools.lru_cache(maxsize=4)
def stdlib_summaries(limit: int = 4000) -> tuple[str, ...]:
    """First sentences of public function docstrings of the standard library's training split (parsed once
    per process: seconds of ast work)."""
    out = []
    for _, functions in _public_functions():
        for node in functions:
            doc = ast.get_docstring(node)
            first = doc.strip().split("\n\n")[0].replace("\n", " ") if doc else ""
            if 25 <= len(first) <= 160 and first[0].isupper() and first.endswith("."):
                out.append(first)
        if len(out) >= limit:
            break
    return tuple(out)


@functools.lru_cache(maxsize=4)
def stdlib_functions(limit: int = 1500, min_lines: int = 4, max_lines: int = 18) -> tuple[str, ...]:
    """Short public top-level or method functions of the standard library's training split, as source
    (parsed once per process)."""
    out = []
    for lines, functions in _public_functions():
        for node in functions:
            if not node.end_lineno:
                continue
            body = lines[node.lineno - 1:node.end_lineno]
            if min_lines <= len(body) <= max_lines and max(len(l) for l in body) <= 100:
                indent = len(body[0]) - len(body[0].lstrip())
                out.append("\n".join(l[indent:] for l in body))
        if len(out) >= limit:
            break
    return tuple(out)


def build(n: int, seed: int = 0) -> list[dict]:
    """n prompts, as {"system": str, "user": str, "kind": "chat"|"code"}, deterministic for a seed.

    Five families, drawn at random in turn: everyday requests in many forms (prompt_words.py, ~15 %),
    task x topic requests (~25 %), wider everyday requests (chat_words.py, ~35 %), code writing from a
    standard-library summary (~12.5 %) and editing a short standard-library function (~12.5 %). The
    pools are finite: a used-up family stops being drawn, so past the three chat families' ~5,600
    prompts (used up near prompt 7,500 for seed 0) the set grows with coding requests only."""
    rng = random.Random(seed)
    bench = benchmark_shingles()
    chat = [t.format(t=topic) for t in TASKS for topic in TOPICS]
    everyday = everyday_requests()
    wider = wider_requests()
    write = []
    for s in stdlib_summaries():
        lower = s[0].lower() + s[1:-1]
        write += [t.format(s=s, s_lower=lower) for t in CODE_TASKS]
    edit = [f"{rng.choice(CODE_EDITS)}\n\n```python\n{src}\n```" for src in stdlib_functions()]
    pools = {"everyday": everyday, "chat": chat, "wider": wider, "write": write, "edit": edit}
    for pool in pools.values():
        rng.shuffle(pool)
    weights = {"everyday": 0.15, "chat": 0.25, "wider": 0.35, "write": 0.125, "edit": 0.125}
    taken = dict.fromkeys(pools, 0)
    out, seen = [], set()
    while len(out) < n:
        left = [k for k in pools if taken[k] < len(pools[k])]
        if not left:
            break
        kind = rng.choices(left, [weights[k] for k in left])[0]
        text = pools[kind][taken[kind]]
        taken[kind] += 1
        if text in seen or _shingles(text) & bench:
            continue
        seen.add(text)
        out.append({"system": rng.choice(SYSTEMS), "user": text, "kind": "code" if kind in ("write", "edit") else "chat"})
    return out


def is_heldout(prompt: dict) -> bool:
    """About 4 % of prompts are held out of training: acceptance is measured on their answers."""
    return hashlib.sha256(prompt["user"].encode()).digest()[0] < 10
