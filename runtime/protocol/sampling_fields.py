"""Sampling fields of a request -> a validated `SamplingParams`, plus the bounds a server needs
on top of SamplingParams' own checks and the context-length rule. Everything raises `ApiError`
naming the request field.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from radixlm.runtime.config.sampling_params import FIELD_NAMES, SamplingParams
from radixlm.runtime.protocol.fields import bad

# Server-side bounds on top of SamplingParams' own checks: hostile values that are valid
# Python but would cost the engine (or crash a torch call) are refused at the boundary.
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256  # scanned at every decode step
MAX_SEED = 2**63 - 1 - MAX_N  # the engine seeds sample i with seed + i; torch takes int64


# -- sampling parameters ----------------------------------------------------------------------



def sampling_params(values: Mapping[str, Any], names: Mapping[str, str],
                    prefix: str = "") -> SamplingParams:
    """Build SamplingParams from engine-named `values`; a bad value is a 400 naming the request
    field it came from (`names` maps engine field -> request field; a field not in it is
    named `prefix + field`)."""
    for field in ("stop", "stop_token_ids", "stop_regex"):  # SamplingParams would take keys
        if isinstance(values.get(field), dict):
            param = names.get(field, prefix + field)
            raise bad(f"{param} must be a string or an array, got object", param, "invalid_type")
    try:
        params = SamplingParams.from_dict(values)
    except ValueError as exc:
        raise bad(str(exc), _param_of(str(exc), names, prefix)) from None
    except TypeError as exc:  # e.g. a list where a scalar belongs
        raise bad(str(exc)) from None
    check_limits(params, names, prefix)
    return params


def _param_of(message: str, names: Mapping[str, str], prefix: str) -> str | None:
    """The field a SamplingParams error is about: its messages start with the field name."""
    field = re.match(r"unknown sampling field\(s\): (\w+)", message)
    if field is None:
        field = re.match(r"(\w+)", message)
        if field is None or field.group(1) not in FIELD_NAMES:
            return None
    return names.get(field.group(1), prefix + field.group(1))


def check_limits(p: SamplingParams, names: Mapping[str, str], prefix: str = "") -> None:
    def name(field: str) -> str:
        return names.get(field, prefix + field)

    if p.n > MAX_N:
        raise bad(f"{name('n')} must be <= {MAX_N}, got {p.n}", name("n"))
    if p.top_logprobs_num > MAX_TOP_LOGPROBS:
        raise bad(f"{name('top_logprobs_num')} must be <= {MAX_TOP_LOGPROBS}, "
                  f"got {p.top_logprobs_num}", name("top_logprobs_num"))
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        raise bad(f"{name('seed')} must be in [0, {MAX_SEED}], got {p.seed}", name("seed"))
    if len(p.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise bad(f"{name('stop')}: at most {MAX_STOP_STRINGS} strings of at most "
                  f"{MAX_STOP_CHARS} characters", name("stop"))
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"{name('stop_token_ids')}: at most {MAX_STOP_TOKEN_IDS} token ids, got "
                  f"{len(p.stop_token_ids)}", name("stop_token_ids"))


def fit_context(params: SamplingParams, prompt_len: int, max_model_len: int,
                explicit_max: bool, prompt_param: str, max_param: str,
                min_param: str) -> SamplingParams:
    """Refuse a prompt (or prompt + explicit max tokens, or + min tokens) beyond the context;
    clip a default max_new_tokens to what is left."""
    check_prompt_len(prompt_len, max_model_len, prompt_param)
    allowed = params.remaining_new_tokens(0, prompt_len, max_model_len)
    if allowed == params.max_new_tokens:
        return params
    if explicit_max:
        raise bad(f"the prompt ({prompt_len} tokens) plus {max_param} "
                  f"({params.max_new_tokens}) exceeds this model's context of {max_model_len} "
                  f"tokens", max_param, "context_length_exceeded")
    if params.min_new_tokens > allowed:  # a minimum is asked for explicitly, always
        raise bad(f"the prompt ({prompt_len} tokens) plus {min_param} "
                  f"({params.min_new_tokens}) exceeds this model's context of {max_model_len} "
                  f"tokens", min_param, "context_length_exceeded")
    return params.replace(max_new_tokens=allowed)


def check_prompt_len(prompt_len: int, max_model_len: int, param: str) -> None:
    """The engine needs room for at least one more position after the prompt."""
    if prompt_len >= max_model_len:
        raise bad(f"the prompt is {prompt_len} tokens; this model's context holds "
                  f"{max_model_len} tokens, prompt and completion together", param,
                  "context_length_exceeded")
