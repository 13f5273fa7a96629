"""One model, one generation at a time, for the server: the bounded queue, prefix reuse and per-token
provenance. No HTTP here (serve/app.py is the HTTP face); this is what a route awaits.

Single stream is the point of specdec's serving: requests that arrive while a generation runs wait in a
queue of at most `max_queue` (QueueFull beyond it: the route answers 429). Prefix reuse across
conversations (ConversationCache): up to `max_conversations` kept sequences, each an engine with
keep_cache=True and its own drafter state (RowDrafter.for_row), bounded together by `max_kv_pages`; a
request goes to the one whose kept tokens share the longest prefix with its prompt (the next turn of a
conversation, sent whole as OpenAI clients do, prefills only its new tokens), else to a free slot or the
least recently used one, whose KV is dropped.

Batches (max_batch > 1, `specdec serve --batch N`): requests waiting when the model comes free, with the
same generation settings and no seed, run together as one ragged batch of up to N rows through the
batched engine (specdec/batch.py: one target forward per step for every row), each row streamed as it
is committed; they skip prefix reuse (a batch's KV is not kept). A request alone runs as above.

Provenance: the engine's streamer receives each verification step's tokens together: every token but
the last was drafted and accepted, the last is the target's own (a correction or the bonus); the first
token comes from the prefill (the target's). `Event.drafted` holds one flag per token.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..api import wrap
from ..batch import batchable
from ..cache.pool import common_prefix
from ..drafters.base import Drafter, RowDrafter
from ..hf.compiled import compiling
from ..rows import left_pad


class QueueFull(Exception):
    """More requests wait than the server's max_queue allows."""


@dataclass
class Event:
    """What a generation streams: new token ids with their provenance (drafted[i]: token i was drafted and
    accepted), or at the end the SpecStats (done=True)."""

    tokens: list[int] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)
    stats: object = None
    done: bool = False


@dataclass
class _Pending:
    """A request waiting for the model: what its thread runs, and how its events reach its route."""

    prompt: list[int]
    kwargs: dict
    cancelled: threading.Event
    put: Callable
    taken: bool = False  # run by another request's thread, in a batch


class ConversationCache:
    """Kept conversations, least recently used first: each slot a SpecModel (keep_cache=True) whose engine
    holds one sequence's KV. Not thread-safe: the worker calls it under its generation lock."""

    def __init__(self, target, drafter, options: dict, max_conversations: int = 4, max_kv_pages: int | None = None):
        if max_conversations < 1:
            raise ValueError(f"max_conversations must be >= 1, got {max_conversations}")
        self.target, self.drafter, self.options = target, drafter, options
        self.max_conversations, self.max_kv_pages = max_conversations, max_kv_pages
        self.slots = [self._new_slot(first=True)]

    def _new_slot(self, first: bool = False):
        drafter = self.drafter  # None, 'ngram' and a draft model: each engine makes its own drafter state
        if not first and isinstance(drafter, Drafter):  # an instance holds one sequence's state: a copy per slot
            drafter = drafter.for_row() if isinstance(drafter, RowDrafter) else None
            if drafter is None:  # a drafter that cannot be copied per sequence: one conversation at a time
                return None
        return wrap(self.target, drafter=drafter, keep_cache=True, **self.options)

    @staticmethod
    def pages(model) -> int:
        pool = model.engine.pool
        return pool.num_used if pool is not None else 0

    def checkout(self, prompt: list[int]):
        """The slot for this prompt, moved to most recently used (its kept KV beyond the shared prefix is
        the engine's to drop)."""
        shared = [common_prefix(m.engine.cached_tokens, prompt) for m in self.slots]
        best = max(range(len(self.slots)), key=lambda i: shared[i])
        if shared[best] == 0 and len(self.slots) < self.max_conversations:
            model = self._new_slot()
            if model is not None:
                self.slots.append(model)
                return model
        if shared[best] == 0:
            best = 0  # the least recently used
            self.slots[best].engine.release_cache()
        model = self.slots.pop(best)
        self.slots.append(model)
        return model

    def trim(self) -> None:
        """Drop least recently used conversations' KV until the slots hold at most max_kv_pages (the one just
        used stays)."""
        if self.max_kv_pages is None:
            return
        for model in self.slots[:-1]:
            if self.total_pages() <= self.max_kv_pages:
                break
            model.engine.release_cache()

    def total_pages(self) -> int:
        return sum(self.pages(m) for m in self.slots)


