"""The drafter protocol: what every drafter (small model, n-gram lookup, early exit) gives the engine.

A drafter proposes a chain or a tree of tokens that continue the committed context; the engine has the
target check them in one forward, then tells the drafter what was accepted so it can roll back state.

Words used throughout: the *context* is every committed token (prompt + generated so far, the last one
being the *root*: committed but not yet run through the target); a *draft* is n proposed tokens with a
parent array (parent -1 = child of the root; a chain has parents [-1, 0, 1, ..., n-2]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from ..transfer import to_device


@dataclass
class HostCopy:
    """A draft as Python lists, as the drafter built it on the host (every built-in drafter does: its
    topology and tokens are decided there). The engine plans the step from these and never reads the
    draft back from the device; a draft without one is read once (check_draft)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float] | None = None


@dataclass
class Draft:
    """n proposed tokens.

    tokens:  [n] int64, in topological order (a parent comes before its children)
    parents: [n] int64, parent node index, -1 for children of the root
    q_probs: [n, V] float32 or None. Row i is the draft distribution that token i was sampled FROM
             (for a tree: the parent's distribution, shared by siblings). None means the drafter is
             deterministic (argmax, lookup): its q is one-hot on the proposed token.
    hidden:  [n + 1, H] or None. Set by a self-speculative drafter that ran the target's own layers
             < from_layer over the root and every node (a chain) and wrote their KV into the target's
             pages: the target's hidden states entering layer from_layer, for [root, node 0, ..., n-1].
             The engine then verifies with layers >= from_layer only.
    scores:  [n] float32 or None. A tree drafter's confidence in each node's whole path (the product of
             the draft probabilities along it); the adaptive policy ranks nodes by it to plan the budget.
    siblings_with_replacement: how a sampled tree's siblings were drawn from their shared q row, which
             decides the verification rule that is exact for them (verifiers/tree.py): False (specdec's
             drafters) each next sibling from q with the earlier siblings removed and renormalised;
             True independent draws (SpecInfer), duplicates allowed. Ignored for chains and for
             deterministic drafts.
    host:    the same tokens, parents and scores as lists (HostCopy) when the drafter has them on the host;
             Draft.from_lists builds both at once. Must agree with the tensors.
    free_from: None, or the index of the first of a chain's tokens that cost the drafter nothing to propose
             (a prompt lookup's continuation of the drafted text: drafters/lookup_first.py). Those may
             run past the step's budget up to DraftContext.room, are deterministic (q_probs None), and
             the policy plans from the tokens before them only.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q_probs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    from_layer: int = 0
    scores: torch.Tensor | None = None
    siblings_with_replacement: bool = False
    host: HostCopy | None = None
    free_from: int | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def chain(tokens: torch.Tensor, q_probs: torch.Tensor | None = None) -> "Draft":
        n = int(tokens.numel())
        return Draft(tokens, torch.arange(-1, n - 1, dtype=torch.long, device=tokens.device), q_probs)

    @staticmethod
    def from_lists(tokens: list[int], parents: list[int] | None, device, q_probs: torch.Tensor | None = None,
                   scores: list[float] | None = None) -> "Draft":
        """A draft built on the host: tokens and parents (None = a chain) as lists, copied to `device`
        (pinned and asynchronous on a GPU) and kept as the HostCopy the engine plans from."""
        parents = list(range(-1, len(tokens) - 1)) if parents is None else list(parents)
        return Draft(to_device(tokens, torch.long, device), to_device(parents, torch.long, device), q_probs,
                     scores=None if scores is None else torch.tensor(scores, dtype=torch.float32),
                     host=HostCopy(list(tokens), parents, None if scores is None else list(scores)))

    @staticmethod
    def empty(device=None) -> "Draft":
        return Draft.from_lists([], [], device)


@dataclass
class DraftSetup:
    """What a drafter is told when a generation starts (Drafter.begin), and nothing more of the engine.

    table:   the sequence's BlockTable on the shared page pool (table.pool): a drafter that keeps KV binds
             its pages to it, so the engine's truncate rolls it back with the target's
    prompt:  [T] int64 or None, the committed context the target has just prefilled (in chat the whole
             conversation so far); None in unit tests that feed the drafter by hand
    reused_tokens: leading positions of the prompt whose KV was kept from the previous call on the same
             table (chat; 0 otherwise): a drafter that kept its own state for this table keeps that many
    target:  the target model
    target_kv: the target's PagedKV, whose page tensors a self-speculative drafter may share
    kernel:  whether attention runs the Triton kernels (a model drafter's runner follows the engine)
    """

    table: object
    prompt: torch.Tensor | None = None
    reused_tokens: int = 0
    target: object = None
    target_kv: object = None
    kernel: bool = False


@dataclass
class DraftContext:
    """What a drafter sees when asked to propose.

    tokens:  [T] int64, the committed context (prompt + generated); tokens[-1] is the root
    sampling: the engine's SamplingParams (do_sample, temperature, top_k, top_p)
    generator: torch.Generator for any randomness (seeded by the user through torch.manual_seed)
    process: (scores [r, V], context [T], paths) -> processed scores [r, V]: the SAME logits processing
             the target's rows get (a model drafter's q must be processed like p)
    should_continue: (position, draft_prob) -> bool, the policy's stop-early rule, or None (draft the budget)
    room: the most tokens a chain may hold this step (>= the budget; 0 or the budget: no more): past its
          budget a draft may only hold free tokens (Draft.free_from)
    """

    tokens: torch.Tensor
    sampling: object
    generator: torch.Generator | None = None
    process: Callable | None = None
    should_continue: Callable[[int, float], bool] | None = None
    room: int = 0


@runtime_checkable
class Drafter(Protocol):
    """Protocol every drafter implements.

    A deterministic proposal (argmax, lookup) is a Draft with q_probs None: the verifier then uses the
    one-hot rule (the Draft says so, step by step; the drafter carries no flag for it).
    begin(setup): called once after the target's prefill with a DraftSetup (the block table, the prompt
        [T] int64, ...); the model drafter binds its page tensors and prefills the prompt here (timed as
        prefill, not drafting)
    propose(ctx, budget): return a Draft of at most `budget` tokens (0 allowed: plain decoding)
    accept(num_context_tokens): the committed context now has this many tokens; drop state past it
    end(): generation over (also on exceptions); release anything held

    A drafter that also proposes trees (for `tree=`) implements TreeDrafter.
    """

    def begin(self, setup: DraftSetup) -> None: ...

    def propose(self, ctx: DraftContext, budget: int) -> Draft: ...

    def accept(self, num_context_tokens: int) -> None: ...

    def end(self) -> None: ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that proposes token trees, for `tree=` (a draft model, early exit, n-gram, feature head).

    propose_tree(ctx, spec, budget): a tree Draft of at most `budget` nodes in the shape of the TreeSpec
        `spec` (the engine prunes nodes deeper than the spec allows)
    """

    def propose_tree(self, ctx: DraftContext, spec, budget: int) -> Draft: ...


