"""Grammar-constrained decoding: regex, JSON Schema and Lark/GBNF grammars -> token masks.

- spec.py: the grammar fields of SamplingParams and their cheap checks at submission;
- engine.py: the interface every grammar engine implements, and the factory;
- llguidance_engine.py, schema_check.py: the default engine, and its schema preparation;
- outlines_engine.py: outlines-core, with compiler.py and _worker.py (killable worker
  processes, LRU cache), matcher.py and jump_forward.py (per-state masks and forced tokens),
  json_schema.py, schema_normaliser.py, schema_combinators.py, json_regex.py, regex_check.py
  (schema and pattern -> regex) and vocabulary.py (token ids -> bytes).

A library of its own: it imports nothing else of the runtime. The batch masks that the model
runner applies are built in `radixlm.runtime.execution.grammar_masks`.
"""

from radixlm.runtime.grammar.spec import GrammarSpec, check_grammar_fields, choices_regex

__all__ = ["GrammarSpec", "check_grammar_fields", "choices_regex"]
