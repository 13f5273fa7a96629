"""The feature head's network (EAGLE family): one decoder layer that predicts the target's next feature.

A *feature* of position t is what the target computes there: by default its top feature, the final
norm's output that the LM head reads (the feature predicts token t + 1); with fusion (EAGLE-3) the
concatenation of a low, a middle and the top layer ([T, 3H]; lower layers are the raw residual stream
leaving that layer), projected to H by `fuse`. Layer numbers count from 1 (= after the first decoder
layer) to L (= the top feature).

One head step at position t reads [embedding of token t + 1, feature of t] through `fc` (2H -> H) and
one Llama-style decoder layer (attention over the head's own KV of earlier positions, SwiGLU MLP) with
the target's sizes and an RMS norm, and outputs ĝ(t+1), the predicted top feature of position t + 1
(in the space of the final norm's output): through the target's LM head it predicts token t + 2, and
for k > 1 it is the feature input of the next step.

Two architectures (HeadConfig.arch):
- "eagle" (EAGLE-1/2 style): the above; `fc` has a bias, the layer normalises its input, `norm` maps the
  layer's output to the predicted top feature, which is both the next step's input and, through the
  target's LM-head rows, the draft logits.
- "eagle3" (EAGLE-3, as vLLM's llama_eagle3.py computes it): `fuse` (EAGLE-3's `fc`, 3H -> H, no bias)
  fuses three lower layers' residual streams; the layer's attention reads [norm(embedding), norm(hidden)]
  (2H) with the hidden itself as the residual; the layer's output (before `norm`) is the next step's
  input, and the draft logits are the head's own `lm_head` (N rows) over norm(output). feature_layers
  holds the three fused layers and then L: the target's top feature, read only for training labels.
  drafters/eagle_format.py writes and reads it in the layout vLLM, SGLang and speculators load.

Reduced vocabulary (FR-Spec / EAGLE-3): `vocab_ids` [N] are the only tokens the head can draft; its
logits are ĝ @ W[vocab_ids].T with W the target's own LM head (bound, not stored). The target's
embedding and LM head are referenced through `bind(target)`, never copied into the head's weights.

Shapes: features [.., F] with F = H * len(feature_layers); tokens [..] int64; outputs [.., H];
draft logits [.., N].
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..hf.lean_layer import rms_norm, rotate_half
from ..hf.linear import linear_rows


@dataclass
class HeadConfig:
    """What a head is and which target it was trained for (saved as head_config.json)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_target_layers: int
    vocab_size: int                 # the target's vocabulary
    feature_layers: tuple = ()      # (L,) = top only; 3 layers = fusion
    draft_vocab: int = 0            # N (len(vocab_ids)); 0 = the whole vocabulary
    num_layers: int = 1             # decoder layers in the head (1 or 2)
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    target_architecture: str = ""
    target_fingerprint: str = ""
    # the same over the target's weights rounded to bfloat16: a bfloat16 copy of the target matches it
    target_fingerprint_bf16: str = ""
    trained: dict = field(default_factory=dict)  # what the trainer did (tokens, steps, seed, ...)
    arch: str = "eagle"             # "eagle" (EAGLE-1/2 style) or "eagle3" (module docstring)

    @property
    def fused_layers(self) -> tuple:
        """The layers `fuse` reads: all of feature_layers, except eagle3's trailing label layer L."""
        return tuple(self.feature_layers[:3]) if self.arch == "eagle3" else tuple(self.feature_layers)

    @staticmethod
    def for_target(target, fusion: bool = False, draft_vocab: int = 0, num_layers: int = 1,
                   arch: str = "eagle") -> "HeadConfig":
        cfg = target.config.get_text_config()
        n = cfg.num_hidden_layers
        if arch not in ARCHS:
            raise ValueError(f"a feature head's arch is one of {ARCHS}, got {arch!r}")
        if arch == "eagle3":
            if num_layers != 1:
                raise ValueError("an eagle3 head has one decoder layer (EAGLE-3's midlayer)")
            layers = eagle3_layers(n) + (n,)
        else:
            layers = (max(1, n // 10), n // 2, n) if fusion and n >= 3 else (n,)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        if num_layers not in (1, 2):
            raise ValueError(f"a feature head has 1 or 2 decoder layers, got {num_layers}")
        return HeadConfig(
            hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            intermediate_size=cfg.intermediate_size, num_target_layers=n, vocab_size=cfg.vocab_size,
            feature_layers=layers, draft_vocab=draft_vocab, num_layers=num_layers,
            rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)), rope_theta=float(theta),
            target_architecture=type(target).__name__, target_fingerprint=fingerprint(target),
            target_fingerprint_bf16=fingerprint(target, torch.bfloat16), arch=arch)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @staticmethod
    def from_dict(d: dict) -> "HeadConfig":
        d = dict(d)
        d["feature_layers"] = tuple(d.get("feature_layers", ()))
        return HeadConfig(**d)


