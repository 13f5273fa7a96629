"""The public entry points: generate / wrap / hf_custom_generate. HF keyword semantics; no math here.

Keywords keep their HF `generate()` meaning (resolved through a `GenerationConfig`, with HF's own
defaults: max_length 20, top_k 50 when sampling, ...). A keyword specdec cannot honour raises a
ValueError naming it, never a silent ignore.
"""
from __future__ import annotations

import queue
import threading
import weakref

import torch

from .batch import RowRequest, batchable, generate_batch
from .drafters.resolve import resolve_drafter
from .engine import Engine, Limits
from .generation_config import (check_supported, config_processors, eos_ids, limits_and_sampling,
                                processor_lists, resolve_config, stop_string_criteria)
from .hf.runner import max_positions_of
from .policy import ConstantPolicy, DraftPolicy, make_policy
from .rows import assemble, split_rows
from .verifiers.sampling import SamplingParams

_SPEC_OPTIONS = ("draft_length", "max_draft_length", "tree", "acceptance", "keep_cache", "max_kv_tokens", "tokenizer",
                 "assistant_tokenizer", "cross_tokenizer", "lookup_first", "step")


def _prompt(target, input_ids) -> torch.Tensor:
    """input_ids checked: [B, T] int64 (a [T] prompt becomes [1, T])."""
    if input_ids is None:
        raise ValueError("input_ids is required")
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("empty prompt: input_ids has no tokens (give at least one, e.g. the BOS token)")
    max_pos = max_positions_of(target)
    if max_pos is not None and input_ids.shape[1] >= max_pos:
        raise ValueError(f"prompt of {input_ids.shape[1]} tokens does not fit the model's {max_pos} positions")
    vocab = target.config.get_text_config().vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab})")
    return input_ids.long()


def _generator(device) -> torch.Generator:
    """A generator seeded from torch's global RNG, so torch.manual_seed(s) makes a run reproducible."""
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(0, 2**62, (1,))))
    return g


# target -> {options key: (weak reference to the drafter argument or None, policy)}; see _kept_policy
_kept_policies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


def _kept_policy(target, drafter, draft_length, max_draft_length, tree, acceptance, drafting=()) -> DraftPolicy:
    """The named policy ('adaptive' / 'heuristic') that `generate` keeps for this target, drafter and options.

    Its estimates (acceptance, costs; the heuristic's budget) carry over from call to call, as HF keeps its
    heuristic's num_assistant_tokens on the assistant model and as one `wrap()`ed model keeps its engine: a
    fresh policy per call relearns the costs and the acceptance rates on every call (on the zoo's code
    prompts, two runs: 0.96 and 0.99 of the best fixed k, where the kept policy reached 1.00 in both). A
    new drafter object, tree shape or option gets its own policy (drafting: the options that decide how the
    drafter argument drafts, e.g. cross_tokenizer and lookup_first); nothing here keeps a model alive.
    """
    model_drafter = drafter is not None and not isinstance(drafter, str)
    key = (id(drafter) if model_drafter else drafter, str(draft_length).strip().lower(), max_draft_length,
           repr(tree), acceptance, tuple(drafting))
    with _kept_lock:
        kept = _kept_policies.setdefault(target, {})
        for k in [k for k, (ref, _) in kept.items() if ref is not None and ref() is None]:
            del kept[k]  # its drafter is gone (and its id may be reused)
        entry = kept.get(key)
        if entry is None or (model_drafter and entry[0]() is not drafter):
            try:
                ref = weakref.ref(drafter) if model_drafter else None
            except TypeError:  # a drafter object without weak references: a fresh policy per call
                return make_policy(draft_length, max_draft_length)
            entry = kept[key] = (ref, make_policy(draft_length, max_draft_length))
        return entry[1]


