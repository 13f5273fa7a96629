"""How much to draft next step: the acceptance tracker, the cost model and the draft-length policies.

Speculative decoding pays off only while the drafts are accepted often enough to cover their cost. Two
numbers decide it (DESIGN.md §6, reference/theory.md §1): the per-token acceptance rate alpha and the
measured costs (T_draft per drafted token, T_verify(n) for a target forward over n tokens). This module
estimates both online and turns them into the draft budget k of the next step:

    S(k)   = tau(k) * T_target_1 / (k * T_draft + T_verify(k + 1))     speedup over plain decoding
    tau(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j                        expected tokens per step (bonus incl.)

k = 0 is plain decoding (S(0) = 1). Everything here is plain Python floats: the engine hands over ints
and floats once per step (one host sync), and the policy's math costs a few microseconds.

Words: a step drafts k tokens; n of them are *accepted* (the accepted prefix, 0 <= n <= k); position j
(1-based) is *tested* when the verifier actually looked at it, i.e. j <= n + 1 and j <= k. Drafts after
the first rejection are never tested; counting them as failures is the censoring trap.

The engine's loop, per step:

    k = policy.next_length()                      # 0: plain decoding
    ... draft up to k tokens; after each one: if not policy.should_continue(i, q_i): stop
    ... verify; n accepted of the k_actual drafted
    policy.observe(k_actual, n, draft_s, verify_s, beta=None or [beta_1, ...])
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Protocol, Sequence, runtime_checkable

__all__ = [
    "AcceptanceTracker",
    "CostModel",
    "DraftPolicy",
    "ConstantPolicy",
    "HeuristicPolicy",
    "AdaptivePolicy",
    "make_policy",
    "expected_tokens",
    "expected_speedup",
    "ideal_speedup",
    "best_length",
]


# ----------------------------------------------------------------------------------------------------
# The formulas (pure functions; the policy and the tests both use them)


def _as_float_list(x) -> list[float]:
    """A sequence, numpy array or torch tensor -> list of Python floats (one host sync for a tensor)."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, numbers.Real):
        return [float(x)]
    return [float(v) for v in x]


def _position_rates(alphas_or_alpha, k: int) -> list[float]:
    """alpha (one float, i.i.d.) or per-position rates [alpha_1, alpha_2, ...] -> the first k rates."""
    if isinstance(alphas_or_alpha, numbers.Real):
        return [float(alphas_or_alpha)] * k
    rates = _as_float_list(alphas_or_alpha)
    if len(rates) < k:
        raise ValueError(f"need {k} per-position acceptance rates, got {len(rates)}")
    return rates[:k]


def expected_tokens(alphas_or_alpha, k: int) -> float:
    """tau(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j: expected tokens emitted per step, the bonus included.

    With one i.i.d. alpha this is (1 - alpha^(k+1)) / (1 - alpha).
    """
    tau, run = 1.0, 1.0
    for a in _position_rates(alphas_or_alpha, k):
        run *= a
        tau += run
    return tau


def expected_speedup(
    alphas_or_alpha,
    k: int,
    t_draft: float,
    t_verify_fn: Callable[[int], float] | None,
    t_target_1: float,
) -> float:
    """S(k) = tau(k) * T_target_1 / (k * T_draft + T_verify(k + 1)), computed directly.

    alphas_or_alpha: one alpha (i.i.d.) or per-position rates (at least k of them)
    t_draft:         seconds per drafted token
    t_verify_fn:     n -> seconds for a target forward over n tokens; None: flat, T_verify(n) = T_target_1
    t_target_1:      seconds for a plain decoding step (target forward over 1 token)
    """
    if k < 0:
        raise ValueError(f"draft length k must be >= 0, got {k}")
    t_verify = t_target_1 if t_verify_fn is None else float(t_verify_fn(k + 1))
    return expected_tokens(alphas_or_alpha, k) * t_target_1 / (k * t_draft + t_verify)


