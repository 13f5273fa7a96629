"""A lean forward for Llama, Mistral, Qwen2, Qwen3 and Gemma 3 models (hf/lean_layer.py has their layer forms):
the same weights and operations, less Python per forward.

A one-layer draft's token costs about 0.3 ms of arithmetic and, through transformers' modules, about
0.5 ms more of Python (module calls, output dataclasses, rotary recomputation, cache bookkeeping), paid
k times per speculation step; the zoo target pays about 2 ms of it per forward (20 %). `LeanRunner`
runs its forwards (prefill, chain verification and drafting, tree blocks, and verification entering at
layer E with hidden states after an early-exit draft) as a straight-line loop over the model's own
weight tensors (referenced, not copied), with RoPE from a cached cos/sin table (one per layer type for
Gemma 3's local and global layers) and attention by SDPA over
the gathered pages, masked by the same StepMeta mask the HF path gets. The Triton kernel path goes
through the HF modules as usual, on the same pages, same layout.

It performs the HF modules' operations in their order on the same shapes, so its logits are bit for bit
the HF path's, with two deliberate exceptions in how a linear multiplies, both fixed per machine: on a
CPU whose BLAS handles short blocks badly (MKL on a CPU not Intel's), blocks of up to 16 rows multiply
through specdec's row kernel (longer ones too where it beats the BLAS: hf/linear.py `kernel_rows`), or
float32 blocks of up to 6 rows weight-first where it does not build
(hf/linear.py: the same sums in another order, last-bit differences, 1.5-3x cheaper there); on an Intel CPU, float32 blocks of 4 rows or more and every bfloat16 block multiply
through weights packed once for oneDNN (hf/packed.py: float32 differs in the last bits, bfloat16 gives
the same numbers; a 4-8 token verification costs about one token's forward), with q/k/v and gate/up on
that path as one packed product each (PackedJoined: the same numbers, but for a bfloat16 long prefill's
last bits). step="bitwise" turns all of these off (for_model(bitwise=True)). `LeanRunner.for_model`
checks the rest on a probe sequence, once per model, dtype and device, and returns None (the caller
keeps the HF path) for any model it does not reproduce: an unsupported architecture or config option,
a hook. With exact=True (the target: its logits decide the output) the
probe demands bitwise equality; for a draft (exact=False) the same greedy tokens and logits within
rounding suffice, since a draft's numbers only move acceptance, and a draft's runner goes further
(fused=True): a quantized draft's q/k/v and gate/up projections as one product each (quantize.joined),
torch's one-op RMSNorm, RoPE on q and k together, and no mask where a lone new token sees every key
(an int4 SmolLM2-135M draft token 15.7 -> 12.7 ms on 2 threads, with the leaner calls below). Every
runner binds its tensors once (no module attribute lookups per call) and applies RoPE in four ops
(`rope`, HF's numbers bit for bit). The verdict is cached per model object:
hooks or weights changed after its first generation are not re-probed (`ModelDrafter(lean=False)` and
`Engine(lean=False)` bypass the loop).

Shapes: tokens [n] int64, positions [n] int64; hidden states [n, H]; queries [1, Hq, n, D];
keys/values gathered [1, Hkv, T, D]; returned logits [r, V] float32.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache.pool import BlockTable, PagePool
from .cache import StepMeta
from . import linear, packed as packed_path
from .lean_layer import FORMS, LLAMA, LeanLayer, bound_module_linear, norm_forward, rope, rotate_half  # noqa: F401 (rope, rotate_half: re-exported)
from .runner import ModelRunner

# model -> {(dtype, device): "exact" | "close" | "no"}: probe verdicts, so each model is probed once
_verdicts: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class LeanRunner(ModelRunner):
    """short_blocks: None (default) multiplies short blocks through the row kernel or weight-first where
    this machine's rules say so (hf/linear.py); True always; False never. packed: None (default) multiplies through packed weights
    where this machine's rule says so (hf/packed.py); True wherever torch can; False never. Both False:
    every block through F.linear, as HF's modules do (the probe's setting). fused (a draft's runner, whose
    numbers only move acceptance): a quantized draft's q/k/v and gate/up as one product each, torch's one-op
    RMSNorm, and no mask where a lone new token sees every key: the same math in other rounding (module
    docstring)."""

    step_name = "lean"

    def __init__(self, model, pool: PagePool, table: BlockTable, kernel: bool = False,
                 short_blocks: bool | None = None, packed: bool | None = None, fused: bool = False):
        super().__init__(model, pool, table, kernel)
        if short_blocks is None:
            short_blocks = linear.short_blocks_on()
        if packed is None:
            packed = packed_path.PACKED
        cfg = model.config.get_text_config()
        inner = model.model
        self.layer_form = form = FORMS.get(type(model).__name__, LLAMA)  # hf/lean_layer.py's form of its layers
        self.embed = inner.embed_tokens  # Gemma's scales by sqrt(H) itself
        self.fused = fused
        rot = inner.rotary_emb
        if form.rope_per_layer_type:  # Gemma 3: one table per layer type, each its own inverse frequencies
            keys = list(cfg.layer_types)
            self._rope_params = {t: (getattr(rot, f"{t}_inv_freq").float(), float(getattr(rot, f"{t}_attention_scaling")))
                                 for t in set(keys)}
        else:
            keys = ["default"] * len(inner.layers)
            self._rope_params = {"default": (rot.inv_freq.float(), float(rot.attention_scaling))}
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (cos, signed sin) [size, D]
        self.layers = [LeanLayer(layer, short_blocks, packed, fused, form, key) for layer, key in zip(inner.layers, keys)]
        self.final_norm = norm_forward(inner.norm, fused, form.offset_norms)
        self.head = bound_module_linear(model.lm_head, short_blocks, packed)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma's tanh cap on the logits, if set
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @classmethod
    def for_model(cls, model, pool: PagePool, table: BlockTable, kernel: bool = False,
                  exact: bool = False, bitwise: bool = False) -> "LeanRunner | None":
        """A LeanRunner if `model` is supported and reproduces its HF forward on the probe (bit for bit if
        `exact`), else None; fused unless `exact`. bitwise (step="bitwise"): every product through F.linear's
        own kernel, as HF's modules multiply (no weight-first or packed blocks), so every forward's logits
        are bit for bit HF's. Not on the kernel path (the Triton kernels read the pages themselves)."""
        if kernel or unsupported(model) is not None:
            return None
        # offloaded by accelerate (hf/offload.py) and not held from maps (hf/mapped_offload.py): only its hooks
        # load those weights, so the loop cannot read them (and no probe is paid)
        if any(q.device.type == "meta" for q in model.parameters()):
            return None
        p = next(model.parameters())
        verdicts = _verdicts.setdefault(model, {})
        key = (p.dtype, p.device)
        if key not in verdicts:
            try:
                verdicts[key] = _probe(model)
            except (AttributeError, TypeError, RuntimeError, ValueError):
                verdicts[key] = "no"
        if bitwise:
            return cls(model, pool, table, kernel, short_blocks=False, packed=False) if verdicts[key] == "exact" else None
        if verdicts[key] == "exact" or (verdicts[key] == "close" and not exact):
            return cls(model, pool, table, kernel, fused=not exact)
        return None

    def _rope(self, positions: torch.Tensor, dtype, need: int, key: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] for `positions`, from table `key` (a layer type's, or "default") grown on demand (HF's
        formula, float32), sin's first half negated (see rope). need: a bound on max(positions) + 1 known on
        the host (reading the positions would sync with the device)."""
        cos, sin = self._tables.get(key, (None, None))
        if cos is None or cos.shape[0] < need or cos.dtype != dtype:
            inv_freq, scale = self._rope_params[key]
            size = max(need, 2 * (cos.shape[0] if cos is not None else 256))
            t = torch.arange(size, dtype=torch.float32, device=inv_freq.device)
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * scale).to(dtype)
            sin = (emb.sin() * scale).to(dtype)
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._tables[key] = cos, sin
        return cos[positions], sin[positions]

    def _run(self, tokens, start: int, positions, block_pos, tree_mask, logits_rows, hidden=None,
             start_layer: int = 0) -> torch.Tensor:
        if self.kernel:
            return super()._run(tokens, start, positions, block_pos, tree_mask, logits_rows, hidden, start_layer)
        n, b = tokens.numel(), tree_mask.shape[1]  # b = m + n: a tree block's m earlier nodes, then these n
        end = start + b
        self.table.reserve(end)
        meta = StepMeta(prefix_len=start, write_slots=self.table.slots(end - n, end),
                        read_slots=self.table.slots(0, end), tree_mask=tree_mask,
                        write_span=self.table.span(end - n, end), read_span=self.table.span(0, end),
                        q_pos=positions, block_pos=block_pos)
        x = self.embed(tokens) if hidden is None else hidden  # [n, H]
        # a node's position is start + its depth (< b): end + 1 bounds every position
        return self.run_meta(x, meta, end + 1, logits_rows, start_layer if hidden is not None else 0)

    def block_mask_batch(self, n: int) -> bool:
        """Must a packed batch (hf/batch_runner.py) of n tokens in all come as one block-diagonal mask? Never
        here: this loop attends a padded layout row by row too."""
        return False

    def run_meta(self, x: torch.Tensor, meta: StepMeta, need: int, logits_rows, first: int = 0) -> torch.Tensor:
        """The layer loop from layer `first` over hidden states x [n, H] addressed by `meta` (its write and
        read slots, q_pos and mask: one sequence's, or a packed batch's, hf/batch_runner.py); need bounds
        max(q_pos) + 1 on the host. Returns logits [r, V] float32."""
        n = x.shape[0]
        # per RoPE table: cos, sin broadcast over [n, heads, D] (rows) and over [1, heads, n, D]
        ropes = {key: (c[:, None], s[:, None], c[None, None], s[None, None])
                 for key in self._rope_params for c, s in [self._rope(meta.q_pos, x.dtype, need, key)]}
        Hq, Hkv, D = self.hq, self.hkv, self.head_dim
        write, read, rows = meta.write_slots, meta.read_slots, meta.rows
        want, top = set(self.capture), len(self.layers)
        kept: dict[int, torch.Tensor] = {}  # feature layer -> [n, H]
        for i, L in enumerate(self.layers[first:], start=first):
            cos_rows, sin_rows, cos, sin = ropes[L.rope_key]
            h = L.norm1(x)
            joined_qkv, joined_gate_up = L.joined(n)
            if joined_qkv is not None:  # one product, RoPE on q and k together in [n, heads, D]
                qkv = joined_qkv(h).view(n, -1, D)
                if L.q_norm is None:
                    qk = rope(qkv[:, :Hq + Hkv], cos_rows, sin_rows)
                    q, k = qk[:, :Hq], qk[:, Hq:]
                else:
                    q = rope(L.q_norm(qkv[:, :Hq]), cos_rows, sin_rows)
                    k = rope(L.k_norm(qkv[:, Hq:Hq + Hkv]), cos_rows, sin_rows)
                q, k, v = (t.transpose(0, 1)[None] for t in (q, k, qkv[:, Hq + Hkv:]))
            else:
                q, k, v = (lin(h).view(1, n, -1, D) for lin in (L.q, L.k, L.v))  # [1, n, heads, D]
                if L.q_norm is not None:
                    q, k = L.q_norm(q), L.k_norm(k)
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [1, heads, n, D]
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            self.kv.write(i, write, k, v, meta.write_span)
            if rows is not None:  # a packed batch: every row against its own keys, in one call
                out = L.o(attend_rows(self.kv, i, q[0].transpose(0, 1), rows, L.sliding_window, L.scaling))
            else:
                keys, vals = self.kv.gather(i, read, meta.read_span)  # [1, Hkv, T, D]
                # the same mask the HF path passes (bit-identical attention needs it); a first prefill's
                # causal mask as SDPA's is_causal, which skips the masked half (bit for bit the same)
                causal = meta.causal_from_zero(L.sliding_window)
                mask = None if causal or (self.fused and meta.unmasked(L.sliding_window)) \
                    else meta.mask_for(L.sliding_window)
                att = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, is_causal=causal,
                                                     scale=L.scaling, enable_gqa=Hq != Hkv)  # [1, Hq, n, D]
                out = L.o(att[0].transpose(0, 1).reshape(n, Hq * D))
            x = x + (out if L.attn_out_norm is None else L.attn_out_norm(out))
            h = L.norm2(x)
            if joined_gate_up is not None:
                both = joined_gate_up(h)
                gate, up = both[:, :L.inter], both[:, L.inter:]
            else:
                gate, up = L.gate(h), L.up(h)
            out = L.down(L.act(gate) * up)
            x = x + (out if L.mlp_out_norm is None else L.mlp_out_norm(out))
            if i + 1 in want and i + 1 < top:
                kept[i + 1] = x
        if top in want:  # the final norm over every row (as HF computes it); the logits rows reuse it
            kept[top] = self.final_norm(x)
            normed = _select_rows(kept[top], logits_rows)
        else:
            normed = self.final_norm(_select_rows(x, logits_rows))
        if want:
            self.last_features = torch.cat([kept[l] for l in self.capture], dim=-1)
        return self.capped(self.head(normed))

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [r, V] in the model's dtype -> float32, through the final soft-cap where the config sets one
        (HF's order: / cap, tanh, * cap, in the model's dtype)."""
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


