"""The W4A16 Triton kernel on CPU, under the Triton interpreter, against kernels/reference.py.

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
    from radixlm.runtime.quantization.packing import pack_gptq_weight

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


def case_gemv_split_k_blocks_span_groups_fp32():
    """Batch 1 on CUDA cores: K blocks of 64 inputs over groups of 16, K split in 3 (the last
    split ragged), N not a multiple of the tile."""
    return _case(1, 80, 224, 16, 4, torch.float32,
                 dict(KERNEL="gemv", BLOCK_N=32, BLOCK_W=8, SPLIT_K=3, num_warps=4,
                      num_stages=1, MODE=1))


def case_gemv_group_factored_fp32():
    """MODE 2: scale and zero applied per group (K blocks of 32 in groups of 64)."""
    return _case(1, 96, 320, 64, 4, torch.float32,
                 dict(KERNEL="gemv", BLOCK_N=32, BLOCK_W=4, SPLIT_K=2, num_warps=4,
                      num_stages=1, MODE=2))


def case_gemv_two_rows_int8_fp16():
    return _case(2, 64, 96, 96, 8, torch.float16,
                 dict(KERNEL="gemv", BLOCK_N=32, BLOCK_W=8, SPLIT_K=2, num_warps=4,
                      num_stages=1, MODE=0))


def case_default_configs_fp16():
    """pick_config's choice at batch 1 (GEMV), 3 and 40 (tensor cores)."""
    return "; ".join(_case(m, 64, 256, 128, 4, torch.float16) for m in (1, 3, 40))


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
