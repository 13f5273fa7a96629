"""A draft model drafting chains for every row of a batch: one packed forward per draft step.

ModelDrafter's per-sequence loop, batched: the draft's KV for every row lives in one set of page tensors
on the rows' own block tables (hf/batch_runner.py), each row with its own valid length. A proposal is a
catch-up forward (each drafting row runs the tokens it has not seen yet: at least the root) and then
one forward per further draft position over the rows still drafting; rows with shorter budgets drop
out. Each row's logits are processed with its own pipeline and prefix, and the step's picks of all rows
are read in one transfer. As in ModelDrafter the last drafted token is not run: the next catch-up does.
Trees: the same catch-up, then one forward per depth over every row's frontier (ModelDrafter's
propose_tree, batched).
"""
from __future__ import annotations

import torch

from ..hf.batch_runner import BatchRunner, RowForward
from ..transfer import to_device
from ..tree import TreeGrower, TreeSpec
from ..verifiers.sampling import probs_from_scores, sample
from .base import Draft, DraftContext, DraftSetup


def pick_rows(live: list[tuple[int, DraftContext, int]], scores, out: dict, qs: dict) -> list[int]:
    """One draft step's picks for every drafting row: row i's draft scores [1, V] (scores, in live's
    order) processed like its target rows (its prefix and the tokens out[i] drafted so far), then the
    argmax, or a sample whose q is appended to qs[i]. Every row's pick is read in one transfer, appended to
    out[i] and returned. live: [(row, DraftContext, budget)]. ModelRows and HeadRows share it."""
    picks = []
    for (i, ctx, _), lg in zip(live, scores):
        processed = ctx.process(lg, ctx.tokens, [out[i]])
        if ctx.sampling.do_sample:
            q = probs_from_scores(processed)
            qs[i].append(q[0])
            picks.append(sample(q, ctx.generator)[0])
        else:
            picks.append(processed[0].argmax())
    tokens = [int(x) for x in torch.stack(picks).tolist()]  # the draft step's one read
    for (i, _, _), x in zip(live, tokens):
        out[i].append(x)
    return tokens


def chain_drafts(requests: list, out: dict, qs: dict) -> list[Draft]:
    """One chain Draft per request [(row, DraftContext, budget)] from the tokens out[row] and (sampling)
    the q rows qs[row] that pick_rows kept."""
    return [Draft.from_lists(out[i], None, ctx.tokens.device, torch.stack(qs[i]) if qs[i] else None)
            for i, ctx, _ in requests]


def tree_draft(ctx: DraftContext, grower: TreeGrower) -> Draft:
    """A row's tree Draft: its grower's kept nodes."""
    toks, parents = grower.result()
    return Draft.from_lists(toks, parents, ctx.tokens.device, scores=grower.kept_scores)


def tree_drafts(requests: list, growers: dict) -> list[Draft]:
    """One tree Draft per request [(row, DraftContext, spec, budget)]: its grower's kept nodes."""
    return [tree_draft(ctx, growers[i]) for i, ctx, _, _ in requests]


