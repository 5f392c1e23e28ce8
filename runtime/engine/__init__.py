"""The engine: the public `Engine` (offline API) and the thread that drives its `EngineCore`
(schedule -> run -> postprocess), the overlapped step, structured output, the model's start-up
(loading, runner and speculator), request building, tokenization and detokenization, KV pool
sizing.

Imports every layer below it (scheduling, execution, parallel, models, attention, config,
grammar); only the server and the language import it.
"""