def ideal_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. Theorem 3.8: S(k) = (1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)).

    Assumes i.i.d. acceptance and a verification as cheap as one plain step; alpha == 1 gives
    (k + 1) / (1 + k c). Benchmarks compare the measured speedup with this bound.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    tau = float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tau / (1.0 + k * c)


def best_length(
    alphas_or_alpha,
    max_length: int,
    t_draft: float,
    t_verify_fn: Callable[[int], float] | None,
    t_target_1: float,
) -> tuple[int, float]:
    """argmax_{k in 0..max_length} S(k) and its value. Ties go to the shorter draft (k = 0 on a tie).

    S is quasi-concave in k for i.i.d. alpha, but per-position rates and measured T_verify need not be,
    so this evaluates every k (max_length + 1 values, O(max_length) in all).
    """
    rates = _position_rates(alphas_or_alpha, max_length)
    best_k, best_s = 0, t_target_1 / (t_target_1 if t_verify_fn is None else float(t_verify_fn(1)))
    tau, run = 1.0, 1.0
    for k in range(1, max_length + 1):
        run *= rates[k - 1]
        tau += run
        t_verify = t_target_1 if t_verify_fn is None else float(t_verify_fn(k + 1))
        s = tau * t_target_1 / (k * t_draft + t_verify)
        if s > best_s:
            best_k, best_s = k, s
    return best_k, best_s


# ----------------------------------------------------------------------------------------------------
# Acceptance


