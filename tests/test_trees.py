"""Token trees end to end: TreeSpec shapes, the tree a model drafter grows, and lossless tree decoding.

Greedy tree decoding must equal the target's own greedy generate() token for token (static and dynamic
trees; a random 1-layer drafter, the target drafting for itself, prompt lookup), and sampled tree
decoding must follow the target's distribution (goodness of fit on a tiny vocabulary, with the lossy
typical acceptance as a negative control that shows the test has power at depth 2).
"""

import pytest
import torch

import specdec
from specdec import TreeSpec
from specdec.cache.pool import BlockTable, PagePool
from specdec.drafters.base import Draft, DraftContext, DraftSetup
from specdec.drafters.model import ModelDrafter
from specdec.hf.attention import specdec_attention
from specdec.processing import LogitsPipeline
from specdec.tree import TreeGrower, depths, path_to, top_nodes
from specdec.verifiers.sampling import SamplingParams, probs_from_scores

from conftest import VOCAB, build, hf_greedy, tiny_vocab_model
from test_engine_sampling import TEMPERATURE, TOP_K, gof

STATIC = TreeSpec.static([3, 2, 2])
DYNAMIC = TreeSpec.dynamic(nodes=10, depth=4, topk=3)
FULL = {"static": {}, "dynamic": {"draft_length": DYNAMIC.nodes}}  # every node of the spec, every step
NEW = 20


def prompts(n, seed, length=(3, 12)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1, int(torch.randint(*length, (1,), generator=g))), generator=g)
            for _ in range(n)]


def check_tree_shape(parents: list[int]):
    """Topological (parent before child) and therefore ancestor-closed; returns the children lists."""
    kids = {-1: []}
    for i, p in enumerate(parents):
        assert -1 <= p < i, parents
        kids.setdefault(p, []).append(i)
        kids[i] = []
    return kids


# ----------------------------------------------------------------------------------------- TreeSpec


def test_treespec_shapes():
    s = TreeSpec.static([4, 2, 2, 1])
    assert (s.nodes, s.depth, [s.width(d) for d in range(4)], s.frontier) == (44, 4, [4, 2, 2, 1], None)
    assert s.limited(9) is s and s.limited(2) == TreeSpec.static([4, 2]) and s.limited(2).nodes == 12
    d = TreeSpec.dynamic(nodes=16, depth=5, topk=4)
    assert (d.nodes, d.depth, d.width(3), d.frontier, d.max_slots) == (16, 5, 4, 4, 16)
    assert d.limited(1) == TreeSpec.dynamic(nodes=4, depth=1, topk=4)  # depth 1 holds only topk nodes
    assert TreeSpec.dynamic(nodes=4, depth=9, topk=2).max_slots == 16  # expanded frontiers: 2 per depth
    assert repr(s) == "TreeSpec.static([4, 2, 2, 1])" and specdec.TreeSpec is TreeSpec


