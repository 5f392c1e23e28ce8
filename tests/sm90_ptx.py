"""Triton kernels compiled ahead of time for Hopper (sm_90) on any machine, no GPU needed,
so that tests can check what the CUDA-only paths compile to."""

from __future__ import annotations


def ptx_for_sm90(kernel, signature: dict[str, str], constants: dict, aligned: list[str],
                 num_warps: int, num_stages: int) -> str:
    """The kernel's PTX for sm_90. Arguments missing from `signature` are i32; those named in
    `aligned` are divisible by 16, as a real launch's pointers and strides are (Triton
    specializes on it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    full = {name: "i32" for name in names} | signature
    full.update({name: "constexpr" for name in constants})
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=full, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"]
