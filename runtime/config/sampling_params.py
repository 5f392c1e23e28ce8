"""The single definition of sampling fields. The DSL and the server reuse it.

Field names follow SGLang's native API (`max_new_tokens`, `stop_token_ids`, `top_logprobs_num`);
the server maps OpenAI names (`max_tokens`, `logprobs`, `top_logprobs`) onto these.
Every field is checked once, at construction (and a changed field again by `replace`), so bad
input fails at the boundary with a `ValueError` naming the field, before anything is queued;
later layers (the engine's RequestFactory) trust an instance as is.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    # 0 means greedy. Defaults match the OpenAI API (temperature 1, no truncation).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    # HF-style multiplicative penalty over prompt + output tokens; 1.0 disables it.
    repetition_penalty: float = 1.0
    # OpenAI-style additive penalties over output tokens; 0.0 disables them.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # A per-request seed makes sampling reproducible whatever else is in the batch.
    seed: int | None = None
    # Added to the logits before sampling, as OpenAI's `logit_bias`: token id -> a bias in
    # [-100, 100] (a mapping, or (id, bias) pairs; kept as sorted pairs). Logprobs stay those
    # of the raw distribution.
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    # Stop where the output first contains a match of one of these regexes (SGLang's
    # `stop_regex`); the matched text stays in the output.
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Kept special tokens are joined with spaces (SGLang's and transformers' default; only
    # tokenizers that insert them, the slow ones, see a difference).
    spaces_between_special_tokens: bool = True
    # Keep the stop string, or the stop token's text, at the end of the output.
    no_stop_trim: bool = False
    n: int = 1
    # Logprobs are of the model's raw distribution (log-softmax of the logits, before
    # temperature, penalties and truncation), as select() needs for scoring.
    logprobs: bool = False
    top_logprobs_num: int = 0
    # Prompt-token logprobs from this prompt position on; None returns none.
    logprob_start_len: int | None = None
    # Structured output, at most one of: a regex the whole output must match, a JSON Schema
    # (a dict or JSON text; kept as compact JSON text), a context-free grammar in Lark or
    # GBNF syntax (SGLang's `ebnf`), any JSON object, or a structural tag (free text with
    # constrained tags, as JSON: grammar/structural_tag.py; kept as compact JSON text).
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    # False: schema keywords the grammar engine cannot enforce are left out instead of refused,
    # and Output.grammar_warnings says which (the output may then not validate).
    json_schema_strict: bool = True

    def __post_init__(self) -> None:
        self._check(FIELD_NAMES)

    def _check(self, names: frozenset[str]) -> None:
        """Normalise and check the fields in `names`, then the rules between fields.
        Construction checks every field; `replace` only those it changes, so a request's
        parameters are validated once however often they are adjusted (the JSON schema parse
        and the stop-regex compile are not free)."""
        set_ = object.__setattr__  # frozen: normalise through object.__setattr__
        if "stop" in names:
            if isinstance(self.stop, str):
                set_(self, "stop", (self.stop,))
            elif self.stop is None:
                set_(self, "stop", ())
        if "stop_regex" in names and isinstance(self.stop_regex, str):
            set_(self, "stop_regex", (self.stop_regex,))
        for name in _among(names, ("stop_token_ids", "stop_regex")):
            if getattr(self, name) is None:
                set_(self, name, ())
        for name, kind in (("stop", str), ("stop_regex", str)):
            if name in names:
                set_(self, name, _tuple_of(getattr(self, name), kind, name))
        if "logit_bias" in names:
            set_(self, "logit_bias", _bias_pairs(self.logit_bias))
        if "stop_token_ids" in names:
            set_(self, "stop_token_ids", _tuple_of(self.stop_token_ids, int, "stop_token_ids"))
        for name in _among(names, ("temperature", "top_p", "min_p", "repetition_penalty",
                                   "frequency_penalty", "presence_penalty")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):  # a NaN would poison the whole batch's sampling
                raise ValueError(f"{name} must be a finite number, got {value}")
            set_(self, name, float(value))
        for name in _among(names, ("max_new_tokens", "min_new_tokens", "top_k", "n",
                                   "top_logprobs_num")):
            _check_int(getattr(self, name), name)
        for name in _among(names, ("seed", "logprob_start_len")):
            if getattr(self, name) is not None:
                _check_int(getattr(self, name), name)
        for name in _among(names, ("ignore_eos", "skip_special_tokens",
                                   "spaces_between_special_tokens", "no_stop_trim", "logprobs",
                                   "json_object", "json_schema_strict")):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        self._check_ranges()
        if self.constrained and not names.isdisjoint(_GRAMMAR_FIELDS):
            # Imported here: plain sampling never loads the grammar machinery.
            from radixlm.runtime.grammar.spec import check_grammar_fields

            checked = check_grammar_fields(self.regex, self.json_schema, self.ebnf,
                                           self.json_object, self.structural_tag)
            set_(self, "json_schema", checked["json_schema"])
            set_(self, "structural_tag", checked["structural_tag"])
        if self.stop_regex and "stop_regex" in names:
            from radixlm.runtime.grammar.stop_regex import check_stop_regexes

            check_stop_regexes(self.stop_regex)

    def _check_ranges(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")
        if self.logprob_start_len is not None and self.logprob_start_len < 0:
            raise ValueError(f"logprob_start_len must be >= 0, got {self.logprob_start_len}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constrained(self) -> bool:
        """Does the output have to match a regex, a JSON schema or a grammar?"""
        return (self.regex is not None or self.json_schema is not None
                or self.ebnf is not None or self.json_object is not False
                or self.structural_tag is not None)

    @property
    def has_penalties(self) -> bool:
        """Do the logits depend on the tokens so far (repetition/frequency/presence)?"""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs_num > 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SamplingParams":
        known = FIELD_NAMES
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling field(s): {', '.join(unknown)}; "
                f"known fields are {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def coerce(cls, value: "SamplingParams | Mapping[str, Any] | None") -> "SamplingParams":
        """Params from what a caller passed: an instance as is (it was checked when built),
        a mapping through from_dict, None as the defaults."""
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ValueError(
            f"sampling_params must be a SamplingParams or a dict, got {type(value).__name__}")

    def remaining_new_tokens(self, num_output_tokens: int, num_tokens: int,
                             context_len: int) -> int:
        """The length rule: how many more tokens a sequence of `num_tokens` tokens, the last
        `num_output_tokens` of them generated, may still get. What max_new_tokens leaves,
        within a context of `context_len` tokens (prompt and output together); 0 means the
        sequence is done by length. `Request.remaining_new_tokens` is a request's view of it."""
        return max(0, min(self.max_new_tokens - num_output_tokens, context_len - num_tokens))

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes`, of which only the changed fields (and the rules between
        fields) are checked: the others were checked when this instance was built."""
        if not changes.keys() <= FIELD_NAMES:
            return dataclasses.replace(self, **changes)  # its TypeError names the bad field
        fresh = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(fresh, name, value)
        fresh._check(frozenset(changes))
        return fresh


FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_GRAMMAR_FIELDS = frozenset(("regex", "json_schema", "ebnf", "json_object", "structural_tag"))


MAX_LOGIT_BIAS_TOKENS = 1024


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """{id: bias} (ids may be strings of digits, as JSON object keys are) or (id, bias)
    pairs -> sorted (int, float) pairs, each checked."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise ValueError("logit_bias must map token ids to biases")
    if len(items) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                         f"{len(items)}")
    pairs: dict[int, float] = {}
    for token, bias in items:
        # ASCII digits only: str.isdigit() and int() also take other scripts' digits ("١٢").
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias: keys must be token ids, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                math.isfinite(bias) and -100 <= bias <= 100):
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in "
                             f"[-100, 100], got {bias!r}")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _among(names: frozenset[str], fields: tuple[str, ...]) -> list[str]:
    """`fields` that are in `names`, in `fields`' order (the order errors are raised in)."""
    return [name for name in fields if name in names]


def _check_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")


def _tuple_of(values: Any, kind: type, name: str) -> tuple:
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of {kind.__name__}")
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, kind):
            raise ValueError(f"{name} must be a list of {kind.__name__}, got {v!r}")
    return out