class GenerationWorker:
    def __init__(self, target, tokenizer, drafter=None, max_queue: int = 8, max_conversations: int = 4,
                 max_kv_pages: int | None = None, max_batch: int = 1, **options):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.conversations = ConversationCache(target, drafter, options, max_conversations, max_kv_pages)
        self.tok = tokenizer
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.batches_run = 0  # generations that ran two or more requests together
        self._pending: list[_Pending] = []
        self._batch_model = None
        if max_batch > 1:  # refused at start, not at the first batch: the engine must batch these options
            self._batch_model = wrap(target, drafter=drafter, **options)
            why = batchable(self._batch_model.engine)
            if why is not None:
                raise ValueError(f"max_batch {max_batch}: this target and drafter cannot run as one batch ({why})")
        self._lock = threading.Lock()  # one generation at a time
        self._waiting = 0
        self._count = threading.Lock()
        self.context_length = getattr(target.config.get_text_config(), "max_position_embeddings", None)

    @property
    def model(self):
        """The most recently used conversation's SpecModel."""
        return self.conversations.slots[-1]

    def warm_up(self, background_compile: bool = True) -> None:
        """The first generation's one-off costs paid now; the compiled step's buckets compile in a thread
        (requests run the lean loop until each is ready), so the server answers from the start."""
        self.model.warm_up(background_compile=background_compile)

    @property
    def compiling(self) -> bool:
        """The compiled step still compiling in the background (requests run the lean loop meanwhile)."""
        return compiling(self.conversations.target)

    @property
    def pages_in_use(self) -> int:
        """KV pages held now: the kept conversations' and any running generation's (a batch's too)."""
        batch = self.conversations.pages(self._batch_model) if self._batch_model is not None else 0
        return self.conversations.total_pages() + batch

    @property
    def queued(self) -> int:
        return self._waiting

    def _admit(self) -> None:
        with self._count:
            if self._waiting >= self.max_queue + 1:  # the one running counts as admitted too
                raise QueueFull(f"{self._waiting} requests are running or waiting (max_queue {self.max_queue})")
            self._waiting += 1

    def _leave(self) -> None:
        with self._count:
            self._waiting -= 1

    async def generate(self, prompt: list[int], cancelled: threading.Event, **kwargs):
        """An async iterator of Events for one generation of `prompt` (token ids). Raises QueueFull at once
        when the queue is full. Set `cancelled` (the client left) to stop it at its next accepted tokens;
        its pages go back to the pool (only the kept prefix stays)."""
        self._admit()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        worker = threading.Thread(target=self._run, args=(prompt, kwargs, cancelled, loop, events), daemon=True)
        worker.start()
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.done:
                    break
        finally:
            cancelled.set()  # a consumer that stopped early (disconnect) stops the worker too

    def _run(self, prompt, kwargs, cancelled, loop, events) -> None:
        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the consumer's loop has closed (it left): nobody to tell
                pass

        me = _Pending(prompt, kwargs, cancelled, put)
        with self._count:
            self._pending.append(me)
        finished = False
        try:
            with self._lock:
                with self._count:
                    if me in self._pending:
                        self._pending.remove(me)
                    if me.taken:  # another request's thread ran this one in its batch
                        return
                    group = [me] + self._take_batch(me)
                if len(group) > 1:
                    self._run_batch(group)
                    return
                if cancelled.is_set():
                    put(Event(done=True))
                    return
                seed = kwargs.pop("seed", None)
                if seed is not None:
                    torch.manual_seed(seed)
                first = True
                model = self.conversations.checkout(prompt)
                stream = model.stream(torch.tensor([prompt]), **kwargs)
                try:
                    for item in stream:
                        if isinstance(item, list):
                            drafted = [False] if first else [True] * (len(item) - 1) + [False]
                            first = False
                            put(Event(tokens=item, drafted=drafted))
                            if cancelled.is_set():
                                break
                        else:  # the generation is over and its KV kept: bound the kept pages before answering
                            self.conversations.trim()
                            put(Event(stats=item, done=True))
                            finished = True
                finally:
                    stream.close()
                    self.conversations.trim()  # also after a stop or an error
                if cancelled.is_set() and not finished:
                    put(Event(done=True))
        except BaseException as e:  # noqa: BLE001 (handed to the route, which answers with it)
            put(e)
        finally:
            self._leave()

    def _take_batch(self, leader: _Pending) -> list[_Pending]:
        """Waiting requests that run with `leader` (under self._count): same settings, no seed, at most
        max_batch - 1 of them, first come first."""
        if self.max_batch == 1 or "seed" in leader.kwargs or leader.cancelled.is_set():
            return []
        taken = [p for p in self._pending if p.kwargs == leader.kwargs and not p.cancelled.is_set()]
        taken = taken[:self.max_batch - 1]
        for p in taken:
            p.taken = True
            self._pending.remove(p)
        return taken

    def _run_batch(self, group: list[_Pending]) -> None:
        """One ragged batch (left-padded, the batch engine), each row's tokens sent to its own request as they
        are committed; a row whose client left ends at its next step."""
        pad = self.tok.pad_token_id
        if pad is None:
            eos = self.conversations.target.generation_config.eos_token_id
            pad = (eos[0] if isinstance(eos, list) else eos) or 0
        ids, mask = left_pad([p.prompt for p in group], pad)

        def stream_to(p: _Pending):
            first = [True]

            def on_tokens(tokens: list[int]) -> bool:
                drafted = [False] if first[0] else [True] * (len(tokens) - 1) + [False]
                first[0] = False
                p.put(Event(tokens=tokens, drafted=drafted))
                return p.cancelled.is_set()
            return on_tokens

        try:
            out = self._batch_model.generate(ids, attention_mask=mask, return_dict_in_generate=True,
                                             on_row_tokens=[stream_to(p) for p in group], **group[0].kwargs)
        except BaseException as e:  # noqa: BLE001 (each route answers with it)
            for p in group:
                p.put(e)
            return
        self.batches_run += 1
        for p, stats in zip(group, out.stats):
            p.put(Event(stats=stats, done=True))
