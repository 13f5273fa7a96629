"""The batched engine (specdec/batch.py): one packed target forward per step for every live row.

The packed forward gives each row exactly its own logits; greedy rows equal their own unpadded HF
generation for batches of 1 to 8 prompts and every chain drafter; each step runs one forward holding
every live row and nothing else; sampled rows are independent (a variant whose rows share random
draws fails the test); the planner backs off to plain batched decoding when verification costs
grow with the tokens verified; nothing leaks when the budget is exhausted."""
import copy
import functools
import inspect

import pytest
import torch
from scipy.stats import chi2_contingency

import specdec
import specdec.batch as batch_mod
from specdec.cache.pool import BlockTable, PagePool
from specdec.hf.attention import specdec_attention
from specdec.hf.batch_runner import BatchRunner, RowForward
from specdec.policy.batch import BatchPlanner
from specdec.policy.tracker import AcceptanceTracker

from conftest import ARCHS, build, hf_greedy, tiny_vocab_model
from test_batches import left_padded
from test_engine_greedy import prompts
from test_trees import TEMPERATURE, TOP_K, exact_joint, gof


@pytest.mark.parametrize("num_rows", [3, 5], ids=["block mask", "padded rows"])
@pytest.mark.parametrize("arch, lean", [(a, True) for a in ARCHS] + [("llama", False), ("qwen2", False)])
def test_the_packed_forward_gives_every_row_its_own_logits(arch, lean, num_rows):
    """Three rows of different lengths (longer than the sliding windows), then a few tokens more each:
    every row's logits equal the model's own forward over that row alone, through the lean loop (Llama,
    Mistral, Qwen2, Qwen3, Gemma 3; from 4 rows attending over the rows laid out padded) and through the HF modules."""
    model = build(arch, seed=0)
    pool = PagePool(64, 4)
    runner = BatchRunner(model, pool, lean=lean)
    assert (runner.lean is not None) == (lean and arch in ("llama", "mistral", "qwen2", "qwen3", "gemma3"))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 60, (n,), generator=g) for n in (5, 11, 8, 13, 2)[:num_rows]]
    more = [torch.randint(3, 60, (n,), generator=g) for n in (3, 1, 4, 2, 5)[:num_rows]]
    tables = [BlockTable(pool) for _ in rows]
    with specdec_attention(model):
        first = runner.forward([RowForward(t, 0, r) for t, r in zip(tables, rows)])
        second = runner.forward([RowForward(t, r.numel(), m) for t, r, m in zip(tables, rows, more)])
    for r, m, a, b in zip(rows, more, first, second):
        with torch.no_grad():
            own = model(input_ids=torch.cat([r, m])[None]).logits[0].float()
        torch.testing.assert_close(a, own[:r.numel()], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b, own[r.numel():], rtol=1e-4, atol=1e-5)


def _spy_forwards(monkeypatch, model) -> tuple[list[int], list[int]]:
    """Rows per packed forward of `model` call by call, and of any other model (a draft's)."""
    sizes, others = [], []
    forward = BatchRunner.forward

    def counted(self, rows):
        (sizes if self.model is model else others).append(len(rows))
        return forward(self, rows)

    monkeypatch.setattr(BatchRunner, "forward", counted)
    return sizes, others


@functools.lru_cache(maxsize=None)
def _own_greedy(arch: str, i: int) -> torch.Tensor:
    """Row i's own unpadded HF greedy continuation (12 tokens) under the test's target: computed once."""
    row = prompts(8, seed=21, length=(3, 16))[i]
    return hf_greedy(build(arch, seed=0, scale=2.0), row, 12, eos_token_id=None)[0, row.shape[1]:]


@pytest.mark.parametrize("arch, drafter", [
    (arch, drafter) for arch in ("llama", "qwen2", "gemma3", "gpt2")
    for drafter in ("ngram", "self", "partial", "partial tree", "ngram tree", "early exit")
    if not (arch == "gpt2" and drafter == "early exit")])  # EarlyExit needs model.layers; GPT-2 has none
