"""Shipped drafts that borrow their embedding and LM head from their target (training/draft_trainer.py).

A plain draft for SmolLM2-135M-Instruct shares its tokenizer and its 49152 x 576 embedding (28 M of the
target's 135 M weights); shipping that table again would cost 57 MB. A derived draft ships only its own
layers (`draft.safetensors`, fp16) and `draft_config.json`, which names the target it shares with and
that target's weight fingerprint. On first use it is materialised next to the real models, in
SPECDEC_HOME/models/<name>: a complete HF folder (float32 safetensors, the target's tokenizer and
generation config) that `AutoModelForCausalLM.from_pretrained` and HF's assisted generation load as any
model. Written into a temporary folder and renamed; a target whose weights differ from the ones the draft
was trained with is refused.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..files import sha256_file
from . import real

CONFIG = "draft_config.json"
MARKER = "specdec-derived.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def is_materialised(name: str, src: Path) -> bool:
    """A complete copy of the shipped draft `src` is in SPECDEC_HOME (a copy of an older draft is not)."""
    return _holds(real.model_dir(name), _sha256(src))


def _holds(folder: Path, draft_sha256: str) -> bool:
    """`folder` is a complete materialised copy of the shipped layers with that sha256."""
    marker = folder / MARKER
    return marker.exists() and json.loads(marker.read_text()).get("draft_sha256") == draft_sha256


def _sha256(src: Path) -> str:
    return sha256_file(Path(src) / "draft.safetensors")


def shared_with(src: Path) -> str:
    """The name of the model whose embedding a derived draft's folder borrows."""
    return json.loads((Path(src) / CONFIG).read_text())["specdec"]["embeddings_from"]


SHARED = ("model.embed_tokens.weight", "lm_head.weight")  # the target's tensors: never in draft.safetensors


def load_layers(model, src: Path) -> None:
    """Load a derived draft's own weights (src/draft.safetensors, all but SHARED) into `model`, float32;
    refuses a file that does not fit the model (a weight it lacks, or one it has no place for)."""
    from safetensors.torch import load_file

    own = {k: v.float() for k, v in load_file(str(Path(src) / "draft.safetensors")).items()}
    missing, unexpected = model.load_state_dict(own, strict=False)
    missing = set(missing) - set(SHARED)
    if missing or unexpected:
        raise ValueError(f"{src}/draft.safetensors does not fit its config: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")


def materialise(src: Path, target_dir: Path, out: Path) -> Path:
    """A derived draft's shipped folder `src` + its target's HF folder -> a complete HF folder at `out`
    (which must not exist; written beside it and renamed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..drafters.head_model import fingerprint

    src, out = Path(src), Path(out)
    sha = _sha256(src)
    cfg = json.loads((src / CONFIG).read_text())
    info = cfg.pop("specdec")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, use_safetensors=True)
    if fingerprint(target) != info["target_fingerprint"]:
        raise ValueError(f"the draft in {src} was trained for a target with weight fingerprint "
                         f"{info['target_fingerprint']}; {target_dir} has {fingerprint(target)}: another model")
    config = AutoConfig.for_model(**cfg)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_layers(draft, src)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        if not config.tie_word_embeddings:
            draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    draft.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-{os.getpid()}-", dir=out.parent))
    try:
        draft.save_pretrained(work / "model", safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (Path(target_dir) / name).exists():
                shutil.copy(Path(target_dir) / name, work / "model" / name)
        (work / "model" / MARKER).write_text(json.dumps({"source": str(src), "target": str(target_dir),
                                                         "draft_sha256": sha, **info}, indent=1))
        return real.move_into_place(work / "model", out, lambda: _holds(out, sha))
    finally:
        shutil.rmtree(work, ignore_errors=True)
