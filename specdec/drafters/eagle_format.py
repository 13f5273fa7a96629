"""EAGLE-3 checkpoints as the serving engines load them: specdec's eagle3 heads out, published heads in.

A user who outgrows one process serves with vLLM or SGLang; both load EAGLE-3 heads in one layout
(vLLM's model_executor/models/llama_eagle3.py reads it; SpecForge and `speculators` write it):

    config.json        a LlamaConfig of one layer: architectures ["LlamaForCausalLMEagle3"], the head's
                       sizes, vocab_size (the target's), draft_vocab_size N, target_hidden_size, and
                       eagle_config.eagle_aux_hidden_state_layer_ids: the three target layers fused (each
                       the residual stream entering that 0-based layer)
    model.safetensors  fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}
                       .weight [H]; midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj [H, Hq*D];
                       midlayer.mlp.{gate,up,down}_proj.weight; norm.weight [H]; lm_head.weight [N, H];
                       d2t [N] int64 (target id = draft id + d2t[draft id]); t2d [V] bool

specdec's eagle3 head (drafters/head_model.py) computes exactly that network, so the export is a
renaming (and the import its inverse); an "eagle" head (EAGLE-1/2 style: a biased fc, a normalised layer
input, the predicted top feature through the target's LM head) has no such layout in those engines.
Imports accept the layouts published heads use ("model." prefixes, "layers.0." for "midlayer.", shards;
speculators' config with the layer's sizes nested in transformer_layer_config) and
refuse, naming it, a checkpoint for another hidden size or vocabulary, a missing or surplus tensor, a
wrong shape, or an option of vLLM's that the head does not compute (norm_before_fc, fc_norm, ...).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..files import staged_folder
from .head_model import HeadConfig, HeadNet, eagle3_layers, fingerprint

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
# specdec's HeadNet names -> the checkpoint's
_NAMES = {"fuse.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
_NAMES.update({f"layers.0.{n}.weight": f"midlayer.{n}.weight" for n in (
    "input_layernorm", "hidden_norm", "post_attention_layernorm")})
_NAMES.update({f"layers.0.{n}_proj.weight": f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"})
_NAMES.update({f"layers.0.{n}_proj.weight": f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")})
# vLLM options this head does not compute: present and true -> refused
_UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "attention_bias", "mlp_bias")


def export_eagle3(net: HeadNet, target, out, dtype: torch.dtype = torch.float32) -> Path:
    """Write `net` (an eagle3 head for `target`) to the folder `out` (must not exist; written beside it and
    renamed into place). dtype: the tensors' (float32 keeps the head's numbers bit for bit)."""
    c = net.config
    if c.arch != "eagle3":
        raise ValueError(f"only an eagle3 head has the layout vLLM and SGLang load (this one is {c.arch!r}: its "
                         "biased fc, normalised layer input and top-feature output are not EAGLE-1's either); "
                         "train one with `specdec train-head --arch eagle3`")
    text = target.config.get_text_config()
    n_draft = net.vocab_ids.numel()
    config = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": getattr(text, "max_position_embeddings", 4096),
        "vocab_size": c.vocab_size, "draft_vocab_size": n_draft, "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.fused_layers), "use_aux_hidden_state": True},
        "specdec": {"target_architecture": c.target_architecture, "target_fingerprint": c.target_fingerprint,
                    "target_fingerprint_bf16": c.target_fingerprint_bf16, "trained": c.trained},
    }
    state = net.state_dict()
    tensors = {theirs: state[ours].detach().to("cpu", dtype).contiguous() for ours, theirs in _NAMES.items()}
    ids = net.vocab_ids.detach().cpu().long()
    tensors["d2t"] = (ids - torch.arange(n_draft)).contiguous()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    with staged_folder(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
    return Path(out)


def is_eagle3_folder(path) -> bool:
    """A folder holding an EAGLE-3 checkpoint (its config.json names an Eagle3 architecture or an eagle_config)."""
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    d = json.loads(cfg.read_text())
    return any("eagle3" in a.lower() for a in d.get("architectures") or []) or "eagle_config" in d


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file or shards), names normalised to ours."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors weights (specdec reads weights through safetensors only)")
    out = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            out[name] = t
    return out


def load_eagle3(path, target, check_fingerprint: bool = True) -> HeadNet:
    """An eagle3 HeadNet from a published EAGLE-3 checkpoint folder for `target` (module docstring). One
    that specdec exported records its target's fingerprint, checked as for any specdec head."""
    path = Path(path)
    d = json.loads((path / "config.json").read_text())
    if isinstance(d.get("transformer_layer_config"), dict):  # speculators: the layer's sizes nested
        d = {**d["transformer_layer_config"], **{k: v for k, v in d.items() if k != "transformer_layer_config"}}
    text = target.config.get_text_config()
    n = text.num_hidden_layers
    problems = []
    for key, want in (("hidden_size", text.hidden_size), ("target_hidden_size", text.hidden_size),
                      ("vocab_size", text.vocab_size)):
        if key in d and d[key] != want:
            problems.append(f"{key} {d[key]} (target: {want})")
    if d.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers {d['num_hidden_layers']} (specdec's eagle3 head has one midlayer)")
    eagle = d.get("eagle_config") or {}
    flags = {k: eagle.get(k, d.get(k)) for k in _UNSUPPORTED}
    problems += [f"{k}=true (not computed by specdec's eagle3 head)" for k, v in flags.items() if v]
    if eagle.get("use_aux_hidden_state") is False:
        problems.append("use_aux_hidden_state=false (specdec's eagle3 head fuses three target layers)")
    layers = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids")
                   or eagle3_layers(n))
    if len(layers) != 3 or not all(0 < i < n for i in layers):
        problems.append(f"eagle_aux_hidden_state_layer_ids {list(layers)} (three layers in 1..{n - 1})")
    ours = d.get("specdec") or {}
    prints = fingerprint(target), fingerprint(target, torch.bfloat16)  # every weight read (an offloaded: from disk)
    if check_fingerprint and ours.get("target_fingerprint") and ours["target_fingerprint"] != prints[0] \
            and ours.get("target_fingerprint_bf16") != prints[1]:
        problems.append(f"weights fingerprint {ours['target_fingerprint']} (target: {prints[0]}): it "
                        "was exported from a head trained for another target")
    if problems:
        raise ValueError(f"{path} is not an EAGLE-3 head specdec can run for this target: " + "; ".join(problems))
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"{path}: rope type {rope.get('rope_type', rope.get('type'))!r} (specdec's head applies "
                         "default RoPE only)")
    tensors = _checkpoint_tensors(path)
    n_draft = int(d.get("draft_vocab_size") or text.vocab_size)
    own_embed = tensors.pop("embed_tokens.weight", None)
    if own_embed is not None and not torch.allclose(own_embed.float().cpu(),
                                                    target.get_input_embeddings().weight.float().cpu()):
        raise ValueError(f"{path} carries an embedding of its own that differs from the target's (specdec's head "
                         "reads the target's)")
    heads = d["num_attention_heads"]
    config = HeadConfig(
        hidden_size=d["hidden_size"], num_heads=heads, num_kv_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads, intermediate_size=d["intermediate_size"],
        num_target_layers=n, vocab_size=text.vocab_size, feature_layers=layers + (n,),
        draft_vocab=n_draft if n_draft < text.vocab_size else 0, num_layers=1,
        rms_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, target_architecture=type(target).__name__,
        target_fingerprint=prints[0], target_fingerprint_bf16=prints[1],
        trained={"imported_from": str(path)}, arch="eagle3")
    net = HeadNet(config)
    want = {theirs: ours for ours, theirs in _NAMES.items()}
    extra = sorted(set(tensors) - set(want) - {"d2t", "t2d"})
    missing = sorted(set(want) - set(tensors))
    if extra or missing:
        raise ValueError(f"{path}: tensors missing {missing}, not part of an EAGLE-3 head {extra}")
    state = net.state_dict()
    for theirs, ours in want.items():
        t = tensors[theirs]
        if tuple(t.shape) != tuple(state[ours].shape):
            raise ValueError(f"{path}: {theirs} has shape {tuple(t.shape)}, the config says {tuple(state[ours].shape)}")
        state[ours] = t.float()
    if "d2t" in tensors:
        d2t = tensors["d2t"].long()
        if d2t.shape != (n_draft,):
            raise ValueError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({n_draft},)")
        ids = torch.arange(n_draft) + d2t
    elif n_draft == text.vocab_size:
        ids = torch.arange(n_draft)
    else:
        raise ValueError(f"{path}: a draft vocabulary of {n_draft} < {text.vocab_size} needs the d2t map")
    if ids.unique().numel() != n_draft or int(ids.min()) < 0 or int(ids.max()) >= text.vocab_size:
        raise ValueError(f"{path}: d2t maps draft ids outside the target's vocabulary, or two to one token")
    state["vocab_ids"] = ids
    net.load_state_dict(state)
    return net