def test_greedy_rows_equal_their_own_generation_in_one_forward_per_step(monkeypatch, arch, drafter):
    """'self' drafts 3 tokens with the target itself (every token accepted: rollback never cuts), 'partial'
    with a perturbed copy (accepted in part), 'ngram' with lookup (both planned by the adaptive batch
    planner), and both of those drafting trees (a dynamic tree of 6 nodes, a static one for lookup: accepted
    paths off the first branch are compacted per row), and 'early exit' with the target's first layer (own pages
    per row in a batch; 3 tokens); batches of 1, 2, 5 and 8 prompts."""
    target = build(arch, seed=0, scale=2.0)
    tree = {"partial tree": specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2),
            "ngram tree": specdec.TreeSpec.static([3, 1, 1])}.get(drafter)
    drafter = drafter.replace(" tree", "")
    if drafter == "partial":
        draft = build(arch, seed=0, scale=2.0)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.05 * torch.randn_like(p))
    chosen = {"ngram": "ngram", "self": copy.deepcopy(target),  # the same weights, another object
              "partial": draft if drafter == "partial" else None,
              "early exit": specdec.drafters.EarlyExit(target, 1) if drafter == "early exit" else None}[drafter]
    all_rows = prompts(8, seed=21, length=(3, 16))
    for size in (1, 2, 5, 8):  # the rows' references: _own_greedy, once per architecture
        rows = all_rows[:size]
        ids, mask = left_padded(rows)
        sizes, draft_sizes = _spy_forwards(monkeypatch, target)
        out = specdec.generate(target, ids, attention_mask=mask, drafter=chosen, max_new_tokens=12,
                               eos_token_id=None, return_dict_in_generate=True,
                               draft_length=3 if drafter in ("self", "early exit") else 6 if tree is not None
                               and tree.kind == "dynamic" else "adaptive", tree=tree)
        monkeypatch.undo()
        for i, r in enumerate(rows):
            assert torch.equal(out.sequences[i, ids.shape[1]:], _own_greedy(arch, i)), (size, i)
        if size > 1:
            stats = out.stats
            steps = max(s.target_forwards for s in stats)
            assert sizes[0] == size and len(sizes) == steps + 1, (sizes, steps)  # prefill + one per step
            assert sizes == sorted(sizes, reverse=True)  # finished rows drop out, none comes back
            if drafter == "self":
                assert all(s.accepted_tokens == s.drafted_tokens > 0 for s in stats)
            whole = out.batch_stats
            assert whole.new_tokens == 12 * size and whole.target_forwards == steps
            assert whole.drafted_tokens == sum(s.drafted_tokens for s in stats)
            assert whole.total_s == max(s.total_s for s in stats)
            if drafter in ("self", "early exit") or (drafter == "partial" and tree is not None):
                # fixed plans (3 tokens, or the tree's 6 nodes: the adaptive planner's choices depend on measured
                # time): every row drafts every step, all of them in each draft forward
                assert draft_sizes and max(draft_sizes) == size
                per_step = 3 if tree is None else tree.depth  # catch-up + further tokens, or one per depth
                assert len(draft_sizes) <= per_step * steps, (draft_sizes, steps)


def test_rows_that_stop_at_eos_drop_out_and_free_their_pages():
    target = build("llama", seed=0, scale=2.0)
    rows = prompts(4, seed=22, length=(3, 10))
    firsts = [hf_greedy(target, r, 12, eos_token_id=None)[0, r.shape[1]:] for r in rows]
    eos = int(firsts[0][2])
    ids, mask = left_padded(rows)
    model = specdec.wrap(target, drafter=target)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    want = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    assert torch.equal(out, want)
    assert model.engine.pool.num_used == 0


