"""The lean draft forward (hf/lean.py): same logits as the HF modules, used only where its probe passes."""
import pytest
import torch

import specdec
from specdec.cache.pool import BlockTable, PagePool
from specdec.drafters.model import ModelDrafter
from specdec.hf.attention import specdec_attention
from specdec.hf import linear
from specdec.hf.cache import StepMeta
from specdec.hf.lean import LeanRunner, rope, rotate_half
from specdec.hf.runner import ModelRunner
from specdec.quantize import int4_draft, int8_draft

from conftest import VOCAB, build, hf_greedy


def _hf_order_lean(model, pool, table):
    """The lean loop with every linear through F.linear, as HF's modules multiply (the probe's setting):
    the one the bit-for-bit tests hold to HF's numbers."""
    return LeanRunner(model, pool, table, short_blocks=False, packed=False)


def _logits(cls, model, tokens, chunks):
    pool = PagePool(8, 8)
    runner = cls(model, pool, BlockTable(pool))
    out, at = [], 0
    with specdec_attention(model):
        for size in chunks:
            out.append(runner.forward(tokens[at:at + size], logits_rows=None))
            at += size
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_lean_forward_matches_the_hf_modules_past_the_sliding_window(arch):
    model = build(arch, seed=1)
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
    chunks = [13, 1, 1, 4, 1, 10]  # a prefill, single drafting steps, catch-up forwards; past mistral's window 9
    ref, got = _logits(ModelRunner, model, tokens, chunks), _logits(LeanRunner, model, tokens, chunks)
    assert torch.allclose(ref, got, atol=1e-5, rtol=1e-4)
    pool = PagePool(4, 8)
    assert isinstance(LeanRunner.for_model(model, pool, BlockTable(pool)), LeanRunner)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3"])
