"""How much to draft next step: the acceptance tracker, the cost model and the draft-length policies.

Speculative decoding pays off only while the drafts are accepted often enough to cover their cost. Two
numbers decide it (DESIGN.md §6, reference/theory.md §1): the per-token acceptance rate alpha and the
measured costs (T_draft per drafted token, T_verify(n) for a target forward over n tokens). This package
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

import numbers

from .adaptive import AdaptivePolicy
from .base import DraftPolicy, PolicyBase, SourcePolicy
from .costs import CostModel
from .formulas import best_length, expected_speedup, expected_tokens, ideal_speedup
from .simple import ConstantPolicy, HeuristicPolicy
from .tracker import AcceptanceTracker

__all__ = [
    "AcceptanceTracker",
    "CostModel",
    "DraftPolicy",
    "PolicyBase",
    "SourcePolicy",
    "ConstantPolicy",
    "HeuristicPolicy",
    "AdaptivePolicy",
    "make_policy",
    "expected_tokens",
    "expected_speedup",
    "ideal_speedup",
    "best_length",
]


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