def test_an_exhausted_budget_names_it_and_frees_every_row():
    target = build("llama", seed=0)
    model = specdec.wrap(target, drafter="ngram", max_kv_tokens=40)
    ids, mask = left_padded(prompts(3, seed=23, length=(8, 12)))
    with pytest.raises(RuntimeError, match="max_kv_tokens"):
        model.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    assert model.engine.pool.num_used == 0


def _coupled(monkeypatch):
    """A lossy variant for the power check: every row of a step draws from the same random stream."""
    step, commit = batch_mod._step, batch_mod._commit
    step_args, commit_args = inspect.signature(step), inspect.signature(commit)
    seed = {"state": None}

    def step_(*args, **kwargs):
        seed["state"] = step_args.bind(*args, **kwargs).arguments["generator"].get_state()
        return step(*args, **kwargs)

    def commit_(*args, **kwargs):
        commit_args.bind(*args, **kwargs).arguments["generator"].set_state(seed["state"])
        return commit(*args, **kwargs)

    monkeypatch.setattr(batch_mod, "_step", step_)
    monkeypatch.setattr(batch_mod, "_commit", commit_)


@pytest.mark.parametrize("coupled, tree", [(False, None), (False, specdec.TreeSpec.static([2, 1])), (True, None)],
                         ids=["batched", "batched tree", "rows sharing draws (control)"])
def test_sampled_rows_are_independent_draws_of_their_own_distribution(monkeypatch, coupled, tree):
    """Two rows with the same prompt: each row's 4 tokens follow the target (goodness of fit), chains and
    trees, and the rows' last tokens are independent (contingency test). Rows sharing their random
    draws fail it."""
    target, draft = tiny_vocab_model(4, 0, 4.0), tiny_vocab_model(4, 7, 4.0)
    prompt = torch.tensor([[0, 1, 2]])
    exact = exact_joint(target, prompt)
    if coupled:
        _coupled(monkeypatch)
    model = specdec.wrap(target, drafter=draft, **(dict(tree=tree) if tree else dict(draft_length=2)))
    ids = prompt.repeat(2, 1)
    counts, n = [{}, {}], 400
    table = torch.zeros(4, 4)
    torch.manual_seed(99)
    for _ in range(n):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=True,
                             temperature=TEMPERATURE, top_k=TOP_K)
        for i in range(2):
            key = tuple(out[i, 3:].tolist())
            counts[i][key] = counts[i].get(key, 0) + 1
        table[out[0, -1], out[1, -1]] += 1
    used = table[table.sum(1) > 0][:, table.sum(0) > 0]
    independence = chi2_contingency(used.numpy()).pvalue
    if coupled:
        assert independence < 1e-6, independence
    else:
        assert min(gof(exact, c, n) for c in counts) > 1e-3
        assert independence > 1e-3, independence


def _tracker(alpha: float, steps: int = 40, k: int = 4) -> AcceptanceTracker:
    t = AcceptanceTracker()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        n = 0
        while n < k and float(torch.rand(1, generator=g)) < alpha:
            n += 1
        t.observe(k, n)
    return t


def test_the_planner_drafts_where_acceptance_pays_and_backs_off_when_verification_is_not_free():
    flat = BatchPlanner(max_length=6, probe_every=0)
    for n in (4, 12, 28):
        for _ in range(5):
            flat.observe(n, 0.010, [], 0.0)  # memory bound: any number of tokens costs the same
    good, poor = _tracker(0.9), _tracker(0.1)
    ks = flat.plan([good, poor], [6, 6])
    assert ks[0] == 6 and ks[0] > ks[1]

    steep = BatchPlanner(max_length=6, probe_every=0)
    for n in (4, 12, 28):
        for _ in range(5):
            steep.observe(n, 0.010 * n, [], 0.0)  # compute bound: every token verified costs a full token
    assert steep.plan([_tracker(0.6)] * 4, [6] * 4) == [0, 0, 0, 0]
    assert BatchPlanner(4, fixed=3).plan([good, poor], [2, 9]) == [2, 3]  # a constant length, capped