class AcceptanceTracker:
    """Censoring-aware, forgetting estimate of the acceptance rate alpha, overall and per position.

    A step with n accepted of k drafted counts n successes and 1[n < k] failures: positions after the
    first rejection were never tested. Forgetting Beta posterior, one update per step with k > 0:

        a <- lam * a + n            b <- lam * b + 1[n < k]            alpha = a / (a + b)

    (a, b start at `prior`; the window is about 1 / (1 - lam) steps; lam = 1 is the plain MLE plus prior.)
    A plain step (k = 0) tests nothing but still ages every count by lam: the rates keep their means and
    lose weight, so after falling back to plain decoding the next probe's outcome counts as much as the
    stale evidence that caused the fallback (otherwise one hard prompt kept the plan at k = 0 through
    the easy text after it: a traced generation spent 30 plain steps there while its probes accepted).

    Per position j = 1..max_positions: tested iff j <= n + 1 and j <= k, a success iff j <= n. Each
    position keeps forgetting counts (a_j, b_j), all decayed by lam every step, and reports
    alpha_j = (a_j + m * alpha) / (a_j + b_j + m) with m = sum(prior): a position seldom reached is
    shrunk towards the overall alpha, and one no longer reached drifts back to it (a stale low alpha_j
    would otherwise keep the plan below j forever, so j would never be tested again).

    Sampling mode: `beta[j-1] = sum_x min(p_j(x), q_j(x))` is the exact probability that position j would
    be accepted. For the tested positions it replaces the 0/1 outcome (success mass beta_j, failure mass
    1 - beta_j): same expectation, much less noise. Whether position j is tested depends only on the
    positions before it, so this stays unbiased.

    Bursts: acceptance comes in runs (easy stretches of text, then hard ones), so the per-position
    counts are also kept per *context*, the previous step's outcome (all k accepted, or not), and
    `per_position` reports the current context's rates, each shrunk towards the pooled rate of its
    position: alpha_j|s = (a_j|s + m_c * alpha_j) / (a_j|s + b_j|s + m_c), m_c = `context_prior` (8 steps:
    a context moves the plan only on consistent evidence). Where acceptance has no memory the
    two contexts agree and this is the pooled estimate; where it does, the plan drafts longer after a
    fully accepted step and shorter after a rejection (what HF's +2/-1 heuristic does blindly, here
    priced by the cost model).

    Trees (`observe_ranks`, `per_rank`): the r-th best node of a step's tree (by the draft's path
    probability) is accepted with some rate rho_r, and the tokens a tree emits are 1 + the number of
    accepted nodes, so a tree of the best B nodes emits 1 + sum_{r<=B} rho_r in expectation. Ranks past
    the budget drafted are not tested (censoring again): a rank's rate is shrunk towards the rate of the
    rank before it, and an untested rank takes that rate. (Rates need not fall with r: a shallow sibling
    can outscore a deep node on the top path that is accepted more often.)
    """

    def __init__(self, forgetting: float = 0.95, max_positions: int = 16, prior: tuple[float, float] = (1.0, 1.0)):
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        a0, b0 = (float(v) for v in prior)
        if a0 <= 0 or b0 <= 0:
            raise ValueError(f"prior must be two positive pseudo-counts (a, b), got {prior}")
        self.forgetting = float(forgetting)
        self.max_positions = int(max_positions)
        self.prior = (a0, b0)
        self.a, self.b = a0, b0
        self._pos_a = [0.0] * self.max_positions  # [max_positions] success mass at position j
        self._pos_b = [0.0] * self.max_positions  # [max_positions] failure mass at position j
        # [2][max_positions] the same, split by context (0: last step had a rejection, 1: all accepted)
        self._ctx_a = [[0.0] * self.max_positions for _ in range(2)]
        self._ctx_b = [[0.0] * self.max_positions for _ in range(2)]
        self.context = 0  # the previous drafting step's outcome: 1 if every drafted token was accepted
        self.context_prior = 8.0  # pseudo-steps of the pooled rate in each context's estimate
        self._rank_a: list[float] = []  # [ranks seen] success mass of the r-th best tree node
        self._rank_b: list[float] = []  # [ranks seen] failure mass of the r-th best tree node
        self._steps = 0
        self.tree_steps = 0

    def observe(self, k: int, n: int, beta: Sequence[float] | None = None) -> None:
        """Record one step: n accepted of k drafted.

        beta: optional acceptance probabilities, one per position (chain) or per depth tried (tree); only
        the first min(n + 1, k, len(beta)) are used, and it must cover the n accepted ones. For a tree,
        k may be the node count: a beta of exactly n entries (a leaf was reached, no depth rejected)
        then counts no failure.
        """
        k, n = int(k), int(n)
        if k < 0 or not 0 <= n <= k:
            raise ValueError(f"need 0 <= n <= k, got k={k}, n={n}")
        lam = self.forgetting
        if k == 0:  # plain step: nothing tested, but the evidence ages (see the class doc)
            self._scale_counts(lam)
            return
        tested = min(n + 1, k)
        if beta is None:
            outcomes = [1.0] * n + [0.0] * (tested - n)
        else:
            b_list = _as_float_list(beta)
            if len(b_list) < n:
                raise ValueError(f"beta needs a value for each of the {n} accepted positions, got {len(b_list)}")
            tested = min(tested, len(b_list))
            outcomes = b_list[:tested]
            if any(not 0.0 <= v <= 1.0 for v in outcomes):
                raise ValueError(f"beta values must lie in [0, 1], got {outcomes}")
        succ = sum(outcomes)
        self.a = lam * self.a + succ
        self.b = lam * self.b + (tested - succ)
        ca, cb = self._ctx_a[self.context], self._ctx_b[self.context]
        self._decay_positions()
        for pa, pb in ((self._pos_a, self._pos_b), (ca, cb)):
            for j in range(min(tested, self.max_positions)):
                pa[j] += outcomes[j]
                pb[j] += 1.0 - outcomes[j]
        self.context = 1 if n == k else 0
        self._steps += 1

    def _decay_positions(self, lam: float | None = None) -> None:
        lam = self.forgetting if lam is None else lam
        for pa, pb in [(self._pos_a, self._pos_b)] + list(zip(self._ctx_a, self._ctx_b)):
            for j in range(self.max_positions):
                pa[j] *= lam
                pb[j] *= lam

    def discount(self, factor: float) -> None:
        """Scale every acceptance count by `factor` in (0, 1]: the rates keep their means and lose weight,
        so what comes next moves them faster (a new text starts; trees' per-rank counts are kept)."""
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"discount factor must be in (0, 1], got {factor}")
        self._scale_counts(factor)

    def _scale_counts(self, factor: float) -> None:
        """Overall and per-position (pooled and per-context) counts times `factor`."""
        self.a, self.b = factor * self.a, factor * self.b
        self._decay_positions(factor)

    def observe_ranks(self, accepted: Sequence[bool]) -> None:
        """One tree step: accepted[r] says whether the step's (r+1)-th best node (by path probability) was
        on the accepted path; its length is the number of nodes drafted."""
        lam = self.forgetting
        while len(self._rank_a) < len(accepted):
            self._rank_a.append(0.0)
            self._rank_b.append(0.0)
        for r in range(len(self._rank_a)):
            self._rank_a[r] *= lam
            self._rank_b[r] *= lam
        for r, ok in enumerate(accepted):
            self._rank_a[r] += 1.0 if ok else 0.0
            self._rank_b[r] += 0.0 if ok else 1.0
        self.tree_steps += 1

    def per_rank(self, max_nodes: int) -> list[float]:
        """[max_nodes] rho_r, the acceptance rate of the r-th best tree node (see the class doc)."""
        m = self.prior[0] + self.prior[1]
        out, last = [], self.alpha
        for r in range(max_nodes):
            if r < len(self._rank_a) and self._rank_a[r] + self._rank_b[r] > 1e-3:
                rate = (self._rank_a[r] + m * last) / (self._rank_a[r] + self._rank_b[r] + m)
            else:
                rate = last
            out.append(rate)
            last = rate
        return out

    @property
    def alpha(self) -> float:
        """Posterior mean of the per-token acceptance rate."""
        return self.a / (self.a + self.b)

    @property
    def per_position_pooled(self) -> list[float]:
        """[max_positions] alpha_j = P(position j accepted | positions < j accepted), shrunk to alpha."""
        alpha, m = self.alpha, self.prior[0] + self.prior[1]
        return [(sa + m * alpha) / (sa + sb + m) for sa, sb in zip(self._pos_a, self._pos_b)]

    @property
    def per_position(self) -> list[float]:
        """[max_positions] alpha_j in the current context (see the class doc), shrunk to the pooled alpha_j."""
        m = self.context_prior
        ca, cb = self._ctx_a[self.context], self._ctx_b[self.context]
        return [(sa + m * pooled) / (sa + sb + m) for sa, sb, pooled in zip(ca, cb, self.per_position_pooled)]

    @property
    def steps(self) -> int:
        """Number of steps observed that drafted at least one token."""
        return self._steps

    def tau(self, k: int) -> float:
        """Expected tokens per step with k drafted (bonus included), from the per-position rates."""
        rates = self.per_position
        rates += [rates[-1]] * max(0, k - len(rates))
        return expected_tokens(rates, k)

    def to_dict(self) -> dict:
        return {
            "alpha": self.alpha,
            "per_position": self.per_position,
            "per_position_pooled": self.per_position_pooled,
            "context": self.context,
            "steps": self._steps,
            "a": self.a,
            "b": self.b,
            "forgetting": self.forgetting,
        }


