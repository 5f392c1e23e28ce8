"""Tensor parallelism's ranks: rank 0's driver of a sharded model (`sharded`) and the worker
ranks' loop (`worker`). They sit beside the engine, above execution; the process groups and
collectives the layers use are in `radixlm.runtime.distributed`.
"""