def test_rows_that_draft_together_pay_one_draft_step_for_all_of_them():
    """A draft model drafts every row in one forward per position, so its price is per forward; lookups
    draft row after row, so theirs is per token. Same verification (flat) and the same 4 ms per draft step:
    four rows at alpha 0.6 draft one token each together, and nothing one after another."""
    plans = {}
    for together in (False, True):
        planner = BatchPlanner(max_length=4, probe_every=0, together=together)
        for n in (4, 8, 12):
            for _ in range(5):
                planner.observe(n, 0.010, [1, 1, 1, 1] if together else [1], 0.004)
        assert planner.costs.t_draft == pytest.approx(0.004)  # one draft step either way
        plans[together] = planner.plan([_tracker(0.6)] * 4, [4] * 4)
    assert plans[False] == [0, 0, 0, 0]
    assert plans[True] == [1, 1, 1, 1]


def _ranked(rate: float, steps: int = 40, nodes: int = 6) -> AcceptanceTracker:
    """A tracker whose tree steps put the r-th best node on the accepted path with probability rate^(r+1)."""
    t = AcceptanceTracker()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        t.observe_ranks([float(torch.rand(1, generator=g)) < rate ** (r + 1) for r in range(nodes)])
    return t


def test_tree_budgets_follow_each_rows_ranks_and_the_cost_of_verifying():
    """Dynamic trees in a batch: where verification is nearly flat a row whose top nodes are accepted gets more
    nodes than one whose are not; where every verified token costs a plain step, no row drafts; rows still
    in their warm-up draft the whole spec; a constant draft_length fixes every budget."""
    flat = BatchPlanner(max_length=3, probe_every=0, together=True)
    for n in (4, 12, 20):
        for _ in range(5):
            flat.observe_trees(n, 0.010 + 0.0005 * n, [6, 6], 0.002)  # nearly flat
    assert flat.t_tree == pytest.approx(0.002)  # one tree step for both rows
    good, poor = _ranked(0.9), _ranked(0.2)
    budgets = flat.node_budgets([good, poor], [6, 6])
    assert budgets[0] == 6 and budgets[0] > budgets[1]
    steep = BatchPlanner(max_length=3, probe_every=0, together=True)
    for n in (4, 12, 20):
        for _ in range(5):
            steep.observe_trees(n, 0.010 * n, [6, 6], 0.002)
    assert steep.node_budgets([_ranked(0.6)] * 2, [6, 6]) == [0, 0]
    assert steep.node_budgets([AcceptanceTracker(), _ranked(0.6)], [6, 4]) == [6, 0]  # a fresh row warms up
    assert BatchPlanner(3, tree_nodes=4).node_budgets([good, poor], [6, 3]) == [4, 3]


def test_every_probe_step_halves_the_plan_or_drafts_a_little_after_plain_steps():
    planner = BatchPlanner(max_length=4, probe_every=4)
    good = _tracker(0.9)
    plans = [planner.plan([good, good], [4, 4]) for _ in range(8)]
    assert plans[3] == [2, 2] and plans[7] == [2, 2] and plans[0] == [4, 4]
    steep = BatchPlanner(max_length=4, probe_every=4, probe_length=2)
    for n in (2, 6, 10):
        for _ in range(5):
            steep.observe(n, 0.010 * n, [], 0.0)
    plans = [steep.plan([_tracker(0.3)] * 2, [4, 1]) for _ in range(12)]
    assert plans[0] == [0, 0] and plans[4] == [0, 0]  # plain decoding still probes: a quarter of the rows
    assert plans[3] == [2, 0] and plans[11] == [0, 1]  # (at least one), in turn, capped
    rows = BatchPlanner(max_length=4, probe_every=1)
    for n in (8, 16, 24):
        for _ in range(5):
            rows.observe(n, 0.010 * n, [], 0.0)
    probed = [rows.plan([_tracker(0.3)] * 8, [4] * 8) for _ in range(4)]
    assert [sum(k > 0 for k in ks) for ks in probed] == [2, 0, 2, 0]  # intervals 1, 2: rows 0-1, then 2-3
    assert probed[0][:2] == [2, 2] and probed[2][2:4] == [2, 2]