ARCHS = ("eagle", "eagle3")


def eagle3_layers(n: int) -> tuple[int, int, int]:
    """The three layers an EAGLE-3 head fuses for an n-layer target: vLLM's default (2, n // 2, n - 3),
    each the residual stream entering that 0-based layer (= leaving our layer of that number), or for a
    target too shallow for three distinct ones, (1, n // 2, n - 1)."""
    if n < 4:
        raise ValueError(f"an eagle3 head fuses three distinct lower layers: the target has only {n}")
    first = (2, n // 2, n - 3)
    return first if len(set(first)) == 3 and first[0] < first[1] < first[2] else (1, n // 2, n - 1)


@torch.no_grad()
def fingerprint(model, rounded_to: torch.dtype | None = None) -> str:
    """A short hash of the target's weights: sums of a few strided samples of every tensor, in fp32.

    Stable across dtype casts of fp32 weights to themselves and across processes; changes when any
    sampled weight changes (a fine-tuned or different model). rounded_to=torch.bfloat16 hashes the samples
    rounded to bfloat16 first: the same for a float32 model and its bfloat16 copy (what a head records, so
    that the user's choice of the target's dtype does not refuse it)."""
    import hashlib

    from ..hf.offload import tensor_data

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = tensor_data(model, name, p).detach().reshape(-1)  # offloaded (accelerate): its hook's copy
        if flat.numel() == 0 or not flat.is_floating_point():
            continue
        k = min(64, flat.numel())
        idx = torch.arange(k) * (flat.numel() - 1) // max(1, k - 1)
        h.update(name.encode())
        h.update(f"{tuple(p.shape)}".encode())
        samples = flat[idx] if rounded_to is None else flat[idx].to(rounded_to)
        h.update(" ".join(f"{v:.4e}" for v in samples.float().tolist()).encode())
    return h.hexdigest()[:16]


class _RMSNorm(nn.Module):
    """A Llama RMS norm with its own weight (the lean runner's op, hf/lean.py)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self, x)


class HeadLayer(nn.Module):
    """A Llama decoder layer whose attention takes its keys/values from the caller (paged or unrolled).

    `qkv(x, cos, sin)` -> q [B, Hq, n, D], k, v [B, Hkv, n, D] (RoPE applied); `finish(x, att)` adds the
    attention output [B, n, Hq*D] and the MLP to the residual x [B, n, H]."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        H, D = c.hidden_size, c.head_dim
        self.hq, self.hkv, self.d = c.num_heads, c.num_kv_heads, D
        self.input_layernorm = _RMSNorm(H, c.rms_eps)
        self.q_proj = nn.Linear(H, self.hq * D, bias=False)
        self.k_proj = nn.Linear(H, self.hkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.hkv * D, bias=False)
        self.o_proj = nn.Linear(self.hq * D, H, bias=False)
        self.post_attention_layernorm = _RMSNorm(H, c.rms_eps)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)

    def qkv(self, x, cos, sin):
        B, n, _ = x.shape
        h = self.input_layernorm(x)
        q = linear_rows(h, self.q_proj.weight).view(B, n, self.hq, self.d).transpose(1, 2)
        k = linear_rows(h, self.k_proj.weight).view(B, n, self.hkv, self.d).transpose(1, 2)
        v = linear_rows(h, self.v_proj.weight).view(B, n, self.hkv, self.d).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x, att):
        x = x + linear_rows(att, self.o_proj.weight)
        h = self.post_attention_layernorm(x)
        return x + linear_rows(F.silu(linear_rows(h, self.gate_proj.weight)) * linear_rows(h, self.up_proj.weight),
                               self.down_proj.weight)


