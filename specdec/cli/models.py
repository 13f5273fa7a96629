"""Resolving the command line's model and drafter names (zoo, real, heads, directories, hub ids)."""
from __future__ import annotations

from pathlib import Path


def _load(spec: str, role: str, dtype: str = "float32"):
    """A model from a zoo name ('target', 'draft-wide'), a local directory or a hub id.

    dtype 'int8' / 'int4' (drafts only): int8 / int4 weight-only linears computing in bfloat16
    (specdec.quantize).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import zoo

    if dtype in ("int8", "int4"):
        from ..quantize import int4_draft, int8_draft

        model, tok = _load(spec, role, "float32")
        return (int8_draft if dtype == "int8" else int4_draft)(model), tok
    dtype = getattr(torch, dtype)
    if spec in zoo.names():
        return zoo.load(spec, dtype=dtype)
    if not Path(spec).exists() and ("/" not in spec or spec.startswith((".", "/"))):
        raise SystemExit(f"specdec: {role} {spec!r} is neither a model name ({', '.join(zoo.names())}) "
                         "nor an existing directory; pass a zoo name, a local model directory or a hub id")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, use_safetensors=True)
        tok = AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 (a broken or partial model folder, a bad hub id: whatever it raises)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"specdec: the {role} {spec!r} does not load ({type(e).__name__}: {first})") from None
    return model.eval(), tok


def _sampling_kwargs(a) -> dict:
    if not a.do_sample:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}


def _tree_spec(a):
    """--tree NODES DEPTH TOPK as a dynamic TreeSpec (None without it); a bad shape fails here, before any
    model loads."""
    from ..tree import TreeSpec

    return TreeSpec.dynamic(*a.tree) if a.tree else None


def _default_drafter(target: str, command: str = "demo") -> str:
    """'auto': the zoo target drafts with draft-wide; a real model with a shipped head (SmolLM2) with prompt
    lookup in front of the head in demo, chat and serve (measured: the highest tau and the lowest time per token
    of its drafters, greedy and at T=0.7; README "On real models"), with n-gram in bench (whose --drafter
    HF runs too; the head modes come from --head); any other real model with n-gram."""
    from .. import zoo

    if target == "target":
        return "draft-wide"
    head = zoo.head_for(target)
    return "ngram+" + head if head and command in ("demo", "chat", "serve") else "ngram"


def _drafter_arg(spec: str, tok, dtype: str = "float32", target=None):
    """'ngram', 'early-exit:LAYER' (the target's first LAYER layers; needs target), a feature head (a
    shipped head's name or 'head:DIR'; needs target) or a draft model; one with another tokenizer drafts
    across tokenizers (CrossTokenizerDrafter, mode 'auto'). 'ngram+SPEC': prompt lookup where the context
    repeats, SPEC's drafter elsewhere (drafters.LookupFirst)."""
    from .. import zoo

    if spec == "ngram":
        return "ngram"
    if spec.startswith("ngram+"):
        from ..drafters import LookupFirst

        inner = _drafter_arg(spec[len("ngram+"):], tok, dtype, target)
        if inner == "ngram" or isinstance(inner, LookupFirst):
            raise SystemExit(f"specdec: drafter {spec!r}: after 'ngram+' name a model, a head or early-exit:LAYER")
        return LookupFirst(inner)  # a draft model is drafted with a ModelDrafter
    if spec in zoo.heads() or spec.startswith("head:"):
        from ..drafters import FeatureHead

        return FeatureHead.from_pretrained(zoo.path(spec) if spec in zoo.heads() else spec[5:], target)
    if spec.startswith("early-exit:"):
        from ..drafters import EarlyExit

        return EarlyExit(target, exit_layer=int(spec.split(":", 1)[1]))
    drafter, dtok = _load(spec, "drafter", dtype)
    if dtok.get_vocab() != tok.get_vocab():
        from ..drafters import CrossTokenizerDrafter

        return CrossTokenizerDrafter(drafter, dtok, tok)
    return drafter
