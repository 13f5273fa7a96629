"""generate() over several rows: left-padded batches and num_return_sequences.

HF's convention: a batch is left-padded, `attention_mask` marks each row's real tokens. Each row is
generated from its own unpadded prompt, exactly as `generate(row, **the same keywords)` would (so a row's
output is its own unpadded generation token for token), and the rows come back laid out like HF's
batched output: [B, T + N], each row's prompt with its left padding as given, its new tokens after it,
`pad_token_id` after a row that ended early. `num_return_sequences = n` repeats each row n times (HF's
order: row 0's n samples first).

api.py runs the rows together through specdec/batch.py (one target forward per step for every live row)
when the engine can (batch.batchable); otherwise one after another through the same engine (its policy
keeps learning from row to row; every row's pages go back to the pool before the next starts).
"""
from __future__ import annotations

import torch


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [B, T], attention_mask [B, T]), left-padded with pad_id (HF's convention)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def split_rows(input_ids: torch.Tensor, attention_mask) -> list[torch.Tensor]:
    """input_ids [B, T], attention_mask [B, T] or None -> each row's real tokens [T_i] (left padding only)."""
    if attention_mask is None:
        return [row for row in input_ids]
    mask = torch.as_tensor(attention_mask).to(input_ids.device).bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    rows = []
    for i, (ids, m) in enumerate(zip(input_ids, mask)):
        n = int(m.sum())
        if n == 0:
            raise ValueError(f"row {i} of the batch has no tokens (its attention_mask is all zeros)")
        if not bool(m[-n:].all()):
            raise ValueError(f"row {i} is not left-padded: specdec follows HF's decoder-only convention (padding "
                             "on the left, attention_mask 0 there); pad on the left (tokenizer.padding_side='left')")
        rows.append(ids[-n:])
    return rows


def assemble(padded: torch.Tensor, prompt_lengths: list[int], outputs: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    """padded [B, T] (the prompts as given); outputs: row i's own [T_i + N_i] (T_i = prompt_lengths[i]) ->
    [B, T + max N_i]: the padded prompts, each row's new tokens, pad_id after the shorter ones."""
    news = [o[t:] for o, t in zip(outputs, prompt_lengths)]
    T = padded.shape[1]
    out = torch.full((len(news), T + max(int(x.numel()) for x in news)), int(pad_id), dtype=torch.long,
                     device=padded.device)
    out[:, :T] = padded
    for i, new in enumerate(news):
        out[i, T:T + new.numel()] = new.to(padded.device)
    return out
