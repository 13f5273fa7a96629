"""Logits processing shared by target and draft, so p and q are processed the SAME way.

Order as in HF generate: per-row processors (min_new_tokens EOS suppression, then HF's processors built
from the generation config and the user's LogitsProcessorList, each seeing the row's own prefix), then
the warpers (temperature, top-k, top-p), then the later warpers (min_p, typical_p, epsilon, eta).
A row's prefix is the committed context plus the draft tokens on the path to that row.
"""
from __future__ import annotations

import torch

from .verifiers.sampling import SamplingParams, warp_logits


class LogitsPipeline:
    def __init__(self, sampling: SamplingParams, prompt_len: int, min_new_tokens: int = 0,
                 eos_token_ids: list[int] | None = None, processors=None, post_processors=None):
        self.sampling = sampling
        self.prompt_len = prompt_len
        self.min_new_tokens = min_new_tokens
        self.eos = torch.tensor(eos_token_ids or [], dtype=torch.long)
        self.processors = processors if processors else None
        self.post_processors = post_processors if post_processors else None

    def __call__(self, scores: torch.Tensor, context: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """scores [r, V]; context [N] int64 committed tokens; paths: r lists of draft tokens after context.

        Returns processed scores [r, V] float32 (greedy: argmax of these; sampling: softmax of these).
        """
        scores = scores.float()
        generated = context.numel() - self.prompt_len
        if self.min_new_tokens and self.eos.numel():
            short = [i for i, p in enumerate(paths) if generated + len(p) < self.min_new_tokens]
            if short:
                scores = scores.clone()
                rows = torch.tensor(short, device=scores.device)
                scores[rows[:, None], self.eos.to(scores.device)[None, :]] = float("-inf")
        if self.processors is not None:
            rows = []
            for i, p in enumerate(paths):
                ids = torch.cat([context, torch.tensor(p, dtype=torch.long, device=context.device)])[None]
                rows.append(self.processors(ids, scores[i:i + 1].clone()))
            scores = torch.cat(rows).float()
        scores = warp_logits(scores, self.sampling)
        if self.post_processors is not None:  # row-wise warpers: they read the scores only
            scores = self.post_processors(context[None], scores).float()
        return scores