def _make_engine(target, drafter, draft_length="adaptive", max_draft_length=8, tree=None, acceptance="exact",
                 keep_cache=False, keep_policy=False, max_kv_tokens=None, tokenizer=None, assistant_tokenizer=None,
                 cross_tokenizer="auto", lookup_first="auto", step="auto"):
    if acceptance not in ("exact", "typical"):
        raise ValueError(f"acceptance must be 'exact' (lossless) or 'typical' (lossy, opt-in), got {acceptance!r}")
    if isinstance(draft_length, int) and not isinstance(draft_length, bool) and draft_length < 0:
        raise ValueError(f"draft_length must be >= 0, 'adaptive' or 'heuristic', got {draft_length}")
    if tree is not None and isinstance(draft_length, int) and not isinstance(draft_length, bool):
        if getattr(tree, "kind", None) == "static":
            raise ValueError(f"draft_length={draft_length} sets a chain's length or a dynamic tree's node count; "
                             f"tree={tree!r} fixes its own shape: pass one of the two")
        if getattr(tree, "kind", None) == "dynamic" and not 1 <= draft_length <= tree.nodes:
            raise ValueError(f"draft_length={draft_length} is a node count for tree={tree!r}: it must be in "
                             f"[1, {tree.nodes}]")
    target.eval()
    resolved = resolve_drafter(target, drafter, tokenizer, assistant_tokenizer, cross_tokenizer, lookup_first)
    if keep_policy and isinstance(draft_length, str) and drafter is not None:
        policy = _kept_policy(target, drafter, draft_length, max_draft_length, tree, acceptance,
                              (cross_tokenizer, lookup_first, assistant_tokenizer is not None))
    else:
        policy = make_policy(draft_length, max_draft_length)
    return Engine(target, resolved, policy, acceptance=acceptance, tree=tree, keep_cache=keep_cache,
                  max_kv_tokens=max_kv_tokens, step=step)


def _run(engine: Engine, input_ids, generation_config=None, logits_processor=None, stopping_criteria=None,
         streamer=None, attention_mask=None, inputs=None, tokenizer=None, on_row_tokens=None, **kwargs):
    """on_row_tokens (specdec's own): one callable per output row, each given that row's new tokens as they
    are committed (a streamer per row, for batches); returning True ends the row. Runs the batch engine."""
    target = engine.target
    if inputs is not None:  # HF's first parameter is called `inputs`
        if input_ids is not None:
            raise ValueError("pass the prompt once: as inputs= or as input_ids, not both")
        input_ids = inputs
    padded = _prompt(target, input_ids)  # [B, T]
    rows = split_rows(padded, attention_mask)  # each row's own tokens: left padding dropped
    logits_processor, stopping_criteria = processor_lists(logits_processor, stopping_criteria)
    kwargs.pop("use_cache", None)
    cfg, leftover, default_max_length = resolve_config(target, generation_config, kwargs)
    if leftover:
        raise ValueError(f"unknown keyword argument(s) for generate: {', '.join(sorted(leftover))}")
    stopping_criteria = stop_string_criteria(cfg, stopping_criteria, tokenizer)
    record = _record_for(cfg)
    n = cfg.num_return_sequences or 1
    if n > 1 and not bool(cfg.do_sample):
        raise ValueError(f"num_return_sequences={n} needs do_sample=True: greedy decoding returns one sequence "
                         "(as in HF without beam search)")
    if len(rows) * n > 1 and (streamer is not None or record is not None):
        raise ValueError(f"{len(rows) * n} sequences (batch {len(rows)} x num_return_sequences {n}) cannot be combined "
                         "with a streamer (HF streams one sequence too) or output_scores / output_logits yet")
    if on_row_tokens is not None:
        why = batchable(engine) or (f"on_row_tokens has {len(on_row_tokens)} callables for {len(rows) * n} rows"
                                    if len(on_row_tokens) != len(rows) * n else None)
        if why is not None:
            raise ValueError(f"on_row_tokens needs the batch engine: {why}")
    requests, lengths = [], []
    for prompt in rows:  # [T_i]
        limits, sampling = limits_and_sampling(cfg, prompt.numel(), stopping_criteria, target, default_max_length)
        before, after = config_processors(target, cfg, prompt.numel(), logits_processor, engine.device)
        requests += [RowRequest(prompt, limits, before, after) for _ in range(n)]
        lengths += [prompt.numel()] * n
    for r, callback in zip(requests, on_row_tokens or []):
        r.on_tokens = callback
    if (len(requests) > 1 or on_row_tokens is not None) and batchable(engine) is None:  # one forward per step
        outputs, stats = map(list, zip(*generate_batch(engine, requests, sampling, _generator(engine.device))))
    else:  # one row after another (specdec/rows.py; batch.batchable says when)
        outputs, stats = [], []
        for r in requests:
            seq, st = engine.generate(r.prompt, sampling, r.limits, processors=r.processors, streamer=streamer,
                                      generator=_generator(engine.device), post_processors=r.post_processors,
                                      record=record)
            outputs.append(seq)
            stats.append(st)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (limits.eos_token_ids or [0])[0]
    seq = assemble(padded.repeat_interleave(n, dim=0), lengths, outputs, pad)
    if cfg.return_dict_in_generate:
        return _output(seq, stats[0] if len(stats) == 1 else stats, record)
    return seq


