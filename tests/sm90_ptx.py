"""Triton kernels compiled ahead of time for a CUDA architecture (Hopper's sm_90 unless
asked) on any machine, no GPU needed, so that tests can check what the CUDA-only paths
compile to."""

from __future__ import annotations


def compile_for_cuda(kernel, signature: dict[str, str], constants: dict, aligned: list[str],
                     num_warps: int, num_stages: int, capability: int = 90):
    """The compiled kernel (its `asm` and `metadata`). Arguments missing from `signature` are
    i32; those named in `aligned` are divisible by 16, as a real launch's pointers and strides
    are (Triton specializes on it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    full = {name: "i32" for name in names} | signature
    full.update({name: "constexpr" for name in constants})
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(
        ASTSource(fn=kernel, signature=full, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": num_warps, "num_stages": num_stages})


def ptx_for_sm90(kernel, signature: dict[str, str], constants: dict, aligned: list[str],
                 num_warps: int, num_stages: int) -> str:
    """The kernel's PTX for sm_90 (see compile_for_cuda)."""
    return compile_for_cuda(kernel, signature, constants, aligned, num_warps,
                            num_stages).asm["ptx"]
