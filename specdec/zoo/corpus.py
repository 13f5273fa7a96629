"""The zoo's training text: the running interpreter's standard library source, split by module.

Every machine with the same Python version has the same corpus, so the zoo is reproducible offline.
Held-out split: a module (a .py file) is held out when the first byte of sha256(its path relative to
the stdlib root) is below HELDOUT_BYTE (about 5 % of modules). Training never sees those files.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

HELDOUT_BYTE = 13  # 13/256 ~ 5 % of modules
EOS = "<|endoftext|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(relpath: str) -> bool:
    return hashlib.sha256(relpath.encode()).digest()[0] < HELDOUT_BYTE


def module_files(split: str) -> list[Path]:
    """Sorted stdlib .py files of one split ("train" or "heldout"); never site-packages."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if is_heldout(rel) == (split == "heldout"):
                out.append(path)
    return out


def read_texts(split: str) -> list[str]:
    texts = []
    for path in module_files(split):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib test files are deliberately not UTF-8
    return texts


def build_prompts(n: int = 32, chars: int = 600) -> list[dict]:
    """Held-out prompts: the opening of a function body from held-out modules, cut at a line end.

    Deterministic: the first `def` (at any indentation) after the module's first 20 % of lines, from
    every held-out module in sorted order, until n prompts. Each prompt ends after the def line and the
    next few lines, so a continuation must write the rest of the function.
    """
    out = []
    for path in module_files("heldout"):
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        start = len(lines) // 5
        for i in range(start, len(lines)):
            if lines[i].lstrip().startswith("def ") and len(lines) > i + 4:
                lo = max(0, i - 8)
                text = "".join(lines[lo:i + 4])
                if len(text) > chars:
                    text = text[-chars:]
                    text = text[text.index("\n") + 1:] if "\n" in text else text
                out.append({"module": path.relative_to(stdlib_root()).as_posix(), "prompt": text})
                break
        if len(out) >= n:
            break
    return out