# ----------------------------------------------------------------------------------------------------
# Costs


class CostModel:
    """Measured, smoothed (EMA) costs: seconds per drafted token and seconds per target forward over n tokens.

    x <- (1 - smoothing) * x + smoothing * new; the first measurement of a quantity is taken as is.

    T_target_1 (a plain step) is its own EMA: a forward over one token is a matrix-vector product, a
    different kernel from a forward over several, and on a CPU it is much cheaper than the line through
    the multi-token forwards would say (the zoo target: 9 ms for 1 token, 12 ms for 2, 14 ms for 9).
    Until a plain step is measured it is the line's value at n = 1, never below max_n T_verify(n) / n.

    T_verify(n) for n >= 2 is a line, a + b (n - 1) with b >= 0 (a forward over more tokens never costs
    less), fitted by weighted least squares through the per-n EMAs of n >= 2, each weighted by how often,
    and how recently, that n was measured (weights decay by `forgetting` per measurement). One line, not
    a table: a slow measurement at an n the plan then stops visiting (a first forward at a new shape pays
    for kernel set-up) fades behind the n's measured every step instead of pricing that k out for good.
    The slope is ridge-shrunk towards 0 (flat, the memory-bound case): with two distinct n the
    least-squares line passes through both whatever their weights, so without the shrinkage one stale
    slow forward would tilt the line for good; shrunk, the line flattens as that point's weight fades,
    the plan tries longer drafts, and their measurements set the slope. Likewise the intercept is shrunk
    towards T_target_1 with the same prior weight, so stale multi-token measurements fade towards the
    plain step's cost. With one n >= 2 measured the line is flat; with none it is flat at T_target_1
    (the optimistic, memory-bound prior).

    An n measured often and recently (decayed count >= `trusted_weight`) is priced by its own EMA rather
    than the line: real kernels are not linear in n (on this project's CPU a forward over 4-7 tokens
    can cost less than one over 2-3), and the plan should see that where it has the evidence. A single
    or stale measurement never is: the line prices it.

    Before any measurement the unit is arbitrary: T_target_1 = 1, verification is flat, c = 0.1.
    """

    DEFAULT_C = 0.1

    def __init__(self, smoothing: float = 0.2, forgetting: float = 0.9):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.smoothing = float(smoothing)
        self.forgetting = float(forgetting)
        self.slope_prior = 0.5  # ridge on b, in weight x tokens^2: a slope needs recent evidence at 2+ n's
        self.trusted_weight = 2.0  # an n measured this often (decayed count) is priced by its own EMA
        self._draft: float | None = None  # seconds per drafted token
        self._verify: dict[int, float] = {}  # n tokens in the target forward -> seconds (EMA)
        self._weight: dict[int, float] = {}  # n -> measurements seen, decayed by `forgetting` per measurement
        self._fitted: tuple[float, float] | None = None  # (a, b), cached until the next measurement

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.smoothing) * old + self.smoothing * new

    def observe_draft(self, num_tokens: int, seconds: float) -> None:
        """The drafter spent `seconds` proposing `num_tokens` tokens (ignored when num_tokens <= 0)."""
        if num_tokens > 0 and seconds >= 0:
            self._draft = self._ema(self._draft, float(seconds) / num_tokens)

    def observe_verify(self, num_tokens_verified: int, seconds: float) -> None:
        """A target forward over n = num_tokens_verified tokens (k drafted + the root: n = k + 1)."""
        n = int(num_tokens_verified)
        if n < 1:
            raise ValueError(f"a target forward covers at least 1 token, got {n}")
        if seconds >= 0:
            self._verify[n] = self._ema(self._verify.get(n), float(seconds))
            for m in self._weight:
                self._weight[m] *= self.forgetting
            self._weight[n] = self._weight.get(n, 0.0) + 1.0
            self._fitted = None

    def trusted(self, n: int) -> bool:
        """Whether n is measured often and recently enough to be priced by its own EMA."""
        return self._weight.get(int(n), 0.0) >= self.trusted_weight

    def observe_plain(self, seconds: float) -> None:
        """A plain decoding step: the target forward over one token (T_target_1)."""
        self.observe_verify(1, seconds)

    @property
    def measured(self) -> bool:
        """True once at least one target forward has been timed."""
        return bool(self._verify)

    def _line(self) -> tuple[float, float]:
        """(a, b) of T_verify(n) = a + b (n - 1) for n >= 2: weighted least squares through the n >= 2
        EMAs, b >= 0 (see class doc); flat at the plain step's cost while no n >= 2 is measured."""
        if self._fitted is None:
            pts = {n: t for n, t in self._verify.items() if n >= 2}
            if not pts:
                self._fitted = (self._verify[1], 0.0)
            else:
                w = self._weight
                total = sum(w[n] for n in pts)
                xm = sum(w[n] * n for n in pts) / total
                ym = sum(w[n] * t for n, t in pts.items()) / total
                sxx = sum(w[n] * (n - xm) ** 2 for n in pts)
                sxy = sum(w[n] * (n - xm) * (t - ym) for n, t in pts.items())
                b = max(0.0, sxy / (sxx + self.slope_prior)) if sxx + self.slope_prior > 0 else 0.0
                a = ym - b * (xm - 1.0)
                if 1 in self._verify:  # prior: flat at the plain step, worth `slope_prior` measurements
                    a = (total * a + self.slope_prior * self._verify[1]) / (total + self.slope_prior)
                self._fitted = (a, b)
        return self._fitted

    @property
    def t_target_1(self) -> float:
        """Seconds for a plain decoding step (target forward over 1 token; see class doc)."""
        if not self._verify:
            return 1.0
        if 1 in self._verify:
            return self._verify[1]
        a = self._line()[0]
        return max(a, max(t / n for n, t in self._verify.items()))

    def t_verify(self, n: int) -> float:
        """Seconds for a target forward over n tokens: T_target_1 for n = 1; for n >= 2 its own EMA while
        n is measured often (weight >= `trusted_weight`), the fitted line otherwise (see class doc)."""
        n = int(n)
        if n < 1:
            raise ValueError(f"a target forward covers at least 1 token, got {n}")
        if not self._verify:
            return 1.0
        if n == 1:
            return self.t_target_1
        if self.trusted(n):
            return self._verify[n]
        a, b = self._line()
        return a + b * (n - 1)

    @property
    def t_draft(self) -> float:
        """Seconds per drafted token (DEFAULT_C * T_target_1 until measured)."""
        return self.DEFAULT_C * self.t_target_1 if self._draft is None else self._draft

    @property
    def c(self) -> float:
        """Cost ratio c = T_draft / T_target_1."""
        return self.t_draft / self.t_target_1

    def to_dict(self) -> dict:
        return {
            "t_draft": self.t_draft,
            "t_target_1": self.t_target_1,
            "c": self.c,
            "t_verify": dict(sorted(self._verify.items())),
        }