@pytest.mark.parametrize("row_kernel", ["0", "1"])
def test_lean_tree_blocks_match_the_hf_modules_bit_for_bit(arch, row_kernel, monkeypatch):
    """A tree grown one depth per forward (forward_tree with earlier nodes in the block), past mistral's
    sliding window: the lean loop's logits equal the HF modules' exactly, and the pages hold the same KV."""
    model = build(arch, seed=1)
    tokens = torch.randint(3, VOCAB, (17,), generator=torch.Generator().manual_seed(4))
    # depth 1: nodes a, b (siblings); depth 2: c under a, d under b, e under a
    pos = torch.tensor([12, 12, 13, 13, 13])
    masks = [torch.tensor([[1, 0], [0, 1]], dtype=torch.bool),
             torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)]
    outs, pages = [], []
    for cls in (ModelRunner, _hf_order_lean):
        pool = PagePool(8, 4)
        runner = cls(model, pool, BlockTable(pool))
        with specdec_attention(model):
            rows = [runner.forward(tokens[:12], logits_rows=None)]
            rows.append(runner.forward_tree(tokens[12:14], pos[:2], masks[0]))
            rows.append(runner.forward_tree(tokens[14:17], pos, masks[1]))
        outs.append(torch.cat(rows))
        pages.append(torch.cat([torch.cat(runner.kv.gather(i, runner.table.slots(0, 17))) for i in range(runner.num_layers)]))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pages[0], pages[1])
    # short blocks through the row kernel or weight-first (the engine's setting where the machine's rules
    # turn them on): the same numbers to rounding, the same greedy tokens
    monkeypatch.setattr(linear, "ROW_KERNEL_OVERRIDE", row_kernel)
    assert linear.row_kernel_ready() == (row_kernel == "1")  # x86 with AVX2 and a compiler, as inductor needs
    pool = PagePool(8, 4)
    runner = LeanRunner(model, pool, BlockTable(pool), short_blocks=True)
    with specdec_attention(model):
        rows = [runner.forward(tokens[:12], logits_rows=None), runner.forward_tree(tokens[12:14], pos[:2], masks[0]),
                runner.forward_tree(tokens[14:17], pos, masks[1])]
    fast = torch.cat(rows)
    assert torch.allclose(fast, outs[0], atol=1e-5, rtol=1e-4) and torch.equal(fast.argmax(-1), outs[0].argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("prefill", [700, 5])
def test_a_first_prefill_attends_as_sdpas_is_causal_bit_for_bit(arch, prefill, monkeypatch):
    """A prompt's first prefill (from position 0) passes SDPA is_causal instead of the explicit mask, which
    lets attention skip the masked half: the logits equal the masked attention's exactly, past the CPU
    flash kernel's 512-key blocks; later forwards keep the mask, and so do Gemma 3's sliding layers (window
    6) where the prefill is longer than their window (700 tokens), not where it fits in it (5)."""
    from specdec.hf import lean

    model = build(arch, seed=1)
    tokens = torch.randint(3, VOCAB, (prefill + 4,), generator=torch.Generator().manual_seed(3))
    seen = []
    sdpa = lean.F.scaled_dot_product_attention

    def spy(*a, is_causal=False, attn_mask=None, **kw):
        seen.append((is_causal, attn_mask is None))
        return sdpa(*a, is_causal=is_causal, attn_mask=attn_mask, **kw)

    def run():
        pool = PagePool(64, 16)
        runner = _hf_order_lean(model, pool, BlockTable(pool))
        return torch.cat([runner.forward(tokens[:prefill], logits_rows=None),
                          runner.forward(tokens[prefill:], logits_rows=None)])

    monkeypatch.setattr(lean.F, "scaled_dot_product_attention", spy)
    fast = run()
    layers = model.config.num_hidden_layers
    windowed = [t == "sliding_attention" and prefill > model.config.sliding_window
                for t in getattr(model.config, "layer_types", None) or ["full"] * layers]
    assert seen[:layers] == [(not w, not w) for w in windowed]  # the prefill: is_causal, no mask, where no window cuts
    assert seen[layers:] == [(False, False)] * layers  # the next forward sees the prefix: the mask
    monkeypatch.setattr(StepMeta, "causal_from_zero", lambda self, window: False)
    seen.clear()
    assert torch.equal(run(), fast)
    assert not any(c for c, _ in seen)


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "gpt2"])
def test_unsupported_architectures_keep_the_hf_path_and_the_output(arch):
    pool = PagePool(4, 8)
    draft_model = build(arch, seed=3, layers=1)
    assert LeanRunner.for_model(draft_model, pool, BlockTable(pool)) is None
    target = build(arch, seed=0)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    out = specdec.generate(target, ids, drafter=draft_model, draft_length=3, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(out, hf_greedy(target, ids, 20, eos_token_id=None))


def test_the_probe_refuses_a_model_the_lean_loop_does_not_reproduce():
    model = build("llama", seed=1)
    # a forward hook changes what the HF modules compute; the lean loop reads weights and never sees it
    model.model.layers[0].mlp.register_forward_hook(lambda mod, inp, out: out * 1.5)
    pool = PagePool(4, 8)
    assert LeanRunner.for_model(model, pool, BlockTable(pool)) is None
    assert isinstance(LeanRunner.for_model(build("llama", seed=1), pool, BlockTable(pool)), LeanRunner)


@pytest.mark.parametrize("quantized", [False, True])
def test_model_drafter_drafts_through_the_lean_loop_and_keeps_greedy_output(monkeypatch, quantized):
    calls = []
    real = LeanRunner._run

    def spy(self, tokens, start, positions, block_pos, *a, **kw):
        calls.append(block_pos is None)
        return real(self, tokens, start, positions, block_pos, *a, **kw)

    monkeypatch.setattr(LeanRunner, "_run", spy)
    target = build("llama", seed=0, layers=3)
    draft = build("llama", seed=4, layers=1)
    draft = int8_draft(draft) if quantized else draft
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    ref = hf_greedy(target, ids, 30, eos_token_id=None)
    for kw in (dict(draft_length=4), dict(draft_length="adaptive"), dict(draft_length=6, do_sample=False)):
        assert torch.equal(specdec.generate(target, ids, drafter=ModelDrafter(draft), max_new_tokens=30,
                                            eos_token_id=None, **kw), ref)
    assert calls.count(True) > 10  # drafting steps and catch-ups ran lean (tree blocks may too: the probe's)
    off = ModelDrafter(draft, lean=False)
    calls.clear()
    runners = []
    monkeypatch.setattr(ModelDrafter, "end", lambda self: runners.append(type(self.runner)))
    assert torch.equal(specdec.generate(target, ids, drafter=off, draft_length=4, max_new_tokens=30,
                                        eos_token_id=None), ref)
    assert runners == [ModelRunner]


def test_the_target_runs_lean_only_where_the_probe_proves_it_bit_identical(monkeypatch):
    import specdec.hf.lean as lean
    import specdec.hf.lean_layer as lean_layer

    targets, probing = [], []
    real_init, real_probe = lean.LeanRunner.__init__, lean._probe

    def spy(self, model, *a, **kw):
        if not probing:  # runners the engine and drafter use, not the probe's own
            targets.append(model)
        real_init(self, model, *a, **kw)

    def probe(model):
        probing.append(model)
        try:
            return real_probe(model)
        finally:
            probing.clear()

    monkeypatch.setattr(lean.LeanRunner, "__init__", spy)
    monkeypatch.setattr(lean, "_probe", probe)
    target, draft = build("llama", seed=0, layers=3), build("llama", seed=4, layers=1)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = hf_greedy(target, ids, 24, eos_token_id=None)
    assert torch.equal(specdec.generate(target, ids, drafter=draft, max_new_tokens=24, eos_token_id=None), ref)
    assert any(m is target for m in targets)  # bit-identical: the target used the lean loop
    # a lean loop off by a rounding step: still fine for a draft, never for the target
    real_rms = lean_layer.rms_norm
    monkeypatch.setattr(lean_layer, "rms_norm", lambda norm, x: real_rms(norm, x) * (1 + 1e-6))
    target2, draft2 = build("llama", seed=7, layers=3), build("llama", seed=8, layers=1)
    targets.clear()
    ref2 = hf_greedy(target2, ids, 24, eos_token_id=None)
    assert torch.equal(specdec.generate(target2, ids, drafter=draft2, max_new_tokens=24, eos_token_id=None), ref2)
    assert any(m is draft2 for m in targets) and not any(m is target2 for m in targets)
    assert lean._verdicts[target2][(torch.float32, torch.device("cpu"))] == "close"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_entering_at_a_layer_with_hidden_states_matches_the_hf_modules_bit_for_bit(arch):
    model = build(arch, seed=2, layers=4)
    tokens = torch.randint(3, VOCAB, (14,), generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    outs = []
    for cls in (ModelRunner, _hf_order_lean):
        pool = PagePool(4, 8)
        runner = cls(model, pool, BlockTable(pool))
        with specdec_attention(model):
            runner.forward(tokens[:10], logits_rows=1)
            runner.forward(tokens[10:], logits_rows=1)  # layers < 2 now hold KV for positions 10..13
            runner.rollback(10)
            outs.append(runner.forward(tokens[10:], hidden=hidden, start_layer=2))
        with pytest.raises(ValueError, match="entering a layer > 0"):
            runner.forward(tokens[10:], hidden=hidden[:2], start_layer=2)
    assert torch.equal(outs[0], outs[1])


def test_lean_refuses_rope_that_changes_with_the_sequence_length():
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.cache.pool import BlockTable, PagePool
    from specdec.hf.lean import LeanRunner

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128,
                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    pool = PagePool(4, 8)
    assert LeanRunner.for_model(model, pool, BlockTable(pool), exact=True) is None
    ids = torch.randint(3, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    assert torch.equal(specdec.generate(model, ids, drafter="ngram", max_new_tokens=40), want)


def _phi3_longrope():
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=32,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                      "long_factor": [6.0, 9.0, 13.0, 20.0], "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    return Phi3ForCausalLM(cfg).eval()


def test_longrope_past_its_switch_is_refused_and_exact_on_either_side():
    """Phi-3's LongRoPE changes factors past original_max_position_embeddings (32 here), where HF recomputes
    its cache: a generation that would cross it is refused, naming the limit; below it, and from a prompt
    already past it, the output is HF's."""
    from specdec.hf.runner import rope_switch_of

    model = _phi3_longrope()
    assert rope_switch_of(model) == ("longrope", 32)
    gen = torch.Generator().manual_seed(2)
    short, long = torch.randint(3, 61, (1, 8), generator=gen), torch.randint(3, 61, (1, 40), generator=gen)
    for ids, new in ((short, 20), (long, 20)):
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              eos_token_id=None)
        for drafter in ("ngram", model):
            got = specdec.generate(model, ids, drafter=drafter, draft_length=3, max_new_tokens=new, eos_token_id=None)
            assert torch.equal(got, want)
    model_s = specdec.wrap(model, drafter="ngram")
    with pytest.raises(ValueError, match=r"longrope RoPE.*past position 32.*prompt \+ max_new_tokens <= 32"):
        model_s.generate(short, max_new_tokens=30, eos_token_id=None)
    assert model_s.engine.pool is None or model_s.engine.pool.num_used == 0
    assert torch.equal(model_s.generate(short, max_new_tokens=20, eos_token_id=None),
                       model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=20,
                                      do_sample=False, eos_token_id=None))


def _tree_logits(runner, model, tokens):
    """A prefill, a single token, then a two-depth tree block (siblings, earlier nodes in the block)."""
    pos = torch.tensor([13, 13, 14, 14, 14])
    masks = [torch.tensor([[1, 0], [0, 1]], dtype=torch.bool),
             torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)]
    with specdec_attention(model):
        rows = [runner.forward(tokens[:12], logits_rows=None), runner.forward(tokens[12:13], logits_rows=1),
                runner.forward_tree(tokens[13:15], pos[:2], masks[0]), runner.forward_tree(tokens[15:18], pos, masks[1])]
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_drafts_fused_loop_keeps_the_hf_modules_tokens(arch):
    """A draft's runner (for_model without exact) joins a quantized draft's q/k/v and gate/up into one
    product each and uses torch's RMSNorm: the HF modules' logits to rounding and the same greedy tokens,
    for single tokens and tree blocks; a target's runner (exact) stays op for op."""
    model = int4_draft(build(arch, seed=1, scale=3.0))
    tokens = torch.randint(3, VOCAB, (18,), generator=torch.Generator().manual_seed(4))
    pool = PagePool(8, 4)
    ref = _tree_logits(ModelRunner(model, pool, BlockTable(pool)), model, tokens)
    pool = PagePool(8, 4)
    runner = LeanRunner.for_model(model, pool, BlockTable(pool))
    assert runner.fused and runner.layers[0].qkv is not None and runner.layers[0].q is None
    got = _tree_logits(runner, model, tokens)
    assert torch.allclose(got, ref, atol=5e-2 * ref.abs().max(), rtol=0) and torch.equal(got.argmax(-1), ref.argmax(-1))
    exact = LeanRunner.for_model(build(arch, seed=1), pool, BlockTable(pool), exact=True)
    assert not exact.fused and exact.layers[0].qkv is None


