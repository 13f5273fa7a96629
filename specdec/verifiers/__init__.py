"""Verifiers: pure functions that decide which drafted tokens the target keeps.

greedy_chain / greedy_tree     argmax matching (lossless for greedy decoding)
sample_chain / sample_tree     speculative rejection sampling (lossless for sampling)
typical_tree                   Medusa typical acceptance (LOSSY, explicit opt-in)

p and q must both come from `warp_logits` + `probs_from_scores` with the same SamplingParams.
"""
from .chain import sample_chain
from .greedy import greedy_chain, greedy_tree
from .result import VerifyResult
from .sampling import SamplingParams, probs_from_scores, sample, warp_logits
from .tree import sample_tree
from .typical import typical_tree

__all__ = [
    "SamplingParams",
    "VerifyResult",
    "greedy_chain",
    "greedy_tree",
    "probs_from_scores",
    "sample",
    "sample_chain",
    "sample_tree",
    "typical_tree",
    "warp_logits",
]
