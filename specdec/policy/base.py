"""The policy protocol: every hook the engine calls on a draft-length policy, and a base that gives the
optional ones their neutral behaviour (a custom policy subclasses PolicyBase and overrides what it plans)."""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from .costs import CostModel
from .tracker import AcceptanceTracker


@runtime_checkable
class DraftPolicy(Protocol):
    """What the engine asks, per generation and per step.

    max_length:      the largest budget next_length() returns (the engine sizes buffers by it); None: no
                     bound (HF's heuristic), the engine then never drafts past the tokens left
    tracker:         the AcceptanceTracker fed by observe() (stats read alpha and tau from it)
    begin_sequence(): a generation starts (after the prefill)
    next_length():   draft budget k for the next step; 0 = plain decoding. The engine may lower it
                     (remaining tokens, free pages) and then reports the k it actually drafted.
    tree_budget(max_nodes): with a dynamic tree, the nodes to verify next step (0: a plain step), at most
                     max_nodes
    should_continue(position, draft_prob): called after drafting token `position` (1-based) with the
                     draft's probability of that token; False stops drafting this step.
    observe(k, n, draft_s, verify_s, beta=None): after every step, plain ones included (k = 0): k drafted,
                     n accepted, seconds spent drafting and in the target forward over k + 1 tokens,
                     beta = optional per-position acceptance probabilities sum_x min(p_j, q_j) (sampling).
    observe_tree(accepted_by_rank, draft_s): after a tree step whose drafter scored its nodes: for the
                     nodes in order of decreasing score, whether each is on the accepted path.
    """

    max_length: int | None
    tracker: AcceptanceTracker

    def begin_sequence(self) -> None: ...

    def next_length(self) -> int: ...

    def tree_budget(self, max_nodes: int) -> int: ...

    def should_continue(self, position: int, draft_prob: float) -> bool: ...

    def observe(self, k: int, n: int, draft_s: float, verify_s: float, beta=None) -> None: ...

    def observe_tree(self, accepted_by_rank: Sequence[bool], draft_s: float) -> None: ...


@runtime_checkable
class SourcePolicy(DraftPolicy, Protocol):
    """A policy that plans each source of a switching drafter (drafters/base.py SwitchingDrafter) on its
    own: for_source(name) is the DraftPolicy the engine asks and tells about the steps that source
    proposes (policy/adaptive.py). A policy without it plans every step alike (a constant k)."""

    def for_source(self, source: str) -> DraftPolicy: ...


class PolicyBase:
    """Shared bookkeeping and the neutral hooks: a tracker and a cost model (so stats can report alpha and
    c), no early stop, a dynamic tree's whole budget, nothing to do when a sequence begins. Subclasses
    implement next_length()."""

    def __init__(self, max_length: int | None, tracker: AcceptanceTracker | None, costs: CostModel | None):
        self.max_length = max_length
        self.tracker = tracker if tracker is not None else AcceptanceTracker()
        self.costs = costs if costs is not None else CostModel()

    def begin_sequence(self) -> None:
        pass

    def next_length(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement next_length()")

    def tree_budget(self, max_nodes: int) -> int:
        return max_nodes

    def should_continue(self, position: int, draft_prob: float) -> bool:
        return True

    def observe(self, k: int, n: int, draft_s: float, verify_s: float, beta=None) -> None:
        self.tracker.observe(k, n, beta)
        self.costs.observe_draft(k, draft_s)
        self.costs.observe_verify(k + 1, verify_s)

    def observe_tree(self, accepted_by_rank: Sequence[bool], draft_s: float) -> None:
        self.tracker.observe_ranks(accepted_by_rank)
