"""`specdec serve`: an OpenAI-compatible HTTP server over one speculative engine, with a chat page that
shows which tokens the drafter guessed (optional extra `[serve]`: FastAPI, uvicorn, sse-starlette,
prometheus-client; nothing here is imported by `import specdec`).

worker.py runs the generations (one at a time, a bounded queue, the previous conversation's KV reused);
protocol.py checks requests; app.py is the HTTP face; static/ the page.
"""
from __future__ import annotations

import socket


def check_port(host: str, port: int) -> None:
    """OSError naming the address when it cannot be bound (in use, or not this machine's), before any model
    loads: a server that cannot listen should say so at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def build_app(target, tokenizer, drafter=None, model_name: str = "specdec", max_queue: int = 8,
              max_conversations: int = 4, max_kv_pages: int | None = None, warm_up: bool = True,
              max_batch: int = 1, **options):
    """The ASGI app over a GenerationWorker for (target, drafter); options go to specdec.wrap.
    max_conversations / max_kv_pages: the kept conversations whose KV later requests reuse; max_batch:
    how many waiting requests may run as one batch (serve/worker.py)."""
    from .app import create_app
    from .worker import GenerationWorker

    worker = GenerationWorker(target, tokenizer, drafter, max_queue=max_queue, max_conversations=max_conversations,
                              max_kv_pages=max_kv_pages, max_batch=max_batch, **options)
    if warm_up:
        worker.warm_up()
    return create_app(worker, model_name), worker
