"""The one model loader: the shipped zoo and real pretrained models, by name.

    >>> import specdec
    >>> specdec.zoo.names()   # ['target', 'draft-small', 'draft-tiny', 'draft-wide', 'smollm2-135m-instruct', ...]
    >>> model, tok = specdec.zoo.load("target")
    >>> model, tok = specdec.zoo.load("smollm2-135m-instruct")   # materialised from its package on first use

The zoo (a target and drafts trained offline on the Python standard library, specdec/zoo/train.py) ships
as package data under specdec/zoo/models/<name>/: the fast fixture of the unit tests, no ground for speed
claims. Real models (specdec/zoo/real.py) come from GGUF packages and live in SPECDEC_HOME once
materialised. Both are ordinary HF folders: `AutoModelForCausalLM.from_pretrained(specdec.zoo.path(name))`.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import derived as _derived
from . import real

MODELS_DIR = Path(__file__).parent / "models"
PROMPTS = Path(__file__).parent / "prompts.jsonl"


def shipped() -> list[str]:
    """Shipped zoo models: 'target' first, then the drafts (names start with 'draft')."""
    found = sorted(p.name for p in MODELS_DIR.glob("*") if (p / "config.json").exists()) if MODELS_DIR.exists() else []
    return sorted(found, key=lambda n: (n != "target", n))


def heads() -> list[str]:
    """Shipped feature heads (drafters/feature_head.py): folders with a head_config.json, named
    '<target>-head'. Load one with FeatureHead.from_pretrained(zoo.path(name), target)."""
    if not MODELS_DIR.exists():
        return []
    return sorted(p.name for p in MODELS_DIR.glob("*") if (p / "head_config.json").exists())


def head_for(target_name: str) -> str | None:
    """The shipped head trained for the zoo or real model `target_name`, if there is one."""
    name = f"{target_name}-head"
    return name if name in heads() else None


def drafts() -> list[str]:
    """Shipped drafts that borrow their target's embedding (zoo/derived.py): folders with a
    draft_config.json, named '<target>-draft'; materialised into SPECDEC_HOME on first use."""
    if not MODELS_DIR.exists():
        return []
    return sorted(p.name for p in MODELS_DIR.glob("*") if (p / _derived.CONFIG).exists())


def draft_for(target_name: str) -> str | None:
    """The shipped plain draft derived from the zoo or real model `target_name`, if there is one."""
    name = f"{target_name}-draft"
    return name if name in drafts() else None


def names() -> list[str]:
    """Every name the loader serves: the shipped zoo, heads and derived drafts, then the real models."""
    return shipped() + heads() + drafts() + list(real.MODELS)


def status(name: str) -> str:
    """'shipped', 'materialised' (a real model ready to load), 'installed' (its package is, the conversion
    runs on first use) or 'not installed'."""
    if name in shipped() or name in heads():
        return "shipped"
    if name in drafts():
        return "materialised" if _derived.is_materialised(name, MODELS_DIR / name) else "shipped"
    _check_name(name)
    return "materialised" if real.is_materialised(name) else "installed" if real.is_installed(name) else "not installed"


def path(name: str) -> Path:
    """The model's folder; a real model is materialised first if it is not yet."""
    if name in real.MODELS:
        return real.path(name)
    if name in drafts():  # materialised from its shipped layers and its target's embedding on first use
        src = MODELS_DIR / name
        if not _derived.is_materialised(name, src):
            _derived.materialise(src, path(_derived.shared_with(src)), real.model_dir(name))
        return real.model_dir(name)
    _check_name(name)
    return MODELS_DIR / name


def _check_name(name: str) -> None:
    if name not in names():
        raise ValueError(f"no model named {name!r}; the loader serves {names()}")


def load(name: str, dtype=None, device: str = "cpu"):
    """(model, tokenizer), in float32 on CPU by default (zoo weights are stored fp16, real ones float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in heads():
        raise ValueError(f"{name!r} is a feature head, not a model: load it for its target with "
                         f"specdec.drafters.FeatureHead.from_pretrained(specdec.zoo.path({name!r}), target)")
    p = path(name)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype or torch.float32, use_safetensors=True)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(p)


def prompts(n: int | None = None) -> list[str]:
    """Held-out prompts (function openings from modules the zoo never trained on)."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[:n]]


def card(name: str) -> dict:
    """The measured facts of a model's card (card.json), {} if not measured yet."""
    if name not in shipped() and name not in heads():
        return {}
    p = path(name) / "card.json"
    return json.loads(p.read_text()) if p.exists() else {}
