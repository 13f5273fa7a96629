"""The adaptive policy: the k (and tree size) that maximises the expected speedup, from measurements."""
from __future__ import annotations

import math
import numbers
from typing import Sequence

from .base import PolicyBase
from .costs import CostModel
from .formulas import best_length, expected_speedup
from .tracker import AcceptanceTracker

class AdaptivePolicy(PolicyBase):
    """Draft the k that maximises the expected speedup, from the tracked alpha_j and the measured costs.

    Plan (next_length): k = argmax_{k in 0..max_length} S(k), S(k) = tau(k) T_1 / (k T_d + T_v(k+1)),
    tau from the tracker's per-position rates, T from the cost model (see `best_length`).

    Marginal stop (should_continue), a threshold rule (theory.md §1.2, SpecDec++): after drafting token i,
    one more draft token adds g = P(tokens 1..i+1 all accepted) expected tokens and costs
    dC = T_d + T_v(i+2) - T_v(i+1). By the renewal-reward argument it pays iff g > S* dC / T_1, with S* the
    speedup planned for this step (the rate the extra token must beat; comparing with 1, plain decoding,
    would keep drafting tokens that lower the throughput). g is estimated from the draft's confidence:

        g = prod_{j<=i} cal(q_j) * alpha_{i+1}

    where q_j is the draft's probability of its token j (EAGLE-2: draft confidence tracks acceptance) and
    cal() is an online calibration of q against the observed outcomes (10 bins, forgetting counts,
    starting from cal(q) = q), needed in sampling mode where the sampled token's q is not the acceptance
    probability. Early stops keep the estimate honest because observe() receives the k actually drafted;
    alpha_j beyond the first position then describe confident drafts, which is what the cap is used for.

    Fallback: when every k >= 1 is expected to be slower than plain decoding by more than a margin
    (`fallback_below` = 0.95: speculation clearly loses; with flat verification about when alpha <= c),
    decode plainly and now and then draft `probe_length` tokens once (a *probe*) so alpha is measured
    again; speculation resumes by itself when the estimate says it pays. The probes are spaced by an
    exploration budget: a failed probe after G plain steps costs a + b G over a plain step, a = L T_d +
    T_v(L + 1) - T_target_1 (L = probe_length; from the cost model) and b G the model drafter catching up
    on the G tokens decoded while it idled (b measured on every probe), so probing every G steps costs
    a / (G T_1) + b / T_1 of plain decoding. The gap is the shortest G that keeps this within
    `probe_budget` (2 %), G = a / (probe_budget T_1 - b), at most `max_probe_gap` (64; also when b alone
    exceeds the budget): a drafter that never pays costs about `probe_budget`, and a cheap probe (an
    n-gram lookup: no catch-up) is made often. Pricing a probe by its measured time with the catch-up
    lumped in was tried: the price then grows with the gap, each gap set a longer next one, and a traced
    float32 draft ran 34+ plain steps between probes on text HF's heuristic sped up. The margin is there
    because acceptance comes in bursts: near break-even, speculating keeps measuring alpha every step and
    catches the next easy stretch at once, while plain decoding sees it only at the next probe (on the
    zoo's prose prompts, falling back at break-even cost 15 % against a fixed k). Fixed gaps that doubled after each failed
    probe were tried first: on traces of the zoo draft's acceptance they left a generation plain for
    up to 48 steps while its text had turned easy (the gap had doubled during the hard start).

    Exploration: a fresh policy does not fall back before the target has judged `explore_tokens` (4) of
    its drafted tokens, unless no k >= 1 would pay even at the tracker's prior rate (a drafter too dear
    to ever pay). One rejected token is no evidence that a drafter is useless, yet it moves a
    Beta(1, 1) prior to alpha = 1/3: a fresh policy on a 2-core CI machine left speculation after the
    first token of a 40-token zoo generation was rejected, and its first probe came after the generation
    had ended, while the draft's next guesses were accepted 4 of 7. A useless drafter pays the
    exploration once per policy: about 4 k = 1 steps.

    Trees (tree_budget): the node budget B = argmax_{B in 0..max} (1 + sum_{r<=B} rho_r) T_1 /
    (T_tree_draft(B) + T_verify(B + 1)), rho_r the tracker's per-rank rates and T_tree_draft(B) the
    measured drafting time of a tree step of B nodes (an EMA per node count: the grower expands only
    nodes that can have a kept child, so a small budget runs fewer draft forwards). A B never drafted is
    priced optimistically, as the nearest measured count below it (drafting more never costs less) or,
    below every measurement, in proportion to the smallest, so the plan tries it and learns. The first
    `warmup` tree steps, and every `tree_probe_every`-th after, draft the whole spec so every rank stays
    measured. After the warm-up, one plain step and one step at half the spec are planned once each if
    no forward of their size was ever timed: with only the whole spec's forward measured the cost line is
    flat and T_target_1 is read off it, so every budget looked equally cheap and the plan kept the whole
    spec for good (SmolLM2's head drafted 16 nodes every step where a 17-token forward costs 1.75x one).
    """

    _BINS = 10

    def __init__(
        self,
        max_length: int = 8,
        tracker: AcceptanceTracker | None = None,
        costs: CostModel | None = None,
        probe_budget: float = 0.02,
        probe_length: int = 1,
        max_probe_gap: int = 64,
        tree_probe_every: int = 16,
        early_stop: bool = True,
        calibration_prior: float = 4.0,
        fallback_below: float = 0.95,
        sequence_discount: float = 0.25,
        explore_tokens: int = 4,
    ):
        if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < 1:
            raise ValueError(f"max_draft_length must be an int >= 1, got {max_length!r}")
        if not 0.0 < probe_budget < 1.0:
            raise ValueError(f"probe_budget must be in (0, 1), got {probe_budget}")
        if tree_probe_every < 1:
            raise ValueError(f"tree_probe_every must be >= 1, got {tree_probe_every}")
        if probe_length < 1:
            raise ValueError(f"probe_length must be >= 1, got {probe_length}")
        if tracker is None:
            tracker = AcceptanceTracker(max_positions=max(16, int(max_length)))
        super().__init__(int(max_length), tracker, costs)
        self.probe_budget = float(probe_budget)
        if max_probe_gap < 1:
            raise ValueError(f"max_probe_gap must be >= 1, got {max_probe_gap}")
        self.max_probe_gap = int(max_probe_gap)
        self.tree_probe_every = int(tree_probe_every)
        self.probe_length = min(int(probe_length), self.max_length)
        self.early_stop = bool(early_stop)
        self.calibration_prior = float(calibration_prior)
        if not 0.0 < fallback_below <= 1.0:
            raise ValueError(f"fallback_below must be in (0, 1], got {fallback_below}")
        self.fallback_below = float(fallback_below)
        if not 0.0 < sequence_discount <= 1.0:
            raise ValueError(f"sequence_discount must be in (0, 1], got {sequence_discount}")
        self.sequence_discount = float(sequence_discount)
        if explore_tokens < 0:
            raise ValueError(f"explore_tokens must be >= 0, got {explore_tokens}")
        self.explore_tokens = int(explore_tokens)
        self._tested = 0  # drafted tokens the target has judged so far (a fresh policy explores first)
        self._plain_run = 0  # plain steps since the drafter last ran (its catch-up at the next probe)
        self._probe_next = False  # a new sequence began in fallback: probe on its first step
        self._catchup_s: float | None = None  # EMA of the drafter's catch-up seconds per idle step (b)
        self._plan_k, self._plan_s, self._probing = 0, 1.0, False
        self._rates: list[float] = []  # per-position rates used by the last plan
        self._p_cum = 1.0  # prod cal(q_j) over this step's drafted tokens
        self._step_q: list[float] = []  # draft probs reported this step, for calibration
        self._cal_s = [0.0] * self._BINS  # [bins] forgetting success mass per confidence bin
        self._cal_n = [0.0] * self._BINS  # [bins] forgetting test mass per confidence bin
        self._tree_draft_s: dict[int, float] = {}  # nodes drafted -> EMA of a tree step's drafting seconds
        self._tree_plan = 0  # tree steps planned so far
        self.tree_warmup = 3
        self._settings = dict(probe_budget=probe_budget, probe_length=probe_length, max_probe_gap=max_probe_gap,
                              tree_probe_every=tree_probe_every, early_stop=early_stop,
                              calibration_prior=calibration_prior, fallback_below=fallback_below,
                              sequence_discount=sequence_discount, explore_tokens=explore_tokens)
        self._sources: dict[str, AdaptivePolicy] = {}  # for_source's plans, by source name
        self._overall: AcceptanceTracker | None = None  # a per-source plan's parent's tracker (for_source)

    # ---- sources of a switching drafter

    def for_source(self, source: str) -> "AdaptivePolicy":
        """The plan for the steps one source of a switching drafter proposes (drafters/lookup_first.py:
        an n-gram match, or the model): an AdaptivePolicy of the same settings with its own acceptance
        tracker, draft cost, calibration and fallback state, sharing this policy's target forward timings
        (one target verifies for both). A lookup whose matches are accepted 0.6-1.0 by position and cost
        nothing plans long drafts; the model beside it plans its own short ones, where one plan over the
        mix planned 1-2 tokens for both. Steps observed through it also feed this policy's tracker, which
        the generation's stats report."""
        plan = self._sources.get(source)
        if plan is None:
            plan = AdaptivePolicy(self.max_length, costs=self.costs.sharing_target(), **self._settings)
            plan._overall = self.tracker
            self._sources[source] = plan
        return plan

    # ---- planning

    def _rates_for_plan(self) -> list[float]:
        rates = self.tracker.per_position
        return rates + [rates[-1]] * max(0, self.max_length - len(rates))

    def speedups(self, alpha: float | None = None) -> list[float]:
        """[max_length + 1] expected S(k) for k = 0..max_length under the current estimates (at one rate
        `alpha` for every position instead of the tracked rates, when given)."""
        rates, c = self._rates_for_plan() if alpha is None else alpha, self.costs
        return [expected_speedup(rates, k, c.t_draft, c.t_verify, c.t_target_1) for k in range(self.max_length + 1)]

    def next_length(self) -> int:
        c = self.costs
        self._rates = self._rates_for_plan()
        k, s = best_length(self._rates, self.max_length, c.t_draft, c.t_verify, c.t_target_1)
        if k == 0:  # leave speculation only when it clearly loses (hysteresis) and after exploring
            sp = self.speedups()
            k1 = max(range(1, len(sp)), key=sp.__getitem__)
            close = self.fallback_below < 1.0 and sp[k1] >= self.fallback_below * sp[0]
            if close or (self._tested < self.explore_tokens and self._prior_pays()):
                k, s = k1, sp[k1]
        self._probing = k == 0 and (self._probe_next or self._plain_run + 1 >= self.probe_gap())
        self._probe_next = False
        if self._probing:
            k = self.probe_length
        self._plan_k, self._plan_s = k, s
        self._p_cum, self._step_q = 1.0, []
        return k

    def _prior_pays(self) -> bool:
        """Whether some k >= 1 would pay, within the fallback margin, at the tracker's prior acceptance rate
        (what is assumed before any evidence) and the measured costs."""
        a0, b0 = self.tracker.prior
        sp = self.speedups(a0 / (a0 + b0))
        return max(sp[1:]) >= self.fallback_below * sp[0]

    def _probe_price(self, k: int) -> float:
        """a: seconds a k-token probe costs beyond a plain step, the drafter's catch-up left out."""
        c = self.costs
        return k * c.t_draft + c.t_verify(k + 1) - c.t_target_1

    def probe_gap(self) -> int:
        """Plain steps from one probe to the next while in fallback: the shortest G with
        (a + b G) / (G T_1) <= probe_budget, within [1, max_probe_gap] (see the class doc)."""
        a = max(0.0, self._probe_price(self.probe_length))
        room = self.probe_budget * self.costs.t_target_1 - (self._catchup_s or 0.0)
        if room <= 0:
            return self.max_probe_gap
        return min(self.max_probe_gap, max(1, math.ceil(a / room)))

    def tree_budget(self, max_nodes: int) -> int:
        """Nodes to verify in the next tree step (0: a plain step), at most max_nodes (see class doc)."""
        self._tree_plan += 1
        if self.tracker.tree_steps < self.tree_warmup or self._tree_plan % self.tree_probe_every == 0:
            return max_nodes
        c = self.costs
        half = max(1, max_nodes // 2)
        for n in (1, half + 1):  # price the budget from more than the whole spec's forward (class doc)
            if not c.measured_at(n):
                return n - 1
        best_b, best_s, tau = 0, c.t_target_1 / c.t_verify(1), 1.0
        for b, rho in enumerate(self.tracker.per_rank(max_nodes), start=1):
            tau += rho
            s = tau * c.t_target_1 / (self.tree_draft_s(b) + c.t_verify(b + 1))
            if s > best_s:
                best_b, best_s = b, s
        self._plan_s = best_s
        return best_b

    def observe_tree(self, accepted_by_rank: Sequence[bool], draft_s: float) -> None:
        """A tree step: accepted_by_rank as in AcceptanceTracker.observe_ranks; draft_s its drafting time."""
        self.tracker.observe_ranks(accepted_by_rank)
        if self._overall is not None:
            self._overall.observe_ranks(accepted_by_rank)
        n = len(accepted_by_rank)
        if n:
            self._tree_draft_s[n] = self.costs._ema(self._tree_draft_s.get(n), float(draft_s))

    def tree_draft_s(self, nodes: int) -> float:
        """Seconds to draft a tree of `nodes` nodes: its EMA, else priced optimistically (class doc)."""
        seen = self._tree_draft_s
        if nodes in seen:
            return seen[nodes]
        below = [n for n in seen if n < nodes]
        if below:
            return seen[max(below)]
        if seen:
            m = min(seen)
            return seen[m] * nodes / m
        return self.costs.t_draft * nodes

    def begin_sequence(self) -> None:
        """A new generation: its text may be easier than the last one's, so a policy that fell back to
        plain decoding probes on its first step (the exploration budget then costs a useless drafter one
        more probe per generation). The acceptance evidence keeps its means but is discounted by
        `sequence_discount` (0.25): the last text's rates are the new one's starting point, and its first
        steps move them four times faster. A policy that has observed no drafting step keeps its prior."""
        self._probe_next = self._plain_run > 0
        self._plain_run = 0  # the drafter has just read the prompt: nothing to catch up on
        if self.tracker.steps > 0:  # a fresh tracker holds only its prior, no last text to discount
            self.tracker.discount(self.sequence_discount)
        for plan in self._sources.values():
            plan.begin_sequence()

    # ---- inside a step

    def _calibrated(self, q: float) -> float:
        i = min(int(q * self._BINS), self._BINS - 1)
        m = self.calibration_prior
        return (self._cal_s[i] + m * q) / (self._cal_n[i] + m)

    def should_continue(self, position: int, draft_prob: float) -> bool:
        q = min(max(float(draft_prob), 0.0), 1.0)
        if position == 1:
            self._p_cum, self._step_q = 1.0, []
        self._step_q.append(q)
        self._p_cum *= self._calibrated(q)
        if not self.early_stop or self._probing:
            return True
        i = position
        if i >= self.max_length:
            return False
        rates = self._rates or self._rates_for_plan()
        g = self._p_cum * rates[i]  # rates[i] = alpha_{i+1}
        c = self.costs
        d_cost = c.t_draft + c.t_verify(i + 2) - c.t_verify(i + 1)
        return g * c.t_target_1 > self._plan_s * d_cost

    # ---- after a step

    def observe(self, k: int, n: int, draft_s: float, verify_s: float, beta=None) -> None:
        if self._probing and k > 0 and self._plain_run > 0:  # b: what the catch-up added, per idle step
            extra = draft_s + verify_s - self.costs.t_target_1 - self._probe_price(k)
            self._catchup_s = self.costs._ema(self._catchup_s, max(0.0, extra) / self._plain_run)
        super().observe(k, n, draft_s, verify_s, beta)
        if self._overall is not None:
            self._overall.observe(k, n, beta)
        self._tested += min(n + 1, k)
        self._plain_run = self._plain_run + 1 if k == 0 else 0
        if k > 0 and self._step_q:
            lam = self.tracker.forgetting
            for j, q in enumerate(self._step_q[: min(n + 1, k)]):
                b = min(int(q * self._BINS), self._BINS - 1)
                self._cal_s[b] = lam * self._cal_s[b] + (1.0 if j < n else 0.0)
                self._cal_n[b] = lam * self._cal_n[b] + 1.0
        self._step_q = []
        self._probing = False

    def to_dict(self) -> dict:
        return {
            "tracker": self.tracker.to_dict(),
            "costs": self.costs.to_dict(),
            "plan_k": self._plan_k,
            "plan_speedup": self._plan_s,
            **({"sources": {name: plan.to_dict() for name, plan in self._sources.items()}} if self._sources else {}),
        }

    def __repr__(self) -> str:
        return f"AdaptivePolicy(max_length={self.max_length}, alpha={self.tracker.alpha:.3f}, c={self.costs.c:.3f})"
