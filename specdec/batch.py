"""Speculative decoding for a batch of sequences: one target forward per step verifies every live row.

Each row is its own sequence on the shared page pool: its own block table (holding only its real
tokens: left padding is dropped before this point, specdec/rows.py), positions from 0, its own
acceptance tracker and logits pipeline, and its own drafter instance (RowDrafter.for_row: shared
weights, per-row state), or its place in a drafter that drafts every row in one forward per draft step
(BatchDrafter.for_batch: a draft model's, a feature head's or a draft of another tokenizer's chains
and trees, one forward per draft position or depth; LookupFirst's rows without an n-gram match go to
the wrapped drafter's). A feature head reads each row's own FeatureLog,
which the packed forwards fill as the single-sequence engine's do.

A step: every live row drafts a chain (the length the BatchPlanner chose for it) or a tree (the
engine's TreeSpec, cut to the tokens the row has left, with the node budget the planner chose); ONE
packed forward (hf/batch_runner.py) runs each row's [root + draft] (tree positions and ancestor mask for
a tree) against that row's pages only; each row is verified, rolled back and committed on its own
exactly as the single-sequence engine does (engine.py), so every row's output is its own generation
token for token (greedy) or a sample of its own distribution (sampling). A row that ends (EOS, length, a
stopping criterion) gives its pages back and drops out of the next step's forward.

A kept cache (chat) holds one sequence, and drafters that cannot serve rows run them one after another
through the single-sequence engine (api.py decides; `batchable` says why not).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .cache.pool import BlockTable
from .drafters.base import (BatchDrafter, Draft, DraftContext, DraftRows, DraftSetup, FeatureDrafter, FeatureRows,
                            ModelBackedDrafter, RowDrafter, check_draft)
from .engine import Engine
from .hf.attention import specdec_attention
from .hf.batch_runner import BatchRunner, RowForward
from .hf.mapped_offload import mapped_offload, offload_reading
from .hf.features import FeatureLog
from .hf.runner import check_rope_span, max_positions_of
from .policy.batch import BatchPlanner
from .policy.simple import ConstantPolicy
from .processing import LogitsPipeline
from .stats import SpecStats
from .step import Limits, check_tree, compact_path, emitting_rows, node_paths, pick_token, stops_at, verify
from .transfer import to_device
from .tree import ancestor_mask_with_root, depth_list, is_chain
from .verifiers.sampling import SamplingParams


@dataclass
class RowRequest:
    """One row: its prompt [T] int64 (no padding), when it stops, and its HF processors (built for its
    own prompt length: before / after specdec's warping, as Engine.generate takes them). on_tokens, when
    given, receives the row's new tokens as they are committed (the prefill's first token, then each
    step's accepted tokens and the target's own); returning True ends the row there (a client that left)."""

    prompt: torch.Tensor
    limits: Limits
    processors: object = None
    post_processors: object = None
    on_tokens: Callable[[list[int]], bool | None] | None = None


def _emit(row, tokens: list[int]) -> None:
    """Hand a row's new tokens to its on_tokens; a True answer ends the row."""
    if row.request.on_tokens is not None and tokens and row.request.on_tokens(tokens) and not row.done:
        row.done = True
        _finish(row)


def batchable(engine: Engine) -> str | None:
    """Why `engine` cannot run a batch in one forward per step (None: it can)."""
    if engine.keep_cache:
        return "a kept cache (chat) holds one sequence"
    if engine.drafter is not None and not (isinstance(engine.drafter, RowDrafter) and engine.drafter.for_row()):
        return f"{type(engine.drafter).__name__} cannot serve a batch's rows"
    return None


def planner_for(engine: Engine) -> BatchPlanner:
    """The engine's batch planner, made on its first batch and kept (its cost model is the target's, so
    the next batch starts from what this one measured; acceptance is tracked per row, afresh per call):
    a constant draft_length stays constant per row; any other policy plans by the batch's measured
    costs, up to its max_length."""
    planner = engine.batch_planner
    if planner is None:
        policy = engine.policy
        if engine.drafter is None:
            planner = BatchPlanner(0, fixed=0)
        elif engine.tree is not None:  # every row's tree as deep as its tokens left allow; its nodes planned
            tree = engine.tree          # (a dynamic tree under an adaptive policy) or fixed (as Engine's are)
            nodes = (tree.nodes if tree.kind == "static" else
                     policy.k if isinstance(policy, ConstantPolicy) else None)
            planner = BatchPlanner(tree.depth, fixed=tree.depth, tree_nodes=nodes)
        elif isinstance(policy, ConstantPolicy):
            planner = BatchPlanner(policy.k, fixed=policy.k)
        else:
            planner = BatchPlanner(policy.max_length or 8)
        engine.batch_planner = planner
    return planner


