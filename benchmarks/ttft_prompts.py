"""The prompts time-to-first-token benchmarks share (benchmarks/prefill.py, peers/vllm_ttft.py): short and long,
chat and code, none used by a training run. Only json and a tokenizer: it runs in vLLM's venv too.

The first two of chat.jsonl, the first two of code_edit.jsonl, and all of code_edit.jsonl's prompts joined
into one long prompt; each in the tokenizer's chat template as a user turn, or as plain text where it has none.
"""
from __future__ import annotations

import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"


def read(name: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in (PROMPTS / name).read_text().splitlines() if line.strip()]


def render(tok, text: str) -> list[int]:
    """text -> token ids: a user turn in the chat template (generation prompt added), or plain text."""
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])
    return list(tok(text)["input_ids"])


def ttft_prompts(tok) -> list[tuple[str, list[int]]]:
    """(kind, token ids) for each prompt, shortest kinds first."""
    chat, code = read("chat.jsonl"), read("code_edit.jsonl")
    rows = [("chat", render(tok, t)) for t in chat[:2]] + [("code edit", render(tok, t)) for t in code[:2]]
    return rows + [("all code edits", render(tok, "\n\n".join(code)))]
