"""Grammar-constrained decoding: regex and JSON schema -> token masks (outlines-core).

- spec.py: the grammar fields of SamplingParams and their checks at submission;
- json_schema.py, json_regex.py, regex_check.py: schema and pattern -> regex;
- vocabulary.py: token ids -> bytes for any HF tokenizer;
- compiler.py, _worker.py: index compilation in killable worker processes, LRU cache;
- matcher.py: per-state masks and per-request positions; jump_forward.py; backend.py.

A library of its own: it imports nothing else of the runtime. The batch masks that the model
runner applies are built in `radixlm.runtime.execution.grammar_masks`.
"""

from radixlm.runtime.grammar.spec import GrammarSpec, check_grammar_fields, choices_regex

__all__ = ["GrammarSpec", "check_grammar_fields", "choices_regex"]