class PerRowDrafts:
    """DraftRows over one drafter per row (RowDrafter.for_row), each drafting on its own; also trees.
    features: one FeatureLog per row, attached to each row's drafter when it reads features."""

    def __init__(self, drafters: list, features: list | None = None):
        self.drafters = drafters
        for drafter, log in zip(drafters, features or []):
            if isinstance(drafter, FeatureDrafter):
                drafter.attach(log)

    def begin(self, setups: list[DraftSetup]) -> None:
        for drafter, setup in zip(self.drafters, setups):
            drafter.begin(setup)

    def propose(self, requests: list[tuple[int, DraftContext, int]]) -> list[Draft]:
        return [self.drafters[i].propose(ctx, k) for i, ctx, k in requests]

    def propose_trees(self, requests: list) -> list[Draft]:
        return [self.drafters[i].propose_tree(ctx, spec, budget) for i, ctx, spec, budget in requests]

    def accept(self, row: int, num_context_tokens: int) -> None:
        self.drafters[row].accept(num_context_tokens)

    def end(self) -> None:
        for drafter in self.drafters:
            drafter.end()


def draft_rows(engine: Engine, pool, rows: int, features: list | None) -> DraftRows:
    """The batch's drafting: chains and trees from a BatchDrafter in one forward per draft step (per
    depth, for trees), else one drafter per row. features: each row's FeatureLog (a drafter that reads
    features), or None."""
    drafter = engine.drafter
    if isinstance(drafter, BatchDrafter):
        together = drafter.for_batch(pool)
        if together is not None:
            if isinstance(together, FeatureRows):
                together.attach(features)
            return together
    return PerRowDrafts([drafter.for_row() for _ in range(rows)], features)


class _Row:
    """A live row's state."""

    def __init__(self, index: int, request: RowRequest, table: BlockTable, tracker, pipeline, context: torch.Tensor,
                 features: FeatureLog | None):
        self.index = index  # the row's number in the batch (its drafter's, in DraftRows)
        self.request = request
        self.T = request.prompt.numel()
        self.table = table
        self.tracker = tracker
        self.pipeline = pipeline
        self.context = context  # [T + max_new + 1] on the device; the committed tokens lead it
        self.tokens: list[int] = request.prompt.tolist()  # committed; the target holds KV for all but the last
        self.stats = SpecStats(prompt_tokens=self.T)
        self.done = False
        self.decode_t0 = 0.0
        self.features = features  # the target's features by position (a feature-head drafter), else None


def generate_batch(engine: Engine, requests: list[RowRequest], sampling: SamplingParams,
                   generator: torch.Generator | None = None) -> list[tuple[torch.Tensor, SpecStats]]:
    """Every request's (sequence [T_i + N_i] int64, stats), generated together (see the module doc)."""
    why = batchable(engine)
    if why is not None:
        raise ValueError(f"this engine cannot run a batch in one forward per step: {why}")
    with engine._busy, mapped_offload(engine.target):
        return _generate(engine, requests, sampling, generator)


