"""Tokenization in the HTTP process, off the event loop, in two lanes.

Tokenizer calls run on dedicated threads: a 100k-token prompt (or a slow chat template) then
delays only requests behind it in its lane, while the loop keeps answering /health and
streaming other responses. Texts longer than LONG_TEXT_CHARS go to a lane of their own, so a
megabyte prompt never holds up a two-token one. Each lane has its own copy of the tokenizer:
a Hugging Face fast tokenizer shared between threads can fail with "Already borrowed".

Chat templates are programs: they run in the killable worker processes of sandbox.py, bounded
in time, memory and output (never on these threads, where a Jinja loop could not be stopped).

A text is refused before tokenization when it is longer than the context could hold even if
every token were the vocabulary's longest (max_model_len x that many characters).

Prompt text is encoded with `radixlm.runtime.engine.tokenization.encode_prompt`, the same rule
the offline Engine uses, so the server and `Engine.generate` see the same ids for the same text.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from radixlm.runtime.engine.tokenization import encode_prompt
from radixlm.runtime.grammar.structural_tag import special_tokens
from radixlm.runtime.protocol.fields import ApiError, bad
from radixlm.runtime.server.sandbox import RENDER_TIMEOUT, Sandbox, SandboxError, check_template

log = logging.getLogger("radixlm.server")

LONG_TEXT_CHARS = 16_384


class TextCodec:
    def __init__(self, tokenizer: Any | None, max_model_len: int | None = None,
                 render_timeout: float = RENDER_TIMEOUT) -> None:
        self.render_timeout = render_timeout
        self.sandbox: Sandbox | None = None
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._long = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-long")
        self._token_text: dict[int, str] = {}
        self.configure(tokenizer, max_model_len)

    def configure(self, tokenizer: Any | None, max_model_len: int | None) -> None:
        """Use this tokenizer for a model of this context length."""
        self.tokenizer = tokenizer
        self._specials: set[str] | None = None  # is_special's, read once
        self._long_tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.max_text_chars: int | None = None
        if tokenizer is not None and max_model_len:
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            longest = max((len(p) for p in pieces if isinstance(p, str)), default=1)
            self.max_text_chars = max_model_len * max(longest, 1)
        if self.sandbox is not None:
            self.sandbox.close()
        self.sandbox = None
        self.template_error: str | None = None
        if tokenizer is not None:
            special = {k: str(v) if not isinstance(v, (str, list)) else v
                       for k, v in getattr(tokenizer, "special_tokens_map", {}).items()}
            self.sandbox = Sandbox(self.chat_template, special, self.max_text_chars,
                                   self.render_timeout)
        if self.has_chat_template:
            try:
                check_template(self.chat_template, "the model's chat template")
            except ValueError as exc:  # the operator's own was checked before start-up
                self.template_error = str(exc)
                log.warning("%s; chat requests will fail (replace it with --chat-template)",
                            exc)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def is_special(self, text: str) -> bool:
        """Is `text` one of the tokenizer's special tokens (which detokenizing skips unless
        asked not to)?"""
        if self._specials is None:
            self._specials = set(special_tokens(self.tokenizer)) if self.tokenizer else set()
        return text in self._specials

    @property
    def chat_template(self) -> Any:
        return getattr(self.tokenizer, "chat_template", None)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        for lane in (self._short, self._long):
            lane.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[Any], Any], chars: int = 0) -> Any:
        """fn(tokenizer) on the lane for a text of `chars` characters."""
        long = chars > LONG_TEXT_CHARS
        tokenizer = self._long_tokenizer if long else self.tokenizer
        lane = self._long if long else self._short
        return await asyncio.get_running_loop().run_in_executor(lane, fn, tokenizer)

    def _need_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise bad(f"{param}: this model has no tokenizer; send token ids instead", param)
        return self.tokenizer

    async def encode_prompt(self, text: str, param: str) -> list[int]:
        """Prompt text -> ids, special tokens added as the offline engine adds them."""
        ids = await self._encode(text, lambda tok: encode_prompt(tok, text), param)
        if not ids:
            raise bad(f"{param} is empty after tokenization", param)
        return ids

    async def tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Text -> ids as /tokenize reports them: with special tokens as a prompt gets them, or
        none; an empty result is allowed."""
        if add_special_tokens:
            return await self._encode(text, lambda tok: encode_prompt(tok, text), param)
        return await self.encode_plain(text, param)

    async def encode_plain(self, text: str, param: str) -> list[int]:
        """Text that continues other text (e.g. a scored continuation): no special tokens."""
        return await self._encode(text, lambda tok: tok.encode(text, add_special_tokens=False),
                                  param)

    def check_length(self, chars: int, param: str) -> None:
        """400 for text the context could never hold, before spending time tokenizing it."""
        if self.max_text_chars is not None and chars > self.max_text_chars:
            raise bad(f"{param} is {chars} characters: more than this model's context could "
                      f"hold, even as the vocabulary's longest tokens ({self.max_text_chars} "
                      f"characters)", param, "context_length_exceeded")

    async def _encode(self, text: str, fn: Callable[[Any], list[int]], param: str) -> list[int]:
        self._need_tokenizer(param)
        self.check_length(len(text), param)
        try:
            return list(await self._run(fn, len(text)))
        except ApiError:
            raise
        except Exception as exc:  # e.g. lone surrogates the tokenizer cannot encode
            raise bad(f"{param} could not be tokenized: {exc}", param) from None

    async def render_chat(self, messages: list[dict[str, Any]],
                          add_generation_prompt: bool = True,
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None,
                          template: str | None = None) -> str:
        """The conversation rendered by the model's chat template (with `tools` in OpenAI's
        shape, for templates that take them, and extra template variables), or by `template`:
        a client's (chat_template_kwargs.chat_template), where the operator trusts them."""
        self._need_tokenizer("messages")
        if template is None and not self.has_chat_template:
            raise bad("messages: this model has no chat template; use /v1/completions",
                      "messages", "no_chat_template")
        chars = sum(len(m.get("content") or "") for m in messages) + len(str(tools or ""))
        self.check_length(chars, "messages")
        param = "messages" if template is None else "chat_template_kwargs.chat_template"
        if template is None and self.template_error is not None:
            raise bad(f"messages cannot be rendered: {self.template_error}", "messages",
                      "invalid_chat_template")
        assert self.sandbox is not None
        try:
            return await self.sandbox.render(messages, add_generation_prompt, tools or None,
                                             template_kwargs or {}, template)
        except SandboxError as exc:
            raise _render_error(exc, param, self.sandbox.timeout) from None

    async def check_tool_schemas(self, schemas: list[tuple[str, Any]]) -> None:
        """400 naming the field of the first tool `parameters` that is not a valid JSON
        Schema; checked in the sandbox (a large `enum` makes `uniqueItems` quadratic)."""
        if not schemas:
            return
        if self.sandbox is None:  # no tokenizer, so no chat: nothing will use the tools
            self.sandbox = Sandbox(None, {}, timeout=self.render_timeout)
        try:
            await self.sandbox.check_schemas(schemas)
        except SandboxError as exc:
            if exc.kind == "schema":
                raise bad(exc.message, exc.where, "invalid_value") from None
            raise bad(f"tools: checking the parameter schemas took too long or too much "
                      f"memory ({exc.message}); simplify them", "tools") from None

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text ("" without a tokenizer: ids are then all there is)."""
        if self.tokenizer is None:
            return ""
        return await self._run(lambda tok: tok.decode(ids,
                                                      skip_special_tokens=skip_special_tokens))

    async def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs), cached per id."""
        missing = sorted({t for t in ids if t not in self._token_text})
        if missing:
            if self.tokenizer is None:
                texts = [str(t) for t in missing]
            else:
                texts = await self._run(lambda tok: [tok.decode([t]) for t in missing])
            self._token_text.update(zip(missing, texts))
        return [self._token_text[t] for t in ids]


def _render_error(exc: SandboxError, param: str, timeout: float) -> ApiError:
    if exc.kind in ("start", "closed"):  # the server's state, not the request's fault
        why = "it did not start in time" if exc.kind == "start" else "it is shut down"
        return ApiError(503, f"the chat template renderer is not available ({why}); try again",
                        code="unavailable")
    if exc.kind == "syntax":
        return bad(f"{param} is not a valid Jinja template: {exc.message}", param,
                   "invalid_chat_template")
    if exc.kind == "timeout":
        return bad(f"{param}: the chat template took more than {timeout:g} s to render", param,
                   "chat_template_timeout")
    if exc.kind == "too_large":
        return bad(f"{param}: {exc.message}", param, "context_length_exceeded")
    if exc.kind in ("memory", "crashed"):
        return bad(f"{param}: the chat template's worker {exc.message}", param,
                   "chat_template_limit")
    # templates raise on e.g. roles that do not alternate
    return bad(f"{param} could not be rendered by the chat template: {exc.message}", param)