def attend_rows(kv, i: int, q: torch.Tensor, rows, sliding_window, scale) -> torch.Tensor:
    """A packed batch laid out padded (hf/cache.py RowLayout): layer i's queries q [n, Hq, D] (n = every
    row's tokens, packed), each row against its own keys in `kv` (a PagedKV), in one SDPA call ->
    [n, Hq * D] in packed order. The lean loop's and the compiled step's attention for batches."""
    B, Hq, D = rows.k_slots.shape[0], q.shape[1], q.shape[2]
    keys, vals = kv.gather_rows(i, rows.k_slots)  # [B, Hkv, T_max, D]
    qb = q[rows.q_index].view(B, -1, Hq, D).transpose(1, 2)  # [B, Hq, n_max, D]
    att = F.scaled_dot_product_attention(qb, keys, vals, attn_mask=rows.mask_for(sliding_window), scale=scale,
                                         enable_gqa=Hq != keys.shape[1])
    return att.transpose(1, 2).reshape(-1, Hq * D)[rows.out_index]


def _select_rows(x: torch.Tensor, logits_rows) -> torch.Tensor:
    """logits_rows: None (all rows), an int r (the last r) or an index tensor."""
    if logits_rows is None:
        return x
    return x[-logits_rows:] if isinstance(logits_rows, int) else x[logits_rows]


