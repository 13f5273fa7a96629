"""Drafts with another tokenizer (drafters/cross_tokenizer.py): greedy output is the target's own in both
modes, the shared-vocabulary map is right (a draft that is the target under permuted ids is accepted),
sampled output follows the target's distribution in intersection mode (and a lossy q fails the same
test; chains and trees, one sequence and batched), and the bad inputs get clear errors."""
import copy
import json
from types import SimpleNamespace

import pytest
import torch

import specdec
from specdec import TreeSpec
from specdec.tree import is_chain
from specdec.drafters import CrossTokenizerDrafter
from specdec.drafters.vocab_map import VocabMap
from specdec.policy import ConstantPolicy

from conftest import hf_greedy, tiny_vocab_model
from test_trees import SAMPLE_NEW, SAMPLE_PROMPT, SAMPLES, exact_joint, gof

NEW = 24


@pytest.fixture(scope="module")
def zoo_target():
    return specdec.zoo.load("target")


def permuted_copy(model, tok, seed: int):
    """The same model and tokenizer with every token id permuted: a draft that knows the target exactly
    but shares none of its ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    perm = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(seed))  # new id = perm[old id]
    spec["model"]["vocab"] = {t: int(perm[i]) for t, i in vocab.items()}
    for added in spec["added_tokens"]:
        added["id"] = int(perm[added["id"]])
    new_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=tok.eos_token,
                                      bos_token=tok.bos_token, clean_up_tokenization_spaces=False)
    draft = copy.deepcopy(model)
    old_of_new = torch.argsort(perm)
    with torch.no_grad():
        weights = {id(m.weight): m.weight for m in (draft.get_input_embeddings(), draft.get_output_embeddings())}
        for w in weights.values():  # tied embeddings: one tensor, permuted once
            w[: len(vocab)] = w[: len(vocab)][old_of_new].clone()
    return draft, new_tok


def other_tokenizer(vocab_size: int):
    """A tokenizer unlike the zoo's: SentencePiece-style spaces ('▁'), another vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specdec.zoo.corpus import read_texts

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(read_texts("train")[:200], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def watch_trees(drafter) -> list:
    """Every Draft the drafter's propose_tree returns from now on, in a list (the drafter is patched)."""
    drafts, propose_tree = [], drafter.propose_tree

    def recorded(ctx, spec, budget):
        drafts.append(propose_tree(ctx, spec, budget))
        return drafts[-1]

    drafter.propose_tree = recorded
    return drafts


def branching(drafts: list) -> int:
    """How many of the drafts are trees with a branch (not chains)."""
    return sum(not is_chain(d.host.parents) for d in drafts)


def tiny_llama(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("mode", ["intersection", "text"])
def test_a_permuted_copy_of_the_target_drafts_exactly_and_is_accepted(zoo_target, mode):
    target, tok = zoo_target
    draft, draft_tok = permuted_copy(target, tok, seed=0)
    vocab = VocabMap(draft_tok, tok, len(draft_tok), len(tok))
    assert vocab.size > 0.9 * len(tok)
    assert all(draft_tok.convert_ids_to_tokens(int(d)) == tok.convert_ids_to_tokens(int(t))
               for d, t in zip(vocab.draft_ids[:200], vocab.target_ids[:200]))  # the same token, other ids
    for prompt in specdec.zoo.prompts(2):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = specdec.generate(target, ids, drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok,
                               cross_tokenizer=mode, lookup_first=False, draft_length=4, max_new_tokens=NEW,
                               eos_token_id=None, return_dict_in_generate=True)
        assert torch.equal(out.sequences, hf_greedy(target, ids, NEW, eos_token_id=None))
        assert out.stats.acceptance_rate > 0.6, out.stats.summary()  # a wrong map or history would be ~0


@pytest.mark.parametrize("mode", ["intersection", "text"])
def test_token_trees_across_tokenizers_give_the_targets_greedy_output(zoo_target, mode):
    """A dynamic tree of 8 nodes: intersection mode grows it over the shared tokens, text mode in the
    draft's vocabulary and re-encodes its leaves into one target-token trie (a permuted copy of the target
    is accepted down the tree, about two tokens per step, as the same-vocabulary copy is). Greedy output is
    the target's either way, the trees branch, and both page pools are given back."""
    target, tok = zoo_target
    draft, draft_tok = permuted_copy(target, tok, seed=0)
    drafter = CrossTokenizerDrafter(draft, draft_tok, tok, mode=mode)
    model = specdec.wrap(target, drafter=drafter, tree=TreeSpec.dynamic(nodes=8, depth=4, topk=2), draft_length=8)
    trees = watch_trees(drafter)
    for prompt in specdec.zoo.prompts(2):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=NEW, eos_token_id=None, return_dict_in_generate=True)
        assert torch.equal(out.sequences, hf_greedy(target, ids, NEW, eos_token_id=None))
        # a wrong map, position or mask below the first level would accept next to nothing past depth 1
        assert out.stats.accepted_tokens / out.stats.target_forwards > 1.2, out.stats.summary()
        assert model.engine.pool.num_used == 0 and drafter.runner is None
    assert branching(trees) > len(trees) // 2, len(trees)  # trees, not chains


@pytest.mark.parametrize("mode, tree", [("intersection", None), ("text", None), ("auto", None),
                                        ("text", TreeSpec.dynamic(nodes=10, depth=4, topk=3))],
                         ids=["intersection", "text", "auto", "text tree"])
def test_greedy_output_is_the_targets_with_a_really_different_tokenizer(zoo_target, mode, tree):
    """Text trees: leaves whose text re-encodes across the look-behind window (SentencePiece spaces against
    the zoo's byte-level pieces) are dropped or merged, never proposed wrong."""
    target, tok = zoo_target
    draft_tok = other_tokenizer(700)
    drafter = CrossTokenizerDrafter(tiny_llama(len(draft_tok), seed=1), draft_tok, tok, mode=mode, min_shared=64)
    model = specdec.wrap(target, drafter=drafter, draft_length=3, tree=tree)
    for prompt in specdec.zoo.prompts(4)[2:]:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert torch.equal(model.generate(ids, max_new_tokens=NEW, eos_token_id=None),
                           hf_greedy(target, ids, NEW, eos_token_id=None))
        assert model.engine.pool.num_used == 0 and drafter.runner is None  # both page pools given back


def char_tokenizer(chars: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


class LossyQ(CrossTokenizerDrafter):
    """The control: q over the shared tokens NOT renormalised (the unshared token's mass just dropped)."""

    def _propose_shared(self, ctx, budget, logits):
        draft = super()._propose_shared(ctx, budget, logits)
        if draft.q_probs is not None:
            draft.q_probs = draft.q_probs * 0.6
        return draft


@pytest.mark.parametrize("cls, lossless, behind_lookup, mode",
                         [(CrossTokenizerDrafter, True, False, "intersection"), (LossyQ, False, False, "intersection"),
                          (CrossTokenizerDrafter, True, True, "intersection"), (CrossTokenizerDrafter, True, True, "text"),
                          (CrossTokenizerDrafter, True, False, "text tree")],
                         ids=["exact", "lossy control", "exact behind prompt lookup", "text mode behind prompt lookup",
                              "text-mode trees"])
def test_sampling_through_the_intersection_follows_the_target(cls, lossless, behind_lookup, mode):
    """Target over 'abcd', draft over 'dcbae' (other ids, one token the target lacks): the exact joint
    distribution of 4 sampled tokens is reproduced; the lossy control is caught. Behind prompt lookup
    (drafters.LookupFirst, 1-token matches) the draft and the lookup take turns, still exact; in text
    mode (one-hot proposals) the lookup also continues the draft's chains past their plan. Text-mode
    trees (the draft's top 2 at each of 2 depths, re-encoded: 'e' becomes the target's unknown 'a') are
    one-hot siblings: exact too."""
    from specdec.drafters import LookupFirst

    target = tiny_vocab_model(4, seed=0, scale=4.0)
    exact = exact_joint(target)
    tree = TreeSpec.static([2, 2]) if mode == "text tree" else None
    drafter = cls(tiny_vocab_model(5, seed=7, scale=4.0), char_tokenizer("dcbae"), char_tokenizer("abcd"),
                  mode=mode.split()[0], min_shared=1)
    if behind_lookup:
        drafter = LookupFirst(drafter, min_match=1, extend=mode == "text")
    if mode == "text":  # k = 1 planned and room for more (4 new tokens, the first from the prefill: room 2)
        policy = ConstantPolicy(1)
        policy.max_length = 3
    if tree is not None:
        model = specdec.wrap(target, drafter=drafter, tree=tree)
    else:
        model = specdec.wrap(target, drafter=drafter, draft_length=policy if mode == "text" else 2)
    trees = watch_trees(drafter) if tree is not None else []
    counts = {}
    torch.manual_seed(1234)
    for _ in range(SAMPLES):
        seq = model.generate(SAMPLE_PROMPT, max_new_tokens=SAMPLE_NEW, do_sample=True, temperature=0.9, top_k=3)
        key = tuple(seq[0, SAMPLE_PROMPT.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
    p = gof(exact, counts, SAMPLES)
    assert p > 1e-3 if lossless else p < 1e-6
    if behind_lookup:
        assert drafter.lookup_steps > 100 and drafter.drafter_steps > 100
    if mode == "text":
        assert drafter.extensions > 100
    if tree is not None:  # siblings verified, not just chains
        assert branching(trees) > SAMPLES // 2


@pytest.mark.parametrize("tree, lossy", [(None, False), (None, True), (TreeSpec.static([2, 1]), False)],
                         ids=["chains", "chains, q scaled (control)", "trees"])
def test_sampled_batch_rows_through_the_intersection_follow_the_target(monkeypatch, tree, lossy):
    """Two rows of one batch drafted together over the shared tokens, chains and static [2, 1] trees: each
    row's 4 sampled tokens follow the target's joint distribution; scaling the q the rows keep (as LossyQ
    does) is caught."""
    from specdec.drafters import cross_rows

    target = tiny_vocab_model(4, seed=0, scale=4.0)
    exact = exact_joint(target)
    if lossy:
        chains = cross_rows.chain_drafts

        def scaled(requests, out, qs):
            drafts = chains(requests, out, qs)
            for d in drafts:
                if d.q_probs is not None:
                    d.q_probs = d.q_probs * 0.6
            return drafts

        monkeypatch.setattr(cross_rows, "chain_drafts", scaled)
    drafter = CrossTokenizerDrafter(tiny_vocab_model(5, seed=7, scale=4.0), char_tokenizer("dcbae"),
                                    char_tokenizer("abcd"), mode="intersection", min_shared=1)
    model = specdec.wrap(target, drafter=drafter, **(dict(tree=tree) if tree else dict(draft_length=2)))
    ids = SAMPLE_PROMPT.repeat(2, 1)
    counts = [{}, {}]
    torch.manual_seed(2468)
    for _ in range(SAMPLES):
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SAMPLE_NEW, do_sample=True,
                             temperature=0.9, top_k=3)
        for i in range(2):
            key = tuple(seq[i, SAMPLE_PROMPT.shape[1]:].tolist())
            counts[i][key] = counts[i].get(key, 0) + 1
    p = [gof(exact, c, SAMPLES) for c in counts]
    assert min(p) < 1e-6 if lossy else min(p) > 1e-3, p


def test_hf_keywords_put_prompt_lookup_in_front_of_a_draft_of_another_tokenizer(zoo_target):
    """tokenizer= / assistant_tokenizer= with a draft of another vocabulary draft behind prompt lookup by
    default (lookup_first='auto'): the target's greedy output, both sources proposing (the zoo target
    repeats itself, so its context has matches), both page pools given back. lookup_first=False drafts
    with the model alone (every step the drafter's); a draft of the same vocabulary stays a plain
    ModelDrafter unless lookup_first=True."""
    from specdec.drafters import LookupFirst
    from specdec.drafters.model import ModelDrafter

    target, tok = zoo_target
    draft_tok = other_tokenizer(700)
    draft = tiny_llama(len(draft_tok), seed=1)
    ids = tok(specdec.zoo.prompts(3)[2], return_tensors="pt").input_ids
    want = hf_greedy(target, ids, NEW, eos_token_id=None)
    model = specdec.wrap(target, drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok, draft_length=3)
    first = model.engine.drafter
    assert isinstance(first, LookupFirst) and isinstance(first.drafter, CrossTokenizerDrafter)
    assert torch.equal(model.generate(ids, max_new_tokens=NEW, eos_token_id=None), want)
    assert first.lookup_steps > 0 and first.drafter_steps > 0, (first.lookup_steps, first.drafter_steps)
    assert model.engine.pool.num_used == 0 and first.drafter.runner is None
    plain = specdec.wrap(target, drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok, lookup_first=False)
    assert isinstance(plain.engine.drafter, CrossTokenizerDrafter)
    assert torch.equal(plain.generate(ids, max_new_tokens=NEW, eos_token_id=None), want)
    same = specdec.zoo.load("draft-tiny")[0]
    assert isinstance(specdec.wrap(target, drafter=same, tokenizer=tok, assistant_tokenizer=tok).engine.drafter,
                      ModelDrafter)
    behind = specdec.wrap(target, drafter=same, lookup_first=True).engine.drafter
    assert isinstance(behind, LookupFirst) and isinstance(behind.drafter, ModelDrafter)
    out = specdec.generate(target, ids, drafter=same, lookup_first=True, draft_length=3, max_new_tokens=NEW,
                           eos_token_id=None)
    assert torch.equal(out, want)


def test_lookup_first_errors_name_the_problem(zoo_target):
    target, tok = zoo_target
    ids = tok("def f(x):", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="lookup_first must be True, False or 'auto'"):
        specdec.generate(target, ids, drafter="ngram", lookup_first="yes", max_new_tokens=2)
    for drafter in (None, "ngram"):  # nothing to put the lookup in front of
        with pytest.raises(ValueError, match="for prompt lookup alone pass drafter='ngram'"):
            specdec.wrap(target, drafter=drafter, lookup_first=True)


def test_cross_tokenizer_errors_name_the_problem(zoo_target):
    target, tok = zoo_target
    draft_tok = char_tokenizer("xyz")
    draft = tiny_llama(3, seed=0)
    ids = tok("def f(x):", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="share only .* tokens"):
        specdec.generate(target, ids, drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok,
                         cross_tokenizer="intersection", max_new_tokens=4)
    with pytest.raises(ValueError, match="needs tokenizer="):
        specdec.generate(target, ids, drafter=draft, assistant_tokenizer=draft_tok, max_new_tokens=4)
    with pytest.raises(ValueError, match="mode must be one of"):
        CrossTokenizerDrafter(draft, draft_tok, tok, mode="bytes")
    with pytest.raises(ValueError, match="past its model's vocabulary"):
        specdec.wrap(target, drafter=tiny_llama(2, seed=0), tokenizer=tok, assistant_tokenizer=draft_tok)
    with pytest.raises(ValueError, match="does not match the target's"):  # no tokenizers: the plain model drafter
        specdec.generate(target, ids, drafter=draft, max_new_tokens=4)
    assert "assistant_tokenizer" in str(pytest.raises(ValueError, specdec.generate, target, ids, drafter=draft,
                                                      max_new_tokens=4).value)


def test_the_command_line_drafts_across_tokenizers_with_a_model_of_another_vocabulary(zoo_target, tmp_path):
    from specdec.cli.models import _drafter_arg

    target, tok = zoo_target
    draft_tok = other_tokenizer(500)
    tiny_llama(len(draft_tok), seed=2).save_pretrained(tmp_path / "draft")
    draft_tok.save_pretrained(tmp_path / "draft")
    drafter = _drafter_arg(str(tmp_path / "draft"), tok, target=target)
    assert isinstance(drafter, CrossTokenizerDrafter) and drafter.mode == "auto"
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    assert torch.equal(specdec.generate(target, ids, drafter=drafter, max_new_tokens=12, eos_token_id=None),
                       hf_greedy(target, ids, 12, eos_token_id=None))


def test_auto_drafts_by_intersection_only_when_sampling_with_tokenizers_that_cut_text_alike(zoo_target):
    from specdec.drafters.vocab_map import span_agreement

    target, tok = zoo_target
    draft, draft_tok = permuted_copy(target, tok, seed=1)
    text = specdec.zoo.prompts(1)[0]
    assert span_agreement(draft_tok, tok, text) == 1.0  # the same cuts under other ids
    assert span_agreement(other_tokenizer(300), tok, text) < 0.9
    ids = tok(text, return_tensors="pt").input_ids
    for sample, want in ((False, "text"), (True, "intersection")):
        drafter = CrossTokenizerDrafter(draft, draft_tok, tok)
        specdec.generate(target, ids, drafter=drafter, draft_length=2, max_new_tokens=4, do_sample=sample)
        assert drafter.active == want


@pytest.mark.parametrize("mode, tree", [("intersection", None), ("text", None),
                                        ("intersection", TreeSpec.dynamic(nodes=6, depth=3, topk=2)),
                                        ("text", TreeSpec.dynamic(nodes=6, depth=3, topk=2))])
def test_a_left_padded_batch_drafts_across_tokenizers_in_one_draft_and_one_target_forward(monkeypatch, zoo_target,
                                                                                          mode, tree):
    """Three prompts in one batch: every row equals its own greedy generation and keeps its own draft
    history (a shared history would be rejected: acceptance would fall to ~0); every drafting row runs in
    each draft forward (chains: a sync, then one per further token, text mode's look-ahead token
    included; trees: one per depth, text rows' trees grown in the draft's ids and re-encoded, branching),
    and both page pools are given back."""
    import specdec.batch as batch_mod
    from specdec.drafters.cross_rows import CrossTokenizerRows
    from specdec.hf.batch_runner import BatchRunner

    target, tok = zoo_target
    draft, draft_tok = permuted_copy(target, tok, seed=1)
    tok.padding_side = "left"
    texts = specdec.zoo.prompts(3)
    enc = tok(texts, return_tensors="pt", padding=True)
    model = specdec.wrap(target, drafter=draft, tokenizer=tok, assistant_tokenizer=draft_tok, cross_tokenizer=mode,
                         lookup_first=False, draft_length=4 if tree is None else 6, tree=tree)
    assert batch_mod.batchable(model.engine) is None
    draft_rows, forward = [], BatchRunner.forward

    def counted(self, rows):
        if self.model is draft:
            draft_rows.append(len(rows))
        return forward(self, rows)

    monkeypatch.setattr(BatchRunner, "forward", counted)
    trees, propose_trees = [], CrossTokenizerRows.propose_trees
    monkeypatch.setattr(CrossTokenizerRows, "propose_trees", lambda self, requests: trees.extend(
        propose_trees(self, requests)) or trees[-len(requests):])
    out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=NEW, eos_token_id=None,
                         return_dict_in_generate=True)
    monkeypatch.undo()
    if tree is not None:
        assert branching(trees) > len(trees) // 3, len(trees)  # trees, not chains
    for i, text in enumerate(texts):
        ids = tok(text, return_tensors="pt").input_ids
        assert torch.equal(out.sequences[i, enc.input_ids.shape[1]:], hf_greedy(target, ids, NEW, eos_token_id=None)[0, ids.shape[1]:])
        assert out.stats[i].accepted_tokens / out.stats[i].target_forwards > (2.0 if tree is None else 1.2), \
            out.stats[i].summary()
    steps = max(s.target_forwards for s in out.stats)
    per_step = 3 if tree is not None else 4 + (model.engine.drafter.lookahead if mode == "text" else 0)
    assert max(draft_rows) == 3 and len(draft_rows) <= per_step * steps, (draft_rows, steps)
    assert model.engine.pool.num_used == 0 and model.engine.drafter.runner is None


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE like the zoo's but far smaller: it cuts words into other, shorter pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specdec.zoo.corpus import read_texts

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(read_texts("train")[:200], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", clean_up_tokenization_spaces=False)


class CutSentence:
    """A sentence split after `head`: the target's ids of the head (committed) and of the rest as the whole
    sentence encodes it (whole), the draft's ids of the head and of the rest, and a text-mode drafter."""

    def __init__(self, tok, draft_tok, head: str, rest: str):
        self.drafter = CrossTokenizerDrafter(tiny_llama(len(draft_tok), seed=1), draft_tok, tok, mode="text")
        self.committed = tok.encode(head, add_special_tokens=False)
        self.whole = tok.encode(head + rest, add_special_tokens=False)[len(self.committed):]
        head_ids = draft_tok.encode(head, add_special_tokens=False)
        self.anchor = head_ids[-1]
        self.drafted = draft_tok.encode(head + rest, add_special_tokens=False)[len(head_ids):]

    def proposals(self, first_cut: int, anchor) -> list[list[int]]:
        """The text-mode proposal (budget 8) with the draft's text cut after each of its tokens."""
        return [self.drafter._retokenized(self.committed, self.drafted[:j], 8, anchor)
                for j in range(first_cut, len(self.drafted) + 1)]


def test_text_mode_proposes_only_target_tokens_its_look_ahead_shows_complete(zoo_target):
    """The draft's text cut after every one of its tokens: with one look-ahead token every proposed target
    token is the one the whole sentence has there; without it the text's last target token is sometimes
    a piece of a longer one ('ga' of ' game'), which the target would reject."""
    target, tok = zoo_target
    draft_tok = byte_level_tokenizer(400)
    cut = CutSentence(tok, draft_tok, "The old keeper climbed",
                      " the winding stairs of the lighthouse every evening to light the great lamp")
    assert len(cut.drafted) > len(cut.whole)  # the draft's pieces are shorter
    wrong = {}
    for lookahead in (0, 1):
        cut.drafter.lookahead = lookahead
        proposals = cut.proposals(1 + lookahead, cut.anchor)
        assert sum(map(len, proposals)) > len(cut.drafted)  # proposals were made
        wrong[lookahead] = sum(p != cut.whole[:len(p)] for p in proposals)
    assert wrong[1] == 0 and wrong[0] > 0, wrong
    with pytest.raises(ValueError, match="lookahead must be >= 0"):
        CrossTokenizerDrafter(tiny_llama(len(draft_tok), seed=1), draft_tok, tok, lookahead=-1)


def test_text_mode_keeps_the_space_a_sentencepiece_draft_token_starts_with(zoo_target):
    """A SentencePiece-style draft ('▁time'): its drafted tokens decode to ' time ...' only after the
    committed text's last draft token (decoded alone, the leading space is dropped and the proposal
    would glue words: 'atime'). With the anchor the proposals are the whole sentence's target tokens."""
    target, tok = zoo_target
    draft_tok = other_tokenizer(700)
    cut = CutSentence(tok, draft_tok, "Once upon a", " time there was a little girl who lived in a village near the forest")
    assert draft_tok.convert_ids_to_tokens(cut.drafted[0]).startswith("▁")
    right = {}
    for anchor in (cut.anchor, None):
        right[anchor is not None] = sum(bool(p) and p == cut.whole[:len(p)] for p in cut.proposals(1, anchor))
    assert right[True] >= len(cut.drafted) // 2 and right[False] == 0, right  # the rest end in a piece (no look-ahead)


class ScriptedDraft(CrossTokenizerDrafter):
    """Text mode with a draft that writes a given sequence of draft ids (one-hot logits), counting its steps."""

    def script(self, head_ids: list[int], drafted: list[int]):
        self.ids, self.rest, self.steps = list(head_ids), list(drafted), 0
        return self._one_hot(0)

    def _one_hot(self, i: int) -> torch.Tensor:
        logits = torch.zeros(1, len(self.draft_tok))
        logits[0, self.rest[i]] = 1.0
        return logits

    def _step(self, draft_id: int) -> torch.Tensor:
        self.steps += 1
        self.ids.append(draft_id)
        return self._one_hot(self.steps)


def test_text_mode_drafts_until_its_text_gives_the_planned_number_of_target_tokens(zoo_target):
    """A draft whose tokens are shorter pieces than the target's: k draft tokens often re-encode to fewer
    than k target tokens, and stopping there proposed less than planned. The drafter drafts on (at most
    2k draft tokens) until the text gives k target tokens; with a look-ahead token they are the whole
    sentence's."""
    target, tok = zoo_target
    draft_tok = byte_level_tokenizer(400)
    cut = CutSentence(tok, draft_tok, "The old keeper climbed",
                      " the winding stairs of the lighthouse every evening to light the great lamp")
    drafter = ScriptedDraft(tiny_llama(len(draft_tok), seed=1), draft_tok, tok, mode="text")
    ctx = SimpleNamespace(tokens=torch.tensor(cut.committed))
    head_ids = draft_tok.encode("The old keeper climbed", add_special_tokens=False)
    for lookahead in (0, 1):
        drafter.lookahead = lookahead
        filled, stopped = [], []
        for k in range(1, 7):
            logits = drafter.script(head_ids, cut.drafted)
            proposal = drafter._propose_text(ctx, k, cut.committed, logits).tokens.tolist()
            assert 1 <= len(proposal) <= k and drafter.steps + 1 <= 2 * k + lookahead, (k, proposal)
            assert not lookahead or proposal == cut.whole[:len(proposal)]
            filled.append(len(proposal))
            stopped.append(len(drafter._retokenized(cut.committed, cut.drafted[:k + lookahead], k, head_ids[-1])))
        assert all(f >= s for f, s in zip(filled, stopped)) and sum(filled) > sum(stopped), (filled, stopped)
        if not lookahead:
            assert filled == list(range(1, 7))  # without look-ahead every budget is met
