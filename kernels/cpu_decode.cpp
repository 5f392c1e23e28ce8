// A decode step of a Llama-style decoder on the CPU in one call: every layer's norm, qkv,
// rotary, KV store, attention, o, norm, gate_up, SiLU-and-mul and down, then the final norm.
//
// Why: at batch 1 on a small model each layer is ~40 tensor ops of a few microseconds of work,
// and from Python each costs several microseconds of dispatch; the matmuls are only a third of
// the step. Here the matmuls and the attention products are ATen calls (torch's own kernels
// and threads), and the small per-row work (norms, rotary, residual adds, SiLU) is plain loops.
//
// Rounding follows the eager bfloat16 path: the residual stream, the norm's output, q/k/v and
// the MLP activations are bfloat16; each norm, rotary and SiLU computes in float32 and rounds
// once. Attention is the same three float32 products as radixlm.runtime.attention.torch_native.
// A row's result can differ in the last bits with the batch around it: the attention's float32
// sums run over the batch's padded context width.
//
// Inputs (B decode tokens; d hidden; H / Hkv heads of D):
//   hidden [B, d] bf16: the token embeddings; cos/sin [B, D/2] float32 at their positions;
//   layers[i]: {input norm [d], post-attention norm [d], qkv bias ([0] when none), then the
//     tensors of qkv, o, gate_up and down}; specs[8 i + 2 j] and [8 i + 2 j + 1] say how
//     linear j is stored: (0, 0): one dense [N, K] bf16 weight; (p, g): p int4 planes of
//     groups of g inputs, (packed, scales_zeros) each;
//   k_cache / v_cache [layers, slots, Hkv, D] bf16, out_slots [B], pages [B, P] (page ids of
//     each sequence's context), valid [B, 1, 1, P * page] (its real key positions).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;

inline float to_f(BFloat16 x) { return static_cast<float>(x); }

// y = x @ W.T for one stored linear starting at tensors[first].
Tensor linear(const Tensor& x, const std::vector<Tensor>& tensors, size_t first,
              const int64_t* spec) {
  const int64_t planes = spec[0], group = spec[1];
  if (planes == 0) return at::linear(x, tensors[first]);
  Tensor out = at::_weight_int4pack_mm_for_cpu(x, tensors[first], group, tensors[first + 1]);
  for (int64_t p = 1; p < planes; ++p) {
    out.add_(at::_weight_int4pack_mm_for_cpu(x, tensors[first + 2 * p], group,
                                             tensors[first + 2 * p + 1]));
  }
  return out;
}

size_t stored_tensors(int64_t planes) { return planes == 0 ? 1 : 2 * planes; }

// out[b] = weight * rms_norm(x[b]) (with x[b] += add[b] first when add is given: the
// residual stream then keeps the sum).
void add_rms_norm(Tensor& x, const Tensor* add, const Tensor& weight, Tensor& out, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  auto* xs = x.data_ptr<BFloat16>();
  auto* ys = out.data_ptr<BFloat16>();
  const auto* w = weight.data_ptr<BFloat16>();
  const BFloat16* as = add ? add->data_ptr<BFloat16>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    BFloat16* xr = xs + r * d;
    float sum = 0.f;
    for (int64_t i = 0; i < d; ++i) {
      if (as) xr[i] = BFloat16(to_f(xr[i]) + to_f(as[r * d + i]));
      const float v = to_f(xr[i]);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t i = 0; i < d; ++i) {
      ys[r * d + i] = BFloat16(to_f(w[i]) * to_f(BFloat16(to_f(xr[i]) * inv)));
    }
  }
}

// Rotate the q and k heads of qkv [B, (H + 2 Hkv) * D] in place (half-split layout), then
// write k and v to their cache slots.
void rotary_and_store(Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, Tensor& k_layer, Tensor& v_layer,
                      const Tensor& out_slots) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  auto* q = qkv.data_ptr<BFloat16>();
  const auto* c = cos.data_ptr<float>();
  const auto* s = sin.data_ptr<float>();
  const auto* slots = out_slots.data_ptr<int64_t>();
  auto* kc = k_layer.data_ptr<BFloat16>();
  auto* vc = v_layer.data_ptr<BFloat16>();
  const int64_t kv_width = kv_heads * head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    BFloat16* row = q + r * width;
    const float* cr = c + r * half;
    const float* sr = s + r * half;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      BFloat16* x = row + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
        x[i] = BFloat16(x1 * cr[i] - x2 * sr[i]);
        x[i + half] = BFloat16(x2 * cr[i] + x1 * sr[i]);
      }
    }
    const int64_t slot = slots[r];
    std::copy(row + heads * head_dim, row + heads * head_dim + kv_width, kc + slot * kv_width);
    std::copy(row + heads * head_dim + kv_width, row + width, vc + slot * kv_width);
  }
}

