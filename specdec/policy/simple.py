"""The fixed and Hugging Face-style policies: a constant k, and HF's +2 / -1 heuristic."""
from __future__ import annotations

import numbers

from .base import PolicyBase
from .costs import CostModel
from .tracker import AcceptanceTracker

class ConstantPolicy(PolicyBase):
    """Always draft k tokens (k = 0: plain decoding)."""

    def __init__(self, k: int, tracker: AcceptanceTracker | None = None, costs: CostModel | None = None):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"draft_length must be an int >= 0, got {k!r}")
        super().__init__(int(k), tracker, costs)
        self.k = int(k)

    def next_length(self) -> int:
        return self.k

    def tree_budget(self, max_nodes: int) -> int:
        """A dynamic tree's node count: k, at most the spec's."""
        return min(self.k, max_nodes)

    def __repr__(self) -> str:
        return f"ConstantPolicy(k={self.k})"


class HeuristicPolicy(PolicyBase):
    """Hugging Face's `num_assistant_tokens_schedule="heuristic"` (candidate_generator.py):

        if every drafted token was accepted: budget += 2     else: budget = max(1, budget - 1)

    "Every drafted token" compares with the k actually drafted this step, as HF does (it compares with
    the number of candidates). HF has no upper bound; here `max_length` (None: none) clamps the budget
    itself, so a drop in acceptance is felt at once instead of after the surplus is worked off. Steps that
    drafted nothing (k = 0) leave the budget alone.
    """

    def __init__(
        self,
        initial: int = 4,
        max_length: int | None = None,
        tracker: AcceptanceTracker | None = None,
        costs: CostModel | None = None,
    ):
        if initial < 1:
            raise ValueError(f"initial must be >= 1, got {initial}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
        super().__init__(max_length, tracker, costs)
        self.budget = int(initial) if max_length is None else min(int(initial), max_length)

    def next_length(self) -> int:
        return self.budget

    def observe(self, k: int, n: int, draft_s: float, verify_s: float, beta=None) -> None:
        super().observe(k, n, draft_s, verify_s, beta)
        if k == 0:
            return
        self.budget = self.budget + 2 if n == k else max(1, self.budget - 1)
        if self.max_length is not None:
            self.budget = min(self.budget, self.max_length)

    def __repr__(self) -> str:
        return f"HeuristicPolicy(budget={self.budget}, max_length={self.max_length})"
