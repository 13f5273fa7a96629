"""Atomic file writes: a crash leaves the old file or the new one, never half of one.

Reports, cards and checkpoints are written to a temporary name in the same folder, then renamed
(os.replace is atomic on one file system)."""
from __future__ import annotations

import os
from pathlib import Path


def write_text(path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_figure(fig, path, **kw) -> None:
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **kw)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