// out [B, H * D] = attention of each row's q over its context (radixlm's decode attention).
Tensor attention(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages,
                 const Tensor& flat_pages, const Tensor& valid, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, double scale) {
  const int64_t b = q.size(0);
  // [B * P, page, Hkv, D] -> [B, L, Hkv, D]
  Tensor k = k_pages.index_select(0, flat_pages).view({b, -1, kv_heads, head_dim});
  Tensor v = v_pages.index_select(0, flat_pages).view({b, -1, kv_heads, head_dim});
  Tensor q4 = q.view({b, heads, head_dim}).to(at::kFloat).view(
      {b, kv_heads, heads / kv_heads, head_dim});
  // [B, Hkv, L, D] float32: one copy each, read by the products as they lie.
  Tensor keys = k.transpose(1, 2).to(at::kFloat, false, false, at::MemoryFormat::Contiguous);
  Tensor values = v.transpose(1, 2).to(at::kFloat, false, false, at::MemoryFormat::Contiguous);
  Tensor scores = at::matmul(q4, keys.transpose(2, 3)).mul_(scale);
  scores.masked_fill_(valid.logical_not(), -INFINITY);
  Tensor probs = at::softmax(scores, -1);
  return at::matmul(probs, values)
      .view({b, heads * head_dim})
      .to(at::kBFloat16);
}

// act [B, I] = silu(gate) * up from gate_up [B, 2 I].
Tensor silu_and_mul(const Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  Tensor out = at::empty({rows, inter}, gate_up.options());
  const auto* g = gate_up.data_ptr<BFloat16>();
  auto* o = out.data_ptr<BFloat16>();
  for (int64_t r = 0; r < rows; ++r) {
    const BFloat16* gr = g + r * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float x = to_f(gr[i]);
      const BFloat16 act(x / (1.f + std::exp(-x)));
      o[r * inter + i] = BFloat16(to_f(act) * to_f(gr[inter + i]));
    }
  }
  return out;
}

Tensor decode(Tensor hidden, const Tensor& cos, const Tensor& sin,
              const std::vector<std::vector<Tensor>>& layers,
              const std::vector<int64_t>& specs, Tensor k_cache, Tensor v_cache,
              const Tensor& out_slots, const Tensor& pages, const Tensor& valid,
              const Tensor& final_norm, int64_t page_size, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double scale) {
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.is_contiguous(),
              "hidden must be contiguous bfloat16");
  TORCH_CHECK(static_cast<int64_t>(specs.size()) == 8 * static_cast<int64_t>(layers.size()),
              "specs: eight entries per layer");
  const Tensor flat_pages = pages.flatten();
  Tensor h = hidden.clone();
  Tensor x = at::empty_like(h);
  Tensor residual_in;  // the previous layer's MLP output, added to h by the next norm
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i];
    const int64_t* p = specs.data() + 8 * i;  // (planes, group) of qkv, o, gate_up, down
    add_rms_norm(h, residual_in.defined() ? &residual_in : nullptr, t[0], x, eps);
    size_t at_ = 3;
    Tensor qkv = linear(x, t, at_, p);
    at_ += stored_tensors(p[0]);
    if (t[2].numel() > 0) qkv.add_(t[2]);
    qkv = qkv.contiguous();
    Tensor k_layer = k_cache[i], v_layer = v_cache[i];
    rotary_and_store(qkv, cos, sin, heads, kv_heads, head_dim, k_layer, v_layer, out_slots);
    const std::vector<int64_t> page_shape = {-1, page_size, kv_heads, head_dim};
    Tensor attn = attention(qkv.narrow(1, 0, heads * head_dim), k_layer.view(page_shape),
                            v_layer.view(page_shape), flat_pages, valid, heads, kv_heads,
                            head_dim, scale);
    Tensor o = linear(attn, t, at_, p + 2);
    at_ += stored_tensors(p[2]);
    add_rms_norm(h, &o, t[1], x, eps);
    Tensor gate_up = linear(x, t, at_, p + 4).contiguous();
    at_ += stored_tensors(p[4]);
    residual_in = linear(silu_and_mul(gate_up), t, at_, p + 6).contiguous();
  }
  Tensor out = at::empty_like(h);
  add_rms_norm(h, residual_in.defined() ? &residual_in : nullptr, final_norm, out, eps);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "One decode step of a Llama-style decoder (see the file's header)");
}
