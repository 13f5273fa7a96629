"""`GenerateOutput`: HF's GenerateDecoderOnlyOutput plus specdec's stats (return_dict_in_generate=True).

Its own module so that `import specdec` does not import transformers' generation utilities (seconds of
start-up); specdec.GenerateOutput and specdec.api.GenerateOutput load it on first use.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.utils import GenerateDecoderOnlyOutput

from .stats import SpecStats


@dataclass
class GenerateOutput(GenerateDecoderOnlyOutput):
    """HF's GenerateDecoderOnlyOutput (indexing by key and position works as in HF) plus `stats`.

    sequences: [1, T + N] int64 (prompt + new tokens); scores / logits (output_scores / output_logits):
    N tensors [1, V] float32, per emitted token the processed scores and the raw logits of the row that
    produced it, as HF's greedy / sample loop returns them; stats: what the run measured (a list, one per
    sequence, for a batch or num_return_sequences > 1); batch_stats: then the whole batch's
    (SpecStats.combine: its throughput, its pooled acceptance)."""

    stats: SpecStats | None = None
    batch_stats: SpecStats | None = None
