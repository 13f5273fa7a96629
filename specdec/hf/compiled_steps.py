"""The compiled step's state per model (hf/compiled.py runs it): which token-count buckets exist, each model's
compiled graphs and which of its buckets are checked or fell back (CompiledSteps, shared by every runner of
the model), the process-wide lock buckets compile under, the exit hook that stops a background compile, and
the check a bucket's first forward makes against the lean loop (agree).

Shapes: ref, got: logits [r, V] float32.
"""
from __future__ import annotations

import atexit
import threading
import warnings
import weakref

import torch
import torch.nn as nn

from .compiled_graphs import make_graphs

BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket_for(n: int) -> int | None:
    """The smallest bucket holding n tokens, or None (the lean loop runs it)."""
    return next((b for b in BUCKETS if b >= n), None)


class CompiledSteps:
    """One model's compiled step on one (dtype, device): its own three compiled functions (make_graphs),
    which buckets are compiled and checked, which fell back and why, and the seconds spent compiling.
    Shared by every runner of the model (a runner lives one generation); buckets compile under one
    process-wide lock (threads may generate at once)."""

    def __init__(self, model):
        self.model_ref = weakref.ref(model)
        self.checked: set[int] = set()
        self.failed: dict[int, str] = {}
        self.compile_s = 0.0
        self._warned = False
        self._graphs: dict | None = None
        self.background: threading.Thread | None = None  # compiling buckets now (CompiledRunner.prepare)

    def compiling_elsewhere(self) -> bool:
        """A background thread is compiling this model's buckets, and the caller is not that thread."""
        t = self.background
        return t is not None and t.is_alive() and t is not threading.current_thread()

    @property
    def graphs(self) -> dict:
        if self._graphs is None:
            with _compiling:
                if self._graphs is None:
                    self._graphs = make_graphs(len(_made))
                    _made.append(weakref.ref(self))
        return self._graphs

    def fail(self, bucket: int, reason: str) -> None:
        self.failed[bucket] = reason
        if not self._warned and not _exiting.is_set():
            self._warned = True
            warnings.warn(f"specdec: the compiled step fell back to the lean loop for {bucket}-token forwards: "
                          f"{reason}", RuntimeWarning, stacklevel=3)


_steps: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
_made: list = []  # every CompiledSteps that made graphs (their count numbers the next one's code objects)
_compiling = threading.RLock()  # held while a bucket compiles and checks, and while graphs are made
_exiting = threading.Event()  # set at exit: a background compile stops before its next bucket


def _stop_background_compiles() -> None:
    """A process exiting while its step compiles in the background (a chat quit at once): the compile thread
    (not a daemon: the interpreter must not be torn down under inductor, which aborts) finishes its current
    bucket and stops, and the interpreter joins it. Called by threading's shutdown before it joins threads,
    ahead of atexit handlers, inductor's own included, so that bucket still compiles normally."""
    _exiting.set()


# threading's hook (the one concurrent.futures uses) runs before the non-daemon threads are joined
getattr(threading, "_register_atexit", atexit.register)(_stop_background_compiles)


def steps_for(model) -> CompiledSteps:
    p = next(model.parameters())
    per_model = _steps.setdefault(model, {})
    key = (p.dtype, p.device)
    if key not in per_model:
        per_model[key] = CompiledSteps(model)
    return per_model[key]


def compiling(model) -> bool:
    """Is a background thread compiling `model`'s step now (CompiledRunner.prepare(background=True))?"""
    return any(steps.compiling_elsewhere() for steps in _steps.get(model, {}).values())


def tolerance(dtype: torch.dtype) -> float:
    """Largest |compiled - lean| logit difference accepted by a bucket's check, relative to max |logit|."""
    return 1e-4 if dtype == torch.float32 else 5e-2


def agree(ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None if logits got [r, V] match ref [r, V] (same argmax per row, within tolerance), else why not.
    A row whose top two reference logits are closer than the difference seen is a numerical tie: its argmax
    may legitimately go either way, so it is not held against the step."""
    diff = (ref - got).abs().max().item()
    scale = ref.abs().max().clamp_min(1).item()
    if diff > tolerance(dtype) * scale:
        return f"logits differ by {diff:.3g} (tolerance {tolerance(dtype) * scale:.3g})"
    top2 = ref.topk(2, dim=-1).values
    tie = (top2[:, 0] - top2[:, 1]) <= 2 * diff
    if not torch.equal(ref.argmax(-1)[~tie], got.argmax(-1)[~tie]):
        return "a different argmax from the lean loop's"
    return None
