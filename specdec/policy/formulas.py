"""The speedup formulas (pure functions of acceptance rates and costs; the policies and the tests use them).

    S(k)   = tau(k) * T_target_1 / (k * T_draft + T_verify(k + 1))     speedup over plain decoding
    tau(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j                        expected tokens per step (bonus incl.)
"""
from __future__ import annotations

import numbers
from typing import Callable

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
