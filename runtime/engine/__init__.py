"""The engine: the public `Engine` (offline API), `EngineCore` (schedule -> run -> postprocess),
the overlapped step loop, request building, tokenization and detokenization, KV pool sizing.

Imports every layer below it (scheduling, execution, parallel, models, attention, config,
grammar); only the server and the language import it.
"""
