"""`specdec serve`: the model and drafter options of `specdec chat`, served over OpenAI's HTTP API
(specdec/serve/)."""
from __future__ import annotations

import sys

from .models import _drafter_arg, _load, _tree_spec

INSTALL = 'pip install -e ".[serve]"'


def add_serve_parser(sub, add_model_args) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible chat server with a live view of the speculation")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queue", type=int, default=8, help="requests that may wait while one runs (429 beyond)")
    s.add_argument("--max-conversations", type=int, default=4,
                   help="conversations whose KV is kept for their next turn (least recently used dropped first)")
    s.add_argument("--max-kv-pages", type=int, default=None,
                   help="KV pages the kept conversations may hold together (default: no bound but --max-conversations)")
    s.add_argument("--batch", type=int, default=1, help="requests waiting together (same settings, no seed) run as "
                   "one batch of up to this many rows, skipping prefix reuse (default 1: one at a time)")
    s.add_argument("--model-name", default=None, help="the id clients send as `model` (default: --target)")


def cmd_serve(a) -> None:
    import torch

    try:
        import uvicorn

        from ..serve import build_app, check_port
    except ImportError as e:
        raise SystemExit(f"specdec serve needs its extra ({e.name} is missing): {INSTALL}") from None
    check_port(a.host, a.port)
    torch.set_num_threads(a.threads)
    target, tok = _load(a.target, "target", a.dtype)
    print("(loading and warming up)", file=sys.stderr, flush=True)
    app, _ = build_app(target, tok, _drafter_arg(a.drafter, tok, a.draft_dtype, target),
                       model_name=a.model_name or a.target, max_queue=a.max_queue, tree=_tree_spec(a),
                       max_conversations=a.max_conversations, max_kv_pages=a.max_kv_pages, max_batch=a.batch)
    print(f"specdec serve: http://{a.host}:{a.port}/ (chat page), OpenAI API at http://{a.host}:{a.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