@pytest.mark.parametrize("make, words", [
    (lambda: TreeSpec.static([]), "non-empty"),
    (lambda: TreeSpec.static([2, 0]), "branching factor"),
    (lambda: TreeSpec.static(3), "list of ints"),
    (lambda: TreeSpec.static([2, 1.5]), "branching factor"),
    (lambda: TreeSpec.dynamic(nodes=0), "nodes"),
    (lambda: TreeSpec.dynamic(depth=-1), "depth"),
    (lambda: TreeSpec.dynamic(topk=True), "topk"),
    (lambda: TreeSpec.dynamic(nodes=100, depth=2, topk=3), "more than"),
    (lambda: TreeSpec("beam", 4, 2), "kind"),
])
def test_treespec_validation(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def fake_q(path: list[int], V: int = 23) -> torch.Tensor:
    """A deterministic draft distribution that depends on the path (as a model's would)."""
    g = torch.Generator().manual_seed(hash(tuple(path)) % 2**31)
    return torch.softmax(3 * torch.randn(V, generator=g), -1)


def grow(spec, budget):
    grower = TreeGrower(spec, budget)
    frontier = grower.expand(fake_q([])[None])
    while frontier and grower.level < spec.depth:
        assert spec.frontier is None or len(frontier) <= spec.frontier
        assert all(grower.depth[i] == grower.level for i in frontier)
        frontier = grower.expand(torch.stack([fake_q([grower.tokens[a] for a in grower.path(i)]) for i in frontier]))
    return grower


def test_static_tree_is_the_full_top_k_tree():
    spec = TreeSpec.static([4, 2, 2, 1])
    grower = grow(spec, spec.nodes)
    tokens, parents = grower.result()
    kids = check_tree_shape(parents)
    assert len(tokens) == 44 and depths(torch.tensor(parents)).bincount().tolist() == [0, 4, 8, 16, 16]
    for node, children in kids.items():
        path = [tokens[a] for a in path_to(parents, node)]
        want = fake_q(path).topk(spec.width(len(path))).indices.tolist() if len(path) < spec.depth else []
        assert [tokens[c] for c in children] == want  # the draft's top tokens, most likely first


def full_expansion(spec) -> tuple[list[tuple[int, ...]], list[float]]:
    """Every node EAGLE-2's expansion proposes (each depth's best `frontier` nodes all expanded, no
    pruning), as (token paths, path probabilities) in creation order."""
    paths, scores, frontier = [], [], [-1]
    for level in range(spec.depth):
        new = []
        for parent in frontier:
            prefix, base = (paths[parent], scores[parent]) if parent >= 0 else ((), 1.0)
            top_q, top_x = fake_q(list(prefix)).topk(spec.width(level))
            for qx, x in zip(top_q.tolist(), top_x.tolist()):
                new.append(len(paths))
                paths.append(prefix + (x,))
                scores.append(base * qx)
        if spec.frontier is not None:
            new = sorted(sorted(new, key=lambda i: (-scores[i], i))[:spec.frontier])
        frontier = new
    return paths, scores


def kept_paths(grower) -> set[tuple[int, ...]]:
    tokens, parents = grower.result()
    return {tuple(tokens[a] for a in path_to(parents, i)) for i in range(len(tokens))}


def test_dynamic_tree_keeps_the_best_nodes_ancestor_closed():
    spec = TreeSpec.dynamic(nodes=12, depth=5, topk=3)
    grower = grow(spec, spec.nodes)
    tokens, parents = grower.result()
    kids = check_tree_shape(parents)
    assert len(tokens) == 12 and max(depths(torch.tensor(parents)).tolist()) <= 5
    assert all(len(c) <= 3 for c in kids.values())
    # exactly the 12 best path probabilities among everything the full expansion proposes
    paths, scores = full_expansion(spec)
    assert len(paths) == 3 + 4 * 9  # topk children of the root, then topk x topk per depth
    best = top_nodes([-1] * len(paths), scores, 12)
    assert kept_paths(grower) == {paths[i] for i in best}


@pytest.mark.parametrize("spec", [TreeSpec.dynamic(nodes=12, depth=5, topk=3), TreeSpec.static([4, 2, 2, 1])],
                         ids=["dynamic", "static"])
def test_small_budgets_expand_only_nodes_that_can_have_kept_children(spec):
    """Pruning the frontier keeps exactly the nodes a full expansion keeps, with fewer expansions:
    budget 1 expands nothing past the root, budget b reaches at most depth b."""
    paths, scores = full_expansion(spec)
    expanded = []
    for budget in range(1, spec.nodes + 1):
        grower = grow(spec, budget)
        best = {paths[i] for i in top_nodes([-1] * len(paths), scores, budget)}
        assert kept_paths(grower) == best, budget
        assert grower.level <= budget
        expanded.append(len(grower.tokens))
    assert expanded[0] == spec.width(0)  # the root's children only
    assert expanded == sorted(expanded) and expanded[-1] <= len(paths)
    assert expanded[spec.nodes // 2] < len(paths)  # a half budget never needs the whole expansion
    # a smaller budget keeps a prefix of the ranking; and ancestor closure holds even for adversarial scores
    assert len(grow(spec, 5).result()[0]) == 5
    assert top_nodes([-1, 0, -1], [0.1, 0.9, 0.5], 2) == [0, 2]


# ------------------------------------------------------------------------------ the model drafter


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_drafter_tree_nodes_match_dense_forwards(arch):
    """Each node's children are the top tokens of the drafter's own dense forward over context + path:
    the batched per-depth forwards (tree positions, ancestor mask over the scratch block) are right."""
    draft = build(arch, seed=1, layers=1)
    context = prompts(1, seed=3, length=(9, 10))[0][0]
    pool = PagePool(8, 4)
    table = BlockTable(pool)
    drafter = ModelDrafter(draft)
    drafter.begin(DraftSetup(table))
    ctx = DraftContext(tokens=context, sampling=SamplingParams())
    ctx.process = LogitsPipeline(ctx.sampling, 3)
    with specdec_attention(draft):
        drafter.runner.forward(context[:-4])  # part of the context already cached, as after a step
        d1 = drafter.propose_tree(ctx, STATIC, STATIC.nodes)
        assert drafter.runner.valid == context.numel()  # the tree's KV was scratch
        drafter.accept(context.numel())  # as if nothing was accepted: the root's KV is dropped again
        d2 = drafter.propose_tree(ctx, STATIC, STATIC.nodes)
    assert torch.equal(d1.tokens, d2.tokens) and torch.equal(d1.parents, d2.parents) and d1.q_probs is None
    tokens, parents = d1.tokens.tolist(), d1.parents.tolist()
    kids = check_tree_shape(parents)
    assert len(tokens) == STATIC.nodes
    for node, children in kids.items():
        path = [tokens[a] for a in path_to(parents, node)]
        if len(path) == STATIC.depth:
            continue
        with torch.no_grad():
            logits = draft(torch.cat([context, torch.tensor(path, dtype=torch.long)])[None]).logits[0, -1]
        k = STATIC.width(len(path))
        top = logits.topk(k + 1)
        if top.values[k - 1] - top.values[k] > 1e-4:  # skip a near-tie at the cut
            assert [tokens[c] for c in children] == top.indices[:k].tolist(), (node, path)


# ---------------------------------------------------------------------------------- greedy: lossless


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3", "gpt2"])
def test_greedy_tree_decoding_equals_target_greedy(arch):
    target = build(arch, seed=0)
    drafters = {"random": build(arch, seed=1, layers=1), "self": target, "ngram": "ngram"}
    tau = {}
    for ids in prompts(2, seed=len(arch)):
        ref = hf_greedy(target, ids, NEW, eos_token_id=None)
        for name, drafter in drafters.items():
            for spec in (STATIC, DYNAMIC):
                # the spec's full budget every step (the adaptive budget would rightly find that
                # the target drafting for itself does not pay)
                model = specdec.wrap(target, drafter=drafter, tree=spec, **FULL[spec.kind])
                out = model.generate(ids, max_new_tokens=NEW, eos_token_id=None, return_dict_in_generate=True)
                assert torch.equal(out.sequences, ref), (arch, name, spec, ids.tolist())
                assert model.engine.pool.num_used == 0
                assert max(out.stats.draft_lengths) <= spec.nodes
                tau.setdefault(name, []).append(out.stats.mean_accepted_length)
    assert min(tau["self"]) > 1.5  # the target drafting for itself: its top child is always right


def test_tree_depth_is_cut_to_the_tokens_and_positions_left():
    target, draft = build("gpt2", seed=0), build("gpt2", seed=1, layers=1)  # learned positions: no slack at 128
    deep = TreeSpec.static([2, 2, 2, 2, 2, 1, 1])
    ids = prompts(1, seed=4)[0]
    for new in (1, 2, 3, 5):
        for drafter in (target, draft, "ngram"):
            out = specdec.generate(target, ids, drafter=drafter, tree=deep, max_new_tokens=new, eos_token_id=None)
            assert torch.equal(out, hf_greedy(target, ids, new, eos_token_id=None))
    long_ids = torch.randint(3, VOCAB, (1, 121), generator=torch.Generator().manual_seed(0))
    ref = hf_greedy(target, long_ids, 7, eos_token_id=None)  # up to the last of the 128 positions
    for drafter in (target, "ngram"):
        out = specdec.generate(target, long_ids, drafter=drafter, tree=deep, max_new_tokens=7, eos_token_id=None)
        assert torch.equal(out, ref)


def test_kernel_path_runs_tree_drafting(monkeypatch):
    """The kernel branch of the attention (square tree blocks, idle rows for the drafter's written nodes),
    run on the CPU with the torch reference standing in for the Triton kernel (same signature)."""
    import specdec.kernels

    monkeypatch.setattr(specdec.kernels, "tree_attention", specdec.kernels.tree_attention_ref)
    for arch in ("qwen2", "gemma2", "gemma3"):  # sliding windows; softcapping
        target = build(arch, seed=0)
        ids = prompts(1, seed=7)[0]
        ref = hf_greedy(target, ids, NEW, eos_token_id=None)
        for drafter in (target, build(arch, seed=1, layers=1)):
            model = specdec.wrap(target, drafter=drafter, tree=DYNAMIC)
            model.engine.kernel = True
            assert torch.equal(model.generate(ids, max_new_tokens=NEW, eos_token_id=None), ref)


def test_tree_inside_hf_generate():
    target, draft = build("llama", seed=0), build("llama", seed=1, layers=1)
    ids = prompts(1, seed=8)[0]
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, custom_generate=specdec.hf_custom_generate, drafter=draft, tree=STATIC)
    assert torch.equal(out, hf_greedy(target, ids, 12, eos_token_id=None))


def test_tree_option_errors():
    target = build("llama", seed=0, layers=1)

    class ChainOnly:

        def begin(self, setup): ...
        def propose(self, ctx, budget): ...
        def accept(self, n): ...
        def end(self): ...

    with pytest.raises(ValueError, match="TreeSpec"):
        specdec.wrap(target, drafter="ngram", tree=[4, 2])
    with pytest.raises(ValueError, match="propose_tree"):
        specdec.wrap(target, drafter=None, tree=STATIC)
    with pytest.raises(ValueError, match="propose_tree"):
        specdec.wrap(target, drafter=ChainOnly(), tree=STATIC)
    with pytest.raises(ValueError, match="draft_length"):
        specdec.wrap(target, drafter="ngram", tree=STATIC, draft_length=3)


# -------------------------------------------------------------------------------- sampling: lossless

V, SAMPLE_NEW, SAMPLES = 4, 4, 1500
SAMPLE_PROMPT = torch.tensor([[0, 1, 2]])


def tiny(seed, scale=4.0):
    return tiny_vocab_model(V, seed, scale)


def exact_joint(model, prompt=None):
    """P(x_1..x_SAMPLE_NEW | prompt) under temperature + top-k: one forward per prefix, products of rows."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper)

    warp = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    prompt = SAMPLE_PROMPT if prompt is None else prompt
    out = {(): 1.0}
    for _ in range(SAMPLE_NEW):
        nxt = {}
        for seq, prob in out.items():
            ids = torch.cat([prompt, torch.tensor([seq], dtype=torch.long).reshape(1, -1)], 1)
            with torch.no_grad():
                row = torch.softmax(warp(ids, model(ids).logits[:, -1]), -1)[0]
            for tok in range(V):
                if row[tok] > 0:
                    nxt[seq + (tok,)] = prob * row[tok].item()
        out = nxt
    return out


def empirical(model, n):
    counts = {}
    torch.manual_seed(1234)
    for _ in range(n):
        seq = model.generate(SAMPLE_PROMPT, max_new_tokens=SAMPLE_NEW, do_sample=True, temperature=TEMPERATURE,
                             top_k=TOP_K)
        key = tuple(seq[0, SAMPLE_PROMPT.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def sampling_models():
    target = tiny(0)
    return target, tiny(7), exact_joint(target)


@pytest.mark.parametrize("drafter, spec", [("model", TreeSpec.static([2, 2, 1])),
                                           ("model", TreeSpec.dynamic(nodes=4, depth=3, topk=2)),
                                           ("ngram", TreeSpec.static([2, 2, 1]))])
def test_sampled_tree_decoding_follows_the_target(sampling_models, drafter, spec):
    target, draft, exact = sampling_models
    model = specdec.wrap(target, drafter=draft if drafter == "model" else "ngram", tree=spec)
    assert gof(exact, empirical(model, SAMPLES), SAMPLES) > 1e-3
    assert model.engine.pool.num_used == 0


class IIDSiblings:
    """A custom tree drafter in the SpecInfer manner: the root's children are independent draws (duplicates
    allowed) from a bigram table's processed distribution. `claim` is what its Draft says about that."""


    def __init__(self, claim: bool):
        self.logits = torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 8  # [last token, next]
        self.claim = claim

    def begin(self, setup): ...
    def accept(self, n): ...
    def end(self): ...

    def propose(self, ctx, budget):
        return Draft.empty()

    def propose_tree(self, ctx, spec, budget):
        logits = self.logits[ctx.tokens[-1]][None]  # [1, V]
        q = probs_from_scores(ctx.process(logits, ctx.tokens, [[]]))  # [1, V]
        tokens = torch.multinomial(q[0], budget, replacement=True, generator=ctx.generator)
        return Draft(tokens, torch.full((budget,), -1, dtype=torch.long), q.expand(budget, -1).clone(),
                     siblings_with_replacement=self.claim)


