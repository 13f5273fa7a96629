"""The acceptance tracker: what the target has accepted, per position and per tree rank, with forgetting."""
from __future__ import annotations

from typing import Sequence

from .formulas import _as_float_list, expected_tokens

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