def test_probes_from_plain_decoding_back_off_while_speculation_does_not_pay():
    """Each probe from plain decoding that finds speculation still losing doubles the interval to the next
    (up to max_probe_every); a plan that drafts brings the base interval back."""
    steep = BatchPlanner(max_length=4, probe_every=4, probe_length=2, max_probe_every=16)
    for n in (2, 6, 10):
        for _ in range(5):
            steep.observe(n, 0.010 * n, [], 0.0)
    poor = [_tracker(0.3)] * 2
    probes = [i for i in range(60) if any(steep.plan(poor, [4, 4]))]
    assert probes[:4] == [3, 11, 27, 43] and steep.interval == 16  # gaps 8, 16, 16: doubled, then capped
    flat = BatchPlanner(max_length=4, probe_every=4)
    flat.interval = 16
    assert flat.plan([_tracker(0.9)] * 2, [4, 4]) == [4, 4] and flat.interval == 4


def test_what_cannot_batch_says_why_and_runs_row_by_row():
    target = build("llama", seed=0)
    chat = specdec.wrap(target, drafter="ngram")
    chat.engine.keep_cache = True
    assert "kept cache" in batch_mod.batchable(chat.engine)

    class OneSequence(specdec.drafters.PromptLookup):
        def for_row(self):
            return None

    lone = specdec.wrap(target, drafter=OneSequence())
    assert "OneSequence cannot serve a batch" in batch_mod.batchable(lone.engine)
    for options in (dict(drafter="ngram"), dict(drafter="ngram", acceptance="typical"),
                    dict(drafter=specdec.drafters.EarlyExit(target, 1))):
        assert batch_mod.batchable(specdec.wrap(target, **options).engine) is None
    with pytest.raises(ValueError, match="cannot run a batch"):
        batch_mod.generate_batch(lone.engine, [], None)


def test_each_row_streams_its_own_tokens_and_can_be_ended_early():
    """on_row_tokens: every row's callable receives exactly that row's new tokens, in order; a row whose
    callable answers True ends there (the others run on, unchanged); a wrong count is refused by name."""
    target = build("llama", seed=0, layers=2)
    prompts = [torch.tensor([1, 5, 9, 2]), torch.tensor([3, 4, 8]), torch.tensor([8, 1, 4, 4, 6])]
    from specdec.rows import left_pad

    ids, mask = left_pad([p.tolist() for p in prompts], 0)
    seen = [[], [], []]

    def collect(i, stop_after=None):
        def on(tokens):
            seen[i] += tokens
            return stop_after is not None and len(seen[i]) >= stop_after
        return on

    out = specdec.generate(target, ids, attention_mask=mask, drafter=build("llama", seed=1, layers=1), draft_length=3,
                           max_new_tokens=12, on_row_tokens=[collect(0), collect(1), collect(2)],
                           return_dict_in_generate=True)
    full, width = out.sequences, ids.shape[1]
    assert all(seen[i] == full[i, width:width + out.stats[i].new_tokens].tolist() for i in range(3))
    assert min(len(s) for s in seen) > 1
    seen = [[], [], []]
    cut = specdec.generate(target, ids, attention_mask=mask, drafter=build("llama", seed=1, layers=1), draft_length=3,
                           max_new_tokens=12, on_row_tokens=[collect(0), collect(1, stop_after=1), collect(2)])
    assert seen[1] == full[1, width:width + 1].tolist()  # ended at its first token (the prefill's)
    assert torch.equal(cut[0], full[0]) and torch.equal(cut[2], full[2])
    with pytest.raises(ValueError, match="2 callables for 3 rows"):
        specdec.generate(target, ids, attention_mask=mask, max_new_tokens=4, on_row_tokens=[collect(0), collect(1)])