@pytest.mark.parametrize("claim", [True, False])
def test_the_sibling_rule_travels_with_the_draft(sampling_models, claim):
    """i.i.d. siblings are verified exactly when their Draft says so; verified by the without-replacement
    rule (the claim False, specdec's own drafters' rule) the same draws are biased, and the test sees it."""
    target, _, exact = sampling_models
    model = specdec.wrap(target, drafter=IIDSiblings(claim), tree=TreeSpec.static([2]))
    p = gof(exact, empirical(model, SAMPLES), SAMPLES)
    assert p > 1e-3 if claim else p < 1e-6


def test_lossy_typical_acceptance_on_trees_fails_the_same_test(sampling_models):
    target, draft, exact = sampling_models
    model = specdec.wrap(target, drafter=draft, tree=TreeSpec.static([2, 2, 1]), acceptance="typical")
    assert gof(exact, empirical(model, SAMPLES), SAMPLES) < 1e-6


def test_tree_stats_count_depths_not_nodes():
    """A tree's per-position acceptance is indexed by depth: a self-drafting 2-level tree is always right."""
    target = build("llama", seed=0)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    out = specdec.generate(target, ids, drafter=target, tree=specdec.TreeSpec.static([3, 1]), max_new_tokens=20,
                           eos_token_id=None, return_dict_in_generate=True)
    s = out.stats
    assert len(s.per_position_acceptance) == 2
    assert s.per_position_acceptance == [1.0, 1.0] and s.alpha == 1.0
    assert s.mean_accepted_length > 2.5
