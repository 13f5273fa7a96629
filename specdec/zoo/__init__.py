"""The model zoo: a target and several drafts trained offline on the Python standard library.

    >>> import specdec
    >>> specdec.zoo.names()           # ['target', 'draft-small', 'draft-tiny', 'draft-wide']
    >>> model, tok = specdec.zoo.load("target")

Models are ordinary HF checkpoints (safetensors) under specdec/zoo/models/<name>/, so
`AutoModelForCausalLM.from_pretrained(specdec.zoo.path(name))` works too. How they were trained:
specdec/zoo/train.py (`specdec zoo train`); what they measure: each model's README.md (model card).
"""
from __future__ import annotations

import json
from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"
PROMPTS = Path(__file__).parent / "prompts.jsonl"


def names() -> list[str]:
    """Shipped models: 'target' first, then the drafts (names start with 'draft')."""
    found = sorted(p.name for p in MODELS_DIR.glob("*") if (p / "config.json").exists()) if MODELS_DIR.exists() else []
    return sorted(found, key=lambda n: (n != "target", n))


def path(name: str) -> Path:
    p = MODELS_DIR / name
    if not (p / "config.json").exists():
        have = names()
        raise ValueError(f"no zoo model named {name!r}; the zoo has {have}" if have else
                         "the model zoo is empty: train it with `specdec zoo train` (see specdec/zoo/train.py)")
    return p


def load(name: str, dtype=None, device: str = "cpu"):
    """(model, tokenizer) for a zoo model, in float32 on CPU by default (weights are stored fp16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = path(name)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype or torch.float32, use_safetensors=True)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(p)


def prompts(n: int | None = None) -> list[str]:
    """Held-out prompts (function openings from modules the zoo never trained on)."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[:n]]


def card(name: str) -> dict:
    """The measured facts of a model's card (card.json), {} if not measured yet."""
    p = path(name) / "card.json"
    return json.loads(p.read_text()) if p.exists() else {}