# ----------------------------------------------------------------------------------------------------
# Policies


@runtime_checkable
class DraftPolicy(Protocol):
    """What the engine asks every step.

    max_length:      the largest budget next_length() returns (the engine may size buffers by it)
    tracker:         the AcceptanceTracker fed by observe() (stats read alpha and tau from it)
    next_length():   draft budget k for the next step; 0 = plain decoding. The engine may lower it
                     (remaining tokens, free pages) and must then report the k it actually drafted.
    should_continue(position, draft_prob): called after drafting token `position` (1-based) with the
                     draft's probability of that token; False stops drafting this step.
    observe(k, n, draft_s, verify_s, beta=None): after every step, plain ones included (k = 0): k drafted,
                     n accepted, seconds spent drafting and in the target forward over k + 1 tokens,
                     beta = optional per-position acceptance probabilities sum_x min(p_j, q_j) (sampling).
    begin_sequence(): optional; the engine calls it when a generation starts (after the prefill).
    """

    max_length: int
    tracker: AcceptanceTracker

    def next_length(self) -> int: ...

    def should_continue(self, position: int, draft_prob: float) -> bool: ...

    def observe(self, k: int, n: int, draft_s: float, verify_s: float, beta=None) -> None: ...


class _BasePolicy:
    """Shared bookkeeping: every policy keeps a tracker and a cost model so stats can report alpha and c."""

    def __init__(self, max_length: int, tracker: AcceptanceTracker | None, costs: CostModel | None):
        self.max_length = max_length
        self.tracker = tracker if tracker is not None else AcceptanceTracker()
        self.costs = costs if costs is not None else CostModel()

    def should_continue(self, position: int, draft_prob: float) -> bool:
        return True

    def observe(self, k: int, n: int, draft_s: float, verify_s: float, beta=None) -> None:
        self.tracker.observe(k, n, beta)
        self.costs.observe_draft(k, draft_s)
        self.costs.observe_verify(k + 1, verify_s)


