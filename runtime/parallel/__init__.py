"""Tensor parallelism: process groups and collectives (`groups`, imported by the model layers,
importing nothing of the runtime), the rank-0 driver of a sharded model (`sharded`) and the
worker ranks' loop (`worker`), which sit beside execution.
"""
