"""Tokenization in the HTTP process, off the event loop, in two lanes.

Tokenizer calls run on dedicated threads: a 100k-token prompt (or a slow chat template) then
delays only requests behind it in its lane, while the loop keeps answering /health and
streaming other responses. Texts longer than LONG_TEXT_CHARS go to a lane of their own, so a
megabyte prompt never holds up a two-token one. Each lane has its own copy of the tokenizer:
a Hugging Face fast tokenizer shared between threads can fail with "Already borrowed".

A text is refused before tokenization when it is longer than the context could hold even if
every token were the vocabulary's longest (max_model_len x that many characters).

Prompt text is encoded with `radixlm.runtime.engine.tokenization.encode_prompt`, the same rule
the offline Engine uses, so the server and `Engine.generate` see the same ids for the same text.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from radixlm.runtime.engine.tokenization import encode_prompt
from radixlm.runtime.protocol.fields import ApiError, bad

LONG_TEXT_CHARS = 16_384


class TextCodec:
    def __init__(self, tokenizer: Any | None, max_model_len: int | None = None) -> None:
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._long = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-long")
        self._token_text: dict[int, str] = {}
        self.configure(tokenizer, max_model_len)

    def configure(self, tokenizer: Any | None, max_model_len: int | None) -> None:
        """Use this tokenizer for a model of this context length."""
        self.tokenizer = tokenizer
        self._long_tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.max_text_chars: int | None = None
        if tokenizer is not None and max_model_len:
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            longest = max((len(p) for p in pieces if isinstance(p, str)), default=1)
            self.max_text_chars = max_model_len * max(longest, 1)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def chat_template(self) -> Any:
        return getattr(self.tokenizer, "chat_template", None)

    def close(self) -> None:
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
                          template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation rendered by the model's chat template (with `tools` in OpenAI's
        shape, for templates that take them, and extra template variables)."""
        self._need_tokenizer("messages")
        if not self.has_chat_template:
            raise bad("messages: this model has no chat template; use /v1/completions",
                      "messages", "no_chat_template")
        chars = sum(len(m.get("content") or "") for m in messages) + len(str(tools or ""))
        self.check_length(chars, "messages")

        def render(tokenizer: Any) -> str:
            return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **(template_kwargs or {}))
        try:
            return await self._run(render, chars)
        except Exception as exc:  # templates raise on e.g. roles that do not alternate
            raise bad(f"messages could not be rendered by the chat template: {exc}",
                      "messages") from None

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