def _record_for(cfg) -> dict | None:
    """What the engine keeps per emitted token for output_scores / output_logits (with return_dict)."""
    if not cfg.return_dict_in_generate or not (cfg.output_scores or cfg.output_logits):
        return None
    return {k: [] for k, on in (("scores", cfg.output_scores), ("logits", cfg.output_logits)) if on}


def __getattr__(name):  # GenerateOutput subclasses HF's output type: imported on first use, not at start-up
    if name == "GenerateOutput":
        from .output import GenerateOutput

        return GenerateOutput
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _output(seq, stats, record):
    from .output import GenerateOutput
    from .stats import SpecStats

    record = record or {}
    tup = {k: tuple(v) for k, v in record.items()}
    batch = SpecStats.combine(stats) if isinstance(stats, list) else None
    return GenerateOutput(sequences=seq, scores=tup.get("scores"), logits=tup.get("logits"), stats=stats,
                          batch_stats=batch)


def generate(model, input_ids=None, drafter=None, *, draft_length="adaptive", max_draft_length: int = 8,
             tree=None, acceptance: str = "exact", max_kv_tokens: int | None = None, assistant_tokenizer=None,
             cross_tokenizer: str = "auto", lookup_first: bool | str = "auto", step: str = "auto", **kwargs):
    """Speculative `model.generate(input_ids, **kwargs)`: same keywords, same output (lossless).

    input_ids: [B, T] int64 (left-padded, with attention_mask, when B > 1: specdec/rows.py). Returns
    [B, T + N] int64, or GenerateOutput(sequences, stats; a list of per-row stats when B > 1) with
    return_dict_in_generate=True. drafter: a PreTrainedModel sharing the vocabulary, a Drafter, 'ngram' or
    None (plain decoding through the same engine); a PreTrainedModel with another vocabulary drafts across
    tokenizers with HF's keywords tokenizer= (the target's) and assistant_tokenizer= (the draft's), in
    cross_tokenizer mode 'auto', 'text' or 'intersection' (drafters/cross_tokenizer.py). lookup_first:
    prompt lookup in front of the drafter (drafters/lookup_first.py); 'auto' (default) for a draft model of
    another vocabulary given with those keywords only, True for any drafter, False never. tree: None (draft a
    chain) or a specdec.TreeSpec (draft a token tree of that shape each step; needs a drafter with
    propose_tree: a draft model, a feature head, 'ngram', a draft of another vocabulary in either mode). With
    a dynamic tree, draft_length='adaptive' sets its node count each step from measured per-rank acceptance
    and costs (0 = a plain step); an int draft_length fixes it (at most the spec's `nodes`). max_kv_tokens:
    the KV budget in token positions (default: what the generation needs; page tensors grow with the
    sequence either way); a generation that needs more raises PoolExhausted naming it. step: what runs the
    target's forwards: 'auto' (default: the compiled step, hf/compiled.py, for a target of 50 M parameters
    or more on a CPU whose lean loop has no packed weights, i.e. not an Intel one; else the lean loop), 'compiled' (for any size) or 'bitwise' (logits bit for bit HF's
    eager forward: the lean loop, else HF's modules). Every step gives the target's greedy output and
    samples exactly from the logits it computes; out.stats.step says which ran.

    'adaptive' and 'heuristic' keep their estimates from call to call for the same model, drafter object
    and options (see `_kept_policy`); pass a DraftPolicy instance (specdec.policy.make_policy('adaptive'))
    to hold the state yourself, e.g. a fresh one per call. With do_sample=True a seed reproduces a sample
    only with a fixed int draft_length: the policies pick k from measured time, and k decides how the
    random stream is consumed (every run is still an exact sample of the target's distribution).
    """
    engine = _make_engine(model, drafter, draft_length, max_draft_length, tree, acceptance, keep_policy=True,
                          max_kv_tokens=max_kv_tokens, tokenizer=kwargs.get("tokenizer"),
                          assistant_tokenizer=assistant_tokenizer, cross_tokenizer=cross_tokenizer,
                          lookup_first=lookup_first, step=step)
    return _run(engine, input_ids, **kwargs)


