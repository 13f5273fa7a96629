"""Run an unmodified HF causal LM over the shared paged cache: one call = one forward of n tokens.

The same runner serves the target (prefill, verification of a chain or tree) and a model drafter
(catch-up, one drafting step per depth). Callers must be inside `specdec_attention(model)`.
A forward may also enter at layer E with hidden states instead of tokens (`hidden=`, `start_layer=E`):
the target's verification after a self-speculative drafter has run, and written the KV of, layers < E.
"""
from __future__ import annotations

import torch

from ..cache.paged import PagedKV
from ..cache.pool import BlockTable, PagePool
from .attention import check_supported
from .cache import PagedCache, StepMeta, cache_keyword, check_cache_used
from .linear import plain_linears, short_block_linears


def num_layers_of(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def max_positions_of(model) -> int | None:
    cfg = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def rope_switch_of(model) -> tuple[str, int] | None:
    """(rope type, position) for RoPE whose frequencies change with the sequence length: 'longrope'
    (Phi-3) switches from short to long factors once a forward sees more than `original_max_position_
    embeddings` positions, 'dynamic' (NTK) rescales every length past it. None for static RoPE."""
    cfg = model.config.get_text_config()
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return None
    per_layer_type = [v for v in rope.values() if isinstance(v, dict)]  # Gemma 3: {layer type: parameters}
    for params in per_layer_type or [rope]:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in ("longrope", "dynamic"):
            switch = (params.get("original_max_position_embeddings")
                      or getattr(cfg, "original_max_position_embeddings", None) or max_positions_of(model))
            return (kind, int(switch)) if switch else None
    return None


def check_rope_span(model, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse a generation whose forwards would cross a length-dependent RoPE's switch position.

    HF decodes one token per forward, so its rotary table follows the length token by token, and at
    Phi-3's longrope switch it drops the whole cache and recomputes it with the long factors. A
    verification forward over k + 1 tokens sees one length for all of them, and the KV cached before the
    switch keeps the short factors: the output would not be HF's. A prompt already past a longrope
    switch uses the long factors throughout, as HF does, and is fine."""
    switch = rope_switch_of(model)
    if switch is None:
        return
    kind, at = switch
    end = prompt_len + max_new_tokens
    crosses = prompt_len <= at < end if kind == "longrope" else end > at
    if crosses:
        raise ValueError(f"{type(model).__name__} uses {kind} RoPE, whose frequencies change past position {at}, "
                         f"and this generation could run from {prompt_len} to {end} tokens, across it: specdec cannot "
                         f"reproduce HF's output there. Keep prompt + max_new_tokens <= {at}"
                         + (f", or start with a prompt longer than {at}" if kind == "longrope" else ""))


def causal_mask(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


class ModelRunner:
    """One model, its page tensors on `pool`, addressed through the shared `table`."""

    step_name = "hf"  # which step runs the forwards, as SpecStats.step reports it
    compile_s = 0.0  # seconds this runner spent compiling (hf/compiled.py's runner only)

    def __init__(self, model, pool: PagePool, table: BlockTable, kernel: bool = False, short_blocks: bool = False):
        check_supported(model)
        self.model = model
        # the model's nn.Linear modules multiply through this machine's short-block products during its
        # forwards (hf/linear.py short_block_linears): not bit for bit HF's logits, so never for step="bitwise"
        self.linears = plain_linears(model) if short_blocks else []
        self.device = next(model.parameters()).device
        self.table = table
        self.kv = PagedKV(pool, num_layers_of(model), self.device)
        self.cache = PagedCache(self.kv)
        self.kernel = kernel
        self.num_layers = self.kv.num_layers
        self._tails: dict[int, object] = {}  # start_layer -> layer view (see hf/layer_views.py)
        # feature layers (hf/features.py) a feature-head drafter reads; each forward then leaves them,
        # one row per token it ran, in last_features [n, F]
        self.capture: tuple[int, ...] = ()
        self.last_features: torch.Tensor | None = None

    @property
    def valid(self) -> int:
        """Leading positions of the sequence holding this model's KV."""
        return self.kv.valid

    def rollback(self, length: int) -> None:
        self.kv.valid = min(self.kv.valid, length)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits_rows=None, hidden: torch.Tensor | None = None,
                start_layer: int = 0) -> torch.Tensor:
        """Run n new tokens written at sequence positions valid..valid+n-1.

        tokens [n] int64; positions [n] int64 (RoPE / learned positions; default valid + arange(n), a
        tree passes valid + depth); tree_mask [n, n] bool (default causal); logits_rows: None (all), an
        int r (last r rows) or an index tensor. Returns logits [r, V] float32. Advances `valid` by n.
        hidden [n, H]: the tokens' hidden states entering layer `start_layer` (> 0); layers below it are
        skipped, and their KV for these positions must already be in the pages.
        """
        n = tokens.numel()
        if hidden is not None and (start_layer <= 0 or hidden.shape[0] != n):
            raise ValueError(f"hidden must be [n = {n}, H] entering a layer > 0; got {tuple(hidden.shape)} at "
                             f"layer {start_layer}")
        start = self.kv.valid
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        if tree_mask is None:
            tree_mask = causal_mask(n, self.device)
        logits = self._run(tokens, start, positions, None, tree_mask, logits_rows, hidden, start_layer)
        self.kv.valid = start + n
        return logits

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, block_pos: torch.Tensor, tree_mask: torch.Tensor,
                     logits_rows=None) -> torch.Tensor:
        """Run n more nodes of a tree whose first m nodes earlier calls wrote right after `valid`.

        tokens [n] int64; block_pos [m + n] int64, the positions of the whole tree block (the m written
        nodes, then the n new ones); tree_mask [n, m + n] bool, which block nodes each new node sees (its
        ancestors and itself; the prefix [0, valid) is always visible). The new nodes' KV goes to sequence
        positions valid+m .. valid+m+n-1. `valid` does not move: the block is scratch space past the
        committed KV, overwritten by whatever runs next. Returns logits [r, V] float32 (see forward).
        """
        n, b = tokens.numel(), block_pos.numel()
        if tree_mask.shape != (n, b) or b < n:
            raise ValueError(f"forward_tree: tree_mask must be [n, m + n] = [{n}, {b}], got {tuple(tree_mask.shape)}")
        return self._run(tokens, self.kv.valid, block_pos[b - n:], block_pos, tree_mask, logits_rows)

    def _model_from(self, start_layer: int):
        if start_layer == 0:
            return self.model
        view = self._tails.get(start_layer)
        if view is None:
            from .layer_views import last_layers

            view = self._tails[start_layer] = last_layers(self.model, start_layer)
        return view

    def _run(self, tokens, start: int, positions, block_pos, tree_mask, logits_rows, hidden=None,
             start_layer: int = 0) -> torch.Tensor:
        """One forward: the n tokens go to the last n of positions start .. start+b-1 (b = tree_mask's width)."""
        n, b = tokens.numel(), tree_mask.shape[1]
        end = start + b
        self.table.reserve(end)
        meta = StepMeta(prefix_len=start, write_slots=self.table.slots(end - n, end),
                        read_slots=self.table.slots(0, end), tree_mask=tree_mask,
                        write_span=self.table.span(end - n, end), read_span=self.table.span(0, end), q_pos=positions,
                        kernel=self.kernel, block_table=self.table.block_table_tensor() if self.kernel else None,
                        block_pos=block_pos)
        self.cache.meta = meta
        keep = 0 if logits_rows is None else logits_rows
        inputs = dict(input_ids=tokens[None]) if hidden is None else dict(inputs_embeds=hidden[None])
        model = self._model_from(start_layer if hidden is not None else 0)
        kwargs = {"position_ids": positions[None], cache_keyword(model): self.cache, "use_cache": True,
                  "specdec_meta": meta, "logits_to_keep": keep}
        with short_block_linears(self.linears):
            if self.capture:
                from .features import FeatureCapture

                with FeatureCapture(self.model, self.capture) as cap:
                    out = model(**inputs, **kwargs)
                self.last_features = cap.features()[0]
            else:
                out = model(**inputs, **kwargs)
        layers = self.num_layers - (start_layer if hidden is not None else 0)
        check_cache_used(self.model, meta, layers)
        self.cache.meta = None
        return out.logits[0].float()
