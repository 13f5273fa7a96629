"""Draft lengths for a batch: per-row acceptance, one cost for the whole step.

In a batched step every live row drafts, then ONE target forward verifies all rows' tokens. Its cost
grows with the total number of tokens in it (at B = 8 on a CPU a forward is no longer bound by reading
the weights), so a row's longer draft is paid by the whole batch. The planner keeps one
AcceptanceTracker per row (acceptance is a property of the row's text) and one CostModel over the
forward's total tokens N = sum_i (k_i + 1), plus the seconds per sequential draft step. How many steps
a plan costs depends on how the rows draft: one after another (n-gram lookups, drafts across
tokenizers), every drafted token is a step, D(k) = sum_i k_i; together (a draft model's or a feature
head's rows, one forward per draft position for every drafting row), a step is one such forward,
D(k) = max_i k_i, so a second row's draft costs the batch almost nothing more. It picks the lengths k_i
that maximise the step's expected tokens per second:

    rate(k) = sum_i tau_i(k_i) / (T_verify(N) + T_draft_step * D(k))

greedily: starting from plain batched decoding (every k_i = 0), add the draft token with the largest
acceptance probability prod_{j <= k_i + 1} alpha_ij (the expected gain of that token, which only falls
as k_i grows) and keep the best plan on that path. All zeros is the fallback when speculation stops
paying. Until costs are measured, verification is priced flat (the optimistic, memory-bound prior of
CostModel), so the first steps draft and measure.

Dynamic trees (node_budgets): the same plan over node budgets B_i instead of lengths, with each row's
per-rank rates rho_ir (AcceptanceTracker.per_rank: how often the r-th best node was on the accepted
path) as the gains and one tree step's drafting time (one forward per depth that some row still
expands; the grower stops expanding nodes that cannot be kept, so small budgets stop early, but the
batch is priced by one EMA, unlike AdaptivePolicy's per-count one) as the draft price:

    rate(B) = sum_i (1 + sum_{r <= B_i} rho_ir) / (T_verify(sum_i (B_i + 1)) + T_tree * S(B))

S(B) is 1 when any row drafts and the rows draft together, else the number of rows drafting. A row's
first `tree_warmup` tree steps, and every probe, draft its whole spec so every rank stays measured;
`tree_nodes` (a constant draft_length) fixes every budget at min(k, the spec's nodes) instead.

Probes: every `probe_every` steps a drafting plan is halved, and plain decoding drafts `probe_length`
tokens (a tree: its whole spec) for a quarter of the rows (at least one, in turn), or it would never
learn again. A quarter, not all: a probe from plain decoding measures what the next plan needs (the
probed rows' acceptance now, and the verify cost just above plain), and with every row drafting it
would cost the batch a catch-up over every row's text and a forward over 3B tokens. While probes keep
finding that speculation does not pay, the interval doubles (up to `max_probe_every`), and it returns
to `probe_every` as soon as a plan drafts.
"""
from __future__ import annotations

from .costs import CostModel
from .tracker import AcceptanceTracker


