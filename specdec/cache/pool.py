"""Page allocator: which KV pages are free, and each sequence's block table. CPU ints only.

A page holds `page_size` consecutive token positions of one sequence. The pool hands out page ids; the
page tensors themselves live in `paged.PagedKV`, one per model, all indexed by the SAME page ids, so
the target and its drafter share one block table per sequence: one rollback, one free serves both.
"""
from __future__ import annotations

import torch

from ..transfer import to_device


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share: how much of a kept sequence's KV a new one can reuse."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PoolExhausted(RuntimeError):
    """The KV budget cannot hold the requested tokens."""


class PagePool:
    """A free list of `num_pages` page ids of `page_size` token slots each."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.high_water = 0  # 1 + the highest page id ever handed out: page tensors need this many pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(
                f"KV cache budget exceeded: need {n} more pages of {self.page_size} tokens, {len(self._free)} free "
                f"of {self.num_pages}; raise the KV budget (max_kv_tokens) or lower max_new_tokens")
        pages = [self._free.pop() for _ in range(n)]
        if pages:
            self.high_water = max(self.high_water, max(pages) + 1)
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        if len(self._free) == self.num_pages:  # all back: start again from page 0 (page tensors stay small)
            self._free = list(range(self.num_pages - 1, -1, -1))
            self.high_water = 0


class BlockTable:
    """One sequence's pages. Position p lives in page pages[p // page_size] at offset p % page_size.

    `length` is the number of positions reserved (some may hold KV not yet valid for every model: each
    model's PagedKV tracks how far its own KV is valid).
    """

    def __init__(self, pool: PagePool, device: torch.device | str = "cpu"):
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0
        self.device = torch.device(device)
        self._slots: torch.Tensor | None = None  # [len(pages) * page_size] flat slot of every position

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_size

    def reserve(self, length: int) -> None:
        """Make positions [0, length) addressable, allocating pages as needed."""
        need = -(-length // self.pool.page_size) - len(self.pages)
        if need > 0:
            self.pages.extend(self.pool.allocate(need))
            self._slots = None
        self.length = max(self.length, length)

    def truncate(self, length: int) -> None:
        """Roll back to `length` positions; whole pages past it go back to the pool."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} positions to {length}")
        keep = -(-length // self.pool.page_size)
        if keep < len(self.pages):
            self.pool.free(self.pages[keep:])
            del self.pages[keep:]
            self._slots = None
        self.length = length

    def release(self) -> None:
        """Give every page back (the sequence is over)."""
        self.pool.free(self.pages)
        self.pages = []
        self.length = 0
        self._slots = None

    def _check_reserved(self, end: int) -> None:
        if end > self.capacity:
            raise ValueError(f"positions up to {end} requested, only {self.capacity} reserved")

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Flat slots (page_id * page_size + offset) of positions [start, end): [end - start] int64."""
        self._check_reserved(end)
        if self._slots is None:
            ps = self.pool.page_size
            pages = torch.tensor(self.pages, dtype=torch.long)
            self._slots = to_device((pages[:, None] * ps + torch.arange(ps)).flatten(), torch.long, self.device)
        return self._slots[start:end]

    def span(self, start: int, end: int) -> slice | None:
        """The flat slots of positions [start, end) as one slice where they lie on consecutive pages (a
        single sequence's pages usually do: the pool hands out low ids first), else None. Reading or
        writing the KV through a slice is a view or a plain copy instead of an index_select / index_copy_
        (the same values)."""
        self._check_reserved(end)
        if start >= end:
            return None
        ps, pages = self.pool.page_size, self.pages
        first, last = start // ps, (end - 1) // ps
        if any(pages[i + 1] != pages[i] + 1 for i in range(first, last)):
            return None
        base = pages[first] * ps - first * ps
        return slice(base + start, base + end)

    def block_table_tensor(self) -> torch.Tensor:
        """[num_pages_held] int32 page ids, for kernels."""
        return to_device(self.pages, torch.int32, self.device)