@torch.no_grad()
def _generate(engine: Engine, requests, sampling, generator):
    t_begin = time.perf_counter()  # TTFT and total count from here: the runner's setup is waited for too
    dev, target = engine.device, engine.target
    planner = planner_for(engine)
    max_pos = max_positions_of(target)
    for r in requests:
        check_rope_span(target, r.prompt.numel(), r.limits.max_new_tokens)
    ps = engine.page_size
    need = sum(-(-(r.prompt.numel() + r.limits.max_new_tokens + planner.max_length + 2) // ps) * ps for r in requests)
    pool = engine._pool_for(need)
    runner = BatchRunner(target, pool, lean=engine.lean, kernel=engine.kernel, step=engine.step,
                         max_tokens=len(requests) * (planner.max_length + 1))
    runner.capture = engine.feature_layers
    features = [FeatureLog() for _ in requests] if engine.feature_layers else None
    rows: list[_Row] = []
    drafts = draft_rows(engine, pool, len(requests), features) if engine.drafter is not None else None
    planner.together = drafts is not None and not isinstance(drafts, PerRowDrafts)  # how a draft step is priced
    draft_model = engine.drafter.model if isinstance(engine.drafter, ModelBackedDrafter) else None
    began = False
    try:
        with specdec_attention(target, draft_model):
            for i, r in enumerate(requests):
                prompt = r.prompt.to(dev)
                context = torch.empty(prompt.numel() + r.limits.max_new_tokens + 1, dtype=torch.long, device=dev)
                context[:prompt.numel()] = prompt
                pipeline = LogitsPipeline(sampling, prompt.numel(), r.limits.min_new_tokens, r.limits.eos_token_ids,
                                          r.processors, r.post_processors)
                rows.append(_Row(i, r, BlockTable(pool, dev), planner.new_row(), pipeline, context,
                                 features[i] if features is not None else None))
            _prefill(engine, runner, rows, sampling, generator, t_begin)
            if drafts is not None:  # the drafter's own prefill, after every row's first token is out
                t_draft = time.perf_counter()
                began = True
                drafts.begin([DraftSetup(row.table, row.context[:row.T], 0, target, runner.kv, engine.kernel)
                              for row in rows])
                t_draft = time.perf_counter() - t_draft
                for row in rows:
                    row.stats.prefill_s += t_draft
            live = [row for row in rows if not row.done]
            while live:
                _step(engine, runner, drafts, planner, live, sampling, generator, max_pos)
                live = [row for row in live if not row.done]
    finally:
        if began:
            drafts.end()
        for row in rows:
            row.table.release()
    step = runner.lean.step_name if runner.lean is not None else "hf"
    offload = offload_reading(engine.target)
    for row in rows:
        row.stats.step, row.stats.offload = step, offload
    return [(torch.tensor(row.tokens, dtype=torch.long), row.stats) for row in rows]


def _prefill(engine, runner: BatchRunner, rows: list[_Row], sampling, generator, t_begin: float) -> None:
    """All prompts in one forward; each row's first token. t_begin: when the generation started (setup)."""
    t0 = time.perf_counter()
    logits = runner.forward([RowForward(row.table, 0, row.context[:row.T], logits_rows=1) for row in rows])
    t1 = time.perf_counter()
    for j, (row, lg) in enumerate(zip(rows, logits)):
        if row.features is not None:
            row.features.write(0, runner.last_features[j])
        scores = row.pipeline(lg, row.context[:row.T], [[]])
        first = pick_token(scores, sampling, generator)
        row.tokens.append(first)
        row.context[row.T] = first
        row.stats.setup_s, row.stats.prefill_s, row.stats.ttft_s = t0 - t_begin, t1 - t0, t1 - t_begin
        row.done = stops_at(row.tokens, row.T, row.request.limits, scores[:1])
        row.decode_t0 = time.perf_counter()
        if row.done:
            _finish(row)
        _emit(row, [first])


def _step(engine, runner: BatchRunner, drafts, planner: BatchPlanner, live: list[_Row], sampling, generator,
          max_pos) -> None:
    caps = []
    for row in live:
        n = len(row.tokens)
        cap = row.request.limits.max_new_tokens - (n - row.T) - 1
        caps.append(max(0, min(cap, max_pos - n) if max_pos is not None else cap))
    trackers = [row.tracker for row in live]
    if engine.tree is None:
        ks = planner.plan(trackers, caps)  # chain lengths
    else:  # each row's spec cut to the tokens it has left, then its node budget
        specs = [engine.tree.limited(cap) if cap > 0 else None for cap in caps]
        ks = planner.node_budgets(trackers, [spec.nodes if spec is not None else 0 for spec in specs])
    t0 = time.perf_counter()
    empty = (Draft.empty(engine.device), [], [], None)
    proposed = [empty] * len(live)
    contexts = [DraftContext(tokens=row.context[:len(row.tokens)], sampling=sampling, generator=generator,
                             process=row.pipeline) for row in live]
    asked = [j for j, k in enumerate(ks) if k > 0] if drafts is not None else []
    if engine.tree is not None and asked:
        trees = drafts.propose_trees([(live[j].index, contexts[j], specs[j], ks[j]) for j in asked])
        for j, draft in zip(asked, trees):
            proposed[j] = check_tree(engine.drafter, draft, specs[j], ks[j], engine.vocab_size, engine.device)
    elif asked:
        chains = drafts.propose([(live[j].index, contexts[j], ks[j]) for j in asked])
        for j, draft in zip(asked, chains):
            toks, par, _ = check_draft(engine.drafter, draft, ks[j], engine.vocab_size)
            proposed[j] = (draft, toks, par, None)
    forwards = []
    for row, ctx, (draft, toks, par, _) in zip(live, contexts, proposed):
        L = ctx.tokens.numel() - 1
        positions = to_device([L] + [L + d for d in depth_list(par)], torch.long, engine.device)
        forwards.append(RowForward(row.table, L, torch.cat([ctx.tokens[-1:], draft.tokens]), positions,
                                   ancestor_mask_with_root(par, engine.device)))
    t1 = time.perf_counter()
    logits = runner.forward(forwards)
    t2 = time.perf_counter()
    total = sum(f.tokens.numel() for f in forwards)
    if engine.tree is None:
        planner.observe(total, t2 - t1, [len(p[1]) for p in proposed], t1 - t0)
    else:
        planner.observe_trees(total, t2 - t1, [len(p[1]) for p in proposed], t1 - t0)
    for j, (row, (draft, toks, par, node_scores), lg) in enumerate(zip(live, proposed, logits)):
        feats = runner.last_features[j] if row.features is not None else None
        _commit(row, runner, drafts, draft, toks, par, lg, feats, sampling, generator, t1 - t0, t2 - t1,
                engine.acceptance, node_scores)


def _commit(row: _Row, runner: BatchRunner, drafts, draft: Draft, toks: list[int], par: list[int],
            logits: torch.Tensor, feats: torch.Tensor | None, sampling, generator, draft_s: float,
            verify_s: float, acceptance: str = "exact", node_scores: list[float] | None = None) -> None:
    """Verify one row's draft against its rows of the batch's logits [n + 1, V] (and target features
    [n + 1, F] when the drafter reads them), roll back, commit."""
    N = len(row.tokens)
    L = N - 1
    context = row.context[:N]
    n = len(toks)
    chain = is_chain(par)
    scores = row.pipeline(logits, context, node_paths(toks, par, chain))
    result = verify(draft, scores, sampling, generator, chain, acceptance)
    m = len(result.path)
    compact_path(runner.kv, row.table, L, result.path, runner.kernel)
    new = [toks[i] for i in result.path] + [result.next_token]
    emitting = emitting_rows(result.path)
    if feats is not None:  # the root's and the accepted nodes' features: positions L .. L + m
        row.features.write(L, feats[emitting])
    emitted = 0
    for tok, i in zip(new, emitting):  # i: the scores row that predicted tok
        row.tokens.append(tok)
        emitted += 1
        if stops_at(row.tokens, row.T, row.request.limits, scores[i][None]):
            row.done = True
            break
    row.context[N:N + emitted] = to_device(new[:emitted], torch.long, row.context.device)
    if drafts is not None:
        drafts.accept(row.index, len(row.tokens))
    row.table.truncate(L + 1 + m)  # the target's KV: the context before this step's root, root and path
    row.tracker.observe(n, m, result.beta)
    if n and node_scores is not None:  # a tree: which ranks (best node first) were on the accepted path
        on_path = set(result.path)
        row.tracker.observe_ranks([i in on_path for i in sorted(range(n), key=lambda i: (-node_scores[i], i))])
    row.stats.record_step(n, m, depth=max(depth_list(par), default=0))
    row.stats.draft_s += draft_s
    row.stats.verify_s += verify_s
    if row.done:
        _finish(row)
    _emit(row, new[:emitted])


def _finish(row: _Row) -> None:
    st = row.stats
    st.decode_s = time.perf_counter() - row.decode_t0
    st.total_s = st.setup_s + st.prefill_s + st.decode_s
    st.new_tokens = len(row.tokens) - row.T
    st.tracker = row.tracker.to_dict()
