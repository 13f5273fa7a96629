"""The one thing every verifier returns.

Words (as in vLLM): the draft's tokens that the target keeps are *accepted*; at the first rejection the
verifier emits a *recovered* (correction) token drawn from the residual distribution; when every draft
token on the path is accepted it emits a *bonus* token from the target's distribution after the last
one. So one verification step always emits  accepted + (recovered or bonus)  =  len(path) + 1  tokens.
"""
from __future__ import annotations

from dataclasses import dataclass



@dataclass
class VerifyResult:
    """Outcome of verifying one draft (a chain or a tree) against one target forward.

    path:       accepted node indices into the draft, root-to-leaf order; [] if none was accepted.
                For a chain this is always [0, 1, ..., n_accepted - 1].
    next_token: the recovered token (at the first rejection) or the bonus token (everything on the
                path accepted and nothing left to try). It becomes the next step's root.
    beta:       [d] floats (read with the path, in the same transfer): the acceptance probability per
                depth where the verifier knows it, else None.
                Chain verifiers give one entry per draft position ([k]); entry j is the exact probability
                that position j is accepted given the drafted prefix before it (sampling:
                sum_v min(p_j, q_j); greedy: 1.0 if the draft equals the target argmax, else 0.0).
                Entries past the first rejection were never tested: a tracker that wants only tested
                positions uses beta[: len(path) + 1].
                Tree verifiers give one entry per depth actually tried (len(path) + 1 when stopped at a
                node with children, len(path) when a leaf was reached): the probability that some child
                at that depth is accepted, given the drafted children.
    """

    path: list[int]
    next_token: int
    beta: list[float] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.path)
