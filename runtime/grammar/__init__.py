"""Grammar-constrained decoding: regex, JSON Schema and Lark/GBNF grammars -> token masks.

- spec.py: the grammar fields of SamplingParams and their cheap checks at submission
  (regex_check.py, schema_check.py, stop_regex.py for `stop_regex`);
- interface.py: what every grammar engine implements, and its errors;
- llguidance_engine.py: the default engine;
- outlines/: outlines-core, the alternative (killable compile workers, schema -> regex,
  per-state masks and jump-forward);
- this file: the registry, `create_grammar_engine(name, ...)`.

A library of its own: it imports nothing else of the runtime. The batch masks that the model
runner applies are built in `radixlm.runtime.execution.sampling.grammar_masks`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixlm.runtime.grammar.spec import GrammarSpec, check_grammar_fields, choices_regex

if TYPE_CHECKING:  # the interface loads numpy, which the request checks in `spec` do not need
    from radixlm.runtime.grammar.interface import GrammarEngine

# name -> (module, class), imported on first use: llguidance's engine loads torch, which the
# HTTP process and the request checks in `spec` do not need.
ENGINES = {
    "llguidance": ("radixlm.runtime.grammar.llguidance_engine", "LLGuidanceEngine"),
    "outlines": ("radixlm.runtime.grammar.outlines.outlines_engine", "OutlinesEngine"),
}


def create_grammar_engine(name: str, tokenizer: Any, model_vocab_size: int,
                          config: Any) -> GrammarEngine:
    """The engine named by EngineConfig.grammar_backend, for this tokenizer."""
    if name not in ENGINES:
        raise ValueError(f"grammar_backend must be llguidance or outlines, got {name!r}")
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)(tokenizer, model_vocab_size, config)


__all__ = ["ENGINES", "GrammarSpec", "check_grammar_fields", "choices_regex",
           "create_grammar_engine"]