class ModelRows:
    """DraftRows for a HF causal LM `model` over the batch's page pool."""

    def __init__(self, model, pool, lean: bool = True):
        self.runner = BatchRunner(model, pool, lean=lean, exact=False)
        self.tables: list = []
        self.valid: list[int] = []

    def begin(self, setups: list[DraftSetup]) -> None:
        """Bind the rows' tables. No prefill here: a row's first proposal catches up on its whole context,
        so a row the planner never drafts for (plain batched decoding) never costs a draft forward."""
        self.tables = [s.table for s in setups]
        self.valid = [0] * len(setups)

    def propose(self, requests: list[tuple[int, DraftContext, int]]) -> list[Draft]:
        live = [(i, ctx, k) for i, ctx, k in requests if k > 0]
        out: dict[int, list[int]] = {i: [] for i, _, _ in requests}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in requests}
        forwards = [self._catch_up(i, ctx) for i, ctx, _ in live]
        while live:
            tokens = pick_rows(live, self.runner.forward(forwards), out, qs)
            forwards, still = [], []
            for (i, ctx, k), x in zip(live, tokens):
                if len(out[i]) < k:
                    forwards.append(RowForward(self.tables[i], self.valid[i],
                                               torch.tensor([x], dtype=torch.long, device=ctx.tokens.device),
                                               logits_rows=1))
                    self.valid[i] += 1
                    still.append((i, ctx, k))
            live = still
        return chain_drafts(requests, out, qs)

    def propose_trees(self, requests: list[tuple[int, DraftContext, TreeSpec, int]]) -> list[Draft]:
        """ModelDrafter.propose_tree for every row at once: one catch-up forward (each row's last logits
        row is its root's distribution), then one forward per depth over every growing row's frontier,
        written as scratch past the row's valid KV (a row's block: its m earlier nodes, then these)."""
        growers = {i: TreeGrower(spec, budget) for i, _, spec, budget in requests}
        live = [(i, ctx) for i, ctx, _, _ in requests if growers[i].budget > 0]
        written: dict[int, list[int]] = {i: [] for i, _ in live}  # grower ids with KV in the row's block
        frontier: dict[int, list[int]] = {}
        if live:
            logits = self.runner.forward([self._catch_up(i, ctx) for i, ctx in live])
            for (i, ctx), lg in zip(live, logits):
                frontier[i] = self._expandable(i, growers[i], growers[i].expand(self._probs(i, ctx, lg, [[]])))
        while True:
            growing = [(i, ctx) for i, ctx in live if frontier[i] and growers[i].level < growers[i].spec.depth]
            if not growing:
                break
            forwards, paths = [], {}
            for i, ctx in growing:
                g, block = growers[i], written[i]
                m = len(block)
                mask, paths[i] = g.frontier_block(frontier[i], block)
                root = self.valid[i] - 1
                device = ctx.tokens.device
                forwards.append(RowForward(
                    self.tables[i], self.valid[i] + m,
                    to_device(self._model_ids(i, [g.tokens[a] for a in frontier[i]]), torch.long, device),
                    to_device([root + g.depth[a] for a in frontier[i]], torch.long, device), mask.to(device),
                    block_pos=to_device([root + g.depth[a] for a in block], torch.long, device)))
            for (i, ctx), lg in zip(growing, self.runner.forward(forwards)):
                frontier[i] = self._expandable(i, growers[i], growers[i].expand(self._probs(i, ctx, lg, paths[i])))
        return [self._tree_draft(i, ctx, growers[i]) for i, ctx, _, _ in requests]

    # what a draft of another vocabulary changes (drafters/cross_rows.py) ----------------------------
    def _catch_up(self, i: int, ctx: DraftContext) -> RowForward:
        """Row i's forward over the committed tokens its KV lacks (its valid length moves to their end)."""
        forward = RowForward(self.tables[i], self.valid[i], ctx.tokens[self.valid[i]:], logits_rows=1)
        self.valid[i] = ctx.tokens.numel()
        return forward

    def _scores(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        """Row i's draft logits [r, V] as scores over the target's ids (the same ids here)."""
        return logits

    def _model_ids(self, i: int, target_ids: list[int]) -> list[int]:
        """Tree tokens (target ids) as the draft model's input ids (the same ids here)."""
        return target_ids

    def _probs(self, i: int, ctx: DraftContext, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """Row i's tree: the next-token probabilities [r, V] of its frontier nodes (tokens on `paths`) from
        their draft logits, processed like the target's rows."""
        return probs_from_scores(ctx.process(self._scores(i, logits), ctx.tokens, paths))

    def _expandable(self, i: int, grower: TreeGrower, frontier: list[int]) -> list[int]:
        """Row i's tree: which of the new frontier nodes to expand (all here)."""
        return frontier

    def _tree_draft(self, i: int, ctx: DraftContext, grower: TreeGrower) -> Draft:
        """Row i's tree Draft from its grown tree (its kept nodes here)."""
        return tree_draft(ctx, grower)

    def accept(self, row: int, num_context_tokens: int) -> None:
        self.valid[row] = min(self.valid[row], num_context_tokens - 1)

    def end(self) -> None:
        self.tables, self.valid = [], []
