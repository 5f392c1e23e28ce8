"""Kernels: Triton attention (triton_attention: K/V store, split-KV paged decode, paged extend),
fused elementwise Triton kernels (fused), and the plain-torch references they are tested
against (reference), and host-to-device copies that never make the host wait (host_copy).
Importing the Triton modules needs the triton package; reference and host_copy do not.
Kernels never import the runtime.
"""