# RoPE types whose frequencies depend on the sequence length: the lean loop's one cos/sin table cannot
# reproduce them past the probe's 12 tokens, so it never certifies itself for them
DYNAMIC_ROPE = ("dynamic", "longrope")


def _static_rope(model) -> bool:
    cfg = model.config.get_text_config()
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return True
    # one set of parameters, or (Gemma 3) one per layer type
    sets = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    return all(p.get("rope_type", p.get("type", "default")) not in DYNAMIC_ROPE for p in sets if p)


def unsupported(model) -> str | None:
    """Why the lean loop cannot run `model` (None: it may; the probe still decides)."""
    name = type(model).__name__
    if name not in FORMS:
        return f"architecture {name}"
    if not _static_rope(model):
        return "RoPE that changes with the sequence length"
    cfg = model.config.get_text_config()
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


@torch.no_grad()
def _probe(model) -> str:
    """'exact', 'close' or 'no': both paths over a probe (a 9-token prefill, a 3-node tree block with a
    branch, then 3 single tokens)."""
    from .attention import specdec_attention

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    probe = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(0)).to(device)
    outs = []
    for make in (ModelRunner, lambda *a: LeanRunner(*a, short_blocks=False, packed=False)):
        pool = PagePool(4, 8)
        table = BlockTable(pool, device)
        runner = make(model, pool, table)
        with specdec_attention(model):
            rows = [runner.forward(probe[:9], logits_rows=None)]
            branch = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)
            rows.append(runner.forward_tree(probe[9:12], torch.tensor([9, 10, 10], device=device), branch))
            rows += [runner.forward(probe[i:i + 1], logits_rows=1) for i in range(9, 12)]
        table.release()
        outs.append(torch.cat(rows))
    ref, got = outs
    if torch.equal(ref, got):
        return "exact"
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    close = torch.equal(ref.argmax(-1), got.argmax(-1)) and (ref - got).abs().max() <= tol * ref.abs().max().clamp_min(1)
    return "close" if close else "no"
