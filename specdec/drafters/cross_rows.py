"""A draft with another tokenizer drafting for every row of a batch: one packed draft forward per step.

CrossTokenizerDrafter's loop (drafters/cross_tokenizer.py), batched like ModelRows: each row keeps its
own draft-token history on its own block table, all of them on one draft page pool of their own (a
row's draft positions are its own text's, not the target's), and its own mode (auto decides per row at
its first proposal, as the one-sequence drafter decides per generation). A proposal syncs every
drafting row in one forward (each rolls its draft KV back to the longest prefix that still matches its
committed text re-encoded, and runs the rest), then runs one forward per further draft position over
the rows still drafting: text rows take the draft's argmax in its own ids and re-encode the text at the
end; intersection rows pick over the shared tokens in target ids (processed like the target's rows; q
kept when sampling). Trees grow one depth per forward (ModelRows' loop): intersection rows through the
vocabulary map, text rows in the draft's vocabulary, their leaves re-encoded and merged into a trie as
CrossTokenizerDrafter does for one sequence. No prefill at begin: a row's first proposal catches
up, so a row the planner never drafts for never costs a draft forward.
"""
from __future__ import annotations

import torch

from ..cache.pool import BlockTable, PagePool, common_prefix
from ..hf.batch_runner import BatchRunner, RowForward
from ..hf.runner import max_positions_of
from ..tree import TreeGrower
from .base import Draft, DraftContext, DraftSetup
from .model_rows import ModelRows, chain_drafts, pick_rows


