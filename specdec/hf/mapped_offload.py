"""Disk-offloaded weights read in place: each offloaded file mapped into memory once, for a generation's
every forward, instead of copied out of a fresh map for each one.

Why: accelerate's disk offload (`device_map` with "disk", `disk_offload`, `dispatch_model(offload_dir=)`)
loads an offloaded module's weights in its hook before every forward: `np.memmap` of the weight's file,
then `torch.tensor` of it, a copy (and the page-table setup of a new mapping) of every byte, and for
weights it offloads by reference to a safetensors checkpoint, `safe_open(...).get_tensor`, a copy too.
For half of Qwen2.5-Coder-1.5B's float32 layers (2.6 GB) on a 2-core Xeon that made a one-token forward
2.6 s against 0.7 s read in place (HF's modules both; benchmarks/results/offload_qwen2.5-coder.md): a
decode pays it per token, a verification once for k + 1 tokens.

What it does: while a generation runs (`mapped_offload(model)`, entered by the engine), every accelerate
hook that loads from disk gets a `MappedWeights` in place of its weights map: the same keys, each weight a
tensor over a copy-on-write memory map of its file (`torch.from_file(shared=False)`), made on first use and
kept for the process. Where every tensor a hook loads is mapped (and its execution device is the CPU),
the module holds those tensors for the generation and its hook stops loading per forward: the model then
reads like one in memory, so the lean loop (hf/lean.py) binds and runs it, while hf/packed.py never copies
a mapped weight into its layout (that would hold in memory what the user put on disk). The bytes are the
file's: logits are what the same step computes over accelerate's loaded copies.
The operating system keeps recently read pages in its page cache as it does for accelerate's reads; under
memory pressure it drops clean pages and reads them again from disk, so mapping holds no memory that
accelerate's loading would not (nothing is pinned). On exit the modules' tensors go back to the meta
device and the hooks get their own maps and loading back: HF's own `generate()` on the same model is
untouched. Weights held in memory (CPU offload), a weight whose dtype accelerate converts on loading, and
a checkpoint tensor not aligned for its dtype stay on accelerate's loader (their modules stay on their
hooks). `SPECDEC_MAPPED_OFFLOAD=0` turns it off.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import threading
import weakref
from collections.abc import Mapping

import torch

from .offload import _align_hooks

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def enabled() -> bool:
    """SPECDEC_MAPPED_OFFLOAD: unset or 1 maps offloaded files, 0 leaves accelerate's loading as it is."""
    value = os.environ.get("SPECDEC_MAPPED_OFFLOAD", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"SPECDEC_MAPPED_OFFLOAD must be 0 or 1, got {value!r}")
    return value != "0"


