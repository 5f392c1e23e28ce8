"""The engine: the public `Engine` (offline API) and the thread that drives its `EngineCore`
(schedule -> run -> postprocess), the overlapped step, structured output, the model's start-up
(loading, runner and speculator), request building, tokenization and detokenization, KV pool
sizing.

Imports the layers below it (parallel, execution, scheduling, models, attention, distributed,
config, grammar, kernels); the engine process, the replicas, the server and the language
import it.
"""
