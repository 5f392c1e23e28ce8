"""The HTTP server: `radixlm serve` (or `python -m radixlm.runtime.server`).

An aiohttp process validates, tokenizes and streams: the app and its middlewares, the native
(SGLang-style) and OpenAI-compatible routes with their request shapes, and one generation in
flight. The engine runs in its own process behind a pipe (`radixlm.runtime.engine_process`), or
in replicas on Ray (`radixlm.runtime.replicas`). See docs/server.md.
"""