def _mapped_file(path: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """[numel] of dtype over a private (copy-on-write) map of the file at `path`; nothing is read yet."""
    t = torch.from_file(path, shared=False, size=numel, dtype=dtype)
    _mapped_pointers.add(t.untyped_storage().data_ptr())
    return t


class _Checkpoint:
    """One safetensors file mapped whole as bytes, its header parsed: tensors are views into it."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(header_len))
        self.start = 8 + header_len
        self.bytes = _mapped_file(path, torch.uint8, os.path.getsize(path))

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor `name` as a view of the map, or None where it cannot be one (unknown dtype, misaligned)."""
        info = self.header.get(name)
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"]) if info else None
        if dtype is None:
            return None
        begin, end = (self.start + o for o in info["data_offsets"])
        if begin % dtype.itemsize:
            return None
        return self.bytes[begin:end].view(dtype).view(info["shape"])


class MappedWeights(Mapping):
    """An accelerate weights map (PrefixedDataset over an OffloadedWeightsLoader) whose on-disk entries come
    back as tensors over memory maps, made once; everything else from the map it wraps."""

    def __init__(self, inner: Mapping):
        self.inner = inner
        self.loader, self.prefix = inner.dataset, inner.prefix
        self._tensors: dict[str, torch.Tensor] = {}

    def _mapped(self, key: str) -> torch.Tensor | None:
        loader = self.loader
        if key in loader.state_dict or key not in loader.index:
            return None
        info = loader.index[key]
        if info.get("safetensors_file") is not None:
            if "dtype" in info:  # accelerate converts this one on loading: a copy either way
                return None
            files, path = _checkpoints_of(loader), info["safetensors_file"]
            if path not in files:
                files[path] = _Checkpoint(path)
            return files[path].tensor(info.get("weight_name", key))
        dtype = getattr(torch, info["dtype"], None)
        if not isinstance(dtype, torch.dtype) or loader.save_folder is None:
            return None
        shape = tuple(info["shape"]) or (1,)  # accelerate saves a 0-dim tensor as 1-dim
        t = _mapped_file(os.path.join(loader.save_folder, f"{key}.dat"), dtype, math.prod(shape)).view(shape)
        return t[0] if not info["shape"] else t

    def __getitem__(self, key: str) -> torch.Tensor:
        full = f"{self.prefix}{key}"
        t = self._tensors.get(full)
        if t is None:
            t = self._mapped(full)
            if t is None:
                return self.inner[key]
            self._tensors[full] = t
        return t

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def __contains__(self, key) -> bool:
        return key in self.inner


_lock = threading.Lock()
# id(loader) -> (weakref to it, {file: _Checkpoint}); id(hook) -> (weakref, MappedWeights)
_checkpoints: dict[int, tuple] = {}
_mapped_maps: dict[int, tuple] = {}
# id(model) -> [generations inside mapped_offload now, the (module, hook) pairs it swapped, those it holds]
_active: dict[int, list] = {}
# the data pointers of every map made (a storage at one of them is file-backed: hf/packed.py does not copy it)
_mapped_pointers: set[int] = set()


def is_mapped_tensor(t: torch.Tensor) -> bool:
    """Does t's data live in one of this process's maps of offloaded files (a weight to read in place, not to
    copy into another layout)?"""
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in _mapped_pointers


def _by_identity(table: dict, obj, make):
    """table's entry for obj (keyed by identity, dropped when obj is collected), made by make() if absent."""
    hit = table.get(id(obj))
    if hit is not None and hit[0]() is obj:
        return hit[1]
    value = make()
    key = id(obj)
    table[key] = (weakref.ref(obj, lambda _, k=key: table.pop(k, None)), value)
    return value


def _checkpoints_of(loader) -> dict:
    return _by_identity(_checkpoints, loader, dict)


def _disk_hooks(model) -> list:
    """Every accelerate AlignDevicesHook in model that loads weights through an OffloadedWeightsLoader."""
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset

    found = []
    for module in model.modules():
        for hook in _align_hooks(module):
            wm = hook.weights_map
            if isinstance(wm, PrefixedDataset) and isinstance(wm.dataset, OffloadedWeightsLoader):
                found.append((module, hook))
    return found


def _module_tensors(module, hook) -> dict[str, torch.Tensor]:
    """The tensors the hook loads into its module for every forward (accelerate's own list), by name."""
    from accelerate.utils import named_module_tensors

    return dict(named_module_tensors(module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules,
                                     remove_non_persistent=True))


def _hold(module, hook) -> bool:
    """Put the mapped tensors into the module for the generation and stop its hook loading them per forward:
    the module then reads like one in memory (the lean loop can bind its weights). Only where every tensor
    it loads is mapped, in the dtype the module holds (no copy is made); returns whether it did."""
    from accelerate.utils import set_module_tensor_to_device

    held = _module_tensors(module, hook)
    values = {name: hook.weights_map[name] for name in held}
    if not held or not all(is_mapped_tensor(v) and v.dtype == held[name].dtype for name, v in values.items()):
        return False
    for name, value in values.items():
        set_module_tensor_to_device(module, name, "cpu", value=value)
    hook.offload = False
    return True


def _release(module, hook) -> None:
    """Undo _hold: the module's tensors back on the meta device, its hook loading them again per forward."""
    from accelerate.utils import set_module_tensor_to_device

    for name in _module_tensors(module, hook):
        set_module_tensor_to_device(module, name, "meta")
    hook.offload = True


def is_mapped(model) -> bool:
    """Is `model` inside mapped_offload now with at least one hook mapped (every hook it found is)?"""
    entry = _active.get(id(model))
    return entry is not None and bool(entry[1])


def offload_reading(model) -> str:
    """How `model`'s disk-offloaded weights are read now: 'mapped' (in place, inside mapped_offload), 'copied'
    (accelerate's hooks, a copy per forward), or '' (nothing on disk)."""
    if is_mapped(model):
        return "mapped"
    return "copied" if "disk" in (getattr(model, "hf_device_map", None) or {}).values() else ""


@contextlib.contextmanager
def mapped_offload(model):
    """For the block's duration, `model`'s disk-offloaded weights come from memory maps made once (module
    docstring); a model without disk offload, or SPECDEC_MAPPED_OFFLOAD=0, runs as it is. Nested and
    concurrent uses on one model share the swap: the hooks get their own maps back when the last one exits."""
    if not enabled() or getattr(model, "hf_device_map", None) is None:
        yield
        return
    with _lock:
        entry = _active.get(id(model))
        if entry is None:
            entry = _active[id(model)] = [0, _disk_hooks(model), []]
            for module, hook in entry[1]:
                hook.weights_map = _mapped_for(hook)
                if hook.execution_device is not None and torch.device(hook.execution_device).type == "cpu" \
                        and hook.offload and _hold(module, hook):
                    entry[2].append((module, hook))
        entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _active[id(model)]
                for module, hook in entry[2]:
                    _release(module, hook)
                for _, hook in entry[1]:
                    if isinstance(hook.weights_map, MappedWeights):
                        hook.weights_map = hook.weights_map.inner


def _mapped_for(hook) -> MappedWeights:
    """The hook's MappedWeights, made once (again if the hook got another weights map since)."""
    def make():
        return MappedWeights(hook.weights_map)

    mapped = _by_identity(_mapped_maps, hook, make)
    if mapped.inner is not hook.weights_map:
        del _mapped_maps[id(hook)]
        mapped = _by_identity(_mapped_maps, hook, make)
    return mapped