def _gemma3(**overrides):
    from transformers import Gemma3ForCausalLM

    from conftest import _cfgs

    cfg = _cfgs()["gemma3"][1]
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(5)
    return Gemma3ForCausalLM(cfg).eval()


def test_gemma3_runs_lean_in_both_dtypes_with_its_logit_cap_and_refuses_attention_capping():
    """Gemma 3's own parts (q/k norms, sandwich and (1 + w) norms, local and global RoPE tables, the scaled
    embedding, and a final logit cap where its config sets one) reproduce its HF modules bit for bit in
    float32 and bfloat16; a config the loop does not compute (attention logit capping) keeps the HF path,
    with the reason named."""
    from specdec.hf.lean import _probe, unsupported

    capped = _gemma3(final_logit_softcapping=0.5)  # small enough that the tanh bends every logit
    assert unsupported(capped) is None and _probe(capped) == "exact"
    assert _probe(capped.to(torch.bfloat16)) == "exact"
    pool = PagePool(4, 8)
    runner = LeanRunner.for_model(_gemma3(final_logit_softcapping=0.5), pool, BlockTable(pool), exact=True)
    logits = runner.forward(torch.arange(3, 9), logits_rows=None)
    assert logits.abs().max() < 0.5  # the cap applied: |tanh(z / c) * c| < c
    uncapped = _gemma3()
    assert _probe(uncapped) == "exact" and not torch.equal(
        _logits(LeanRunner, uncapped, torch.arange(3, 9), [6]), logits)
    attn_capped = _gemma3(attn_logit_softcapping=20.0)
    assert unsupported(attn_capped) == "attention logit soft-capping"
    assert LeanRunner.for_model(attn_capped, pool, BlockTable(pool)) is None
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    out = specdec.generate(attn_capped, ids, drafter="ngram", max_new_tokens=12, eos_token_id=None,
                           return_dict_in_generate=True)
    assert out.stats.step == "hf" and torch.equal(out.sequences, hf_greedy(attn_capped, ids, 12, eos_token_id=None))


