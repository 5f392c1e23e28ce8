"""Logits -> tokens, as pure tensor functions: penalties, logit bias and bans
(`logit_processing`), the draw (`sampler`: temperature, top-k/p, min-p, seeded), logprobs
(`logprobs`), and one step's grammar bitmask (`grammar_masks`). The model runner and
speculative decoding both use it.
"""
