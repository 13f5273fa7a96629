"""One model, one generation at a time, for the server: the bounded queue, prefix reuse and per-token
provenance. No HTTP here (serve/app.py is the HTTP face); this is what a route awaits.

Single stream is the point of specdec's serving: requests that arrive while a generation runs wait in a
queue of at most `max_queue` (QueueFull beyond it: the route answers 429). The engine keeps the last
sequence's KV (keep_cache=True), so a request whose prompt extends the previous one (the next turn of a
conversation, sent whole as OpenAI clients do) prefills only the new tokens.

Provenance: the engine's streamer receives each verification step's tokens together: every token but
the last was drafted and accepted, the last is the target's own (a correction or the bonus); the first
token comes from the prefill (the target's). `Event.drafted` holds one flag per token.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import torch

from ..api import wrap


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


class GenerationWorker:
    def __init__(self, target, tokenizer, drafter=None, max_queue: int = 8, **options):
        self.model = wrap(target, drafter=drafter, keep_cache=True, **options)
        self.tok = tokenizer
        self.max_queue = max_queue
        self._lock = threading.Lock()  # one generation at a time
        self._waiting = 0
        self._count = threading.Lock()
        self.context_length = getattr(target.config.get_text_config(), "max_position_embeddings", None)

    def warm_up(self) -> None:
        self.model.warm_up()

    @property
    def pages_in_use(self) -> int:
        """KV pages held now: the kept conversation's and any running generation's."""
        pool = self.model.engine.pool
        return pool.num_used if pool is not None else 0

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
        put = lambda item: loop.call_soon_threadsafe(events.put_nowait, item)  # noqa: E731
        try:
            with self._lock:
                if cancelled.is_set():
                    put(Event(done=True))
                    return
                seed = kwargs.pop("seed", None)
                if seed is not None:
                    torch.manual_seed(seed)
                first = True
                stream = self.model.stream(torch.tensor([prompt]), **kwargs)
                try:
                    for item in stream:
                        if isinstance(item, list):
                            drafted = [False] if first else [True] * (len(item) - 1) + [False]
                            first = False
                            put(Event(tokens=item, drafted=drafted))
                            if cancelled.is_set():
                                break
                        else:
                            put(Event(stats=item, done=True))
                finally:
                    stream.close()
                if cancelled.is_set():
                    put(Event(done=True))
        except BaseException as e:  # noqa: BLE001 (handed to the route, which answers with it)
            put(e)
        finally:
            self._leave()
