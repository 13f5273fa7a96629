"""The compiled step: the lean loop's arithmetic between attentions, captured by torch.compile per
token-count bucket, so a decode or verification forward pays a few fused kernels per layer instead of
a dozen small ops and their Python.

Why: on a CPU a SmolLM2-135M forward over one token is about 10 ms of small ops (norms, RoPE,
residuals, SwiGLU, views, dispatch) on top of reading its 538 MB of weights, and where torch multiplies
float32 with MKL on a CPU that is not Intel's (hf/linear.py), the one-to-few-row products themselves read
the weights at about half the memory bandwidth. Inductor (torch.compile's CPU C++ backend) fuses each
layer's norm + projections + RoPE, and its residual + norm + SwiGLU + residual, into a few loops, and on
such a machine (`product_form`) multiplies every bucket's blocks through specdec's row kernel
(kernels/cpu_rows.py; up to hf/linear.py's `kernel_rows`), or without it one or two rows as reductions it vectorises itself (reading each
weight once for both rows) and 3-16 rows weight-first.

Architectures: the graphs compute Llama-form layers (Llama, Mistral, Qwen2); the layer kernel also Qwen3's
and Gemma 3's (hf/lean_layer.py's forms), so for those the step is the layer kernel up to 32 tokens and the
lean loop beyond, and the lean loop throughout where the layer kernel does not run (`covers`).

The layer kernel: where the row kernel multiplies short blocks (up to 16 rows) and specdec's CPU kernels
load (`layer_kernel_takes`), forwards of up to 32 tokens (every bucket) skip the graphs: each layer is one
call of kernels/cpu_layer.py (the same arithmetic, rounded where the graphs round, attention included), so
a layer costs one op call instead of a graph call's guards and wrapper and its ops' Python calls. On an AMD
EPYC (2 threads, benchmarks/results/compiled_step_amd_epyc.md) a float32 SmolLM2 token costs 19.6 ms
against 29.8 through the graphs and 39.0 in the lean loop (the weights alone 17.4; the bandwidth line
21.7 in that run), a bfloat16 one 14.1 against 21.1 and 39.3; a 16-node tree's 17-token verification
(the 32-token bucket) 27 ms against 53 in bfloat16 (cpu_layer.MAX_ROWS).

What is compiled (hf/compiled_graphs.py; for every bucket where the layer kernel does not run): per layer,
`_pre` (input norm, q/k/v, RoPE) and `_post` (o projection, residual, norm, MLP, residual) fused with the next
layer's `_pre` (`_mid`), and the last layer's `_post` with the final norm and the LM head (`_last`). Between
them attention stays outside the graphs: for a single sequence one call of specdec's CPU attention kernel
(kernels/cpu_attention.py: the KV page write and the attention under the step's mask, where the CPU kernels
load), else hf/lean.py's torch ops (page write, gather, SDPA); so the compiled graphs see only [bucket, ...]
shapes: no dynamic length, nothing that grows with the KV, no state of the sequence. The kernel took a
bfloat16 one-token step from 39.0 ms to 29.4 and a float32 8-token one from 51.0 to 42.7
(benchmarks/results/compiled_step_amd_epyc.md). A forward of n tokens pads to the smallest bucket >= n
(BUCKETS; pad rows are zeros, their outputs dropped); longer forwards (prefill) and what the graphs do not
cover (entry at a later layer, a quantized draft's joined products) take the lean loop. A packed batch
(hf/batch_runner.py) runs its rows' tokens together through the same buckets: through the graphs attention row
by row as the lean loop does it, through the layer kernel over the batch's block-diagonal mask.

Exactness: the graphs compute the same math as HF's modules in another rounding (fused loops, other
summation order), so logits differ from HF's eager ones in the last bits; the promise kept is the
target's greedy output and exact sampling of the logits the step computes (`step="bitwise"` keeps the
lean loop's bit-for-bit logits). Each (model, dtype, bucket) is checked once, on its first forward
(graphs or layer kernel),
against the lean loop on the same inputs (same argmax on every row, logits within rounding); a bucket
that fails it, fails to compile or raises later falls back to the lean loop with one warning naming
the reason.

Shapes: x, the hidden states [B, H] (B the bucket); q [B, Hq, D], k and v [B, Hkv, D]; att [B, Hq * D];
cos, sin [B, 1, D]; logits [B, V] float32.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch
import torch.nn.functional as F

from ..cache.pool import BlockTable, PagePool
from ..kernels import cpu_attention, cpu_layer, cpu_library, cpu_rows
from . import packed
from .attention import specdec_attention
from .cache import StepMeta
from .compiled_graphs import _layer_params, activation_of, kernel_layer_args, norm_eps, product_form, unsupported_reason
from .compiled_steps import BUCKETS, CompiledSteps, _compiling, _exiting, agree, bucket_for, compiling, steps_for  # noqa: F401 (re-exported)
from .lean import LeanRunner, _select_rows, attend_rows
from .lean_layer import LLAMA

log = logging.getLogger("specdec")


def layer_kernel_takes(form: tuple, attention_kernel: bool) -> bool:
    """Do forwards of up to cpu_layer.MAX_ROWS tokens run as kernels/cpu_layer.py calls instead of the graphs?
    Where the attention kernel runs and the machine's rule sends short blocks (up to cpu_rows.MAX_ROWS rows)
    through the row kernel (form: product_form's), whose code the layer's products run; SPECDEC_LAYER_KERNEL=0
    keeps the graphs."""
    if os.environ.get("SPECDEC_LAYER_KERNEL", "") == "0":
        return False
    return attention_kernel and form[0] >= cpu_rows.MAX_ROWS


def attention_kernel_takes(weight: torch.Tensor, head_dim: int) -> bool:
    """Does the step's attention go through kernels/cpu_attention.py for a model like this (its LM head's
    weight, its head dimension)? On a CPU, float32 or bfloat16, D a multiple of 8, where the CPU kernels
    load; SPECDEC_ATTENTION_KERNEL=0 keeps the torch path (write, gather, SDPA)."""
    if os.environ.get("SPECDEC_ATTENTION_KERNEL", "") == "0":
        return False
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0
            and cpu_library.load() is None)


# "auto" compiles targets at least this large: below it a forward is mostly attention and dispatch of a
# few small layers, and compiling (seconds per bucket) would not pay within a generation
AUTO_MIN_PARAMS = 50_000_000
STEPS = ("auto", "compiled", "bitwise")


def auto_compiles(model, kernel: bool) -> bool:
    """Does step='auto' compile this target? On a CPU, not on the Triton kernel path, where the lean loop
    does not multiply through packed weights (hf/packed.py), a model of at least AUTO_MIN_PARAMS
    parameters; SPECDEC_COMPILE=0 turns it off (=1 compiles any size, on any CPU).

    Where packed weights are on (Intel CPUs), the lean loop is the faster step: inductor cannot call a
    packed weight that is a graph input (its oneDNN lowering wants a frozen constant), so the graphs go
    through F.linear, and a SmolLM2 step measured 1.02x the lean loop's time for 1 token, 1.11x / 1.19x
    for 4 / 8 (float32) and 1.27-1.30x in bfloat16 (benchmarks/results/compiled_step.md): the small ops
    the graphs fuse save about what their 31 calls a forward cost in dispatch and guards. Freezing each
    layer's weights into a graph of its own instead (inductor's freezing + its CPP GEMM template, which
    prepacks them) was measured on the same Xeon: a step 0.94x (float32) / 0.84x (bfloat16) the lean loop's,
    but 88-106 s to compile one bucket, and every bucket's graphs hold their own packed copy: not taken."""
    override = os.environ.get("SPECDEC_COMPILE", "")
    if override not in ("", "0", "1"):
        raise ValueError(f"SPECDEC_COMPILE must be 0 or 1, got {override!r}")
    device = next(model.parameters()).device
    if override == "0" or kernel or device.type != "cpu":
        return False
    if override == "1":
        return True
    return not packed.PACKED and sum(p.numel() for p in model.parameters()) >= AUTO_MIN_PARAMS


