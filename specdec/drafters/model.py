"""A small HF causal LM as the drafter, with its own page tensors on the target's block table.

Its KV covers the same positions as the target's (never more after a step): it lags only by tokens it
has not run yet (the last draft token, the correction/bonus token), which it catches up on in the
first forward of its next proposal.

Trees (`propose_tree`): one draft forward per depth, all frontier nodes batched, written as scratch
past the drafter's valid KV (see ModelRunner.forward_tree). Afterwards the drafter's KV is valid only
for the committed context; the accepted tokens are re-run in the next proposal's catch-up forward
(simplest and exact; the engine moves no drafter KV).
"""
from __future__ import annotations

import torch

from ..hf import linear
from ..hf.lean import LeanRunner
from ..hf.runner import ModelRunner
from ..tree import TreeGrower, TreeSpec
from ..verifiers.sampling import probs_from_scores, sample
from .base import Draft, DraftContext, DraftSetup


def grow_tree(runner: ModelRunner, grower: TreeGrower, ctx: DraftContext, logits: torch.Tensor, device,
              scores=lambda logits: logits, model_ids=lambda ids: ids, processed: bool = True,
              final_token: int | None = None) -> None:
    """The tree-growing loop one-sequence model drafters share: expand `grower` from the root's draft
    logits [1, V] (the catch-up's last row; the root sits at runner.valid - 1), then one forward_tree per
    further depth over the frontier, written as scratch past the runner's valid KV. scores: draft logits
    -> scores over the target's ids; model_ids: target ids -> the draft model's input ids (both the same
    ids for a draft of the target's vocabulary; drafters/cross_tokenizer.py maps them). processed=False:
    the draft's own softmax, not the target's logits processors (a tree in the draft's vocabulary, which
    the target's processors do not address). final_token: a token whose nodes are not expanded (EOS)."""
    def probs(logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        if not processed:
            return torch.softmax(scores(logits).float(), dim=-1)
        return probs_from_scores(ctx.process(scores(logits), ctx.tokens, paths))

    frontier = grower.expand(probs(logits, [[]]))
    root_pos = runner.valid - 1
    written: list[int] = []  # grower ids with KV in the scratch block, in block order
    while frontier and grower.level < grower.spec.depth:
        if final_token is not None:
            frontier = grower.restrict([a for a in frontier if grower.tokens[a] != final_token])
            if not frontier:
                break
        tokens = torch.tensor(model_ids([grower.tokens[a] for a in frontier]), dtype=torch.long, device=device)
        mask, paths = grower.frontier_block(frontier, written)
        block_pos = torch.tensor([root_pos + grower.depth[a] for a in written], device=device)
        logits = runner.forward_tree(tokens, block_pos, mask.to(device))
        frontier = grower.expand(probs(logits, paths))


def draft_chain(ctx: DraftContext, budget: int, logits: torch.Tensor, advance) -> Draft:
    """The chain-drafting loop every autoregressive drafter shares: process the draft logits [1, V] like
    the target's rows, pick (argmax, or sample and keep q), stop at the budget or the policy's stop rule,
    else `advance(token, i)` -> the next position's logits [1, V]. Greedy drafts are deterministic (q None)."""
    greedy = not ctx.sampling.do_sample
    stop = ctx.should_continue
    out: list[int] = []
    qs = []
    for i in range(budget):
        scores = ctx.process(logits, ctx.tokens, [out])
        if greedy:  # the token (the next row's processors need it on the host) and its confidence: one read
            best = scores[0].argmax()
            if stop is None:
                x, conf = int(best), 1.0
            else:
                x, conf = torch.stack((best.double(), torch.softmax(scores[0], -1)[best].double())).tolist()
        else:
            q = probs_from_scores(scores)
            pick = sample(q, ctx.generator)[0]
            qs.append(q[0])
            x, conf = torch.stack((pick.double(), q[0, pick].double())).tolist()
        x = int(x)
        out.append(x)
        if i + 1 == budget or (stop is not None and not stop(i + 1, conf)):
            break
        logits = advance(x, i)
    return Draft.from_lists(out, None, ctx.tokens.device, None if greedy else torch.stack(qs))


def model_runner(model, table, kernel: bool, lean: bool = True) -> ModelRunner:
    """A draft model's runner on `table`: the lean loop where the model is supported and its probe passes
    (lean=True), else the HF modules."""
    runner = LeanRunner.for_model(model, table.pool, table, kernel) if lean else None
    return runner or ModelRunner(model, table.pool, table, kernel, short_blocks=linear.short_blocks_on())


def vocab_size_of(model) -> int:
    return model.config.get_text_config().vocab_size


class ModelDrafter:
    """lean: run chain drafting through hf/lean.py's LeanRunner when the model is supported and its probe
    passes; False always uses the HF modules."""

    def __init__(self, model, lean: bool = True):
        self.model = model.eval()
        self.runner: ModelRunner | None = None
        self.lean = lean

    def check_compatible(self, target) -> None:
        tv, dv = vocab_size_of(target), vocab_size_of(self.model)
        if tv != dv:
            raise ValueError(f"draft model vocabulary size {dv} does not match the target's {tv}: a draft model "
                             "shares the target's tokenizer, or drafts across tokenizers when given both: pass "
                             "tokenizer= (the target's) and assistant_tokenizer= (the draft's)")

    def for_row(self) -> "ModelDrafter | None":
        return ModelDrafter(self.model, self.lean)

    def for_batch(self, pool):
        from .model_rows import ModelRows

        return ModelRows(self.model, pool, self.lean)

    def begin(self, setup: DraftSetup) -> None:
        """Bind our pages to the sequence and prefill the prompt [T] (so drafting never pays for it)."""
        table, prompt = setup.table, setup.prompt
        if self.runner is not None and self.runner.table is table:  # a kept sequence (chat): reuse our KV
            self.runner.rollback(min(self.runner.valid, setup.reused_tokens))
        else:
            self.runner = model_runner(self.model, table, setup.kernel, self.lean)
        if prompt is not None and prompt.numel() > self.runner.valid:
            self.runner.forward(prompt[self.runner.valid:], logits_rows=1)

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        runner = self.runner
        logits = runner.forward(ctx.tokens[runner.valid:], logits_rows=1)  # catch up + the first draft position
        device = ctx.tokens.device
        return draft_chain(ctx, budget, logits,
                           lambda x, i: runner.forward(torch.tensor([x], device=device), logits_rows=1))

    def propose_tree(self, ctx: DraftContext, spec: TreeSpec, budget: int) -> Draft:
        """A token tree of at most min(budget, spec.nodes) nodes and spec.depth levels (see TreeSpec).

        A node's children are the top tokens of the processed draft distribution at that node: a
        deterministic choice, so the Draft has q_probs None and the verifier applies the one-hot rule,
        lossless for greedy and sampled decoding alike (DESIGN.md section 5). One catch-up forward (its
        last row is the root's distribution), then one forward per further depth over the frontier.
        """
        runner = self.runner
        device = ctx.tokens.device
        grower = TreeGrower(spec, budget)
        if grower.budget <= 0:
            return Draft.empty(device)
        grow_tree(runner, grower, ctx, runner.forward(ctx.tokens[runner.valid:], logits_rows=1), device)
        toks, parents = grower.result()
        return Draft.from_lists(toks, parents, device, scores=grower.kept_scores)

    def accept(self, num_context_tokens: int) -> None:
        self.runner.rollback(num_context_tokens - 1)

    def end(self) -> None:
        self.runner = None
