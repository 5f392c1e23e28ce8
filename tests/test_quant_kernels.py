"""The W4A16 and FP8 Triton kernels on CPU, under the Triton interpreter, against
kernels/reference.py (or, for the float32 GEMVs, the same function written in torch).

As in test_triton_kernels.py, the cases run in one subprocess with TRITON_INTERPRET=1 (the
variable must be set before the kernels are defined and must not leak into other tests), which
prints each case's outcome as JSON. Shapes are tiny; the GPU tests cover real ones in bf16.
"""

from __future__ import annotations

import pytest
import torch

from interpreter_cases import collect_cases, main, results_under_interpreter


def _case(m: int, n: int, k: int, group: int, bits: int, dtype: torch.dtype,
          config: dict | None = None, seed: int = 0) -> str:
    from radixlm.kernels.reference import w4a16_matmul_reference
    from radixlm.kernels.w4a16 import w4a16_matmul
    from radixlm.runtime.models.quantization.packing import pack_gptq_weight

    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 2 ** bits, (k, n), generator=gen, dtype=torch.int32)
    qweight = pack_gptq_weight(q, bits)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 2 ** bits, (groups, n), generator=gen).to(torch.uint8)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = w4a16_matmul(x, qweight, scales, zeros, group, bits, config=config)
    want = w4a16_matmul_reference(x, qweight, scales, zeros, group, bits)
    assert out.dtype == dtype and out.shape == (m, n)
    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
    limit = 1e-6 if dtype == torch.float32 else 2e-3
    assert err < limit, f"relative error {err:.2e} >= {limit}"
    return f"rel err {err:.1e}"


def case_dot_split_k_fp32():
    """The tensor-core kernel with K split over several programs (a ragged last split)."""
    return _case(3, 96, 224, 32, 4, torch.float32,
                 dict(KERNEL="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, num_warps=4,
                      num_stages=1))


def case_gemv_split_blocks_span_groups_fp32():
    """The two-launch GEMV: K blocks of 64 inputs over groups of 16, K split in 3 (the last
    split ragged), N not a multiple of the tile."""
    return _case(1, 80, 224, 16, 4, torch.float32,
                 dict(KERNEL="gemv_split", BLOCK_N=32, BLOCK_W=8, SPLIT_K=3, num_warps=4,
                      num_stages=1, MODE=1))


def case_gemv_split_two_rows_int8_fp16():
    return _case(2, 64, 96, 96, 8, torch.float16,
                 dict(KERNEL="gemv_split", BLOCK_N=32, BLOCK_W=8, SPLIT_K=2, num_warps=4,
                      num_stages=1, MODE=0))


def case_default_configs_fp16():
    """pick_config's choice at batch 1 and 3 (the GEMV), 5 and 40 (tensor cores)."""
    return "; ".join(_case(m, 64, 256, 128, 4, torch.float16) for m in (1, 3, 5, 40))


def case_ragged_group_and_rows_fp32():
    """K = 80 at group 32 (a last group of 16 inputs), rows that do not fill a tile."""
    return _case(5, 48, 80, 32, 4, torch.float32,
                 dict(KERNEL="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SPLIT_K=1, num_warps=4,
                      num_stages=1))


def case_batch_tiles_fp16():
    return _case(70, 64, 128, 64, 4, torch.float16,
                 dict(KERNEL="dot", BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4,
                      num_stages=1))


def case_int8_per_channel_fp32():
    """8-bit words, one group spanning the whole input (the INT8 weight-only layout)."""
    return _case(3, 32, 96, 96, 8, torch.float32,
                 dict(KERNEL="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4,
                      num_stages=1))


def case_bad_block_k_is_refused():
    try:
        _case(1, 32, 64, 32, 4, torch.float32,
              dict(KERNEL="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4,
                   num_stages=1))
    except ValueError as exc:
        assert "BLOCK_K" in str(exc)
        return "refused"
    raise AssertionError("a K block straddling two groups was accepted")


def _int_weights(n: int, k: int, group: int, bits: int, dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    from radixlm.runtime.models.quantization.packing import pack_gptq_weight

    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 2 ** bits, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 2 ** bits, (groups, n), generator=gen).to(torch.uint8)
    return pack_gptq_weight(q, bits), scales, zeros, gen


