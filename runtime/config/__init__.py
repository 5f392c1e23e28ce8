"""Validated, frozen parameters: `EngineConfig` for an engine, `SamplingParams` for a request.
Bad values fail here, naming the field.

Imports only the grammar package (to check a request's grammar fields); every other runtime
layer may import it.
"""