class _StreamClosed(Exception):
    """Raised inside a stream() worker when its consumer has left; ends that generation cleanly."""


class SpecModel:
    """`wrap(target, drafter=...)`: use it like the HF model; generate() speculates, the rest falls through."""

    def __init__(self, target, drafter=None, **options):
        unknown = set(options) - set(_SPEC_OPTIONS)
        if unknown:
            raise ValueError(f"unknown speculation option(s): {', '.join(sorted(unknown))}; known: {_SPEC_OPTIONS}")
        self.__dict__["target"] = target
        self.__dict__["engine"] = _make_engine(target, drafter, **options)

    def generate(self, input_ids=None, **kwargs):
        if "inputs" in kwargs:
            input_ids = kwargs.pop("inputs")
        return _run(self.engine, input_ids, **kwargs)

    def warm_up(self, new_tokens: int = 4, background_compile: bool = False) -> None:
        """Pay a first generation's one-off costs now rather than in the next one's time to first token.

        The first generation with a model probes its lean loop (hf/lean.py: a few forwards through HF's
        modules and the loop) and packs its weights (hf/packed.py), for the target and a model drafter
        alike: on this project's Xeon ~0.6 s for SmolLM2-135M with its head, ~20 s for Qwen2.5-Coder-1.5B
        in float32. This runs one greedy generation of `new_tokens` tokens from a fixed 8-token prompt,
        drafting k = 2 under a policy of its own (the engine's policy, kept across calls or not, learns
        nothing from it), then drops its KV: a cache kept from an earlier generation (keep_cache=True) is
        dropped too, so call it before the first generation (ChatSession does, when it is made).

        background_compile=True: the compiled step (hf/compiled.py) compiles its buckets in a thread of its
        own from here on, and until a bucket is ready its forwards run the lean loop (the same tokens), so the
        model is ready in the time a cached compile would take (chat and serve start this way). Timed runs
        keep the default, which compiles before it returns."""
        engine = self.engine
        engine.background_compile = background_compile
        vocab = engine.vocab_size
        prompt = (torch.arange(8, device=engine.device) * 37 + 11) % vocab  # [1, 8]: any ids will do
        policy, engine.policy = engine.policy, ConstantPolicy(2 if engine.drafter is not None else 0)
        try:
            _run(engine, prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        finally:
            engine.policy = policy
            engine.release_cache()

    def stream(self, input_ids=None, **kwargs):
        """Yield lists of new token ids as the target accepts them; the last item is the SpecStats.

        Breaking out of the loop (or closing the generator) stops the worker at its next accepted tokens
        and waits for it, so its pages are back in the pool when the loop is left."""
        from transformers.generation.streamers import BaseStreamer

        q: queue.Queue = queue.Queue()
        stop = threading.Event()

        class _Q(BaseStreamer):
            first = True

            def put(self, value):
                if stop.is_set():
                    raise _StreamClosed()
                if self.first:  # HF streamers receive the prompt first
                    self.first = False
                    return
                q.put(value.flatten().tolist())

            def end(self):
                pass

        result = {}

        def work():
            try:
                result["out"] = self.generate(input_ids, streamer=_Q(), return_dict_in_generate=True, **kwargs)
            except BaseException as e:  # re-raised in the consumer
                result["err"] = e
            q.put(None)

        t = threading.Thread(target=work, daemon=True)
        t.start()
        try:
            while (item := q.get()) is not None:
                yield item
        finally:  # also when the consumer stops early (GeneratorExit)
            stop.set()
            t.join()
        if "err" in result:
            raise result["err"]
        yield result["out"].stats

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["target"], name)