class BatchPlanner:
    """max_length: the longest draft for any row; fixed: every row drafts exactly this many (a constant
    draft_length), the trackers and costs still record what happened."""

    def __init__(self, max_length: int = 8, fixed: int | None = None, probe_every: int = 8, probe_length: int = 2,
                 max_probe_every: int = 64, together: bool = False, tree_nodes: int | None = None,
                 tree_warmup: int = 2):
        if max_length < 0 or (fixed is not None and fixed < 0):
            raise ValueError(f"draft lengths must be >= 0, got max_length={max_length}, fixed={fixed}")
        self.max_length = int(max_length)
        self.fixed = fixed
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.probe_length = min(probe_length, self.max_length)
        self.interval = probe_every  # steps between probes now (doubles while plain decoding keeps winning)
        self._since_probe = 0
        self._probes = 0  # probes from plain decoding so far (whose turn the next one is)
        self.together = together  # the rows draft in one forward per draft position (see the module doc)
        self.costs = CostModel()  # its "draft token" is one sequential draft step here
        self.tree_nodes = tree_nodes  # dynamic trees: a fixed node budget (None: planned, see node_budgets)
        self.tree_warmup = tree_warmup
        self.t_tree: float | None = None  # seconds per tree draft step (EMA; per row when rows draft alone)
        self.history: list[list[int]] = []  # the lengths planned, step by step (for reports)

    def new_row(self) -> AcceptanceTracker:
        return AcceptanceTracker()

    def plan(self, trackers: list[AcceptanceTracker], caps: list[int]) -> list[int]:
        """One draft length per live row; caps [B]: the most each row may draft (tokens it has left)."""
        if self.fixed is not None:
            ks = [min(self.fixed, cap) for cap in caps]
        else:  # a probe halves a drafting plan; from plain decoding it drafts a little, or it never learns again
            ks = self._probing(self._greedy(trackers, [min(self.max_length, cap) for cap in caps]), caps,
                               lambda ks: [k // 2 for k in ks], lambda cap: min(self.probe_length, cap))
        self.history.append(ks)
        return ks

    def _probing(self, plan: list[int], caps: list[int], when_drafting, probe_size) -> list[int]:
        """The probe schedule chains and trees share (see the module doc): `plan` as it is, or at a probe
        step when_drafting(plan) if it drafts, else probe_size(cap) for a quarter of the rows."""
        drafting = any(plan)
        if drafting:
            self.interval = self.probe_every
        self._since_probe += 1
        if not (self.probe_every and self._since_probe >= self.interval):
            return plan
        self._since_probe = 0
        if drafting:
            return when_drafting(plan)
        self.interval = min(2 * self.interval, self.max_probe_every)
        return [probe_size(cap) if turn else 0 for turn, cap in zip(self._probed(len(caps)), caps)]

    def _probed(self, rows: int) -> list[bool]:
        """Which rows a probe from plain decoding drafts for: a quarter of them (at least one), in turn."""
        m = max(1, rows // 4)
        first = (self._probes * m) % rows
        self._probes += 1
        turn = {(first + j) % rows for j in range(m)}
        return [i in turn for i in range(rows)]

    def node_budgets(self, trackers: list[AcceptanceTracker], caps: list[int]) -> list[int]:
        """One dynamic tree's node budget per row (0: the row does not draft); caps [B]: each row's spec's
        nodes (after its depth was cut to the tokens it has left). See the module doc."""
        if self.tree_nodes is not None:
            budgets = [min(self.tree_nodes, cap) for cap in caps]
        else:  # a probe drafts every rank: the whole spec
            budgets = self._probing(self._greedy_nodes(trackers, caps), caps, lambda _: list(caps), lambda cap: cap)
            budgets = [cap if t.tree_steps < self.tree_warmup else b for t, b, cap in zip(trackers, budgets, caps)]
        self.history.append(budgets)
        return budgets

    def _greedy_nodes(self, trackers: list[AcceptanceTracker], caps: list[int]) -> list[int]:
        t_tree = self.t_tree if self.t_tree is not None else self.costs.t_draft

        def draft_s(budgets: list[int]) -> float:
            drafting = sum(1 for b in budgets if b)
            return t_tree * (min(1, drafting) if self.together else drafting)

        return self._best_on_path([t.per_rank(cap) for t, cap in zip(trackers, caps)], draft_s)

    def observe_trees(self, total_tokens: int, verify_s: float, budgets: list[int], draft_s: float) -> None:
        """A tree step: its forward ran total_tokens tokens in verify_s; rows drafted trees of budgets[i]
        nodes (0: none) in draft_s."""
        self.costs.observe_verify(total_tokens, verify_s)
        drafting = sum(1 for b in budgets if b)
        if drafting:
            per_step = draft_s if self.together else draft_s / drafting
            self.t_tree = self.costs._ema(self.t_tree, per_step)

    def _greedy(self, trackers: list[AcceptanceTracker], caps: list[int]) -> list[int]:
        gains = []  # row i's k-th token is emitted with P(its first k drafts all accepted)
        for t, cap in zip(trackers, caps):
            rates, reach, row = t.per_position, 1.0, []
            for k in range(cap):
                reach *= _at(rates, k)
                row.append(reach)
            gains.append(row)
        d = self.costs.t_draft
        return self._best_on_path(gains, lambda ks: d * (max(ks, default=0) if self.together else sum(ks)))

    def _best_on_path(self, gains: list[list[float]], draft_s) -> list[int]:
        """The greedy search chains and trees share (see the module doc): from plain decoding (every row
        emits one token), add the row's next draft token or node with the largest gains[i][k_i] (a gain
        that only falls as k_i grows); keep the plan with the best rate on that path, gain over
        T_verify(rows + sum k) + draft_s(k)."""
        rows = len(gains)
        ks, gain = [0] * rows, float(rows)

        def rate() -> float:
            return gain / max(1e-12, self.costs.t_verify(rows + sum(ks)) + draft_s(ks))

        best, best_ks = rate(), list(ks)
        while True:
            options = [(g[k], i) for i, (g, k) in enumerate(zip(gains, ks)) if k < len(g)]
            if not options:
                break
            p, i = max(options)
            if p <= 0.0:
                break
            ks[i] += 1
            gain += p
            r = rate()
            if r > best:
                best, best_ks = r, list(ks)
        return best_ks

    def observe(self, total_tokens: int, verify_s: float, drafts: list[int], draft_s: float) -> None:
        """The step's forward ran total_tokens tokens in verify_s; the rows drafted drafts[i] tokens each
        (planned lengths, or what a lookup found) in draft_s."""
        self.costs.observe_verify(total_tokens, verify_s)
        self.costs.observe_draft(max(drafts, default=0) if self.together else sum(drafts), draft_s)


def _at(rates: list[float], k: int) -> float:
    """alpha for draft position k + 1 (rates past the tracked positions repeat the last)."""
    return rates[min(k, len(rates) - 1)]
