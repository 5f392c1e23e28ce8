"""Tokenization in the HTTP process, off the event loop.

Every tokenizer call runs on one dedicated thread: a 100k-token prompt (or a slow chat
template) then delays only its own request, while the loop keeps answering /health and
streaming other responses. One thread, not a pool, because a Hugging Face fast tokenizer
shared between threads can fail with "Already borrowed" when one call reconfigures it.

Prompt text is encoded with `radixlm.runtime.engine.tokenization.encode_prompt`, the same rule the
offline Engine uses, so the server and `Engine.generate` see the same ids for the same text.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from radixlm.runtime.engine.tokenization import encode_prompt
from radixlm.runtime.server.protocol import ApiError, bad


class TextCodec:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._token_text: dict[int, str] = {}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def _need_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise bad(f"{param}: this model has no tokenizer; send token ids instead", param)
        return self.tokenizer

    async def encode_prompt(self, text: str, param: str) -> list[int]:
        """Prompt text -> ids, special tokens added as the offline engine adds them."""
        tokenizer = self._need_tokenizer(param)
        ids = await self._encode(lambda: encode_prompt(tokenizer, text), param)
        if not ids:
            raise bad(f"{param} is empty after tokenization", param)
        return ids

    async def encode_plain(self, text: str, param: str) -> list[int]:
        """Text that continues other text (e.g. a scored continuation): no special tokens."""
        tokenizer = self._need_tokenizer(param)
        return await self._encode(lambda: tokenizer.encode(text, add_special_tokens=False),
                                  param)

    async def _encode(self, fn: Callable[[], list[int]], param: str) -> list[int]:
        try:
            return list(await self._run(fn))
        except ApiError:
            raise
        except Exception as exc:  # e.g. lone surrogates the tokenizer cannot encode
            raise bad(f"{param} could not be tokenized: {exc}", param) from None

    async def render_chat(self, messages: list[dict[str, Any]],
                          add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model's chat template."""
        tokenizer = self._need_tokenizer("messages")
        if not self.has_chat_template:
            raise bad("messages: this model has no chat template; use /v1/completions",
                      "messages", "no_chat_template")

        def render() -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        try:
            return await self._run(render)
        except Exception as exc:  # templates raise on e.g. roles that do not alternate
            raise bad(f"messages could not be rendered by the chat template: {exc}",
                      "messages") from None

    async def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs), cached per id."""
        missing = sorted({t for t in ids if t not in self._token_text})
        if missing:
            tokenizer = self.tokenizer
            if tokenizer is None:
                texts = [str(t) for t in missing]
            else:
                texts = await self._run(lambda: [tokenizer.decode([t]) for t in missing])
            self._token_text.update(zip(missing, texts))
        return [self._token_text[t] for t in ids]
