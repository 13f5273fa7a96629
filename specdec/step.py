"""The pieces of a speculation step that the single-sequence engine (engine.py) and the batch
(batch.py) share: picking a token, the stop rule, a tree proposal pruned to its spec, the verifier for
a draft, and moving an accepted tree path's KV into place."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .drafters.base import Draft, DraftContext, HostCopy, check_draft
from .transfer import to_device
from .tree import TreeSpec, depth_list, path_to, subtree_parents
from .verifiers import greedy_chain, greedy_tree, sample_chain, sample_tree
from .verifiers.sampling import SamplingParams, probs_from_scores, sample


@dataclass
class Limits:
    """When to stop. max_new_tokens is exact; eos ends generation right after the EOS token."""

    max_new_tokens: int
    min_new_tokens: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    stopping_criteria: object = None  # HF StoppingCriteriaList or None


def pick_token(scores: torch.Tensor, sampling: SamplingParams, generator) -> int:
    """The token after the last row of scores [r, V]: sampled, or the argmax."""
    if sampling.do_sample:
        return int(sample(probs_from_scores(scores[-1:]), generator)[0])
    return int(scores[-1].argmax())


def stops_at(tokens: list[int], T: int, limits: Limits, scores) -> bool:
    """Whether the LAST token of `tokens` (prompt of T tokens + generated) ends generation."""
    if len(tokens) - T >= limits.max_new_tokens or tokens[-1] in limits.eos_token_ids:
        return True
    if limits.stopping_criteria is not None:
        ids = torch.tensor(tokens, dtype=torch.long)[None]
        return bool(limits.stopping_criteria(ids, scores).any())
    return False


def node_paths(toks: list[int], par: list[int], chain: bool) -> list[list[int]]:
    """Per verification row (the root's, then each node's) the draft tokens on its path: the prefix that
    row's logits processors see after the committed context."""
    if chain:
        return [[]] + [toks[:i + 1] for i in range(len(toks))]
    return [[]] + [[toks[j] for j in path_to(par, i)] for i in range(len(toks))]


def emitting_rows(path: list[int]) -> list[int]:
    """The verification row that predicted each emitted token: the root's, then each accepted node's."""
    return [0] + [i + 1 for i in path]


def compact_path(kv, table, L: int, path: list[int], kernel: bool) -> None:
    """Move the accepted path's KV (tree slots L+1+path) to L+1..L+m, in every layer of `kv`; nothing to
    do when the path already sits there (a chain's always does)."""
    if path == list(range(len(path))):
        return
    device = table.device
    path_t = to_device(path, torch.long, device)
    if kernel:  # the Triton kernel, addressed through the block table like the attention kernel
        from .kernels import compact_kv

        src_pos = L + 1 + path_t
        dst_pos = torch.arange(L + 1, L + 1 + len(path), device=device)
        block_table = table.block_table_tensor()
        for layer in range(kv.num_layers):
            if kv.k[layer] is not None:
                k_pages, v_pages = kv.pages_view(layer)
                compact_kv(k_pages, v_pages, block_table, src_pos, dst_pos)
    else:
        n = max(path) + 1
        kv.move(table.slots(L + 1, L + 1 + n)[path_t], table.slots(L + 1, L + 1 + len(path)))


def propose_tree(drafter, ctx: DraftContext, spec: TreeSpec, nodes: int, vocab: int, device):
    """The drafter's tree (at most `nodes` nodes in the shape of `spec`, pruned to its depth) and its
    tokens, parents and scores as lists (check_draft)."""
    if nodes <= 0:
        return Draft.empty(device), [], [], None
    return check_tree(drafter, drafter.propose_tree(ctx, spec, nodes), spec, nodes, vocab, device)


def check_tree(drafter, draft: Draft, spec: TreeSpec, nodes: int, vocab: int, device):
    """A proposed tree checked (check_draft: `drafter` names the culprit) and pruned to the spec's depth:
    (draft, tokens, parents, scores) as propose_tree returns them."""
    toks, par, node_scores = check_draft(drafter, draft, nodes, vocab)
    keep = [i for i, d in enumerate(depth_list(par)) if d <= spec.depth]  # ancestor-closed
    if len(keep) < len(toks):  # lookup branches may run deeper than the spec allows
        par = subtree_parents(par, keep)
        toks = [toks[i] for i in keep]
        node_scores = None if node_scores is None else [node_scores[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long)
        on_device = to_device(keep, torch.long, device)
        draft = replace(draft, tokens=draft.tokens[on_device], parents=to_device(par, torch.long, device),
                        q_probs=None if draft.q_probs is None else draft.q_probs[on_device],
                        scores=None if draft.scores is None else draft.scores[index.to(draft.scores.device)],
                        host=HostCopy(toks, par, node_scores))
    return draft, toks, par, node_scores


def verify(draft: Draft, scores, sampling: SamplingParams, generator, chain: bool, acceptance: str = "exact"):
    """The verifier for this draft and mode: scores [n + 1, V] processed target rows -> VerifyResult."""
    if acceptance == "typical" and sampling.do_sample:  # greedy decoding emits the argmax either way
        from .verifiers import typical_tree

        return typical_tree(draft.tokens, draft.parents, probs_from_scores(scores), generator)
    if not sampling.do_sample:
        if chain:
            return greedy_chain(draft.tokens, scores)
        return greedy_tree(draft.tokens, draft.parents, scores)
    p = probs_from_scores(scores)
    q = draft.q_probs
    if chain:
        return sample_chain(draft.tokens, p, q, generator)
    return sample_tree(draft.tokens, draft.parents, p, q, generator, draft.siblings_with_replacement)
