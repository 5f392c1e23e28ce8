"""Per-layer attention (sliding window, soft-capped scores, own scale) on every backend,
against kernels/reference.py.

The torch backend runs here; the Triton backend runs under the Triton interpreter in a
subprocess (`python tests/test_layer_attention.py`, see interpreter_cases.py); the GPU test
checks Triton and FlashInfer against the torch backend on CUDA in bf16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from radixlm.kernels.reference import paged_attention_reference
from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.backend import LayerAttention

from interpreter_cases import collect_cases, main, results_under_interpreter
from test_attention import make_batch

# Decodes whose context is longer and shorter than the window, a fresh prompt longer than
# the window, a chunk after a cached prefix straddling it, and a one-token context.
Q_LENS = [1, 20, 9, 1, 16, 1]
KV_LENS = [37, 20, 50, 1, 64, 5]
LAYERS = {
    "window": LayerAttention(sliding_window=8),
    "window-1": LayerAttention(sliding_window=1),
    "softcap": LayerAttention(logit_softcap=5.0),
    "window+softcap+scale": LayerAttention(scale=0.3, sliding_window=13, logit_softcap=2.0),
}


def _reference(batch, q, layer: LayerAttention, default_scale: float) -> torch.Tensor:
    scale = default_scale if layer.scale is None else layer.scale
    return paged_attention_reference(q, batch.kv_cache.k[0], batch.kv_cache.v[0],
                                     batch.slot_table, batch.q_lens, batch.kv_lens, scale,
                                     sliding_window=layer.sliding_window,
                                     softcap=layer.logit_softcap)


def test_reference_window_hides_old_keys():
    """The reference itself: with a window of w, changing a key older than w changes
    nothing, and changing one inside the window does."""
    batch, q, _, _ = make_batch("cpu", torch.float32, 4, [1], [30])
    layer = LayerAttention(sliding_window=10)
    before = _reference(batch, q, layer, 0.2)
    old_slot, recent_slot = batch.slot_table[0, 19], batch.slot_table[0, 20]
    batch.kv_cache.k[0][old_slot] += 5.0
    assert torch.equal(_reference(batch, q, layer, 0.2), before)
    batch.kv_cache.k[0][recent_slot] += 5.0
    assert not torch.equal(_reference(batch, q, layer, 0.2), before)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_torch_backend_layer_attention(name, page_size):
    layer = LAYERS[name]
    batch, q, k, v = make_batch("cpu", torch.float32, page_size, Q_LENS, KV_LENS)
    backend = create_backend("torch", scale=32 ** -0.5)
    backend.plan(batch)
    full = backend.forward(q, k, v, 0, batch)  # layers of one step may differ
    out = backend.forward(q, k, v, 0, batch, layer)
    assert (out - _reference(batch, q, layer, 32 ** -0.5)).abs().max().item() < 1e-5
    plain = paged_attention_reference(q, batch.kv_cache.k[0], batch.kv_cache.v[0],
                                      batch.slot_table, Q_LENS, KV_LENS, 32 ** -0.5)
    assert (full - plain).abs().max().item() < 1e-5
    assert (out - plain).abs().max().item() > 1e-3  # the layer's options did something


# -- Triton, under the interpreter (this file run as a script) ---------------------------

def _triton_case(layer: LayerAttention, page_size: int, splits: int | None = None) -> str:
    from radixlm.runtime.attention.triton_backend import TritonAttention

    batch, q, k, v = make_batch("cpu", torch.float32, page_size, Q_LENS + [1, 70],
                                KV_LENS + [300, 260])
    backend = TritonAttention(32 ** -0.5, num_splits=splits)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, batch, layer)
    err = (out - _reference(batch, q, layer, 32 ** -0.5)).abs().max().item()
    assert err < 1e-4, f"max error {err:.2e}"
    return f"max err {err:.1e}"


def case_triton_window_page1():
    return _triton_case(LAYERS["window"], 1)


def case_triton_window_page16_splits4():
    return _triton_case(LayerAttention(sliding_window=40), 16, splits=4)


def case_triton_window_1():
    return _triton_case(LAYERS["window-1"], 4)


def case_triton_softcap():
    return _triton_case(LAYERS["softcap"], 4, splits=3)


def case_triton_window_softcap_scale():
    return _triton_case(LAYERS["window+softcap+scale"], 16)


_CASES = collect_cases(globals())


@pytest.fixture(scope="module")
def interpreter_results():
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", _CASES)
def test_triton_under_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert result["ok"], result["detail"]


# -- GPU: Triton and FlashInfer against the torch backend, bf16 ---------------------------

# FlashInfer compiles a kernel per variant on first use (over a minute for prefill): it runs
# the combined kind only, beside plain layers in the same step.
GPU_CASES = [("triton", name) for name in sorted(LAYERS)] + [
    ("flashinfer", "window+softcap+scale")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("backend_name,name", GPU_CASES)
def test_gpu_backends_layer_attention(backend_name, name, decode_only):
    """Triton and FlashInfer in bf16 against the reference: a plain layer and this kind of
    layer in one step, on a mixed step and on a decode-only one."""
    if backend_name == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    layer = LAYERS[name]
    q_lens, kv_lens = Q_LENS + [1, 70], KV_LENS + [300, 260]
    if decode_only:
        q_lens, kv_lens = [1] * 4, [37, 300, 1, 9]
    batch, q, k, v = make_batch("cuda", torch.bfloat16, 16, q_lens, kv_lens, dim=64)
    backend = create_backend(backend_name, scale=64 ** -0.5)
    backend.plan(batch)
    full = backend.forward(q, k, v, 0, batch)
    out = backend.forward(q, k, v, 0, batch, layer)
    ref = _reference(batch, q, layer, 64 ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 3e-2
    plain = paged_attention_reference(q, batch.kv_cache.k[0], batch.kv_cache.v[0],
                                      batch.slot_table, q_lens, kv_lens, 64 ** -0.5)
    assert (full.float() - plain.float()).abs().max().item() < 3e-2


if __name__ == "__main__":
    main(globals())
