"""`FeatureHead`: the EAGLE-family drafter, a small head that reads the target's own features.

The network is drafters/head_model.py; this module runs it over the paged cache. The head's decoder
layer keeps its KV in its own page tensors on the shared block table, one entry per sequence position:
entry p reads [the target's feature of p, token p + 1] and predicts the feature of p + 1 (so token
p + 2). The engine hands the target's features through a FeatureLog (hf/features.py) filled from the
forwards the target runs anyway; the head's valid entries are exactly the positions whose features it
has, [0, root) after each step, and everything it drafts past them is scratch rewritten next step.

Per proposal: one catch-up forward over the newly verified positions (its last row drafts token 1),
then one forward per further chain token, or, for a tree (EAGLE-2), one forward per depth over the
frontier with the tree mask. Draft logits cover the head's draft vocabulary only; they are scattered
into the full vocabulary (-inf elsewhere) before the engine's logits processing, so the sampled
proposal's q is the head's processed distribution over its subset, zero outside: verification is exact.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..cache.paged import PagedKV
from ..tree import TreeGrower, TreeSpec
from ..verifiers.sampling import probs_from_scores
from .base import Draft, DraftContext, DraftSetup
from .head_forward import run_head
from .head_model import HeadConfig, HeadNet, fingerprint
from .model import draft_chain

CONFIG_NAME, WEIGHTS_NAME = "head_config.json", "head.safetensors"


class FeatureHead:
    """Draft with a trained feature head for `target` (see the module docstring).

    FeatureHead.from_pretrained(dir, target) loads a head saved by the trainer and refuses one trained
    for another target; FeatureHead(net, target) wraps a HeadNet in memory (tests, the trainer)."""

    def __init__(self, net: HeadNet, target):
        self.net = net.eval()
        self.target = target
        dtype = next(target.parameters()).dtype
        self.net.to(device=next(target.parameters()).device, dtype=dtype)
        self.net.bind(target)
        self.feature_layers = tuple(net.config.feature_layers)
        self.vocab_size = net.config.vocab_size
        self.kv: PagedKV | None = None
        self.table = None
        self.features = None

    # -- loading ---------------------------------------------------------------------------------
    @staticmethod
    def from_pretrained(path, target, check_fingerprint: bool = True) -> "FeatureHead":
        """A head saved by `specdec train-head`, or an EAGLE-3 checkpoint as vLLM / SGLang / speculators
        publish them (drafters/eagle_format.py; those record no fingerprint of their target's weights)."""
        from .eagle_format import is_eagle3_folder, load_eagle3

        path = Path(path)
        if not (path / CONFIG_NAME).exists() and is_eagle3_folder(path):
            return FeatureHead(load_eagle3(path, target, check_fingerprint), target)
        if not (path / CONFIG_NAME).exists() or not (path / WEIGHTS_NAME).exists():
            raise ValueError(f"{path} is not a feature head folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME} "
                             "(a specdec head) or config.json and *.safetensors (an EAGLE-3 checkpoint)")
        config = HeadConfig.from_dict(json.loads((path / CONFIG_NAME).read_text()))
        check_head_matches(config, target, check_fingerprint, path)
        net = HeadNet(config)
        state = load_file(str(path / WEIGHTS_NAME))
        missing, unexpected = net.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                   for k, v in state.items()}, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path / WEIGHTS_NAME} does not match its config: missing {missing}, unexpected {unexpected}")
        return FeatureHead(net, target)

    # -- batches (specdec/batch.py) ----------------------------------------------------------------
    def for_row(self) -> "FeatureHead":
        """A head for one row of a batch: the same network, its own pages, table and features."""
        row = copy.copy(self)
        row.kv = row.table = row.features = None
        return row

    def for_batch(self, pool):
        """Every row's chain or tree drafted in one head forward per draft position (HeadRows)."""
        from .head_rows import HeadRows

        return HeadRows(self, pool)

    # -- the Drafter protocol --------------------------------------------------------------------
    def attach(self, features) -> None:
        self.features = features

    def begin(self, setup: DraftSetup) -> None:
        """Bind our pages; catch up on the prompt's positions whose next token is known (all but the last)."""
        if self.features is None:
            raise ValueError("FeatureHead needs the target's features: run it through specdec's engine "
                             "(generate / wrap / hf_custom_generate), which attaches them")
        table, prompt = setup.table, setup.prompt
        if self.kv is not None and self.table is table:  # a kept sequence (chat): keep our entries
            self.kv.valid = min(self.kv.valid, setup.reused_tokens)
        else:
            self.table = table
            self.kv = PagedKV(table.pool, len(self.net.layers), next(self.target.parameters()).device)
        if prompt is not None and prompt.numel() - 1 > self.kv.valid:
            self._catch_up(prompt)

    def accept(self, num_context_tokens: int) -> None:
        self.kv.valid = min(self.kv.valid, num_context_tokens - 1)

    def end(self) -> None:
        self.kv = self.table = self.features = None

    @torch.no_grad()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        device = ctx.tokens.device
        feat, scores = self._catch_up(ctx.tokens)  # the root's predicted feature [1, H] and its draft scores
        pos = self.kv.valid  # the first scratch position: draft token i + 1's entry sits at pos + i

        def advance(x: int, i: int) -> torch.Tensor:  # the next entry reads the feature the last one predicted
            nonlocal feat
            p = pos + i
            self.table.reserve(p + 1)
            slots = self.table.slots(0, p + 1)
            feat = self._run(feat, torch.tensor([x], device=device), torch.tensor([p], device=device),
                             slots[-1:], slots, None)
            return self.full_scores(feat)

        return draft_chain(ctx, budget, scores, advance)

    @torch.no_grad()
    def propose_tree(self, ctx: DraftContext, spec: TreeSpec, budget: int) -> Draft:
        """EAGLE-2: expand by path probability (TreeGrower), one head forward per depth over the frontier."""
        device = ctx.tokens.device
        grower = TreeGrower(spec, budget)
        if grower.budget <= 0:
            return Draft.empty(device)
        root_feat, scores = self._catch_up(ctx.tokens)
        frontier = grower.expand(probs_from_scores(ctx.process(scores, ctx.tokens, [[]])))
        base = self.kv.valid  # a depth-d node's entry sits at position base + d - 1
        written: list[int] = []
        pred: dict[int, torch.Tensor] = {-1: root_feat[0]}  # node -> its predicted feature [H]
        while frontier and grower.level < spec.depth:
            m, f = len(written), len(frontier)
            tree, paths = grower.frontier_block(frontier, written)
            mask = torch.cat([torch.ones(f, base, dtype=torch.bool), tree], dim=1)  # the entries before: all seen
            self.table.reserve(base + m + f)
            slots = self.table.slots(0, base + m + f)
            feats = torch.stack([pred[grower.parents[a]] for a in frontier])
            tokens = torch.tensor([grower.tokens[a] for a in frontier], dtype=torch.long, device=device)
            positions = torch.tensor([base + grower.depth[a] - 1 for a in frontier], device=device)
            out = self._run(feats, tokens, positions, slots[base + m:], slots, mask.to(device))
            for row, node in enumerate(frontier):
                pred[node] = out[row]
            frontier = grower.expand(probs_from_scores(ctx.process(self.full_scores(out), ctx.tokens, paths)))
        toks, parents = grower.result()
        return Draft.from_lists(toks, parents, device, scores=grower.kept_scores)

    # -- the head over the paged cache -----------------------------------------------------------
    def _catch_up(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries for positions [valid, T - 1) of the context tokens [T] (features from the log); returns
        the last entry's predicted feature [1, H] (the root's) and its full-vocabulary scores [1, V]."""
        start, end = self.kv.valid, tokens.numel() - 1
        if end <= start:  # nothing new (e.g. a step right after a kept prefix): re-run the last entry
            start = end - 1
        self.table.reserve(end)
        slots = self.table.slots(0, end)
        feats = self.net.project(self.features.rows(start, end).to(next(self.net.parameters()).dtype))
        positions = torch.arange(start, end, device=tokens.device)
        mask = torch.ones(end - start, end, dtype=torch.bool, device=tokens.device).tril_(start)
        out = self._run(feats, tokens[start + 1:end + 1], positions, slots[start:end], slots, mask)
        self.kv.valid = end
        return out[-1:], self.full_scores(out[-1:])

    def _run(self, feats, tokens, positions, write_slots, read_slots, mask) -> torch.Tensor:
        return run_head(self.net, self.kv, feats, tokens, positions, write_slots, read_slots, mask)

    def full_scores(self, feat: torch.Tensor) -> torch.Tensor:
        """Predicted features [r, H] -> draft logits over the full vocabulary [r, V], -inf off the subset."""
        sub = self.net.logits(feat)
        if sub.shape[-1] == self.vocab_size:
            return sub
        full = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.net.vocab_ids, sub)


def fingerprint_matches(config: HeadConfig, target) -> bool:
    """The target's weights are the ones the head was trained on, in float32 or rounded to bfloat16 (a head
    records both; one saved before the bfloat16 record matches its float32 target only)."""
    if config.target_fingerprint == fingerprint(target):
        return True
    return bool(config.target_fingerprint_bf16) and config.target_fingerprint_bf16 == fingerprint(target, torch.bfloat16)


def check_head_matches(config: HeadConfig, target, check_fingerprint: bool, where="the head") -> None:
    """ValueError naming the mismatch when a head was trained for another target."""
    cfg = target.config.get_text_config()
    have = {"architecture": type(target).__name__, "hidden size": cfg.hidden_size, "vocabulary": cfg.vocab_size,
            "layers": cfg.num_hidden_layers}
    want = {"architecture": config.target_architecture, "hidden size": config.hidden_size,
            "vocabulary": config.vocab_size, "layers": config.num_target_layers}
    diff = [f"{k} {want[k]} (target: {have[k]})" for k in want if want[k] != have[k]]
    if not diff and check_fingerprint and config.target_fingerprint and not fingerprint_matches(config, target):
        diff = [f"weights fingerprint {config.target_fingerprint} (target: {fingerprint(target)})"]
    if diff:
        raise ValueError(f"{where} was trained for another target: " + "; ".join(diff) +
                         ". Train a head for this target with `specdec train-head --target ...`")
