"""Atomic file writes: a crash leaves the old file or the new one, never half of one; and a file's digest.

Reports, cards, data shards and checkpoints are written to a temporary name in the same folder, then renamed
(os.replace is atomic on one file system); a trained model's folder is filled as a temporary folder and
renamed the same way."""
from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def _replacing(path):
    """Yield a temporary name beside `path` to write; renamed to `path` when the block completes, removed
    whatever happens."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path, text: str) -> None:
    with _replacing(path) as tmp:
        tmp.write_text(text)


def save_tensors(tensors: dict, path, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file (each tensor made contiguous), written atomically like write_text."""
    from safetensors.torch import save_file

    with _replacing(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def save_figure(fig, path, **kw) -> None:
    with _replacing(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", **kw)


def refuse_existing(out) -> None:
    """A trainer's output folder must be new: say so before any work is done."""
    if Path(out).exists():
        raise FileExistsError(f"output folder {out} exists; choose a new --out (nothing was overwritten)")


@contextmanager
def staged_folder(out):
    """Yield a new temporary folder beside `out` (which must not exist); renamed to `out` when the block
    completes, removed when it raises."""
    out = Path(out)
    refuse_existing(out)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path) -> str:
    """The file's SHA-256 (hex), read in 16 MiB blocks: what records a GGUF package, a derived draft or a
    resumed head by."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
