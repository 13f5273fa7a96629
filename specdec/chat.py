"""Multi-turn chat over one kept KV cache: each turn prefills only the new text, never the history.

`ChatSession` uses the tokenizer's chat template when it has one (the rendered conversation grows by
appending, so the previous turns' KV stays valid), and plain continuation when it has not (the user's
line is appended to the running token history and the model continues it). The command `specdec chat`
(cli/chat.py) wraps it: streaming, a status line, /reset, /stats, /quit, Ctrl-C stops an answer and
keeps the session.
"""
from __future__ import annotations

import torch

from .api import wrap


class ChatSession:
    def __init__(self, target, tokenizer, drafter=None, system: str | None = None, warm_up: bool = True,
                 background_compile: bool = True, **options):
        """warm_up: pay the first generation's one-off costs (SpecModel.warm_up) here, so that the first
        answer's time to first token is a steady one; background_compile: the compiled step's buckets
        compile in a thread while the user types (forwards run the lean loop until each is ready)."""
        self.model = wrap(target, drafter=drafter, keep_cache=True, **options)
        if warm_up:
            self.model.warm_up(background_compile=background_compile)
        self.tok = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.system = system
        self.history: list[int] = []  # token ids of the whole conversation so far
        self.messages: list[dict] = []
        self.last_stats = None
        self.reset()

    def reset(self) -> None:
        self.model.engine.release_cache()
        self.messages = [{"role": "system", "content": self.system}] if (self.system and self.templated) else []
        self.history = self.tok(self.system, add_special_tokens=False).input_ids if (
            self.system and not self.templated) else []

    def _prompt_ids(self, text: str) -> list[int]:
        if self.templated:
            msgs = self.messages + [{"role": "user", "content": text}]
            full = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            done = self.tok.decode(self.history)
            if self.history and full.startswith(done):
                # keep the generated tokens as they are (re-tokenising the answer would change them and
                # lose the KV), and tokenise only the template's text for the new turn
                return self.history + self.tok(full[len(done):], add_special_tokens=False).input_ids
            return self.tok(full, add_special_tokens=False).input_ids
        return self.history + self.tok(text, add_special_tokens=False).input_ids

    def send(self, text: str, streamer=None, **generate_kwargs) -> str:
        """One turn: returns the answer text (also streamed to `streamer`); stats in self.last_stats.

        On KeyboardInterrupt the partial answer is kept in the conversation and the interrupt re-raised."""
        ids = self._prompt_ids(text)
        try:
            out = self.model.generate(torch.tensor([ids]), streamer=streamer, return_dict_in_generate=True,
                                      **generate_kwargs)
        except KeyboardInterrupt:
            self._commit(text, ids, self.model.engine.cached_tokens)
            raise
        self.last_stats = out.stats
        return self._commit(text, ids, out.sequences[0].tolist())

    def _commit(self, text: str, ids: list[int], sequence: list[int]) -> str:
        if not sequence:  # interrupted before the first token
            return ""
        answer = self.tok.decode(sequence[len(ids):], skip_special_tokens=True)
        self.history = sequence
        if self.templated:
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        return answer
