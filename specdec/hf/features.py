"""The target's features for feature-head drafters: which layers, how they are captured, where they are kept.

A feature layer l counts from 1 to L: layer l < L is the residual stream leaving the l-th decoder layer,
and L is the *top feature*: the final norm's output, what the LM head reads.
The target's runners capture the requested layers inside the forward they run anyway (the lean loop
keeps them as it goes; the HF path uses `FeatureCapture` hooks), so a drafter gets the verified
positions' features with no second target forward and no copy of every layer's hidden states.

`FeatureLog` keeps them by sequence position: [positions, F] with F = H x number of layers; the engine
writes the prefill's rows and, after each verification, the rows of the accepted path.
"""
from __future__ import annotations

import torch


def feature_modules(model, layers: tuple[int, ...]) -> list:
    """The modules whose outputs are the features of `layers` (decoder layer l - 1, or the final norm)."""
    from .layer_views import decoder_of

    decoder = decoder_of(model)
    n = len(decoder.layers)
    if not layers or any(not 1 <= l <= n for l in layers):
        raise ValueError(f"feature layers must be in [1, {n}] for this {n}-layer target, got {tuple(layers)}")
    return [decoder.norm if l == n else decoder.layers[l - 1] for l in layers]


class FeatureCapture:
    """Forward hooks that keep the features of `layers` while inside `with`; features() -> [B, T, F]."""

    def __init__(self, model, layers: tuple[int, ...]):
        self.modules = feature_modules(model, layers)
        self.captured: dict[int, torch.Tensor] = {}
        self._hooks = []

    def __enter__(self) -> "FeatureCapture":
        self.captured.clear()
        for i, m in enumerate(self.modules):
            self._hooks.append(m.register_forward_hook(self._keep(i)))
        return self

    def _keep(self, i: int):
        def hook(module, args, output):
            self.captured[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def features(self) -> torch.Tensor:
        if len(self.captured) != len(self.modules):
            raise RuntimeError(f"features captured from {len(self.captured)} of {len(self.modules)} layers: the "
                               "target's forward did not run its decoder layers and final norm as modules")
        return torch.cat([self.captured[i] for i in range(len(self.modules))], dim=-1)


class FeatureLog:
    """Features by sequence position: rows(a, b) -> [b - a, F]; grows on demand."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.valid = 0  # positions [0, valid) hold features

    def write(self, start: int, rows: torch.Tensor) -> None:
        """rows [n, F] are the features of positions start .. start + n - 1; later positions are dropped."""
        if start > self.valid:
            raise ValueError(f"feature rows must follow the kept ones: writing at {start}, {self.valid} kept")
        end = start + rows.shape[0]
        if self.data is None or self.data.shape[0] < end or self.data.shape[1] != rows.shape[1]:
            size = max(end, 2 * (self.data.shape[0] if self.data is not None else 256))
            grown = rows.new_empty(size, rows.shape[1])
            if self.data is not None and self.data.shape[1] == rows.shape[1]:
                grown[:self.valid] = self.data[:self.valid]
            self.data = grown
        self.data[start:end] = rows
        self.valid = end

    def rows(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.valid:
            raise ValueError(f"features of positions [{start}, {end}) requested, [0, {self.valid}) kept")
        return self.data[start:end]

    def rollback(self, length: int) -> None:
        self.valid = min(self.valid, length)
