"""Self-speculation: the target's own first E layers, plus its final norm and LM head, draft for it.

`EarlyExit(target, exit_layer=E)` drafts with a *view* of the target (hf/layer_views.py: no weight is
copied). With `share_kv` (the default where exact), the draft and the target share the KV of layers
< E, and the work behind it:

- no draft prefill and no draft pages: the target's prefill already wrote layers < E for the prompt;
- each drafting forward (root, then every draft token, the last one included) writes its layer < E KV
  straight into the target's pages and keeps its hidden state leaving layer E - 1;
- verification runs only layers >= E over [root, draft], entered with those hidden states
  (Draft.hidden); rejected positions are rolled back with the target's own KV, as always.

When this is exact: the draft's layers < E compute, for the same token at the same position over the
same prefix KV, the same function the target's forward would; so the shared KV and hidden states are
the target's own values (bit for bit in fp32 on CPU; on accelerators up to the usual batch-shape
rounding, the same single-token shapes plain decoding uses). It needs the decoder to hand
`inputs_embeds` to its first layer untouched: checked on the model itself when the drafter is built
(layer_views.enters_hidden_exactly, a bit-for-bit probe). A model that fails it falls back to separate
draft pages and a full verification, as do token trees (tree nodes are scratch the verification
overwrites), and so do batches (for_row / for_batch: the view drafts every row on its own pages, in one
forward per draft step, ModelRows). Greedy output is the target's either way: the drafter only proposes,
the target verifies.
"""
from __future__ import annotations

import torch

from ..hf.layer_views import enters_hidden_exactly, first_layers
from ..hf.runner import ModelRunner
from .base import Draft, DraftContext, DraftSetup
from .model import ModelDrafter


class EarlyExit(ModelDrafter):
    """Draft with the target's first `exit_layer` layers (self-speculation; no second model).

    share_kv: None (share layers < E with the target where exact, see module docstring), True
    (require it: ValueError for a model where it is not exact) or False (own pages, full verification).
    """

    def __init__(self, target, exit_layer: int, share_kv: bool | None = None):
        super().__init__(first_layers(target, exit_layer))
        exact = share_kv is not False and enters_hidden_exactly(target, exit_layer)
        if share_kv and not exact:
            raise ValueError(f"share_kv=True: entering {type(target).__name__} at layer {exit_layer} with hidden "
                             "states does not reproduce its full forward (its decoder transforms inputs_embeds "
                             "before the first layer); use share_kv=None or False")
        self.target = target
        self.exit_layer = exit_layer
        self.share_kv = exact if share_kv is None else share_kv
        self._tap = self.model.model.norm
        self._target_kv = None

    def begin(self, setup: DraftSetup) -> None:
        if not self.share_kv:
            return super().begin(setup)
        if setup.target is not self.target or setup.target_kv is None:
            raise ValueError("EarlyExit(share_kv) must draft for the model it was built from")
        target_kv = setup.target_kv
        self.runner = ModelRunner(self.model, setup.table.pool, setup.table, setup.kernel)
        self.runner.kv.k, self.runner.kv.v = target_kv.k, target_kv.v  # layers < E: the target's own tensors
        self._target_kv = target_kv

    def for_row(self) -> ModelDrafter:
        """A batch's row drafts with the same view on its own pages (no KV sharing: a shared-KV exit reads
        the one target runner's length, which a batch keeps per row), and the target verifies every layer."""
        return ModelDrafter(self.model, self.lean)

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if not self.share_kv:
            return super().propose(ctx, budget)
        runner = self.runner
        runner.kv.valid = self._target_kv.valid  # the target's KV, every layer, covers [0, root)
        self._tap.captured.clear()
        self._tap.recording = True
        try:
            draft = super().propose(ctx, budget)  # forwards: root, then tokens 0 .. n-2
            runner.forward(draft.tokens[-1:], logits_rows=torch.zeros(0, dtype=torch.long))  # token n-1's KV
            captured = self._tap.captured
            hidden = torch.cat([captured[0][0, -1:]] + [h[0] for h in captured[1:]])  # [n + 1, H]
        finally:
            self._tap.recording = False
            self._tap.captured.clear()
        draft.hidden, draft.from_layer = hidden, self.exit_layer
        return draft

    def propose_tree(self, ctx: DraftContext, spec, budget: int) -> Draft:
        if self.share_kv:  # the target's KV for [0, root) is ours; tree nodes are scratch it overwrites
            self.runner.kv.valid = self._target_kv.valid
        return super().propose_tree(ctx, spec, budget)

    def end(self) -> None:
        super().end()
        self._target_kv = None


@torch.no_grad()
def choose_exit_layer(target, sequences: list[torch.Tensor], prompt_lengths: list[int],
                      layers: list[int] | None = None, max_k: int = 8) -> tuple[int, list[dict]]:
    """The exit layer whose draft should pay best, from one teacher-forced target forward per sequence.

    sequences: [1, T] int64 each, a prompt and the target's own greedy continuation; prompt_lengths: where
    each continuation starts. For every candidate E, alpha_E is how often layer E's hidden state, through
    the final norm and LM head, predicts the target's next token on the continuation, and c_E the draft
    step's share of the target's weights (E layers plus the LM head over all layers plus the LM head).
    Returns (best E, one row per candidate: layer, alpha, c, best k and predicted speedup)."""
    from ..policy import ideal_speedup
    from ..hf.layer_views import decoder_of

    decoder, head = decoder_of(target), target.get_output_embeddings()
    n = len(decoder.layers)
    layers = layers or sorted({max(1, round(n * f)) for f in (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)} - {n})
    hits, total = {e: 0 for e in layers}, 0
    for seq, start in zip(sequences, prompt_lengths):
        out = target(input_ids=seq, output_hidden_states=True, use_cache=False)
        want = out.logits[0, start - 1:-1].argmax(-1)
        total += want.numel()
        for e in layers:
            guess = head(decoder.norm(out.hidden_states[e][0, start - 1:-1])).argmax(-1)
            hits[e] += int((guess == want).sum())
    layer_params = sum(p.numel() for p in decoder.layers[0].parameters())
    head_params = head.weight.numel()
    rows = []
    for e in layers:
        alpha = hits[e] / max(1, total)
        c = (e * layer_params + head_params) / (n * layer_params + head_params)
        k, s = max(((k, ideal_speedup(alpha, k, c)) for k in range(1, max_k + 1)), key=lambda t: t[1])
        rows.append({"layer": e, "alpha": alpha, "c": c, "best_k": k, "predicted_speedup": s})
    return max(rows, key=lambda r: r["predicted_speedup"])["layer"], rows
