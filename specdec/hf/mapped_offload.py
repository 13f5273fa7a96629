"""Disk-offloaded weights read in place: each offloaded file mapped into memory once, for a generation's
every forward, instead of copied out of a fresh map for each one.

Why: accelerate's disk offload (`device_map` with "disk", `disk_offload`, `dispatch_model(offload_dir=)`)
loads an offloaded module's weights in its hook before every forward: `np.memmap` of the weight's file,
then `torch.tensor` of it, a copy (and the page-table setup of a new mapping) of every byte, and for
weights it offloads by reference to a safetensors checkpoint, `safe_open(...).get_tensor`, a copy too.
On a 2-core Xeon that is about 1.4 s a forward for half of Qwen2.5-Coder-1.5B's float32 layers
(2.6 GB; benchmarks/results/offload_qwen2.5-coder.md), several times the forward's own arithmetic: a
decode pays it per token, a verification once for k + 1 tokens.

What it does: while a generation runs (`mapped_offload(model)`, entered by the engine), every accelerate
hook that loads from disk gets a `MappedWeights` in place of its weights map: the same keys, each weight a
tensor over a copy-on-write memory map of its file (`torch.from_file(shared=False)`), made on first use and
kept for the process. The bytes are the file's: logits are bit for bit what accelerate's loading gives.
The operating system keeps recently read pages in its page cache as it does for accelerate's reads; under
memory pressure it drops clean pages and reads them again from disk, so mapping holds no memory that
accelerate's loading would not (nothing is pinned). On exit the hooks get their own maps back: HF's own
`generate()` on the same model is untouched. Weights held in memory (CPU offload), a weight whose dtype
accelerate converts on loading, and a checkpoint tensor not aligned for its dtype stay on accelerate's
loader. `SPECDEC_MAPPED_OFFLOAD=0` turns it off.
"""
from __future__ import annotations

import contextlib
import json
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
    return torch.from_file(path, shared=False, size=numel, dtype=dtype)


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
            checkpoint = _checkpoints_of(loader).get(info["safetensors_file"])
            if checkpoint is None:
                checkpoint = _checkpoints_of(loader)[info["safetensors_file"]] = _Checkpoint(info["safetensors_file"])
            return checkpoint.tensor(info.get("weight_name", key))
        dtype = getattr(torch, info["dtype"], None)
        if not isinstance(dtype, torch.dtype) or loader.save_folder is None:
            return None
        shape = tuple(info["shape"]) or (1,)  # accelerate saves a 0-dim tensor as 1-dim
        numel = 1
        for s in shape:
            numel *= s
        t = _mapped_file(os.path.join(loader.save_folder, f"{key}.dat"), dtype, numel).view(shape)
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
_active: dict[int, list] = {}  # id(model) -> [generations inside mapped_offload now, the hooks it swapped]


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
                found.append(hook)
    return found


def is_mapped(model) -> bool:
    """Is `model` inside mapped_offload now with at least one hook mapped?"""
    entry = _active.get(id(model))
    return entry is not None and any(isinstance(h.weights_map, MappedWeights) for h in entry[1])


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
            entry = _active[id(model)] = [0, _disk_hooks(model)]
            for hook in entry[1]:
                hook.weights_map = _mapped_for(hook)
        entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _active[id(model)]
                for hook in entry[1]:
                    if isinstance(hook.weights_map, MappedWeights):
                        hook.weights_map = hook.weights_map.inner


def _mapped_for(hook) -> MappedWeights:
    """The hook's MappedWeights, made once (again if the hook got another weights map since)."""
    mapped = _by_identity(_mapped_maps, hook, lambda: MappedWeights(hook.weights_map))
    if mapped.inner is not hook.weights_map:
        mapped = MappedWeights(hook.weights_map)
        _mapped_maps[id(hook)] = (weakref.ref(hook, lambda _, k=id(hook): _mapped_maps.pop(k, None)), mapped)
    return mapped
