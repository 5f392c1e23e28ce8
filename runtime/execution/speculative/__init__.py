"""Speculative decoding: drafts (a draft model or n-gram lookup) verified losslessly by one
target forward over all draft positions.

- `verify`: the acceptance rules as pure tensor functions (greedy and rejection sampling).
- `ngram`: prompt-lookup drafting and an adaptive draft length.
- `draft_model`: a small model that shares the target's tokenizer and KV page layout.
- `speculator`: the engine side: who speculates this step, with how many drafts.
"""

from radixlm.runtime.execution.speculative.ngram import (
    AdaptiveK,
    NgramIndex,
    propose_ngram,
)
from radixlm.runtime.execution.speculative.verify import (
    PAD_TOKEN,
    Verified,
    sampling_probs,
    verify_greedy,
    verify_sampling,
    verify_tokens,
)

__all__ = [
    "PAD_TOKEN",
    "AdaptiveK",
    "NgramIndex",
    "Verified",
    "propose_ngram",
    "sampling_probs",
    "verify_greedy",
    "verify_sampling",
    "verify_tokens",
]