@runtime_checkable
class CheckedDrafter(Drafter, Protocol):
    """A drafter that can tell before any generation whether it fits a target (vocabulary, tokenizers):
    check_compatible(target) raises a ValueError naming the mismatch."""

    def check_compatible(self, target) -> None: ...


@runtime_checkable
class ModelBackedDrafter(Drafter, Protocol):
    """A drafter that runs a HF model of its own (`model`), whose attention the engine switches to
    specdec's paged attention for the generation, as it does the target's."""

    model: object


@runtime_checkable
class RowDrafter(Drafter, Protocol):
    """A drafter that can serve the rows of a batch (specdec/batch.py).

    for_row(): a fresh drafter of the same kind for one row, sharing this one's weights, with its own
        per-sequence state (begin/accept/end are called per row); None when this configuration cannot
        (the batch then runs its rows one after another)
    """

    def for_row(self) -> "Drafter | None": ...


@runtime_checkable
class DraftRows(Protocol):
    """Drafting for the rows of a batch together (specdec/batch.py); rows are numbered as the batch's
    requests.

    begin(setups): one DraftSetup per row, after the target's prefill (the drafter's own prefill)
    propose(requests): [(row, DraftContext, budget)] -> one chain Draft per request, in that order
    propose_trees(requests): [(row, DraftContext, TreeSpec, budget)] -> one tree Draft per request (at
        most `budget` nodes in the spec's shape, as TreeDrafter.propose_tree)
    accept(row, num_context_tokens): that row's committed context now has this many tokens
    end(): the batch is over (also on exceptions)
    """

    def begin(self, setups: list) -> None: ...

    def propose(self, requests: list) -> list: ...

    def propose_trees(self, requests: list) -> list: ...

    def accept(self, row: int, num_context_tokens: int) -> None: ...

    def end(self) -> None: ...


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A drafter that drafts every row of a batch in one forward per draft step: for_batch(pool) gives
    its DraftRows over the batch's page pool (None when this configuration cannot)."""

    def for_batch(self, pool) -> "DraftRows | None": ...


