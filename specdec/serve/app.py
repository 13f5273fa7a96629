"""The HTTP face of `specdec serve`: OpenAI's chat and completion routes (SSE streaming), models, health,
Prometheus metrics and the chat page, over one GenerationWorker (serve/worker.py). No generation logic
lives here: requests are checked (serve/protocol.py), rendered to token ids, handed to the worker, and
its events turned into OpenAI's response shapes plus a `specdec` extension: per-token provenance
(drafted and accepted, or the target's own), tau, acceptance, TTFT, TPOT, tokens/s.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sse_starlette.sse import EventSourceResponse

from .protocol import Request, RequestError, generate_kwargs, parse, render
from .worker import GenerationWorker, QueueFull

STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 1 << 20


class Metrics:
    def __init__(self, worker: GenerationWorker):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.tokens = Counter("specdec_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("specdec_ttft_seconds", "Time to first token", registry=r,
                              buckets=(.05, .1, .2, .5, 1, 2, 5, 10, 30))
        self.tpot = Histogram("specdec_tpot_seconds", "Time per output token after the first", registry=r,
                              buckets=(.005, .01, .02, .03, .05, .075, .1, .2, .5))
        self.acceptance = Gauge("specdec_acceptance_rate", "Accepted / drafted tokens, last generation", registry=r)
        self.tau = Gauge("specdec_tau", "Tokens per target forward, last generation", registry=r)
        self.draft_length = Histogram("specdec_draft_length", "Draft length per step", registry=r,
                                      buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16))
        Gauge("specdec_kv_pages_in_use", "KV pages held", registry=r).set_function(lambda: worker.pages_in_use)
        Gauge("specdec_queue_depth", "Requests running or waiting", registry=r).set_function(lambda: worker.queued)
        Gauge("specdec_batches_run", "Generations that ran two or more requests as one batch (--batch)",
              registry=r).set_function(lambda: worker.batches_run)

    def record(self, stats) -> None:
        self.tokens.inc(stats.new_tokens)
        self.ttft.observe(stats.ttft_s)
        if stats.new_tokens > 1:
            self.tpot.observe(stats.tpot_s)
        self.acceptance.set(stats.acceptance_rate)
        self.tau.set(stats.mean_accepted_length)
        for k in stats.draft_lengths:
            self.draft_length.observe(k)


def create_app(worker: GenerationWorker, model_name: str) -> FastAPI:
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    metrics = Metrics(worker)
    tok = worker.tok
    created = int(time.time())

    def error(e: RequestError, route: str) -> JSONResponse:
        metrics.requests.labels(route, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: HTTPRequest):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(f"the request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", status=413)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None

    def prompt_ids(req: Request) -> list[int]:
        ids = render(tok, req)
        limit = worker.context_length
        need = len(ids) + (req.max_tokens or 1)
        if limit and need > limit:
            raise RequestError(f"the prompt ({len(ids)} tokens) plus max_tokens ({req.max_tokens or 1}) exceeds the "
                               f"model's context length of {limit} tokens", param="messages" if req.kind == "chat"
                               else "prompt", code="context_length_exceeded")
        return list(ids)

    def max_new(req: Request, prompt: list[int]) -> int:
        if req.max_tokens is not None:
            return req.max_tokens
        return max(1, (worker.context_length or len(prompt) + 512) - len(prompt))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "compiling": worker.compiling}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specdec"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete(request, "completion")

    async def complete(request: HTTPRequest, kind: str):
        route = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            req = parse(await body_of(request), kind, model_name)
            prompt = prompt_ids(req)
        except RequestError as e:
            return error(e, route)
        kwargs = dict(generate_kwargs(req), max_new_tokens=max_new(req, prompt))
        run = Run(req, prompt, tok, metrics, model_name, kind)
        cancelled = threading.Event()
        events = worker.generate(prompt, cancelled, **kwargs)
        try:
            first = await events.__anext__()
        except QueueFull as e:
            return error(RequestError(str(e), status=429, type_="rate_limit_exceeded"), route)
        except (ValueError, RuntimeError) as e:
            return error(RequestError(str(e)), route)
        metrics.requests.labels(route, "200").inc()
        if req.stream:
            return EventSourceResponse(run.sse(first, events, cancelled, request), ping=15)
        await run.consume(first, events, cancelled)
        return run.response()

    return app


class Run:
    """One request's generation turned into OpenAI's shapes: text with stop strings cut, provenance, usage."""

    def __init__(self, req: Request, prompt: list[int], tok, metrics: Metrics, model_name: str, kind: str):
        self.req, self.prompt, self.tok, self.metrics, self.model, self.kind = req, prompt, tok, metrics, model_name, kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.drafted: list[bool] = []
        self.text = ""  # decoded so far, up to any stop string
        self.sent = 0  # characters of text already streamed
        self.stats = None
        self.finish = None

    def _add(self, event) -> None:
        self.tokens += event.tokens
        self.drafted += event.drafted
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        for s in self.req.stop:
            at = text.find(s)
            if at >= 0:
                text, self.finish = text[:at], "stop"
        self.text = text

    def _finish_reason(self) -> str:
        if self.finish:
            return self.finish
        limit = self.req.max_tokens
        return "length" if limit is not None and len(self.tokens) >= limit else "stop"

    def _extension(self) -> dict:
        pieces = [self.tok.decode([t], skip_special_tokens=True) for t in self.tokens]
        ext = {"tokens": pieces, "drafted": self.drafted}
        s = self.stats
        if s is not None:
            ext.update(tau=s.mean_accepted_length, acceptance_rate=s.acceptance_rate, ttft_s=s.ttft_s,
                       tpot_s=s.tpot_s, tokens_per_s=s.tokens_per_s, step=s.step,
                       per_position_acceptance=s.per_position_acceptance,
                       reused_prompt_tokens=s.reused_prompt_tokens)
        return ext

    def _usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.prompt) + len(self.tokens)}

    async def consume(self, first, events, cancelled) -> None:
        event = first
        while True:
            if event.done:
                self.stats = event.stats
                break
            self._add(event)
            if self.finish:
                cancelled.set()
            event = await events.__anext__()
        if self.stats is not None:
            self.metrics.record(self.stats)

    def response(self) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "finish_reason": self._finish_reason(), "logprobs": None}
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": self._finish_reason(), "logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self._usage(),
                "specdec": self._extension()}

    def _chunk(self, delta: str | None, finish: str | None, ext: dict | None, first: bool = False) -> str:
        if self.kind == "chat":
            d = {"role": "assistant", "content": delta or ""} if first else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if ext is not None:
            body["specdec"] = ext
        return json.dumps(body)

    async def sse(self, first, events, cancelled, request: HTTPRequest):
        event, opened = first, False
        hold = max((len(s) for s in self.req.stop), default=1) - 1  # a stop string may still be forming
        try:
            while not event.done:
                start = len(self.tokens)
                self._add(event)
                safe = len(self.text) if self.finish else max(self.sent, len(self.text) - hold)
                if self.text.endswith("\ufffd") and not self.finish:  # a character still incomplete
                    safe = min(safe, len(self.text) - 1)
                delta = self.text[self.sent:safe]
                self.sent = max(self.sent, safe)
                ext = {"tokens": [self.tok.decode([t], skip_special_tokens=True) for t in self.tokens[start:]],
                       "drafted": self.drafted[start:]}
                yield {"data": self._chunk(delta, None, ext, first=not opened)}
                opened = True
                if self.finish:
                    cancelled.set()
                if await request.is_disconnected():
                    cancelled.set()
                    return
                event = await events.__anext__()
            self.stats = event.stats
            if self.stats is not None:
                self.metrics.record(self.stats)
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            final = {k: v for k, v in self._extension().items() if k not in ("tokens", "drafted")}
            yield {"data": self._chunk(rest or None, self._finish_reason(), final, first=not opened)}
            if self.req.include_usage:
                usage = json.loads(self._chunk(None, None, None))
                usage["choices"], usage["usage"] = [], self._usage()
                yield {"data": json.dumps(usage)}
            yield {"data": "[DONE]"}
        finally:
            cancelled.set()