class ConstantPolicy(_BasePolicy):
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


class HeuristicPolicy(_BasePolicy):
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


class AdaptivePolicy(_BasePolicy):
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
    (T_tree_draft + T_verify(B + 1)), rho_r the tracker's per-rank rates and T_tree_draft the measured
    drafting time of a tree step (one forward per depth, so about the same for every B). The first
    `warmup` tree steps, and every `tree_probe_every`-th after, draft the whole spec so every rank stays
    measured.
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
        self._tree_draft_s: float | None = None  # EMA of a tree step's drafting seconds
        self._tree_plan = 0  # tree steps planned so far
        self.tree_warmup = 3

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
        t_draft = self._tree_draft_s if self._tree_draft_s is not None else c.t_draft
        best_b, best_s, tau = 0, c.t_target_1 / c.t_verify(1), 1.0
        for b, rho in enumerate(self.tracker.per_rank(max_nodes), start=1):
            tau += rho
            s = tau * c.t_target_1 / (t_draft + c.t_verify(b + 1))
            if s > best_s:
                best_b, best_s = b, s
        self._plan_s = best_s
        return best_b

    def observe_tree(self, accepted_by_rank: Sequence[bool], draft_s: float) -> None:
        """A tree step: accepted_by_rank as in AcceptanceTracker.observe_ranks; draft_s its drafting time."""
        self.tracker.observe_ranks(accepted_by_rank)
        if accepted_by_rank:
            self._tree_draft_s = self.costs._ema(self._tree_draft_s, float(draft_s))

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
        }

    def __repr__(self) -> str:
        return f"AdaptivePolicy(max_length={self.max_length}, alpha={self.tracker.alpha:.3f}, c={self.costs.c:.3f})"