@runtime_checkable
class FeatureDrafter(Drafter, Protocol):
    """A drafter that reads the target's own features (a feature head, drafters/feature_head.py).

    feature_layers: which of the target's layers it reads (hf/features.py: 1..L, L = the final norm's
        output); the engine has the target's runner capture exactly those in the forwards it runs anyway
    attach(features): called before begin() with the generation's FeatureLog, which holds the features of
        every position the target has run ([0, the target's KV length)): the prefill's rows, then after
        each verification the accepted path's. The drafter only reads it.
    """

    feature_layers: tuple

    def attach(self, features) -> None: ...


@runtime_checkable
class FeatureRows(DraftRows, Protocol):
    """DraftRows that read the target's features (a feature head's, drafters/head_rows.py): the batch
    captures `feature_layers` in its packed forwards and calls attach(features), one FeatureLog per row,
    before begin()."""

    feature_layers: tuple

    def attach(self, features: list) -> None: ...


@runtime_checkable
class SwitchingDrafter(Drafter, Protocol):
    """A drafter that has several ways to propose and picks one per step (drafters/lookup_first.py: an
    n-gram match where the context repeats, a model elsewhere). Their acceptance and cost differ, so the
    engine plans each source's steps on its own (policy/base.py SourcePolicy).

    source(tokens): the committed context [T] int64 -> the name of the source that will propose from it,
        asked before the step's budget is planned; propose / propose_tree on the same context then use it
    """

    def source(self, tokens: torch.Tensor) -> str: ...


def check_draft(drafter, draft: Draft, budget: int, vocab: int,
                room: int = 0) -> tuple[list[int], list[int], list[float] | None]:
    """The drafter contract: at most `budget` tokens (up to `room` if those past it are free: Draft.free_from),
    ids in [0, vocab), parents in topological order, q rows [n, vocab]. A ValueError names the drafter and
    what it got wrong.

    Returns the draft's tokens, parents and scores (None if it has none) as Python lists, from its
    HostCopy when it has one (no device read: every built-in drafter), else in one transfer from the
    device; the engine works from these lists."""
    name = type(drafter).__name__
    n = len(draft)
    if draft.tokens.dim() != 1 or draft.parents.shape != draft.tokens.shape:
        raise ValueError(f"drafter {name} returned tokens {tuple(draft.tokens.shape)} and parents "
                         f"{tuple(draft.parents.shape)}: both must be [n]")
    if n > budget:
        free = draft.free_from
        if free is None or n > room or draft.q_probs is not None or not 0 <= free <= budget:
            raise ValueError(f"drafter {name} proposed {n} tokens where the budget was {budget}" + (
                "" if free is None else f" (free from {free}, room {room}; tokens past the budget must be free "
                                        "and deterministic)"))
    if draft.scores is not None and tuple(draft.scores.shape) != (n,):
        raise ValueError(f"drafter {name} returned scores {tuple(draft.scores.shape)}, expected [{n}]")
    if n == 0:
        return [], [], None
    if draft.q_probs is not None and tuple(draft.q_probs.shape) != (n, vocab):
        raise ValueError(f"drafter {name} returned q_probs {tuple(draft.q_probs.shape)}, expected [{n}, {vocab}]")
    if draft.host is not None:
        host = draft.host
        if len(host.tokens) != n or len(host.parents) != n or (host.scores is None) != (draft.scores is None) \
                or (host.scores is not None and len(host.scores) != n):
            raise ValueError(f"drafter {name} returned a HostCopy that does not match its tensors")
        tokens, parents, scores = host.tokens, host.parents, host.scores
    else:
        rows = [draft.tokens.double(), draft.parents.to(draft.tokens.device).double()]  # ids < 2^53: exact
        if draft.scores is not None:
            rows.append(draft.scores.to(draft.tokens.device).double())
        flat = torch.stack(rows).tolist()
        tokens, parents = [int(t) for t in flat[0]], [int(p) for p in flat[1]]
        scores = flat[2] if draft.scores is not None else None
    lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi >= vocab:
        raise ValueError(f"drafter {name} proposed token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab})")
    if any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"drafter {name} returned parents {parents}: each must be -1 (the root) or an earlier node")
    return tokens, parents, scores
