"""The OpenAI request fields the server honours, checked by hand into generate() keywords, and the error
shape OpenAI clients parse: {"error": {"message", "type", "param", "code"}} with a 4xx status.

Fields: model, messages (chat: roles system / user / assistant, string content or a list of text parts)
or prompt (completions: a string), temperature, top_p, max_tokens / max_completion_tokens, stop (a
string or up to 4), seed, n (1 only), stream, stream_options.include_usage. Anything else is ignored,
as OpenAI's own server ignores fields it does not know.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "developer")
MAX_TOKENS_CAP = 16384


class RequestError(Exception):
    """A request the server refuses: status, OpenAI error type, the offending parameter."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    kind: str  # 'chat' | 'completion'
    model: str
    messages: list | None
    prompt: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number in [{lo}, {hi}], got {value!r}", status=422, param=name)
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be a number in [{lo}, {hi}], got {value!r}", param=name)
    return float(value)


def parse(body, kind: str, served: str) -> Request:
    """body: the decoded JSON. Raises RequestError: 422 for a field of the wrong JSON type, 400 for a value
    out of its range or a request that cannot be served, 404 for an unknown model."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required (a string; GET /v1/models lists it)", param="model")
    if model != served:
        raise RequestError(f"the model {model!r} does not exist here; this server serves {served!r}", status=404,
                           param="model", code="model_not_found")
    messages = prompt = None
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestError("messages must be a non-empty list", status=422, param="messages")
        if not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        messages = [_message(m, i) for i, m in enumerate(messages)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string", param="prompt")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or not 1 <= max_tokens <= MAX_TOKENS_CAP):
        wrong_type = isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
        raise RequestError(f"max_tokens must be an integer in [1, {MAX_TOKENS_CAP}], got {max_tokens!r}",
                           status=422 if wrong_type else 400, param="max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of at most 4 non-empty strings", param="stop",
                           status=422 if not isinstance(stop, list) else 400)
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError("n must be 1: this server generates one choice per request", param="n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}", status=422, param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", status=422, param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", status=422, param="stream_options")
    return Request(kind, model, messages, prompt, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                   _number(body, "top_p", 1.0, 0.0, 1.0), stop, seed, stream, bool(options.get("include_usage")))


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise RequestError(f"messages[{i}] must be an object with role and content", status=422,
                           param=f"messages[{i}]")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"messages[{i}].role")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{i}].content parts must be text parts", param=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string, got {type(content).__name__}", status=422,
                           param=f"messages[{i}].content")
    return {"role": "system" if role == "developer" else role, "content": content}


def generate_kwargs(req: Request) -> dict:
    """The request's sampling as generate() keywords (temperature 0: greedy, as OpenAI's servers do)."""
    kw = {"do_sample": req.temperature > 0}
    if kw["do_sample"]:
        kw.update(temperature=req.temperature, top_p=req.top_p)
    if req.seed is not None:
        kw["seed"] = req.seed
    return kw


def render(tok, req: Request) -> list[int]:
    """The request's prompt as token ids: the messages in the tokenizer's chat template (a tokenizer without
    one: the contents, one per line, continued as text), or the completion prompt."""
    if req.kind != "chat":
        return list(tok(req.prompt).input_ids)
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
    return list(tok("".join(m["content"] + "\n" for m in req.messages)).input_ids)