class Eagle3Layer(HeadLayer):
    """EAGLE-3's midlayer: x = [embedding | hidden] [B, n, 2H]; attention reads both normalised (q, k, v
    over 2H), the hidden itself is the residual; then the MLP block as in any Llama layer -> [B, n, H]."""

    def __init__(self, c: HeadConfig):
        super().__init__(c)
        H, D = c.hidden_size, c.head_dim
        self.hidden_norm = _RMSNorm(H, c.rms_eps)
        self.q_proj = nn.Linear(2 * H, self.hq * D, bias=False)
        self.k_proj = nn.Linear(2 * H, self.hkv * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.hkv * D, bias=False)

    def qkv_input(self, x):
        """x [.., 2H] = [embedding | hidden] -> what q, k and v multiply: [norm(embedding) | norm(hidden)]."""
        e, hidden = x.chunk(2, dim=-1)
        return torch.cat([self.input_layernorm(e), self.hidden_norm(hidden)], dim=-1)

    def qkv(self, x, cos, sin):
        B, n, _ = x.shape
        h = self.qkv_input(x)
        q = linear_rows(h, self.q_proj.weight).view(B, n, self.hq, self.d).transpose(1, 2)
        k = linear_rows(h, self.k_proj.weight).view(B, n, self.hkv, self.d).transpose(1, 2)
        v = linear_rows(h, self.v_proj.weight).view(B, n, self.hkv, self.d).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x, att):
        return super().finish(x.chunk(2, dim=-1)[1], att)