def make_policy(draft_length="adaptive", max_draft_length: int = 8) -> DraftPolicy:
    """The `draft_length` option -> a DraftPolicy.

    int k >= 0 -> ConstantPolicy(k) (an explicit k wins over max_draft_length); "adaptive" (the default)
    -> AdaptivePolicy(max_draft_length); "heuristic" -> HeuristicPolicy(max_length=max_draft_length);
    a DraftPolicy instance is used as is (its learned state carries over between calls).
    """
    choices = "an int >= 0, 'adaptive', 'heuristic', or a specdec.policy.DraftPolicy instance"
    if isinstance(draft_length, bool):
        raise ValueError(f"draft_length must be {choices}; got {draft_length!r}")
    if isinstance(draft_length, numbers.Integral):
        if draft_length < 0:
            raise ValueError(f"draft_length must be >= 0 (0 = plain decoding), got {draft_length}")
        return ConstantPolicy(int(draft_length))
    if isinstance(draft_length, str):
        name = draft_length.strip().lower()
        if name in ("adaptive", "heuristic"):
            m = max_draft_length
            if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
                raise ValueError(f"max_draft_length must be an int >= 1, got {max_draft_length!r}")
            if name == "adaptive":
                # early stop stays opt-in: measured on the zoo, its confidence calibration starts too
                # pessimistic for greedy drafts and then never sees the later positions it cut off
                return AdaptivePolicy(max_length=int(max_draft_length), early_stop=False)
            return HeuristicPolicy(initial=min(4, int(max_draft_length)), max_length=int(max_draft_length))
    elif isinstance(draft_length, DraftPolicy):
        return draft_length
    raise ValueError(f"draft_length must be {choices}; got {draft_length!r}")