def wrap(model, drafter=None, **options) -> SpecModel:
    """Wrap once, then call .generate(**HF kwargs) / .stream(...); attribute access falls through to the model."""
    return SpecModel(model, drafter, **options)


def hf_custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                       synced_gpus=False, streamer=None, drafter=None, draft_length="adaptive",
                       max_draft_length: int = 8, tree=None, acceptance: str = "exact", specdec_streamer=None,
                       specdec_tokenizer=None, specdec_assistant_tokenizer=None, cross_tokenizer: str = "auto",
                       lookup_first: bool | str = "auto", **model_kwargs):
    """The decoding loop for `model.generate(..., custom_generate=specdec.hf_custom_generate, drafter=d)`.

    HF has already resolved generation_config and built its logits processors (warpers included) and
    stopping criteria; we apply them row by row, identically to target and draft.

    Streaming: transformers (5.x) keeps `streamer=` from a callable custom_generate (it puts the prompt
    into it and never calls it again), so pass the streamer as `specdec_streamer=` on this path (it gets
    the prompt, every token and end(), like HF's own loop); or stream through specdec.wrap(model).
    For the same reason a draft with its own tokenizer takes the tokenizers as specdec_tokenizer= (the
    target's) and specdec_assistant_tokenizer= (the draft's): transformers keeps tokenizer= and
    assistant_tokenizer= from a callable custom_generate.
    """
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise ValueError("attention_mask with padding is not supported by specdec.hf_custom_generate (one sequence, "
                         "no padding): pass the unpadded prompt")
    engine = _make_engine(model, drafter, draft_length, max_draft_length, tree, acceptance, keep_policy=True,
                          tokenizer=specdec_tokenizer, assistant_tokenizer=specdec_assistant_tokenizer,
                          cross_tokenizer=cross_tokenizer, lookup_first=lookup_first)
    batch = _prompt(model, input_ids)
    if batch.shape[0] != 1:
        raise ValueError(f"batch size {batch.shape[0]}: hf_custom_generate runs one sequence; pass the batch to "
                         "specdec.generate (or a wrap()ed model), which takes left-padded batches")
    prompt = batch[0]
    cfg = generation_config
    check_supported(cfg)
    max_new = cfg.max_length - prompt.numel()
    limits = Limits(max_new, 0, eos_ids(cfg.eos_token_id, model), stopping_criteria)
    sampling = SamplingParams(do_sample=bool(cfg.do_sample))  # HF's processors do the warping
    # a streamer HF hands us already has the prompt; specdec_streamer gets everything from us
    record = _record_for(cfg)
    seq, stats = engine.generate(prompt, sampling, limits, processors=logits_processor,
                                 streamer=streamer if streamer is not None else specdec_streamer,
                                 generator=_generator(engine.device), stream_prompt=streamer is None, record=record)
    seq = seq[None].to(input_ids.device)
    if cfg.return_dict_in_generate:
        return _output(seq, stats, record)
    return seq
