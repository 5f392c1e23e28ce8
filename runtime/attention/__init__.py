"""Attention: the KV tensors (`kv_cache`) and the paged attention backends (torch, Triton,
FlashInfer) behind one interface, with the per-step batch description they consume.

The model layers call it; it imports only kernels.
"""
