"""The head trainer's data: the target's own answers and standard-library text, with the target's features.

Self-distillation (HASS, EAGLE-3 regenerate their data): the target answers the prompt set greedily in
left-padded batches; each (prompt + answer) and each standard-library chunk then gets one
teacher-forced target forward whose features (see drafters/head_model.py) are kept in fp16. The
target's distribution at a position is not stored: it is its LM head over the stored top feature,
recomputed by the trainer on the draft vocabulary.

Shards: work/data/chat-NNNNN.safetensors (prompt batches) and text-NNNNN.safetensors (text chunks),
each written to a temporary name and renamed, so an interrupted build resumes at the first missing
shard. The prompt set and the text chunks are prefix-stable for a seed, so a build asked for more
prompts or chunks keeps every full shard and only adds (a shard records how many items it was built
from in its metadata; one built from fewer, the old last partial batch, is rebuilt). Tensors: tokens [N] int32, features [N, F]
fp16, offsets [S + 1] int64 (sequence s is rows offsets[s]:offsets[s+1]), loss_from [S] int64 (the
first position whose token is the target's answer; 0 for text), heldout [S] bool.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..hf.features import FeatureCapture
from ..zoo.corpus import read_texts
from ..rows import left_pad
from . import prompts as prompt_set


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """ids [T] int64 -> the target's features [T, F] (one teacher-forced forward)."""
    with FeatureCapture(target, layers) as cap:
        target(input_ids=ids[None].to(next(target.parameters()).device), use_cache=False)
    return cap.features()[0]


def render(tok, prompt: dict) -> list[int]:
    msgs = ([{"role": "system", "content": prompt["system"]}] if prompt.get("system") else [])
    msgs.append({"role": "user", "content": prompt["user"]})
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@torch.no_grad()
def answer(target, tok, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy answers to a batch of prompts (left-padded), each cut after its first EOS."""
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos) if eos else 0)
    ids, mask = left_pad(prompt_ids, pad)
    width = ids.shape[1]
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=pad, top_p=None, top_k=None, temperature=None)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


def text_chunks(tok, n: int, tokens_per_chunk: int, seed: int) -> list[list[int]]:
    """n chunks of about tokens_per_chunk tokens of standard-library source (training split), seeded."""
    import random

    rng = random.Random(seed)
    texts = [t for t in read_texts("train") if len(t) > 4 * tokens_per_chunk]
    out = []
    for _ in range(n):
        t = rng.choice(texts)
        start = rng.randrange(0, len(t) - 4 * tokens_per_chunk)
        start = t.rfind("\n", 0, start) + 1
        ids = tok(t[start:start + 5 * tokens_per_chunk], add_special_tokens=False)["input_ids"]
        out.append(ids[:tokens_per_chunk])
    return out


def _save_atomic(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def write_shard(path: Path, seqs: list[tuple[list[int], int, bool]], target, layers, items: int) -> int:
    """seqs: (token ids, loss_from, heldout), built from `items` prompts or chunks -> one shard file; returns
    its token count."""
    toks, feats, offsets, starts, held = [], [], [0], [], []
    for ids, loss_from, heldout in seqs:
        t = torch.tensor(ids, dtype=torch.long)
        feats.append(target_features(target, t, layers).to(torch.float16).cpu())
        toks.append(t.to(torch.int32))
        offsets.append(offsets[-1] + len(ids))
        starts.append(loss_from)
        held.append(heldout)
    _save_atomic({"tokens": torch.cat(toks), "features": torch.cat(feats),
                  "offsets": torch.tensor(offsets, dtype=torch.long), "loss_from": torch.tensor(starts, dtype=torch.long),
                  "heldout": torch.tensor(held, dtype=torch.bool)}, path, {"items": str(items)})
    return offsets[-1]


def build(target, tok, work: Path, layers: tuple[int, ...], num_prompts: int, max_new_tokens: int,
          num_text_chunks: int, text_tokens: int, batch: int, seed: int, progress=None) -> list[Path]:
    """Write (or finish writing) every shard; returns the shard paths. Chat shards first, then text."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    if num_prompts <= 0:
        raise ValueError("the prompt set is empty: nothing to distil (num_prompts must be positive)")
    if getattr(tok, "chat_template", None):
        ps = [(render(tok, p), prompt_set.is_heldout(p)) for p in prompt_set.build(num_prompts, seed)]
    else:  # a plain LM (the zoo target): it continues openings of standard-library text
        ps = [(ids, i % 25 == 0) for i, ids in enumerate(text_chunks(tok, num_prompts, 48, seed + 1))]
    jobs: list[tuple[str, list]] = [(f"chat-{j:05d}", ps[i:i + batch]) for j, i in enumerate(range(0, len(ps), batch))]
    chunks = text_chunks(tok, num_text_chunks, text_tokens, seed) if num_text_chunks else []
    jobs += [(f"text-{j:05d}", chunks[i:i + 4 * batch]) for j, i in enumerate(range(0, len(chunks), 4 * batch))]
    paths = []
    for i, (name, items) in enumerate(jobs):
        path = data / f"{name}.safetensors"
        paths.append(path)
        if path.exists() and shard_items(path) == len(items):
            if progress:
                progress(i + 1, len(jobs), 0)
            continue
        if name.startswith("chat"):
            answers = answer(target, tok, [p for p, _ in items], max_new_tokens)
            seqs = [(p + a, len(p), held) for (p, held), a in zip(items, answers) if a]
        else:
            seqs = [(c, 0, False) for c in items if len(c) > 8]
        n = write_shard(path, seqs, target, layers, len(items))
        if progress:
            progress(i + 1, len(jobs), n)
    return paths


def shard_items(path: Path) -> int | None:
    """How many prompts or chunks a shard was built from (its metadata), None if it does not say."""
    with safe_open(str(path), framework="pt") as f:
        items = (f.metadata() or {}).get("items")
    return int(items) if items is not None else None


class Dataset:
    """Every shard in memory: sequences as (tokens [n] int64, features [n, F] fp16, loss_from)."""

    def __init__(self, paths: list[Path]):
        self.train: list[tuple] = []
        self.heldout: list[tuple] = []
        for p in paths:
            d = load_file(str(p))
            off = d["offsets"].tolist()
            for s in range(len(off) - 1):
                a, b = off[s], off[s + 1]
                item = (d["tokens"][a:b].long(), d["features"][a:b], int(d["loss_from"][s]))
                (self.heldout if bool(d["heldout"][s]) else self.train).append(item)
        if not self.train:
            raise ValueError(f"the training data in {paths[0].parent if paths else '(no shards)'} is empty: "
                             "no sequence to train on")

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t, _, _ in self.train)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the training sequences: [vocab_size] int64."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for t, _, _ in self.train:
            counts += torch.bincount(t, minlength=vocab_size)[:vocab_size]
        return counts


GROWABLE = ("num_prompts", "num_text_chunks")  # more of either only adds shards (see the module docstring)


def write_manifest(work: Path, manifest: dict) -> None:
    """Record what the data was built from; a resumed build with different settings is refused, except for
    a different number of prompts or text chunks (the shards already built are kept and reused)."""
    path = work / "manifest.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), manifest.get(k)) for k in set(old) | set(manifest)
                if old.get(k) != manifest.get(k) and k not in GROWABLE}
        if diff:
            raise ValueError(f"work folder {work} holds a run with other settings {diff}; use a new --work folder")
        if old == manifest:
            return
    work.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-manifest.json")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, path)
