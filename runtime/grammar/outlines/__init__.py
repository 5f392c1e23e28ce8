"""outlines-core, the alternative grammar engine (`grammar_backend="outlines"`): regex and
JSON Schema compiled up front into a token automaton.

- outlines_engine.py: the engine; compiler.py and compile_worker.py: killable worker
  processes and an LRU cache of compiled grammars;
- json_schema.py, schema_normaliser.py, schema_combinators.py, json_regex.py: schema -> regex;
- matcher.py and jump_forward.py: per-state masks and forced tokens; vocabulary.py: token ids
  -> bytes.
"""