class HeadNet(nn.Module):
    """The head's trainable weights plus references to the bound target's embedding and LM head."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        H = c.hidden_size
        nf = len(c.fused_layers)
        self.eagle3 = c.arch == "eagle3"
        self.fuse = nn.Linear(nf * H, H, bias=False) if nf > 1 else None
        self.fc = None if self.eagle3 else nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList((Eagle3Layer if self.eagle3 else HeadLayer)(c) for _ in range(c.num_layers))
        self.norm = _RMSNorm(H, c.rms_eps)  # the layer's residual -> a predicted top feature (eagle3: -> lm_head)
        n_vocab = c.draft_vocab or c.vocab_size
        self.lm_head = nn.Linear(H, n_vocab, bias=False) if self.eagle3 else None  # eagle3's own draft LM head
        self.register_buffer("vocab_ids", torch.arange(n_vocab, dtype=torch.long))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._target: tuple | None = None  # (embed module, LM head weight restricted to vocab_ids [N, H])

    # -- binding to the target -------------------------------------------------------------------
    def bind(self, target) -> None:
        """Reference the target's embedding and its LM head rows for vocab_ids (not parameters of ours)."""
        from ..hf.offload import module_weight

        head_w = module_weight(target, target.get_output_embeddings()).detach()  # an offloaded one: read once
        ids = self.vocab_ids.to(head_w.device)
        sub = head_w if ids.numel() == head_w.shape[0] else head_w.index_select(0, ids)
        self._target = (target.get_input_embeddings(), sub.to(self.vocab_ids.device))

    def init_from_target(self, target) -> None:
        """Start the decoder layer(s) from the target's top layer and the output norm from its final norm,
        where the target is Llama-like (same module names and shapes); anything else stays random."""
        from ..hf.layer_views import decoder_of

        decoder = decoder_of(target)
        top = decoder.layers[-1]
        attn, mlp = getattr(top, "self_attn", None), getattr(top, "mlp", None)
        names = {"input_layernorm": getattr(top, "input_layernorm", None),
                 "post_attention_layernorm": getattr(top, "post_attention_layernorm", None)}
        names.update({n: getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        names.update({n: getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")})
        llama_norms = "Gemma" not in type(decoder.norm).__name__  # Gemma's norms scale by (1 + w)
        with torch.no_grad():
            for layer in self.layers:
                for name, src in names.items():
                    dst = getattr(layer, name).weight
                    w = getattr(src, "weight", None)
                    if w is not None and w.shape == dst.shape and (llama_norms or "norm" not in name):
                        dst.copy_(w.float())
            w = getattr(decoder.norm, "weight", None)
            if w is not None and w.shape == self.norm.weight.shape:
                self.norm.weight.copy_(w.float() if llama_norms else 1 + w.float())
            if self.lm_head is not None:  # eagle3: its own LM head starts as the target's rows for vocab_ids
                head_w = target.get_output_embeddings().weight
                self.lm_head.weight.copy_(head_w.index_select(0, self.vocab_ids.to(head_w.device)).float())

    @property
    def bound(self) -> bool:
        return self._target is not None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._target[0](tokens)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [.., H] (what `emit` gave) -> draft logits [.., N] over vocab_ids."""
        if self.eagle3:
            return linear_rows(self.norm(out), self.lm_head.weight).float()
        return self.target_logits(out)  # eagle: out is a predicted top feature, read by the target's rows

    def emit(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' output [.., H] -> what a step hands on (next step's feature input and `logits`'
        input): eagle, the predicted top feature norm(x); eagle3, x itself (EAGLE-3's pre-norm hidden)."""
        return x if self.eagle3 else self.norm(x)

    def target_logits(self, top_feature: torch.Tensor) -> torch.Tensor:
        """The target's own logits over vocab_ids from its top feature [.., H]: its LM head's rows (bound),
        never the head's own (eagle3's lm_head is what training moves toward these)."""
        w = self._target[1]
        return linear_rows(top_feature.to(w.dtype), w).float()

    # -- pieces shared by training and inference -------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., n] -> cos, sin [..., n, D]."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., F] -> [.., H] (fusion projects; top-only passes through; eagle3 fuses its
        three layers and leaves the label layer)."""
        if self.fuse is None:
            return features
        return linear_rows(features[..., :self.fuse.in_features], self.fuse.weight)

    def inputs(self, feature_h: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """[.., H] feature (projected or predicted) and the following tokens [..] -> layer input [.., H]
        (eagle3: [.., 2H], the embedding and the feature side by side for its midlayer)."""
        e = self.embed(next_tokens).to(feature_h.dtype)
        if self.eagle3:
            return torch.cat([e, feature_h], dim=-1)
        return linear_rows(torch.cat([e, feature_h], dim=-1), self.fc.weight, self.fc.bias)

    # -- training: teacher-forced step 1, then training-time test ---------------------------------
    def unroll(self, features: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features [B, T, F] of positions 0..T-1, next_tokens [B, T] (token t + 1 for position t).

        Returns `steps` tensors [B, T, H]: out[j][:, t] is the head's prediction of the top feature of
        position t + 1 when it drafts j + 1 tokens ahead from a context whose last true feature is at
        t - j, exactly as drafting would see it: step j's input at t is step j-1's prediction for t
        (made at t - 1), and its attention sees step 1's keys up to t - j and step s's key at t - j + s
        for s = 2 .. j + 1 (EAGLE-3's training-time test). Positions t < j have no such context and are
        garbage (the trainer masks them)."""
        B, T, _ = features.shape
        pos = torch.arange(T, device=features.device)
        cos, sin = self.rope(pos, features.dtype)
        cos, sin = cos[None, None], sin[None, None]
        feat_h = self.project(features)
        outs: list[torch.Tensor] = []
        x_in = self.inputs(feat_h, next_tokens)
        kv: list[list[tuple]] = [[] for _ in self.layers]  # per layer, per step: (k, v) [B, Hkv, T, D]
        for j in range(steps):
            if j > 0:  # position t's input feature: the previous step's prediction made at t - 1
                prev = outs[-1].detach()
                shifted = torch.cat([prev[:, :1] * 0, prev[:, :-1]], dim=1)
                x_in = self.inputs(shifted, next_tokens)
            mask = _unroll_mask(T, j, features.device)  # [T, (j + 1) * T]
            x = x_in
            for li, layer in enumerate(self.layers):
                q, k, v = layer.qkv(x, cos, sin)
                kv[li].append((k, v))
                keys = torch.cat([kk for kk, _ in kv[li]], dim=2)
                vals = torch.cat([vv for _, vv in kv[li]], dim=2)
                att = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask,
                                                     enable_gqa=layer.hq != layer.hkv)
                x = layer.finish(x, att.transpose(1, 2).reshape(B, T, -1))
            outs.append(self.emit(x))
        return outs


def _unroll_mask(T: int, j: int, device) -> torch.Tensor:
    """[T, (j+1)*T] bool: query t of step j sees step 0's keys p <= t - j and step s's key t - j + s."""
    t = torch.arange(T, device=device)
    blocks = [t[None, :] <= (t[:, None] - j)]
    for s in range(1, j + 1):
        blocks.append(t[None, :] == (t[:, None] - j + s))
    return torch.cat(blocks, dim=1)  # s = j is the query itself: every row sees at least one key


def param_count(net: HeadNet) -> int:
    return sum(p.numel() for p in net.parameters())


def draft_cost(config: HeadConfig, target) -> float:
    """c: the head's weights read per draft token over the target's per token (both LM heads included)."""
    H = config.hidden_size
    tgt = sum(p.numel() for p in target.parameters())
    if getattr(target.config.get_text_config(), "tie_word_embeddings", False):
        tgt += target.get_output_embeddings().weight.numel()  # read twice: embedding row and LM head
    width = 2 * H if config.arch == "eagle3" else H  # eagle3's q, k, v read [embedding | hidden]
    attn = (width + H) * config.head_dim * config.num_heads + 2 * width * config.head_dim * config.num_kv_heads
    layer = attn + 3 * H * config.intermediate_size
    mine = config.num_layers * layer + 2 * H * H + (config.draft_vocab or config.vocab_size) * H
    return mine / max(1, tgt)