class CrossTokenizerRows(ModelRows):
    """DraftRows for a CrossTokenizerDrafter (its model, tokenizers, map and options; one row each)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.runner: BatchRunner | None = None
        self.tables: list[BlockTable] = []
        self.ids: list[list[int]] = []  # each row's draft ids whose KV its table holds
        self.active: list[str | None] = []
        self.agreement: list[float | None] = []

    def begin(self, setups: list[DraftSetup]) -> None:
        d = self.drafter
        device = next(d.model.parameters()).device
        per_row = -(-(max_positions_of(d.model) or 8192) // d.page_size) + 1
        pool = PagePool(per_row * len(setups), d.page_size)  # page tensors grow with use, not with this
        self.runner = BatchRunner(d.model, pool, lean=d.lean, exact=False)
        self.tables = [BlockTable(pool, device) for _ in setups]
        self.ids = [[] for _ in setups]
        auto = d.mode == "auto"
        self.active = [None if auto else d.active for _ in setups]
        self.agreement = [d.usable_agreement(s.prompt.tolist()) if auto and s.prompt is not None else None
                          for s in setups]

    @property
    def valid(self) -> list[int]:
        """Each row's draft KV length (ModelRows' tree loop reads it): its ids'."""
        return [len(ids) for ids in self.ids]

    def _mode(self, i: int, ctx: DraftContext) -> str:
        if self.active[i] is None:
            self.active[i] = self.drafter.mode_for(ctx, self.agreement[i])
        return self.active[i]

    def _catch_up(self, i: int, ctx: DraftContext) -> RowForward:
        """Row i synced to its committed text: its draft KV kept where the re-encoded ids still match."""
        want = self.drafter._draft_ids(ctx.tokens.tolist())
        keep = min(common_prefix(self.ids[i], want), len(want) - 1)
        self.tables[i].truncate(keep)
        self.ids[i] = want
        return RowForward(self.tables[i], keep, torch.tensor(want[keep:], dtype=torch.long, device=self.tables[i].device),
                          logits_rows=1)

    def _scores(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        return self.drafter.vocab.target_scores(logits, self.drafter.target_vocab)

    def _model_ids(self, i: int, tree_ids: list[int]) -> list[int]:
        if self.active[i] == "text":  # a text row's tree is in the draft's ids already
            return tree_ids
        return self.drafter.vocab.to_draft[torch.tensor(tree_ids, dtype=torch.long)].tolist()

    def propose(self, requests: list[tuple[int, DraftContext, int]]) -> list[Draft]:
        live = [(i, ctx, k) for i, ctx, k in requests if k > 0]
        modes = {i: self._mode(i, ctx) for i, ctx, _ in live}
        out: dict[int, list[int]] = {i: [] for i, _, _ in requests}  # target ids (intersection rows)
        qs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in requests}
        drafted: dict[int, list[int]] = {i: [] for i, _, _ in requests}  # draft ids (text rows)
        proposals: dict[int, list[int]] = {}  # target ids (text rows, once drafted enough)
        forwards = [self._catch_up(i, ctx) for i, ctx, _ in live]
        anchors = {i: self.ids[i][-1] for i, _, _ in live}  # each row's committed text's last draft id
        committed = {i: ctx.tokens.tolist() for i, ctx, _ in live if modes[i] == "text"}
        while live:
            logits = self.runner.forward(forwards)
            shared = [(row, lg) for row, lg in zip(live, logits) if modes[row[0]] == "intersection"]
            picks = dict(zip([row[0] for row, _ in shared], pick_rows(
                [row for row, _ in shared], [self._scores(row[0], lg) for row, lg in shared], out, qs))) if shared else {}
            forwards, still = [], []
            for (i, ctx, k), lg in zip(live, logits):
                if modes[i] == "intersection":
                    n, x = len(out[i]), int(self.drafter.vocab.to_draft[picks[i]])
                else:  # a text row drafts until its text gives k target tokens (CrossTokenizerDrafter)
                    x = int(lg[0].argmax())
                    drafted[i].append(x)
                    proposal = self.drafter.text_proposal(committed[i], drafted[i], k, anchors[i])
                    if proposal is not None:
                        proposals[i] = proposal
                    n = 0 if proposal is None else k
                if n < k:  # run the pick: its logits are the next position's
                    forwards.append(RowForward(self.tables[i], len(self.ids[i]),
                                               torch.tensor([x], dtype=torch.long, device=self.tables[i].device),
                                               logits_rows=1))
                    self.ids[i].append(x)
                    still.append((i, ctx, k))
            live = still
        drafts = chain_drafts(requests, out, qs)
        for j, (i, ctx, k) in enumerate(requests):
            if modes.get(i) == "text":
                drafts[j] = Draft.from_lists(proposals[i], None, ctx.tokens.device)
        return drafts

    def propose_trees(self, requests: list) -> list[Draft]:
        """Every row's tree grows in one forward per depth (ModelRows' loop): intersection rows over the
        shared tokens in target ids, text rows in the draft's own vocabulary by its path probability (no
        node past the draft's EOS expanded), each text row's leaves then re-encoded into target tokens and
        merged into one trie (CrossTokenizerDrafter.text_tree)."""
        for i, ctx, _, _ in requests:
            self._mode(i, ctx)
        return super().propose_trees(requests)

    def _probs(self, i: int, ctx: DraftContext, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        if self.active[i] == "text":  # the draft's own softmax: the target's processors do not address its ids
            return torch.softmax(logits.float(), dim=-1)
        return super()._probs(i, ctx, logits, paths)

    def _expandable(self, i: int, grower: TreeGrower, frontier: list[int]) -> list[int]:
        eos = self.drafter.draft_tok.eos_token_id
        if self.active[i] != "text" or eos is None:
            return frontier
        return grower.restrict([a for a in frontier if grower.tokens[a] != eos])

    def _tree_draft(self, i: int, ctx: DraftContext, grower: TreeGrower) -> Draft:
        if self.active[i] == "text" and grower.budget > 0:
            return self.drafter.text_tree(ctx.tokens.tolist(), grower, self.ids[i][-1], ctx.tokens.device)
        return super()._tree_draft(i, ctx, grower)

    def accept(self, row: int, num_context_tokens: int) -> None:
        pass  # the next sync rolls the row's draft back to its committed text, whatever was accepted

    def end(self) -> None:
        for table in self.tables:
            table.release()
        self.runner, self.tables, self.ids = None, [], []
