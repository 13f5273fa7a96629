"""The cost model: measured seconds per drafted token and per target forward over n tokens."""
from __future__ import annotations


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

    `sharing_target()` gives a cost model with its own draft cost that shares these target forward
    timings (one target, drafted for by two sources: policy/adaptive.py's per-source plans).
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
        self._fwd = _ForwardTimes()  # the target forward timings (shared by sharing_target's cost models)

    def sharing_target(self) -> "CostModel":
        """A cost model of the same settings whose draft cost is its own (unmeasured) and whose target
        forward timings are this one's: a measurement through either is seen by both."""
        other = CostModel(self.smoothing, self.forgetting)
        other.slope_prior, other.trusted_weight = self.slope_prior, self.trusted_weight
        other._fwd = self._fwd
        return other

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
            self._fwd.seconds[n] = self._ema(self._fwd.seconds.get(n), float(seconds))
            for m in self._fwd.weight:
                self._fwd.weight[m] *= self.forgetting
            self._fwd.weight[n] = self._fwd.weight.get(n, 0.0) + 1.0
            self._fwd.fitted = None

    def trusted(self, n: int) -> bool:
        """Whether n is measured often and recently enough to be priced by its own EMA."""
        return self._fwd.weight.get(int(n), 0.0) >= self.trusted_weight

    def observe_plain(self, seconds: float) -> None:
        """A plain decoding step: the target forward over one token (T_target_1)."""
        self.observe_verify(1, seconds)

    def measured_at(self, n: int) -> bool:
        """Whether a target forward over n tokens has been timed (n = 1: a plain step)."""
        return int(n) in self._fwd.seconds

    @property
    def measured(self) -> bool:
        """True once at least one target forward has been timed."""
        return bool(self._fwd.seconds)

    def _line(self) -> tuple[float, float]:
        """(a, b) of T_verify(n) = a + b (n - 1) for n >= 2: weighted least squares through the n >= 2
        EMAs, b >= 0 (see class doc); flat at the plain step's cost while no n >= 2 is measured."""
        if self._fwd.fitted is None:
            pts = {n: t for n, t in self._fwd.seconds.items() if n >= 2}
            if not pts:
                self._fwd.fitted = (self._fwd.seconds[1], 0.0)
            else:
                w = self._fwd.weight
                total = sum(w[n] for n in pts)
                xm = sum(w[n] * n for n in pts) / total
                ym = sum(w[n] * t for n, t in pts.items()) / total
                sxx = sum(w[n] * (n - xm) ** 2 for n in pts)
                sxy = sum(w[n] * (n - xm) * (t - ym) for n, t in pts.items())
                b = max(0.0, sxy / (sxx + self.slope_prior)) if sxx + self.slope_prior > 0 else 0.0
                a = ym - b * (xm - 1.0)
                if 1 in self._fwd.seconds:  # prior: flat at the plain step, worth `slope_prior` measurements
                    a = (total * a + self.slope_prior * self._fwd.seconds[1]) / (total + self.slope_prior)
                self._fwd.fitted = (a, b)
        return self._fwd.fitted

    @property
    def t_target_1(self) -> float:
        """Seconds for a plain decoding step (target forward over 1 token; see class doc)."""
        if not self._fwd.seconds:
            return 1.0
        if 1 in self._fwd.seconds:
            return self._fwd.seconds[1]
        a = self._line()[0]
        return max(a, max(t / n for n, t in self._fwd.seconds.items()))

    def t_verify(self, n: int) -> float:
        """Seconds for a target forward over n tokens: T_target_1 for n = 1; for n >= 2 its own EMA while
        n is measured often (weight >= `trusted_weight`), the fitted line otherwise (see class doc)."""
        n = int(n)
        if n < 1:
            raise ValueError(f"a target forward covers at least 1 token, got {n}")
        if not self._fwd.seconds:
            return 1.0
        if n == 1:
            return self.t_target_1
        if self.trusted(n):
            return self._fwd.seconds[n]
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
            "t_verify": dict(sorted(self._fwd.seconds.items())),
        }


class _ForwardTimes:
    """A target's forward timings: per n the EMA of seconds and the decayed measurement weight, and the
    fitted line (cached until the next measurement)."""

    def __init__(self):
        self.seconds: dict[int, float] = {}  # n tokens in the target forward -> seconds (EMA)
        self.weight: dict[int, float] = {}  # n -> measurements seen, decayed by `forgetting` per measurement
        self.fitted: tuple[float, float] | None = None  # (a, b)
