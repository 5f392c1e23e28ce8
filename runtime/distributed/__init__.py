"""torch.distributed for tensor parallelism: process groups (gloo / NCCL) and the collectives
the model layers call. It imports nothing of the runtime but the kernels, so the layers can
use it; the ranks' drivers that sit above execution are in `radixlm.runtime.parallel`.
"""
