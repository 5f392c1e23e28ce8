"""The HTTP server: `radixlm serve` (or `python -m radixlm.runtime.server`).

An aiohttp process validates, tokenizes and streams (native SGLang-style routes and
OpenAI-compatible ones); the engine runs in its own process behind a pipe. See docs/server.md.
"""
