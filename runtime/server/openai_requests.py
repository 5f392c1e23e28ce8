"""OpenAI request shapes (`/v1/completions`, `/v1/chat/completions`) mapped onto
`SamplingParams`, with the extras SGLang and vLLM accept (top_k, min_p, ...). A field we do not
know, or one we know but do not implement (suffix), is a 400 naming it:
silently ignoring it would return something the client did not ask for. Tool calling's
fields are in tool_requests.py."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.grammar.schema_check import check_schema_shape
from radixlm.runtime.grammar.spec import choices_regex
from radixlm.runtime.protocol.fields import Fields, bad, is_id_list, token_ids
from radixlm.runtime.protocol.sampling_fields import MAX_TOP_LOGPROBS, sampling_params
from radixlm.runtime.protocol.tool_requests import ToolRequest, assistant_calls, parse_tools

# Request field -> SamplingParams field, for the fields that map one to one.
_DIRECT = {"n": "n", "stop": "stop", "temperature": "temperature", "top_p": "top_p",
           "seed": "seed", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens",
           "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
           "stop_token_ids": "stop_token_ids", "logit_bias": "logit_bias",
           # Grammars OpenAI has no field for, as SGLang names them (the SDK's extra_body).
           "regex": "regex", "ebnf": "ebnf"}
# vLLM's names for structured output (the SDK's extra_body), and SGLang's json_schema.
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema")
# Fields the OpenAI SDK and agent frameworks send routinely that change nothing about the
# output here: checked for their type and otherwise ignored (_sdk_fields).
SDK_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key",
              "safety_identifier")
CHAT_SDK_FIELDS = ("reasoning_effort", "prediction", "modalities")
_COMMON = (*_DIRECT, *GUIDED, *SDK_FIELDS, "model", "stream", "stream_options", "max_tokens",
           "response_format", "cache_salt", "spaces_between_special_tokens", "no_stop_trim",
           "program_id", "priority")
COMPLETION_FIELDS = (*_COMMON, "prompt", "logprobs", "echo", "best_of", "suffix")
CHAT_FIELDS = (*_COMMON, *CHAT_SDK_FIELDS, "messages", "max_completion_tokens", "logprobs",
               "top_logprobs",
               "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
               "separate_reasoning")
# chat_template_kwargs may not replace what the server passes the template itself (the
# variables below), nor set apply_chat_template's own parameters (see _reserved_kwargs).
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize",
                             "conversation", "documents"}
# The client's own Jinja in place of the server's: refused unless the operator trusts clients
# (--trust-request-chat-template); even then it renders in the sandbox (sandbox.py).
TEMPLATE_PARAM = "chat_template_kwargs.chat_template"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
# Message fields besides role and content, per role.
_MESSAGE_FIELDS = {"assistant": ("name", "tool_calls"), "tool": ("name", "tool_call_id")}
MAX_PROMPTS = 1024
UNLIMITED = 2**31 - 1


@dataclass
class OpenAIRequest:
    params: SamplingParams
    explicit_max: bool  # max_tokens was given: exceeding the context is then a 400
    max_param: str  # the field that set it, for error messages
    stream: bool
    include_usage: bool
    cache_salt: str | None
    prompts: list[str] | list[list[int]] | None = None  # completions
    echo: bool = False  # completions: each choice starts with its prompt
    messages: list[dict[str, Any]] | None = None  # chat
    tools: ToolRequest = dataclasses.field(default_factory=ToolRequest)  # chat
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # chat
    chat_template: str | None = None  # chat: the client's template (when trusted)
    separate_reasoning: bool = True  # chat: with a reasoning parser, split the thinking out
    tags: dict[str, Any] = dataclasses.field(default_factory=dict)  # program_id, priority
    lora: list[str] | None = None  # [the LoRA adapter `model` names], or None: the base model
    grammar_from_tools: bool = False  # chat: params.structural_tag holds the tool calls' tag


def parse_completion(body: dict[str, Any], vocab_size: int) -> OpenAIRequest:
    """With `echo`, each choice's text starts with its prompt and, with `logprobs`, so do its
    logprobs (the first prompt token has none); `max_tokens: 0` then scores the prompt alone
    (how evaluation harnesses compute a text's likelihood)."""
    f = Fields(body)
    f.only(COMPLETION_FIELDS)
    _unsupported(f, suffix="")
    echo = f.boolean("echo", False)
    values, names = _common(f, least_max_tokens=0 if echo else 1)
    if f.has("best_of") and f.integer("best_of") != values.get("n", 1):
        raise bad("best_of is not supported (it must equal n)", "best_of", "not_supported")
    k = f.integer("logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if k is not None:
        values.update(logprobs=True, top_logprobs_num=k)
        names["top_logprobs_num"] = "logprobs"
        if echo:
            if f.boolean("stream", False):
                # The prompt's logprobs are known only once its request ends, after the
                # stream has sent the generated text.
                raise bad("echo with logprobs is not supported when streaming", "echo",
                          "not_supported")
            values["logprob_start_len"] = 0
    explicit = "max_new_tokens" in values
    values.setdefault("max_new_tokens", 16)  # OpenAI's default for completions
    req = _request(f, values, names, "max_tokens", explicit)
    req.prompts = _completion_prompts(body.get("prompt"), vocab_size)
    req.echo = echo
    return req


def parse_chat(body: dict[str, Any], trust_template: bool = False) -> OpenAIRequest:
    """`trust_template`: a client may send its own chat template (chat_template_kwargs)."""
    f = Fields(body)
    f.only(CHAT_FIELDS)
    tools = parse_tools(f)
    for where, schema in tools.schemas:  # the same bounds as response_format's schemas
        try:
            check_schema_shape(schema)
        except ValueError as exc:
            raise bad(f"{where}: {exc}".replace(": json_schema ", ": the schema "), where,
                      "invalid_value") from None
    _chat_sdk_fields(f)
    values, names = _common(f)
    max_param = "max_tokens"
    if f.has("max_completion_tokens"):  # the newer name wins when both are given
        values["max_new_tokens"] = f.integer("max_completion_tokens", lo=1)
        max_param = names["max_new_tokens"] = "max_completion_tokens"
    top = f.integer("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if f.boolean("logprobs", False):
        values.update(logprobs=True, top_logprobs_num=top or 0)
        names["top_logprobs_num"] = "top_logprobs"
    elif top is not None:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    explicit = "max_new_tokens" in values
    # No max_tokens in chat means "until the context is full": fit_context clips this.
    values.setdefault("max_new_tokens", UNLIMITED)
    req = _request(f, values, names, max_param, explicit)
    req.messages = parse_messages(body.get("messages"))
    req.tools = tools
    req.template_kwargs = _template_kwargs(f)
    req.chat_template = req.template_kwargs.pop("chat_template", None)
    if req.chat_template is not None and not trust_template:
        raise bad(f"{TEMPLATE_PARAM}: this server renders chats with its own template; a "
                  "client's template is refused unless the server is started with "
                  "--trust-request-chat-template", TEMPLATE_PARAM, "not_supported")
    if req.chat_template is not None and not isinstance(req.chat_template, str):
        raise bad(f"{TEMPLATE_PARAM} must be a string (a Jinja template)", TEMPLATE_PARAM,
                  "invalid_type")
    req.separate_reasoning = f.boolean("separate_reasoning", True)
    return req


def _template_kwargs(f: Fields) -> dict[str, Any]:
    """`chat_template_kwargs` (e.g. {"enable_thinking": false} for Qwen3): extra variables for
    the chat template."""
    kwargs = f.object("chat_template_kwargs") or {}
    reserved = sorted((reserved_template_kwargs() - {"chat_template"}) & set(kwargs))
    if reserved:
        raise bad(f"chat_template_kwargs may not set {', '.join(reserved)}",
                  "chat_template_kwargs")
    return dict(kwargs)


@functools.cache
def reserved_template_kwargs() -> frozenset[str]:
    """Names a client's template variables may not take: what the server passes the template
    itself, and every parameter of transformers' apply_chat_template and of the render it calls
    (tokenize, return_tensors, continue_final_message, ...), read from their signatures so a
    new transformers release's parameters are reserved too. `chat_template` is among them (it
    is refused on its own, with the reason)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    names = set(_RESERVED_TEMPLATE_KWARGS)
    for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
        names.update(p.name for p in inspect.signature(fn).parameters.values()
                     if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    return frozenset(names)


def _sdk_fields(f: Fields) -> None:
    """The SDK fields that do not change the output: right types, else ignored. `store` and
    `metadata` ask OpenAI to keep the completion (nothing is kept here), `service_tier` and
    the cache and safety keys route or bill it there."""
    for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        f.string(name)
    f.boolean("store")
    metadata = f.object("metadata")
    if metadata is not None and (len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items())):
        raise bad("metadata must hold at most 16 string keys (64 characters) and string "
                  "values (512 characters)", "metadata")


def _chat_sdk_fields(f: Fields) -> None:
    """Chat's harmless SDK fields. `reasoning_effort` is a hint to reasoning models (a chat
    template variable such as Qwen3's enable_thinking is the way to steer ours); a `prediction`
    only makes OpenAI's decoding faster; `modalities` other than text would change the output,
    so they are refused."""
    effort = f.string("reasoning_effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high"):
        raise bad(f"reasoning_effort must be none, minimal, low, medium or high, got "
                  f"{effort!r}", "reasoning_effort")
    prediction = f.object("prediction")
    if prediction is not None and (prediction.get("type") != "content"
                                   or not isinstance(prediction.get("content"), (str, list))):
        raise bad("prediction must be {\"type\": \"content\", \"content\": ...}",
                  "prediction")
    modalities = f.get("modalities", (list,), what="an array")
    if modalities is not None and modalities != ["text"]:
        raise bad(f"modalities: only [\"text\"] is supported, got {modalities!r}",
                  "modalities", "not_supported")


def _common(f: Fields, least_max_tokens: int = 1) -> tuple[dict[str, Any], dict[str, str]]:
    f.string("model")
    _sdk_fields(f)
    f.number("temperature", lo=0, hi=2)  # OpenAI's range (SamplingParams allows more)
    values = {engine: f.body[name] for name, engine in _DIRECT.items() if f.has(name)}
    names = {engine: name for name, engine in _DIRECT.items()}
    names.update(json_schema="response_format", json_object="response_format",
                 structural_tag="response_format")
    if f.has("max_tokens"):
        values["max_new_tokens"] = f.integer("max_tokens", lo=least_max_tokens)
    names["max_new_tokens"] = "max_tokens"
    for name in ("spaces_between_special_tokens", "no_stop_trim"):
        if f.has(name):
            values[name] = f.boolean(name)
    given = [n for n in (*GUIDED, "regex", "ebnf") if f.has(n)]
    response_format = _response_format(f)
    if response_format:
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad(f"at most one of response_format, regex, ebnf, json_schema and the guided_* "
                  f"fields, got {', '.join(given)}", given[-1])
    values.update(response_format)
    values.update(_guided(f, names))
    return values, names


def _guided(f: Fields, names: dict[str, str]) -> dict[str, Any]:
    """vLLM's guided_* fields and SGLang's json_schema -> the engine's grammar fields."""
    out: dict[str, Any] = {}
    for name in ("guided_json", "json_schema"):
        if f.has(name):
            schema = f.body[name]
            if not isinstance(schema, (dict, str)):
                raise bad(f"{name} must be a JSON Schema (an object or its JSON text)", name,
                          "invalid_type")
            out["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
            names["json_schema"] = name
    if f.has("guided_regex"):
        out["regex"] = f.string("guided_regex")
        names["regex"] = "guided_regex"
    if f.has("guided_grammar"):
        out["ebnf"] = f.string("guided_grammar")
        names["ebnf"] = "guided_grammar"
    if f.has("guided_choice"):
        try:
            out["regex"] = choices_regex(f.body["guided_choice"])
        except ValueError as exc:
            raise bad(f"guided_choice: {exc}", "guided_choice") from None
        names["regex"] = "guided_choice"
    return out


def _request(f: Fields, values: dict[str, Any], names: dict[str, str], max_param: str,
             explicit: bool) -> OpenAIRequest:
    stream = f.boolean("stream", False)
    options = f.object("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        Fields(options, "stream_options.").only(("include_usage",))
        include_usage = Fields(options, "stream_options.").boolean("include_usage", False)
    return OpenAIRequest(params=sampling_params(values, names), explicit_max=explicit,
                         max_param=max_param, stream=stream, include_usage=include_usage,
                         cache_salt=f.string("cache_salt"))


def _unsupported(f: Fields, **defaults: Any) -> None:
    """Fields we accept only at their do-nothing value."""
    for name, default in defaults.items():
        value = f.body.get(name)
        if value is not None and value != default:
            raise bad(f"{name} is not supported", name, "not_supported")


def _response_format(f: Fields) -> dict[str, Any]:
    """`response_format` -> the engine's structured-generation fields."""
    rf = f.object("response_format")
    if rf is None or rf.get("type") == "text":
        return {}
    kind = rf.get("type")
    if kind == "structural_tag":  # vLLM's shape: the tag's own fields beside the type
        return {"structural_tag": rf}
    Fields(rf, "response_format.").only(("type", "json_schema"))
    if kind not in ("json_object", "json_schema"):
        raise bad(f"response_format.type must be text, json_object, json_schema or "
                  f"structural_tag, got {kind!r}", "response_format.type")
    if kind == "json_object":
        return {"json_object": True}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad("response_format.json_schema.schema must be an object",
                  "response_format.json_schema.schema", "invalid_type")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict must be a boolean",
                  "response_format.json_schema.strict", "invalid_type")
    # Outputs always match what is enforced; only an explicit strict: false lets keywords the
    # engine cannot enforce be left out (reported in the choice's grammar_warnings).
    return {"json_schema": json.dumps(spec["schema"]), "json_schema_strict": strict is not False}


def _completion_prompts(prompt: Any, vocab_size: int) -> list[str] | list[list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if is_id_list(prompt):
        return [token_ids(prompt, "prompt", vocab_size)]
    if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            return [token_ids(p, "prompt", vocab_size) for p in prompt]
    if prompt is None:
        raise bad("prompt is required", "prompt", "missing_field")
    raise bad(f"prompt must be a string, an array of strings, an array of token ids or an "
              f"array of token id arrays (at most {MAX_PROMPTS} prompts)", "prompt",
              "invalid_type")


def parse_messages(value: Any, param: str = "messages") -> list[dict[str, Any]]:
    """Chat messages as the template wants them: role + text content (+ name)."""
    if not isinstance(value, list) or not value:
        raise bad(f"{param} must be a non-empty array of messages", param,
                  "missing_field" if value is None else "invalid_type")
    messages = []
    for i, message in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        f = Fields(message, f"{where}.")
        role = f.string("role", required=True)
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                      f"{where}.role", "not_supported" if role == "function"
                      else "invalid_value")
        role = ROLES[role]
        extra = _MESSAGE_FIELDS.get(role, ("name",))
        for key, item in message.items():  # e.g. a previous reply echoed back: refusal=None
            if key not in ("role", "content", *extra) and item not in (None, [], {}, ""):
                raise bad(f"{where}.{key} is not supported", f"{where}.{key}", "not_supported")
        calls = message.get("tool_calls") if role == "assistant" else None
        if message.get("content") is None and not calls:
            # OpenAI requires it; only an assistant turn that called tools may omit it.
            raise bad(f"{where}.content is required for role {role!r}", f"{where}.content",
                      "missing_field")
        out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), where)}
        for key in extra:
            if key == "tool_calls":
                if calls:
                    out["tool_calls"] = assistant_calls(calls, where)
            elif f.string(key) is not None:
                out[key] = message[key]
        messages.append(out)
    return messages


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of text parts",
                  f"{where}.content", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str):
            raise bad(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", "
                      f"\"text\": ...}}) are supported", f"{where}.content[{j}]",
                      "not_supported")
        texts.append(part["text"])
    return "".join(texts)
