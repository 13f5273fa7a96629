"""HF `generate()` keyword semantics: a GenerationConfig merged like HF's, then specdec's sampling
parameters, limits and logits processors from it. What cannot be honoured is refused by name.

The engine's own warping (temperature, top-k, top-p) reproduces HF's bit for bit; everything else that
processes logits (sequence-dependent processors, the later warpers) is built by HF's own code here and
applied by the engine row by row with each row's prefix.
"""
from __future__ import annotations

import copy

from .engine import Limits
from .hf.runner import max_positions_of
from .verifiers.sampling import SamplingParams

# generation-config fields that must keep their default (value shown) because specdec does not implement them
# (sequence-dependent processors - repetition_penalty, no_repeat_ngram_size, bad_words_ids, sequence_bias,
# suppress_tokens, begin_suppress_tokens - and the warpers min_p, typical_p, epsilon_cutoff, eta_cutoff, and
# stop_strings are supported: see config_processors)
UNSUPPORTED = {
    "num_beams": 1, "encoder_no_repeat_ngram_size": 0, "top_h": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "guidance_scale": None,
    "output_attentions": False, "output_hidden_states": False,
    "exponential_decay_length_penalty": None, "num_beam_groups": None, "diversity_penalty": None,
    "penalty_alpha": None, "constraints": None, "force_words_ids": None,
    "watermarking_config": None, "renormalize_logits": False, "remove_invalid_values": False, "max_time": None,
    "token_healing": None, "dola_layers": None, "prompt_lookup_num_tokens": None,
}


def resolve_config(target, generation_config, kwargs):
    """Merge like HF's `_prepare_generation_config`: the user's generation_config (or an empty one), its unset
    fields filled from the model's generation config, then HF's global defaults, then the keywords (an
    explicit None in them stays None: top_k=None disables top-k).

    Returns (config, leftover kwargs, whether max_length was left at HF's default)."""
    from transformers import GenerationConfig

    cfg = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    if target.generation_config is not None:
        cfg.update(**target.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    # HF then generates 20 NEW tokens (capped by max positions) when nobody set max_length
    default_max_length = cfg.max_length is None and kwargs.get("max_length") is None
    cfg.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    leftover = cfg.update(**kwargs)
    check_supported(cfg)
    return cfg, leftover, default_max_length


def check_supported(cfg) -> None:
    from transformers import GenerationConfig

    hf_defaults = GenerationConfig._get_default_generation_params()
    for key, default in UNSUPPORTED.items():
        value = getattr(cfg, key, None)
        if value is not None and value != default and value != hf_defaults.get(key, default):
            raise ValueError(f"{key}={value!r} is not supported by specdec (speculative decoding of one sequence); "
                             "remove it or use the model's own generate()")


def limits_and_sampling(cfg, prompt_len: int, stopping_criteria, target, default_max_length: bool):
    if cfg.max_new_tokens is not None:
        max_new = cfg.max_new_tokens
    elif default_max_length:
        max_new = cfg.max_length
        max_pos = max_positions_of(target)
        if max_pos is not None:
            max_new = min(max_new, max_pos - prompt_len)
    else:
        max_new = cfg.max_length - prompt_len
    if max_new <= 0:
        raise ValueError(f"nothing to generate: max_new_tokens={cfg.max_new_tokens}, max_length={cfg.max_length}, "
                         f"prompt has {prompt_len} tokens")
    # as HF: min_new_tokens, when set, takes precedence over min_length
    min_new = cfg.min_new_tokens if cfg.min_new_tokens is not None else max(0, (cfg.min_length or 0) - prompt_len)
    eos = eos_ids(cfg.eos_token_id, target)
    sampling = SamplingParams(do_sample=bool(cfg.do_sample), temperature=float(cfg.temperature),
                              top_k=int(cfg.top_k or 0), top_p=float(cfg.top_p))
    return Limits(max_new, min_new, eos, stopping_criteria), sampling


def eos_ids(eos, target) -> list[int]:
    """The config's EOS ids as a list (None: no EOS); ids outside the vocabulary are dropped with a warning,
    as HF ignores them (a misconfigured config)."""
    import warnings

    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    vocab = target.config.get_text_config().vocab_size
    bad = [e for e in eos if not 0 <= int(e) < vocab]
    if bad:
        warnings.warn(f"eos_token_id {bad} outside the vocabulary [0, {vocab}) ignored")
    return [int(e) for e in eos if 0 <= int(e) < vocab]


def config_processors(target, cfg, prompt_len: int, user_processors, device):
    """The processors HF's generate() would build from `cfg`, split around specdec's own warping.

    Returns (before, after): `before` = HF's processor list for cfg with sampling off and min lengths
    cleared (specdec applies those itself) merged with the user's processors, in HF's order; it sees
    each row's own prefix, so sequence-dependent processors (repetition_penalty, no_repeat_ngram_size,
    bad_words_ids, sequence_bias, suppress_tokens, begin_suppress_tokens) act on every verification and
    draft row exactly as on a plain decode of that position. `after` = the warpers HF applies after
    top-p when sampling (min_p, typical_p, epsilon_cutoff, eta_cutoff)."""
    from transformers import (EpsilonLogitsWarper, EtaLogitsWarper, LogitsProcessorList, MinPLogitsWarper,
                              TypicalLogitsWarper)

    pre_cfg = copy.deepcopy(cfg)
    pre_cfg.do_sample, pre_cfg.min_length, pre_cfg.min_new_tokens = False, 0, None
    target._prepare_special_tokens(pre_cfg, True, device=device)  # HF's processors read its EOS tensor
    before = target._get_logits_processor(pre_cfg, prompt_len, logits_processor=user_processors, device=device)
    after = LogitsProcessorList()
    if cfg.do_sample:
        if cfg.min_p is not None:
            after.append(MinPLogitsWarper(min_p=cfg.min_p))
        if cfg.typical_p is not None and cfg.typical_p < 1.0:
            after.append(TypicalLogitsWarper(mass=cfg.typical_p))
        if cfg.epsilon_cutoff is not None and 0.0 < cfg.epsilon_cutoff < 1.0:
            after.append(EpsilonLogitsWarper(epsilon=cfg.epsilon_cutoff))
        if cfg.eta_cutoff is not None and 0.0 < cfg.eta_cutoff < 1.0:
            after.append(EtaLogitsWarper(epsilon=cfg.eta_cutoff, device=device))
    return (before or None), (after or None)


def stop_string_criteria(cfg, stopping_criteria, tokenizer):
    """HF's StopStringCriteria for cfg.stop_strings (needs the tokenizer, as in HF), added to the user's."""
    if not cfg.stop_strings:
        return stopping_criteria
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate (as with HF)")
    from transformers import StoppingCriteriaList, StopStringCriteria

    out = StoppingCriteriaList(list(stopping_criteria or []))
    out.append(StopStringCriteria(stop_strings=cfg.stop_strings, tokenizer=tokenizer))
    return out


def processor_lists(logits_processor, stopping_criteria):
    """Plain lists are accepted like HF's LogitsProcessorList / StoppingCriteriaList."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    if isinstance(logits_processor, list) and not isinstance(logits_processor, LogitsProcessorList):
        logits_processor = LogitsProcessorList(logits_processor)
    if isinstance(stopping_criteria, list) and not isinstance(stopping_criteria, StoppingCriteriaList):
        stopping_criteria = StoppingCriteriaList(stopping_criteria)
    return logits_processor, stopping_criteria
