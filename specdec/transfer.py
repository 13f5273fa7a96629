"""Host-to-device copies that do not synchronise.

The engine's step plans on the host (positions, masks, slots, committed tokens) and sends the plan to the
device every step. A copy from pageable host memory to a GPU waits for the device's queue to drain, a
synchronisation as costly as a read; a copy from pinned memory with non_blocking=True is queued behind
the work already there. On the CPU both are plain tensors.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor of `dtype` on `device`, without blocking on a GPU."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device is None or torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
