"""A feature head drafting chains for every row of a batch: one head forward per draft step.

FeatureHead's per-sequence loop (drafters/feature_head.py), batched the way ModelRows batches a draft
model: the head's entries for every row live in one set of page tensors on the rows' own block tables,
each row with its own valid length and its own FeatureLog (the target's features of that row, written
by specdec/batch.py from the packed verification forward). A proposal is one catch-up forward over
every drafting row's newly verified positions (rows packed, a block-diagonal mask keeps them apart:
the head is one decoder layer, so the mask's extra work is small), then one forward per further draft
position over the rows still drafting. The picks of all rows are read in one transfer per draft step.
Trees (EAGLE-2, FeatureHead.propose_tree): the same catch-up, then one head forward per depth over every
row's frontier.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..cache.paged import PagedKV
from ..transfer import to_device
from ..tree import TreeGrower, TreeSpec
from ..verifiers.sampling import probs_from_scores
from .base import Draft, DraftContext, DraftSetup
from .head_forward import run_head
from .model_rows import chain_drafts, pick_rows, tree_drafts

if TYPE_CHECKING:
    from .feature_head import FeatureHead


class HeadRows:
    """DraftRows (and FeatureRows) for `head`'s network over the batch's page pool."""

    def __init__(self, head: FeatureHead, pool):
        self.head = head
        self.feature_layers = head.feature_layers
        self.device = next(head.net.parameters()).device
        self.kv = PagedKV(pool, len(head.net.layers), self.device)
        self.tables: list = []
        self.valid: list[int] = []  # row -> positions [0, valid) hold the head's entries
        self.features: list = []  # row -> its FeatureLog

    def attach(self, features: list) -> None:
        self.features = list(features)

    def begin(self, setups: list[DraftSetup]) -> None:
        if len(self.features) != len(setups):
            raise ValueError(f"HeadRows needs one FeatureLog per row: {len(self.features)} attached for "
                             f"{len(setups)} rows")
        self.tables = [s.table for s in setups]
        self.valid = [0] * len(setups)  # no prefill: a row's first proposal catches up (as ModelRows)

    def propose(self, requests: list[tuple[int, DraftContext, int]]) -> list[Draft]:
        live = [(i, ctx, k) for i, ctx, k in requests if k > 0]
        out: dict[int, list[int]] = {i: [] for i, _, _ in requests}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in requests}
        feats, scores = self._catch_up([(i, ctx.tokens) for i, ctx, _ in live]) if live else (None, None)
        step = 0  # draft token step + 1's entry sits at valid + step
        while live:
            pick_rows(live, scores.split(1), out, qs)
            keep = [j for j, (i, _, k) in enumerate(live) if len(out[i]) < k]
            live = [live[j] for j in keep]
            if not live:
                break
            feats = feats[keep]
            parts = []
            for i, _, _ in live:
                p = self.valid[i] + step
                self.tables[i].reserve(p + 1)
                parts.append((i, p, p + 1, torch.ones(1, p + 1, dtype=torch.bool), None))
            x = torch.tensor([out[i][-1] for i, _, _ in live], dtype=torch.long, device=self.device)
            feats = self._forward(parts, feats, x)
            scores = self.head.full_scores(feats)
            step += 1
        return chain_drafts(requests, out, qs)

    def propose_trees(self, requests: list[tuple[int, DraftContext, TreeSpec, int]]) -> list[Draft]:
        """FeatureHead.propose_tree (EAGLE-2) for every row at once: one catch-up forward, then one head
        forward per depth over every growing row's frontier (a depth-d node's entry at valid + d - 1,
        reading the feature its parent predicted)."""
        growers = {i: TreeGrower(spec, budget) for i, _, spec, budget in requests}
        live = [(i, ctx) for i, ctx, _, _ in requests if growers[i].budget > 0]
        written: dict[int, list[int]] = {i: [] for i, _ in live}  # grower ids with entries past valid
        frontier: dict[int, list[int]] = {}
        pred: dict[int, dict[int, torch.Tensor]] = {}  # row -> node -> its predicted feature [H]
        if live:
            feats, scores = self._catch_up([(i, ctx.tokens) for i, ctx in live])
            for j, (i, ctx) in enumerate(live):
                pred[i] = {-1: feats[j]}
                frontier[i] = growers[i].expand(probs_from_scores(ctx.process(scores[j:j + 1], ctx.tokens, [[]])))
        while True:
            growing = [(i, ctx) for i, ctx in live if frontier[i] and growers[i].level < growers[i].spec.depth]
            if not growing:
                break
            parts, inputs, tokens, paths = [], [], [], {}
            for i, ctx in growing:
                g, block, base = growers[i], written[i], self.valid[i]
                m, f = len(block), len(frontier[i])
                tree, paths[i] = g.frontier_block(frontier[i], block)
                mask = torch.cat([torch.ones(f, base, dtype=torch.bool), tree], dim=1)  # the entries before: all seen
                self.tables[i].reserve(base + m + f)
                positions = [base + g.depth[a] - 1 for a in frontier[i]]
                parts.append((i, base + m, base + m + f, mask, positions))
                inputs.extend(pred[i][g.parents[a]] for a in frontier[i])
                tokens.extend(g.tokens[a] for a in frontier[i])
            out = self._forward(parts, torch.stack(inputs), torch.tensor(tokens, dtype=torch.long, device=self.device))
            scores = self.head.full_scores(out)
            at = 0
            for i, ctx in growing:
                f = len(frontier[i])
                for r, node in enumerate(frontier[i]):
                    pred[i][node] = out[at + r]
                frontier[i] = growers[i].expand(probs_from_scores(ctx.process(scores[at:at + f], ctx.tokens, paths[i])))
                at += f
        return tree_drafts(requests, growers)

    def accept(self, row: int, num_context_tokens: int) -> None:
        self.valid[row] = min(self.valid[row], num_context_tokens - 1)

    def end(self) -> None:
        self.tables, self.valid, self.features = [], [], []

    # -- internals -------------------------------------------------------------------------------
    def _catch_up(self, rows: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries for positions [valid, T - 1) of each row's context tokens [T]; returns every row's last
        entry's predicted feature [B, H] (its root's) and full-vocabulary draft scores [B, V]."""
        parts, feats, tokens = [], [], []
        dtype = next(self.head.net.parameters()).dtype
        for i, ctx in rows:
            start, end = self.valid[i], ctx.numel() - 1
            if end <= start:  # nothing new: re-run the last entry
                start = end - 1
            self.tables[i].reserve(end)
            parts.append((i, start, end, torch.ones(end - start, end, dtype=torch.bool).tril_(start), None))
            feats.append(self.features[i].rows(start, end).to(dtype))
            tokens.append(ctx[start + 1:end + 1])
            self.valid[i] = end
        out = self._forward(parts, self.head.net.project(torch.cat(feats)), torch.cat(tokens).to(self.device))
        last = torch.tensor([0] + [e - s for _, s, e, _, _ in parts], device=self.device).cumsum(0)[1:] - 1
        out = out[last]
        return out, self.head.full_scores(out)

    def _forward(self, parts: list, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One head forward over packed rows: parts [(row, first, end, mask [n_i, end], positions or None)]
        write entries first .. end - 1 of each row (at those RoPE positions; None: first .. end - 1) and
        read that row's [0, end); feats [sum n_i, H], tokens [sum n_i]."""
        writes, reads, positions, masks = [], [], [], []
        for i, first, end, mask, pos in parts:
            slots = self.tables[i].slots(0, end)
            writes.append(slots[first:])
            reads.append(slots)
            positions.append(torch.arange(first, end, device=self.device) if pos is None else
                             to_device(pos, torch.long, self.device))
            masks.append(mask)
        mask = torch.block_diag(*masks).to(self.device) if len(masks) > 1 else masks[0].to(self.device)
        return run_head(self.head.net, self.kv, feats, tokens, torch.cat(positions), torch.cat(writes),
                        torch.cat(reads), mask)