def _check_float32(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Against the function computed in float32 (the GEMVs do not round the dequantized weight
    to bf16 as the bf16 reference does). float32: the order of the additions only. bf16: each
    output within one bf16 step (2**-7 relative) of the float32 value, the bound of the
    interpreter's conversion (it truncates; the GPU rounds to nearest)."""
    assert out.dtype == dtype
    err = ((out.float() - want).norm() / want.norm()).item()
    if dtype == torch.float32:
        assert err < 1e-6, f"relative error {err:.2e}"
    else:
        bound = 2 ** -7 * 1.01 * want.abs() + 1e-30
        assert ((out.float() - want).abs() <= bound).all(), f"relative error {err:.2e}"
    return err


def _check_split_state(out: torch.Tensor, again: torch.Tensor) -> None:
    """A second call gives the identical result, and every tile counter is back to 0."""
    from radixlm.kernels import split_k

    assert torch.equal(out, again), "a second call gave a different result"
    for key, buffers in split_k._BUFFERS.items():
        assert not buffers.counters.any(), f"counters left non-zero for {key}"


def _gemv_case(m: int, n: int, k: int, group: int, bits: int, dtype: torch.dtype,
               block_n: int, block_w: int, split: int, seed: int = 0) -> str:
    from radixlm.kernels.reference import w4a16_matmul_reference
    from radixlm.kernels.w4a16 import w4a16_matmul

    qweight, scales, zeros, gen = _int_weights(n, k, group, bits, dtype, seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    cfg = dict(KERNEL="gemv", BLOCK_N=block_n, BLOCK_W=block_w, SPLIT_K=split, num_warps=4)
    out = w4a16_matmul(x, qweight, scales, zeros, group, bits, config=cfg)
    want = w4a16_matmul_reference(x.float(), qweight, scales.float(), zeros, group, bits)
    err = _check_float32(out, want, dtype)
    _check_split_state(out, w4a16_matmul(x, qweight, scales, zeros, group, bits, config=cfg))
    return f"m={m} rel err {err:.1e}"


def case_gemv_4bit_rows_1_to_4_split_fp32():
    """The one-launch GEMV, 1 to 4 rows: N = 80 over tiles of 32 (the last ragged), 7 K
    blocks of 32 inputs split 3, 3, 1 over groups of 32."""
    return "; ".join(_gemv_case(m, 80, 224, 32, 4, torch.float32, 32, 4, 3, seed=m)
                     for m in (1, 2, 3, 4))


def case_gemv_8bit_rows_1_to_4_fp32():
    """8-bit words (4 inputs each), groups of 64 in K blocks of 32, K split 4 ways."""
    return "; ".join(_gemv_case(m, 48, 320, 64, 8, torch.float32, 16, 8, 4, seed=m)
                     for m in (1, 2, 3, 4))


def case_gemv_ragged_k_group_128_bf16():
    """K = 200: the last group (and K block) holds 72 inputs; bf16 activations and scales."""
    return "; ".join(_gemv_case(m, 96, 200, 128, 4, torch.bfloat16, 64, 8, 2, seed=m)
                     for m in (1, 3))


def case_gemv_8bit_per_channel_bf16():
    """The INT8 layout (one group over all of K), K split 5 ways, 2 rows."""
    return _gemv_case(2, 64, 160, 160, 8, torch.bfloat16, 32, 2, 5)


def case_gemv_tiny_and_huge_activations_fp32():
    """x at 1e-20 and at 1e8 (inside the documented range of the scaled-x trick: |x q| >
    2**-73, |x| < 2**32): still float32-exact."""
    from radixlm.kernels.reference import w4a16_matmul_reference
    from radixlm.kernels.w4a16 import w4a16_matmul

    qweight, scales, zeros, gen = _int_weights(32, 128, 64, 4, torch.float32, 3)
    cfg = dict(KERNEL="gemv", BLOCK_N=32, BLOCK_W=8, SPLIT_K=1, num_warps=4)
    errors = []
    for magnitude in (1e-20, 1e8):
        x = torch.randn(2, 128, generator=gen) * magnitude
        out = w4a16_matmul(x, qweight, scales, zeros, 64, 4, config=cfg)
        want = w4a16_matmul_reference(x.double(), qweight, scales.double(), zeros, 64, 4)
        errors.append(((out.double() - want).norm() / want.norm()).item())
        assert errors[-1] < 1e-6, f"x ~ {magnitude}: relative error {errors[-1]:.2e}"
    return "; ".join(f"{e:.1e}" for e in errors)


def case_gemv_block_across_groups_is_refused():
    try:
        _gemv_case(1, 32, 128, 32, 4, torch.float32, 32, 8, 1)
    except ValueError as exc:
        assert "inside one group" in str(exc)
        return "refused"
    raise AssertionError("a K block straddling two groups was accepted")


def _fp8_case(m: int, n: int, k: int, dtype: torch.dtype, config: dict | None,
              seed: int = 0) -> str:
    from radixlm.kernels.fp8 import fp8_gemv
    from radixlm.runtime.models.quantization.fp8 import quantize_fp8_rows

    gen = torch.Generator().manual_seed(seed)
    w8, w_scale = quantize_fp8_rows(torch.randn(n, k, generator=gen))
    x8, x_scale = quantize_fp8_rows(torch.randn(m, k, generator=gen) * 3)
    out = fp8_gemv(x8, x_scale, w8, w_scale.view(-1), dtype, config=config)
    want = (x8.float() * x_scale) @ (w8.float() * w_scale).t()
    err = _check_float32(out, want, dtype)
    _check_split_state(out, fp8_gemv(x8, x_scale, w8, w_scale.view(-1), dtype, config=config))
    return f"m={m} rel err {err:.1e}"


def case_fp8_gemv_rows_1_to_4_split_fp32():
    """N = 40 over tiles of 16 (the last ragged), K = 416: 4 blocks of 128 (the last 32 wide)
    split 3 ways (2 and 2 blocks: one split fewer than asked)."""
    cfg = dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=3, num_warps=4)
    return "; ".join(_fp8_case(m, 40, 416, torch.float32, cfg, seed=m) for m in (1, 2, 3, 4))


def case_fp8_gemv_default_config_bf16():
    return "; ".join(_fp8_case(m, 64, 512, torch.bfloat16, None, seed=m) for m in (1, 4))


CASES = collect_cases(globals())


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", CASES)
def test_w4a16_under_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert result["ok"], result["detail"]


if __name__ == "__main__":
    main(globals())