def test_rope_in_four_ops_is_hfs_bit_for_bit():
    x = torch.randn(2, 4, 5, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    signed = torch.cat((-sin[:, :4], sin[:, 4:]), dim=-1)
    for dtype in (torch.float32, torch.bfloat16):
        a, c, s, ss = (t.to(dtype) for t in (x, cos, sin, signed))
        assert torch.equal(rope(a, c, ss), a * c + rotate_half(a) * s)


def test_only_a_lone_token_seeing_every_key_skips_the_mask():
    def meta(tree_mask, **kw):
        n = tree_mask.shape[0]
        return StepMeta(prefix_len=6, write_slots=torch.arange(n), read_slots=torch.arange(6 + tree_mask.shape[1]),
                        tree_mask=tree_mask, q_pos=torch.arange(6, 6 + n), **kw)

    one = torch.ones(1, 1, dtype=torch.bool)
    assert meta(one).unmasked(None)
    assert not meta(one).unmasked(4)  # a sliding window may hide the prefix
    assert not meta(torch.tensor([[1, 0, 1]], dtype=torch.bool)).unmasked(None)  # earlier tree nodes
    assert not meta(torch.tril(torch.ones(2, 2, dtype=torch.bool))).unmasked(None)
    packed = meta(one, full_mask=torch.tensor([[1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool))
    assert not packed.unmasked(None)


def test_step_bitwise_multiplies_as_hf_does_where_the_machine_rules_would_not(monkeypatch):
    """step="bitwise" promises HF's logits bit for bit: its runner keeps F.linear's kernel even where this
    machine's rules would multiply short blocks weight-first (hf/linear.py) or through packed weights
    (hf/packed.py); the control, the engine's default lean runner with both rules on, differs."""
    import specdec.hf.lean as lean
    from specdec.hf import linear, packed

    monkeypatch.setattr(linear, "WEIGHT_FIRST_MAX_ROWS", linear.SHORT_BLOCK_ROWS)
    monkeypatch.setattr(packed, "PACKED", torch.backends.mkldnn.is_available())
    model = build("llama", seed=3, layers=3)
    tokens = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    chunks = [11, 5, 1, 4, 3]
    bitwise = lambda m, pool, table: lean.LeanRunner.for_model(m, pool, table, exact=True, bitwise=True)  # noqa: E731
    default = lambda m, pool, table: lean.LeanRunner.for_model(m, pool, table, exact=True)  # noqa: E731
    ref = _logits(ModelRunner, model, tokens, chunks)
    assert torch.equal(_logits(bitwise, model, tokens, chunks), ref)
    assert not torch.equal(_logits(default, model, tokens, chunks), ref)


def test_pages_scattered_across_the_pool_give_the_same_logits_bit_for_bit():
    """A sequence on consecutive pages reads its KV as views of them (BlockTable.span); one whose pages are
    scattered gathers them: the same logits either way, through the lean loop and the HF modules."""
    model = build("llama", seed=2, layers=2)
    tokens = torch.randint(3, VOCAB, (26,), generator=torch.Generator().manual_seed(6))
    chunks = [9, 1, 4, 1, 6, 5]

    def run(cls, scatter: bool):
        pool = PagePool(16, 4)
        others = [BlockTable(pool) for _ in range(6)]
        table, runner = BlockTable(pool), None
        runner = cls(model, pool, table)
        out, at = [], 0
        with specdec_attention(model):
            for size in chunks:
                if scatter:  # another sequence takes the next page before this one grows
                    others[len(out)].reserve(1)
                out.append(runner.forward(tokens[at:at + size], logits_rows=None))
                at += size
        spans = table.span(0, table.length)
        return torch.cat(out), spans

    for cls in (_hf_order_lean, ModelRunner):
        together, span = run(cls, False)
        scattered, none = run(cls, True)
        assert span is not None and none is None  # the two layouts really differ
        assert torch.equal(together, scattered)
