"""A small HF causal LM as the drafter, with its own page tensors on the target's block table.

Its KV covers the same positions as the target's (never more after a step): it lags only by tokens it
has not run yet (the last draft token, the correction/bonus token), which it catches up on in the
first forward of its next proposal.
"""
from __future__ import annotations

import torch

from ..hf.runner import ModelRunner
from ..verifiers.sampling import probs_from_scores, sample
from .base import Draft, DraftContext


def vocab_size_of(model) -> int:
    return model.config.get_text_config().vocab_size


class ModelDrafter:
    def __init__(self, model):
        self.model = model.eval()
        self.runner: ModelRunner | None = None
        self.deterministic = False
        self.tree_kv = None  # set when the drafter writes tree nodes (KV moved with the target's on compaction)

    def check_compatible(self, target) -> None:
        tv, dv = vocab_size_of(target), vocab_size_of(self.model)
        if tv != dv:
            raise ValueError(f"draft model vocabulary size {dv} does not match the target's {tv}: the drafter must "
                             "share the target's tokenizer and vocabulary")

    def begin(self, engine, table) -> None:
        self.runner = ModelRunner(self.model, engine.pool, table, engine.kernel)

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        runner = self.runner
        greedy = not ctx.sampling.do_sample
        self.deterministic = greedy
        stop = getattr(ctx, "should_continue", None)
        pending = ctx.tokens[runner.valid:]
        logits = runner.forward(pending, logits_rows=1)  # catch up + the first draft position
        out: list[int] = []
        qs = []
        for i in range(budget):
            scores = ctx.process(logits, ctx.tokens, [out])
            if greedy:
                x = int(scores[0].argmax())
                conf = float(torch.softmax(scores[0], -1)[x]) if stop is not None else 1.0
            else:
                q = probs_from_scores(scores)
                x = int(sample(q, ctx.generator)[0])
                qs.append(q[0])
                conf = float(q[0, x])
            out.append(x)
            if i + 1 == budget or (stop is not None and not stop(i + 1, conf)):
                break
            logits = runner.forward(torch.tensor([x], device=ctx.tokens.device), logits_rows=1)
        tokens = torch.tensor(out, dtype=torch.long, device=ctx.tokens.device)
        return Draft.chain(tokens, None if greedy else torch.stack(qs))

    def accept(self, num_context_tokens: int) -> None:
        self.runner.rollback(num_context_tokens - 1)

    def end(self) -> None:
        self.runner = None
