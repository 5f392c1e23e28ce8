"""Scheduling: requests and their token counts, the token-count scheduler, page ownership
(allocator and request-to-token table), the radix prefix cache, KV manager, and leases.

Owns which KV page belongs to whom; never touches the model or the KV tensors' contents.
Imports config and kernels.host_copy only.
"""
