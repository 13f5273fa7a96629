"""Targets loaded with accelerate device maps: reading weights that live off the model, and refusing a map
the engine cannot run.

A model dispatched by accelerate (`device_map="auto"`, `dispatch_model`, `disk_offload`) keeps offloaded
layers' parameters on the meta device; an `AlignDevicesHook` on each such module loads them from its
`weights_map` (CPU memory or a folder on disk) for the module's forward and drops them after. The target's
forwards go through those hooks (HF's modules run them); a feature head also reads two of the target's
tensors directly (its LM-head rows, and every tensor for the fingerprint): `tensor_data` fetches one from
its hook once.
"""
from __future__ import annotations

import torch


def _align_hooks(module):
    """The accelerate AlignDevicesHook(s) on a module (one, or inside a SequentialHook)."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hook = module.__dict__.get("_hf_hook")
    if isinstance(hook, SequentialHook):
        return [h for h in hook.hooks if isinstance(h, AlignDevicesHook)]
    return [hook] if isinstance(hook, AlignDevicesHook) else []


def tensor_data(model, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The data of model's parameter or buffer `name` (`tensor` as the model holds it): itself, or for one
    accelerate offloaded to CPU memory or disk (held on the meta device), read from its module's hook."""
    if tensor.device.type != "meta":
        return tensor
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    for hook in _align_hooks(module):
        if hook.weights_map is not None and attr in hook.weights_map:
            return hook.weights_map[attr]
    raise ValueError(f"{type(model).__name__}.{name} is on the meta device and no accelerate hook holds its data: "
                     "load the model's weights (or dispatch it with accelerate) before using it")


def module_weight(model, module: torch.nn.Module) -> torch.Tensor:
    """module.weight's data for a module of `model` (see tensor_data)."""
    for name, m in model.named_modules():
        if m is module:
            return tensor_data(model, f"{name}.weight" if name else "weight", module.weight)
    raise ValueError(f"{type(module).__name__} is not a module of {type(model).__name__}")


ENGINE_DEVICES = ("cpu", "cuda", "disk", "meta")


def check_device_map(model) -> None:
    """Refuse, before any forward, a device map placing part of the model where the engine cannot run it."""
    placed = getattr(model, "hf_device_map", None) or {}
    for module, where in placed.items():
        kind = "cuda" if isinstance(where, int) else str(where).split(":")[0]
        if kind not in ENGINE_DEVICES:
            raise ValueError(f"the device map places {module!r} on {where!r}; specdec runs targets on the CPU "
                             f"and CUDA devices (with CPU and disk offload), not {kind!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"the device map places {module!r} on {where!r} but no CUDA device is available")