class CompiledRunner(LeanRunner):
    """The lean loop with its forwards of up to max(BUCKETS) tokens through the compiled graphs (module
    docstring); everything else, and any bucket that fell back, through LeanRunner's own loop."""

    @property
    def step_name(self) -> str:
        """'compiled', naming the buckets that fell back to the lean loop if any, or that were still compiling
        in the background when the generation ended."""
        failed = sorted(self.steps.failed)
        name = "compiled" + (f" (lean for {', '.join(map(str, failed))}-token forwards)" if failed else "")
        return name + (" (still compiling in the background: lean until ready)" if self.steps.compiling_elsewhere()
                       else "")

    def __init__(self, model, pool: PagePool, table: BlockTable, steps: CompiledSteps):
        super().__init__(model, pool, table)
        inner = model.model
        self.steps = steps
        layer_form = self.layer_form
        # the graphs compute Llama's layers only: other forms (Qwen3, Gemma 3) run the layer kernel, else lean
        self.graphs_cover = layer_form == LLAMA
        self.params = [_layer_params(layer) for layer in inner.layers] if self.graphs_cover else []
        self.final_norm_w, self.head_w = inner.norm.weight, model.lm_head.weight
        self.dims = (self.hq, self.hkv, self.head_dim, norm_eps(inner.norm, layer_form))
        self.act = activation_of(model.config.get_text_config())
        self.form = product_form(self.head_w)
        # a single sequence's attention through kernels/cpu_attention.py where it builds (and on a CPU)
        self.attention_kernel = attention_kernel_takes(self.head_w, self.head_dim)
        # and whole layers through kernels/cpu_layer.py for forwards of up to cpu_layer.MAX_ROWS tokens
        self.layer_kernel = layer_kernel_takes(self.form, self.attention_kernel)
        self.layer_args = [kernel_layer_args(layer, layer_form, self.act) for layer in inner.layers]
        # the final norm's arguments for the layer kernel's own norm op (cpu_layer.rms_norm_rows)
        self.final_norm_args = (inner.norm.weight, self.dims[3], layer_form.offset_norms)
        self.compile_s = 0.0  # seconds this runner spent compiling (and checking) buckets

    def block_mask_batch(self, n: int) -> bool:
        """Must a packed batch of n tokens in all come as one block-diagonal mask? Where the layer kernel runs
        it (it takes no padded layout); larger batches run the graphs or the lean loop, row by row."""
        return self.layer_kernel_runs(n)

    def layer_kernel_runs(self, n: int) -> bool:
        """Does a forward of n tokens go through kernels/cpu_layer.py (else the graphs)?"""
        return self.layer_kernel and n <= cpu_layer.MAX_ROWS

    def covers(self, bucket: int) -> bool:
        """Does this step run forwards of this bucket (the graphs or the layer kernel), else the lean loop?"""
        return self.graphs_cover or self.layer_kernel_runs(bucket)

    @classmethod
    def for_model(cls, model, pool: PagePool, table: BlockTable) -> "CompiledRunner | None":
        """A CompiledRunner if the lean loop reproduces this model bit for bit (its probe) and the graphs
        cover its layers; else None, with the reason logged."""
        if LeanRunner.for_model(model, pool, table, exact=True) is None:
            log.info("compiled step: %s has no lean loop here; the HF modules run it", type(model).__name__)
            return None
        reason = unsupported_reason(model)
        if reason is not None:
            log.info("compiled step: %s not compiled (%s); the lean loop runs it", type(model).__name__, reason)
            return None
        runner = cls(model, pool, table, steps_for(model))
        if not runner.covers(1):
            log.info("compiled step: %s's layers run only through the CPU layer kernel, which does not run here; "
                     "the lean loop runs it", type(model).__name__)
            return None
        return runner

    def prepare(self, max_tokens: int, background: bool = False) -> None:
        """Compile and check every bucket a forward of up to max_tokens tokens uses (a generation's
        verifications: the draft budget + 1), on a scratch sequence of random tokens, so no compile lands
        inside a generation's decode, where the draft policy would take it for the cost of a step.

        background=False: now, before returning. background=True: in a thread of its own, returning at once;
        until a bucket is compiled and checked, every runner of the model runs its forwards through the lean
        loop (exact either way): a chat or a server is ready before its graphs are (SpecModel.warm_up)."""
        top = bucket_for(min(max(max_tokens, 1), BUCKETS[-1]))
        todo = [b for b in BUCKETS if b <= top and self.covers(b) and b not in self.steps.checked
                and b not in self.steps.failed]
        if not todo or self.steps.compiling_elsewhere():
            return
        if background:
            with _compiling:
                if self.steps.background is None or not self.steps.background.is_alive():
                    self.steps.background = threading.Thread(target=self._compile, args=(top, todo, False),
                                                             name="specdec-compile")
                    self.steps.background.start()
            return
        self._compile(top, todo, True)

    def _compile(self, top: int, todo: list[int], charge: bool) -> None:
        """prepare's work: each bucket in todo compiled and checked (first forwards) on a scratch sequence;
        charge: count the seconds in this runner's compile_s (its generation waited for them)."""
        pool = PagePool(8, 16)  # 128 slots: a 33-token prefix + the largest bucket
        table = BlockTable(pool, self.device)
        scratch = type(self)(self.model, pool, table, self.steps)
        scratch.layer_kernel = self.layer_kernel  # the same path as this runner's forwards
        vocab = self.model.config.get_text_config().vocab_size
        tokens = torch.randint(0, vocab, (33 + top,), generator=torch.Generator().manual_seed(0)).to(self.device)
        try:
            with specdec_attention(self.model):
                scratch.forward(tokens[:33], logits_rows=1)  # past every bucket: the lean loop
                for b in todo:
                    if _exiting.is_set():
                        break
                    scratch.forward(tokens[33:33 + b], logits_rows=None)
                    scratch.rollback(33)
                    table.truncate(33)
        finally:
            table.release()
        if charge:
            self.compile_s += scratch.compile_s

    def run_meta(self, x: torch.Tensor, meta: StepMeta, need: int, logits_rows, first: int = 0) -> torch.Tensor:
        n = x.shape[0]
        bucket = bucket_for(n)
        if bucket is None or first != 0 or bucket in self.steps.failed or not self.covers(bucket):
            return super().run_meta(x, meta, need, logits_rows, first)
        if bucket not in self.steps.checked:
            if self.steps.compiling_elsewhere():  # not ready yet: the lean loop, rather than wait for it
                return super().run_meta(x, meta, need, logits_rows, first)
            with _compiling:
                if bucket not in self.steps.checked:
                    return self._first(x, meta, need, logits_rows, bucket)
        try:
            return self._compiled(x, meta, need, logits_rows, bucket)
        except Exception as e:  # noqa: BLE001 (e.g. a guard miss that dynamo may not recompile: run it lean;
            # the lean loop rewrites every layer's KV for these slots, whatever the graphs had written)
            with _compiling:
                self.steps.fail(bucket, f"{type(e).__name__} at run time: {str(e).splitlines()[0] if str(e) else ''}")
            return super().run_meta(x, meta, need, logits_rows, first)

    def _first(self, x, meta, need, logits_rows, bucket: int) -> torch.Tensor:
        """A bucket's first forward (the lock held): compile, then check against the lean loop on the same
        inputs; return the lean loop's logits (whose KV it wrote last). A failure marks the bucket failed."""
        if bucket in self.steps.failed:
            return super().run_meta(x, meta, need, logits_rows)
        through_layers = self.layer_kernel_runs(bucket)
        if through_layers:  # nothing to compile: the check alone
            log.info("checking the %s step's CPU layer kernel for %d-token forwards against the lean loop",
                     type(self.model).__name__, bucket)
        else:
            log.info("compiling the %s step for %d-token forwards (inductor, cached on disk) ...",
                     type(self.model).__name__, bucket)
        began = time.perf_counter()
        try:
            got = self._compiled(x, meta, need, logits_rows, bucket)
        except Exception as e:  # noqa: BLE001 (any compile error: the lean loop runs it instead)
            self.steps.fail(bucket, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return super().run_meta(x, meta, need, logits_rows)
        spent = time.perf_counter() - began
        self.compile_s += spent
        self.steps.compile_s += spent
        if not through_layers:
            log.info("compiled the %d-token step in %.1f s", bucket, spent)
        ref = super().run_meta(x, meta, need, logits_rows)
        why = agree(ref, got, x.dtype)
        if why is None:
            self.steps.checked.add(bucket)
        else:
            self.steps.fail(bucket, f"its check against the lean loop failed: {why}")
        return ref

    def _compiled(self, x, meta, need, logits_rows, bucket: int) -> torch.Tensor:
        if self.layer_kernel_runs(x.shape[0]):
            return self._layers(x, meta, need, logits_rows)
        n, graphs, g = x.shape[0], self.steps.graphs, self.form
        cos, sin = self._rope(meta.q_pos, x.dtype, need)  # [n, D]
        if bucket > n:  # pad rows: zeros (their outputs are dropped; attention never sees them)
            x, cos, sin = (F.pad(t, (0, 0, 0, bucket - n)) for t in (x, cos, sin))
        cos, sin = cos[:, None], sin[:, None]
        att_rows = x.new_zeros(bucket, self.hq * self.head_dim) if bucket > n else None
        want, top = set(self.capture), len(self.layers)
        kept: dict[int, torch.Tensor] = {}
        q, k, v = graphs["pre"](x, self.params[0], cos, sin, self.dims, g)
        for i in range(top):
            att = self._attend(i, q[:n], k[:n], v[:n], meta)
            if att_rows is not None:
                att_rows[:n] = att
                att = att_rows
            if i + 1 < top:
                x, q, k, v = graphs["mid"](att, x, self.params[i], self.params[i + 1], cos, sin, self.dims, self.act, g)
                if i + 1 in want:
                    kept[i + 1] = x[:n]
            else:
                x, normed, logits = graphs["last"](att, x, self.params[i], self.final_norm_w, self.head_w,
                                                   self.dims[3], self.act, g)
        if want:
            if top in want:
                kept[top] = normed[:n]
            self.last_features = torch.cat([kept[layer] for layer in self.capture], dim=-1)
        return _select_rows(logits[:n], logits_rows)

    def _layers(self, x, meta, need, logits_rows) -> torch.Tensor:
        """The forward as one kernels/cpu_layer.py call a layer (no padding to the bucket: the kernel takes any
        row count; a packed batch attends over its block-diagonal mask), then the final norm (the layer kernel's
        own, one op) and the LM head's rows through the row kernel."""
        ropes = {key: self._rope(meta.q_pos, x.dtype, need, key) for key in self._rope_params}  # [n, D] each
        Hq, Hkv, D, eps = self.dims
        want, top = set(self.capture), len(self.layers)
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            mask = None if meta.unmasked(layer.sliding_window) else meta.mask_for(layer.sliding_window)
            k_pages, v_pages = self.kv.pages(i, Hkv, D, x.dtype)
            weights, biases, extras = self.layer_args[i]
            cos, sin = ropes[layer.rope_key]
            x = cpu_layer.decoder_layer(x, weights, biases, cos, sin, k_pages, v_pages, meta.write_slots,
                                        meta.read_slots, mask, layer.scaling, eps, Hq, Hkv, **extras)
            if i + 1 in want and i + 1 < top:
                kept[i + 1] = x
        if top in want:
            kept[top] = cpu_layer.rms_norm_rows(x, *self.final_norm_args)
            normed = _select_rows(kept[top], logits_rows)
        else:
            normed = cpu_layer.rms_norm_rows(_select_rows(x, logits_rows), *self.final_norm_args)
        if want:
            self.last_features = torch.cat([kept[layer] for layer in self.capture], dim=-1)
        return self.capped(cpu_rows.rows_linear(normed, self.head_w))

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """Layer i's attention, eager: q [n, Hq, D], k, v [n, Hkv, D] -> [n, Hq * D]; writes k, v to the pages.
        A packed batch laid out padded (meta.rows) attends row by row in one call, as the lean loop does."""
        n, layer = q.shape[0], self.layers[i]
        mask = None if meta.rows is not None or meta.unmasked(layer.sliding_window) else \
            meta.mask_for(layer.sliding_window)
        if self.attention_kernel and meta.rows is None:
            k_pages, v_pages = self.kv.pages(i, self.hkv, self.head_dim, k.dtype)
            return cpu_attention.attend_pages(q, k, v, k_pages, v_pages, meta.write_slots, meta.read_slots, mask,
                                              layer.scaling)
        self.kv.write(i, meta.write_slots, k.transpose(0, 1)[None], v.transpose(0, 1)[None], meta.write_span)
        if meta.rows is not None:
            return attend_rows(self.kv, i, q, meta.rows, layer.sliding_window, layer.scaling)
        keys, vals = self.kv.gather(i, meta.read_slots, meta.read_span)  # [1, Hkv, T, D]
        att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=mask,
                                             scale=layer.scaling, enable_gqa=self.hq != self.hkv)
        return att[0].transpose(0, 1).reshape(n, self.hq * self.head_dim)
