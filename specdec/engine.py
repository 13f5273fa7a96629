"""The speculative decoding loop: prefill -> [draft -> verify -> accept -> commit/rollback -> re-plan]*.

No math here (verifiers do it) and no globals. Batch size 1: one sequence, one block table, shared by
the target and a model drafter. Every page goes back to the pool when the generation ends, also when
it ends by an exception.

Vocabulary: the *context* is every committed token; its last token, the *root*, is committed but not
yet run through the target (its KV is missing). A step runs the target over [root, draft nodes] in one
forward, keeps the accepted path's KV, and commits accepted tokens + one correction/bonus token.

Chains or trees: without a TreeSpec the policy sets the chain length each step; with one (`tree=`) the
drafter proposes a tree of the spec's shape, its depth cut so that the step can emit no more tokens
than are left (a tree of depth d emits at most d + 1) and no position passes the model's last; a policy
with `tree_budget` (the adaptive one) sets a dynamic tree's node count each step (a static tree keeps
the exact shape it was given).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from .cache.pool import BlockTable, PagePool, common_prefix
from .drafters.base import (Draft, DraftContext, DraftSetup, FeatureDrafter, ModelBackedDrafter, SwitchingDrafter,
                            TreeDrafter, check_draft)
from .hf.attention import specdec_attention
from .hf.features import FeatureLog
from .hf.compiled import STEPS, CompiledRunner, auto_compiles
from .hf import linear
from .hf.lean import LeanRunner
from .hf.mapped_offload import mapped_offload, offload_reading
from .hf.offload import check_device_map
from .hf.runner import ModelRunner, check_rope_span, max_positions_of
from .policy import DraftPolicy, SourcePolicy
from .processing import LogitsPipeline
from .stats import SpecStats
from .step import Limits, compact_path, emitting_rows, node_paths, pick_token, propose_tree, stops_at, verify
from .transfer import to_device
from .tree import TreeSpec, ancestor_mask_with_root, depth_list, is_chain
from .verifiers.sampling import SamplingParams


@dataclass
class _Kept:
    """The sequence kept between generate() calls when keep_cache=True (chat)."""

    table: BlockTable
    target: ModelRunner
    tokens: list[int]  # committed tokens; the target holds KV for tokens[:target.valid]
    features: FeatureLog | None = None  # the target's features of those positions (a feature-head drafter)


class Engine:
    """Runs one generation at a time for a (target, drafter, policy).

    keep_cache=True keeps the last sequence's KV (target and drafter pages) after generate() returns, so
    the next call prefills only what follows the longest common prefix: multi-turn chat without
    re-prefilling the history. `release_cache()` gives the pages back."""

    def __init__(self, target, drafter, policy, page_size: int = 16, kernel: bool | None = None,
                 acceptance: str = "exact", tree: TreeSpec | None = None,
                 keep_cache: bool = False, lean: bool = True, max_kv_tokens: int | None = None,
                 step: str = "auto"):
        if step not in STEPS:
            raise ValueError(f"step must be one of {', '.join(map(repr, STEPS))}, got {step!r}")
        if tree is not None:
            if not isinstance(tree, TreeSpec):
                raise ValueError(f"tree must be None (a chain) or a specdec.TreeSpec, got {type(tree).__name__}")
            if not isinstance(drafter, TreeDrafter):
                raise ValueError(f"tree={tree!r} needs a drafter that proposes token trees (a draft model or "
                                 f"'ngram'); {type(drafter).__name__} has no propose_tree")
        if not isinstance(policy, DraftPolicy):
            hooks = [h for h in ("max_length", "tracker", "begin_sequence", "next_length", "tree_budget",
                                 "should_continue", "observe", "observe_tree") if not hasattr(policy, h)]
            raise ValueError(f"policy {type(policy).__name__} is not a specdec.policy.DraftPolicy: it lacks "
                             f"{', '.join(hooks)} (subclass specdec.policy.PolicyBase for the neutral hooks)")
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.page_size = page_size
        check_device_map(target)  # a device map the engine cannot run: refused before any forward
        self.device = next(target.parameters()).device
        if kernel is None:  # Triton where it can run on this device (SPECDEC_KERNELS=torch|triton overrides)
            from .kernels import on_triton

            kernel = on_triton(self.device)
        self.kernel = kernel
        self.acceptance = acceptance
        self.tree = tree
        self.pool: PagePool | None = None
        self.keep_cache = keep_cache
        if max_kv_tokens is not None and (isinstance(max_kv_tokens, bool) or not isinstance(max_kv_tokens, int)
                                          or max_kv_tokens < 1):
            raise ValueError(f"max_kv_tokens must be a positive int (token positions of KV), got {max_kv_tokens!r}")
        self.max_kv_tokens = max_kv_tokens  # the KV budget in token positions; None = what the generation needs
        self._kept: _Kept | None = None
        self.reused_tokens = 0  # positions of this generation's prompt whose KV was kept (drafters read it)
        self.vocab_size = target.config.get_text_config().vocab_size
        self.lean = lean  # run the target through hf/lean.py where its probe proves it bit-identical
        # 'auto' / 'compiled': the target's short forwards through hf/compiled.py (auto: where it pays);
        # 'bitwise': logits bit for bit HF's eager forward (the lean loop, else HF's modules)
        self.step = step
        self.background_compile = False  # compile the step's buckets in a thread, lean until ready (warm_up)
        # the target layers a feature-head drafter reads (hf/features.py); () for every other drafter
        self.feature_layers = tuple(drafter.feature_layers) if isinstance(drafter, FeatureDrafter) else ()
        self.features: FeatureLog | None = None  # the current generation's, when feature_layers
        self._record: dict | None = None  # the current generation's output_scores / output_logits lists
        self._busy = threading.Lock()  # one generation at a time: concurrent callers (threads) wait their turn
        self.batch_planner = None  # specdec/batch.py's, made on the first batch

    def _target_runner(self, pool: PagePool, table: BlockTable, max_tokens: int) -> ModelRunner:
        """The target's runner for one generation: compiled, lean or HF modules (module docstrings).
        max_tokens: the longest verification forward; its buckets are compiled before the prefill."""
        runner = None
        if self.lean and not self.kernel and (self.step == "compiled" or
                                              (self.step == "auto" and auto_compiles(self.target, self.kernel))):
            runner = CompiledRunner.for_model(self.target, pool, table)
            if runner is not None:
                runner.prepare(max_tokens, background=self.background_compile)
        if runner is None and self.lean:
            runner = LeanRunner.for_model(self.target, pool, table, self.kernel, exact=True,
                                           bitwise=self.step == "bitwise")
        return runner or ModelRunner(self.target, pool, table, self.kernel,
                                     short_blocks=self.step != "bitwise" and linear.short_blocks_on())

    def release_cache(self) -> None:
        """Drop the KV kept from the last generation (keep_cache=True); every page goes back to the pool."""
        if self._kept is not None:
            self._kept.table.release()
            self._kept = None

    @property
    def cached_tokens(self) -> list[int]:
        """The committed tokens of the kept sequence (keep_cache=True), [] if none."""
        return list(self._kept.tokens) if self._kept is not None else []

    def _pool_for(self, tokens: int) -> PagePool:
        """A pool of page ids for `tokens` positions (capped by max_kv_tokens). Only ids: the page tensors
        grow with the sequence (cache/paged.py), so a large budget costs no memory until it is used."""
        if self.max_kv_tokens is not None:
            tokens = min(tokens, self.max_kv_tokens)
        pages = -(-tokens // self.page_size) + (0 if self.max_kv_tokens is not None else 1)
        if self.pool is None or self.pool.num_pages < pages:
            self.pool = PagePool(pages, self.page_size)
        if self.pool.num_used:
            raise RuntimeError(f"page pool has {self.pool.num_used} pages in use at the start of a generation")
        return self.pool

    def generate(self, input_ids: torch.Tensor, sampling: SamplingParams, limits: Limits, processors=None,
                 streamer=None, generator: torch.Generator | None = None,
                 stream_prompt: bool = True, post_processors=None,
                 record: dict | None = None) -> tuple[torch.Tensor, SpecStats]:
        """input_ids [T] int64 -> (sequence [T + N] int64, stats). stream_prompt=False: the caller already
        put the prompt into the streamer (HF's generate does, before a custom decoding loop). Threads
        sharing one engine (one wrap()ed model) run their generations one after another. processors run
        before specdec's temperature / top-k / top-p warping, post_processors after it (HF's order).
        record: {"scores": [], "logits": []} (either key) gets, per emitted token, the processed scores and
        the raw logits [1, V] float32 of the row that produced it."""
        with self._busy, mapped_offload(self.target):
            self._record = record
            try:
                return self._generate(input_ids, sampling, limits, processors, streamer, generator, stream_prompt,
                                      post_processors)
            finally:
                self._record = None

    def _keep_rows(self, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """Record one emitted token's processed scores and raw logits ([1, V] each), when asked to."""
        rec = self._record
        if rec is not None:
            if "scores" in rec:
                rec["scores"].append(scores.clone())
            if "logits" in rec:
                rec["logits"].append(logits.float().clone())

    @torch.no_grad()
    def _generate(self, input_ids, sampling, limits, processors, streamer, generator, stream_prompt,
                  post_processors):
        t_begin = time.perf_counter()  # TTFT and total count from here: the runner's setup is waited for too
        prompt = input_ids.to(self.device)
        T = prompt.numel()
        max_draft = self.policy.max_length
        if max_draft is None:  # an unbounded policy (HF's heuristic): a draft never outruns the tokens left
            max_draft = limits.max_new_tokens
        if self.tree is not None:
            max_draft = max(max_draft, self.tree.max_slots)
        max_pos = max_positions_of(self.target)
        check_rope_span(self.target, T, limits.max_new_tokens)
        kept, self._kept = self._kept, None
        if kept is not None:  # multi-turn: reuse the KV of the longest common prefix, prefill only the rest
            table, target = kept.table, kept.target
            reuse = min(common_prefix(kept.tokens[:target.valid], prompt.tolist()), T - 1)
            target.rollback(reuse)
            table.truncate(reuse)
            self.reused_tokens = reuse
            features = kept.features
        else:
            budget = (max_pos or 4096) if self.keep_cache else T + limits.max_new_tokens
            pool = self._pool_for(budget + max_draft + 2)
            table = BlockTable(pool, self.device)
            target = self._target_runner(pool, table, max_draft + 1)
            self.reused_tokens = 0
            features = None
        target.capture = self.feature_layers
        if self.feature_layers:
            features = features or FeatureLog()
            features.rollback(target.valid)
        self.features = features
        pipeline = LogitsPipeline(sampling, T, limits.min_new_tokens, limits.eos_token_ids, processors,
                                  post_processors)
        stats = SpecStats(prompt_tokens=T, offload=offload_reading(self.target))
        stats.reused_prompt_tokens = target.valid
        draft_model = self.drafter.model if isinstance(self.drafter, ModelBackedDrafter) else None
        began = ready = False  # the drafter's begin() was called (end() is owed) / returned (accept() is valid)
        tokens = None
        try:
            with specdec_attention(self.target, draft_model):
                t0 = time.perf_counter()
                stats.setup_s = t0 - t_begin
                start = target.valid
                logits = target.forward(prompt[start:], logits_rows=1)
                if features is not None:
                    features.write(start, target.last_features)
                stats.prefill_s = time.perf_counter() - t0
                scores = pipeline(logits, prompt, [[]])
                first = pick_token(scores, sampling, generator)
                self._keep_rows(scores[-1:], logits[-1:])
                tokens = prompt.tolist() + [first]
                self._context = torch.empty(T + limits.max_new_tokens + 1, dtype=torch.long, device=self.device)
                self._context[:T] = prompt
                self._context[T] = first
                stats.ttft_s = time.perf_counter() - t_begin
                if streamer is not None:
                    if stream_prompt:
                        streamer.put(prompt.cpu())
                    streamer.put(torch.tensor([first]))
                if self.drafter is not None:  # the drafter's own prefill, after the first token is out
                    t_draft = time.perf_counter()
                    began = True
                    if features is not None:
                        self.drafter.attach(features)
                    self.drafter.begin(DraftSetup(table, prompt, self.reused_tokens, self.target, target.kv,
                                                  self.kernel))
                    ready = True
                    stats.prefill_s += time.perf_counter() - t_draft
                done = stops_at(tokens, T, limits, scores[:1])
                self.policy.begin_sequence()
                t_decode = time.perf_counter()
                while not done:
                    done = self._step(tokens, T, target, pipeline, sampling, limits, stats, generator, table,
                                      streamer, max_pos, max_draft)
                stats.decode_s = time.perf_counter() - t_decode
                stats.total_s = time.perf_counter() - t_begin
                stats.new_tokens = len(tokens) - T
                stats.tracker = self.policy.tracker.to_dict()
                stats.step, stats.compile_s = target.step_name, target.compile_s
        finally:
            if self.keep_cache and tokens is not None:
                # keep exactly the committed tokens' KV (also after an interrupt: the partial answer stays)
                target.rollback(len(tokens) - 1)
                if ready:
                    self.drafter.accept(len(tokens))
                elif began:  # interrupted inside begin(): drop the drafter's state, the next turn begins afresh
                    self.drafter.end()
                table.truncate(target.valid)
                if features is not None:
                    features.rollback(target.valid)
                self._kept = _Kept(table, target, tokens, features)
            else:
                if began:
                    self.drafter.end()
                table.release()
            if streamer is not None:
                streamer.end()
        return torch.tensor(tokens, dtype=torch.long), stats

    def _plan_for(self, context: torch.Tensor):
        """The policy that plans this step: a switching drafter's source's own (SourcePolicy.for_source)
        when both sides have them, else the engine's one policy. context: [N] int64, the committed tokens."""
        if isinstance(self.drafter, SwitchingDrafter) and isinstance(self.policy, SourcePolicy):
            return self.policy.for_source(self.drafter.source(context))
        return self.policy

    def _step(self, tokens, T, target: ModelRunner, pipeline, sampling, limits, stats, generator, table,
              streamer, max_pos, max_draft: int) -> bool:
        """One draft-verify step. max_draft: the draft tokens the page pool holds past the sequence."""
        N = len(tokens)
        L = N - 1  # the root's position; the target holds KV for [0, L)
        context = self._context[:N]  # the committed tokens on the device (a view; appended below)
        t0 = time.perf_counter()
        policy = self._plan_for(context)
        # a chain's length, or a tree's depth: the step emits at most that + 1 tokens
        budget = limits.max_new_tokens - (N - T) - 1
        if max_pos is not None:
            budget = min(budget, max_pos - N)
        room = min(budget, max_draft)  # the most a chain may hold: free tokens past the plan (Draft.free_from)
        if self.tree is None:
            budget = min(policy.next_length(), budget)
        toks: list[int] = []
        par: list[int] = []
        node_scores: list[float] | None = None
        if budget > 0 and self.drafter is not None:
            ctx = DraftContext(tokens=context, sampling=sampling, generator=generator, process=pipeline,
                               should_continue=None if self.tree is not None else policy.should_continue,
                               room=room if self.tree is None else 0)
            if self.tree is not None:
                spec = self.tree.limited(budget)
                nodes = spec.nodes if spec.kind == "static" else min(spec.nodes, policy.tree_budget(spec.nodes))
                draft, toks, par, node_scores = propose_tree(self.drafter, ctx, spec, nodes, self.vocab_size,
                                                             self.device)
            else:
                draft = self.drafter.propose(ctx, budget)
                toks, par, node_scores = check_draft(self.drafter, draft, budget, self.vocab_size, room)  # one read
        else:
            draft = Draft.empty(self.device)
        t1 = time.perf_counter()
        n = len(toks)
        chain = is_chain(par)
        node_depth = depth_list(par)
        positions = to_device([L] + [L + d for d in node_depth], torch.long, self.device)
        verify_tokens = torch.cat([context[-1:], draft.tokens])
        hidden = draft.hidden if n else None  # a self-speculative drafter already ran layers < from_layer
        logits = target.forward(verify_tokens, positions, ancestor_mask_with_root(par, self.device), hidden=hidden,
                                start_layer=draft.from_layer if hidden is not None else 0)
        # one row per node: its prefix is the context plus the draft tokens on its path
        scores = pipeline(logits, context, node_paths(toks, par, chain))
        result = verify(draft, scores, sampling, generator, chain, self.acceptance)
        t2 = time.perf_counter()
        m = len(result.path)
        compact_path(target.kv, table, L, result.path, self.kernel)  # drafters keep no tree KV: theirs is scratch
        new = [toks[i] for i in result.path] + [result.next_token]
        target.rollback(L + 1 + m)
        rows = emitting_rows(result.path)  # the scores row that predicted each new token
        if self.features is not None:  # the root's and the accepted nodes' features: positions L .. L + m
            self.features.write(L, target.last_features[rows])
        # commit token by token so EOS / stopping criteria end generation exactly where HF would
        done = False
        emitted = 0
        for tok, row in zip(new, rows):
            tokens.append(tok)
            emitted += 1
            self._keep_rows(scores[row][None], logits[row][None])
            if stops_at(tokens, T, limits, scores[row][None]):
                done = True
                break
        self._context[N:N + emitted] = to_device(new[:emitted], torch.long, self.device)
        if self.drafter is not None:
            self.drafter.accept(len(tokens))
        table.truncate(target.valid)  # frees the pages of rejected nodes (the drafter rolled back in accept)
        stats.record_step(n, m, depth=max(node_depth, default=0))
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        planned = n if draft.free_from is None else draft.free_from  # free tokens are not the plan's to learn from
        policy.observe(planned, min(m, planned), t1 - t0, t2 - t1, result.beta)
        if n and node_scores is not None:  # per-rank acceptance
            on_path = set(result.path)
            order = sorted(range(n), key=lambda i: (-node_scores[i], i))
            policy.observe_tree([i in on_path for i in order], t1 - t0)
        if streamer is not None:
            streamer.put(torch.tensor(new[:emitted]))
        return done

