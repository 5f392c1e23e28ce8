// A decode step of a Llama-style decoder on the CPU in one call: every layer's norm, qkv,
// rotary, KV store, attention, o, norm, gate_up, SiLU-and-mul and down, then the final norm.
//
// Why: at batch 1 on a small model each layer is ~40 tensor ops of a few microseconds of work,
// and from Python each costs several microseconds of dispatch; the matmuls are only a third of
// the step. Here the matmuls, softmax and SiLU are ATen calls (torch's own kernels and
// threads), and attention and the small per-row work (norms, rotary, residual adds) are plain
// loops, spread over torch's threads by at::parallel_for (a batch of one row stays on one).
//
// Rounding follows the eager bfloat16 path: the residual stream, the norm's output, q/k/v and
// the MLP activations are bfloat16; each norm, rotary and SiLU computes in float32 and rounds
// once. Attention is float32 as in radixlm.runtime.attention.torch_native (scores, softmax,
// weighted sum of values), summed in another order. The softmax runs over the step's padded
// context width, so a row's result can differ in the last bits with the batch around it.
//
// Inputs (B decode tokens; d hidden; H / Hkv heads of D):
//   hidden [B, d] bf16: the token embeddings; cos/sin [B, D/2] float32 at their positions;
//   layers[i]: {input norm [d], post-attention norm [d], qkv bias ([0] when none), then the
//     tensors of qkv, o, gate_up and down}; specs[8 i + 2 j] and [8 i + 2 j + 1] say how
//     linear j is stored: (0, 0): one dense [N, K] bf16 weight; (p, g): p int4 planes of
//     groups of g inputs, (packed, scales_zeros) each;
//   k_cache / v_cache [layers, slots, Hkv, D] bf16, out_slots [B], pages [B, P] int64 (page
//     ids of each sequence's context), kv_lens [B] int64 (its length, this token included).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;

inline float to_f(BFloat16 x) { return static_cast<float>(x); }

// Rows of a per-row loop given to one thread at least: a row of a small model is too little
// work to wake a thread for.
constexpr int64_t ROWS_PER_TASK = 8;

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
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
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
  });
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
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
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
  });
}

// Dot product of two float rows; sixteen running sums, so that the compiler vectorizes it.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out [B, H * D] = attention of each row's q (the first H heads of qkv) over its context.
// Each sequence reads its keys and values straight from their cache slots, once, a whole slot
// (every KV head) at a time, in float32: no gathered or converted copy of the context. The
// scores of the whole step go through one softmax over [B, H, P * page] (padding at -inf), as
// in the eager path.
Tensor attention(const Tensor& qkv, const Tensor& k_layer, const Tensor& v_layer,
                 const Tensor& pages, const Tensor& kv_lens, int64_t page_size, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, double scale) {
  const int64_t b = qkv.size(0), width = qkv.size(1), group = heads / kv_heads;
  const int64_t num_pages = pages.size(1), max_len = num_pages * page_size;
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const auto* q_all = qkv.data_ptr<BFloat16>();
  const auto* kc = k_layer.data_ptr<BFloat16>();
  const auto* vc = v_layer.data_ptr<BFloat16>();
  const auto* page_ids = pages.data_ptr<int64_t>();
  const auto* lens = kv_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // The cache row of sequence s's position j, prefetched `ahead` positions early: a row is a
  // few cache lines, and waiting for each in turn would leave the loops bound by latency.
  constexpr int64_t ahead = 4;
  auto row = [&](int64_t s, int64_t j) {
    return (page_ids[s * num_pages + j / page_size] * page_size + j % page_size) * kv_width;
  };
  auto prefetch = [&](const BFloat16* cache, int64_t s, int64_t j, int64_t len) {
    if (j >= len) return;
    const char* at = reinterpret_cast<const char*>(cache + row(s, j));
    for (int64_t off = 0; off < kv_width * 2; off += 64) __builtin_prefetch(at + off);
  };
  Tensor scores = at::empty({b, heads, max_len}, qkv.options().dtype(at::kFloat));
  float* score_all = scores.data_ptr<float>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(q_width), key(kv_width);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      for (int64_t i = 0; i < q_width; ++i) q[i] = to_f(q_all[s * width + i]);
      float* sc = score_all + s * heads * max_len;
      for (int64_t j = 0; j < ahead; ++j) prefetch(kc, s, j, len);
      for (int64_t j = 0; j < len; ++j) {
        prefetch(kc, s, j + ahead, len);
        const BFloat16* k = kc + row(s, j);
        for (int64_t i = 0; i < kv_width; ++i) key[i] = to_f(k[i]);
        for (int64_t h = 0; h < heads; ++h) {
          sc[h * max_len + j] =
              dot(q.data() + h * head_dim, key.data() + h / group * head_dim, head_dim) * fscale;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        std::fill(sc + h * max_len + len, sc + (h + 1) * max_len, -INFINITY);
      }
    }
  });
  const Tensor probs = at::softmax(scores, -1);
  const float* prob_all = probs.data_ptr<float>();
  Tensor out = at::empty({b, q_width}, qkv.options());
  auto* out_all = out.data_ptr<BFloat16>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(q_width), value(kv_width);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      const float* pr = prob_all + s * heads * max_len;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < ahead; ++j) prefetch(vc, s, j, len);
      for (int64_t j = 0; j < len; ++j) {
        prefetch(vc, s, j + ahead, len);
        const BFloat16* v = vc + row(s, j);
        for (int64_t i = 0; i < kv_width; ++i) value[i] = to_f(v[i]);
        for (int64_t h = 0; h < heads; ++h) {
          const float p = pr[h * max_len + j];
          // A weight that underflowed (denormal) adds nothing a float32 sum keeps, and
          // denormal arithmetic costs ~100 cycles an operation on x86.
          if (p < FLT_MIN) continue;
          float* a = acc.data() + h * head_dim;
          const float* val = value.data() + h / group * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * val[d];
        }
      }
      for (int64_t i = 0; i < q_width; ++i) out_all[s * q_width + i] = BFloat16(acc[i]);
    }
  });
  return out;
}

// act [B, I] = silu(gate) * up from gate_up [B, 2 I], as the eager path computes it (ATen's
// vectorized, threaded kernels; each op rounds to bfloat16 once).
Tensor silu_and_mul(const Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
}

Tensor decode(Tensor hidden, const Tensor& cos, const Tensor& sin,
              const std::vector<std::vector<Tensor>>& layers,
              const std::vector<int64_t>& specs, Tensor k_cache, Tensor v_cache,
              const Tensor& out_slots, const Tensor& pages, const Tensor& kv_lens,
              const Tensor& final_norm, int64_t page_size, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double scale) {
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.is_contiguous(),
              "hidden must be contiguous bfloat16");
  TORCH_CHECK(static_cast<int64_t>(specs.size()) == 8 * static_cast<int64_t>(layers.size()),
              "specs: eight entries per layer");
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
    Tensor attn = attention(qkv, k_layer, v_layer, pages, kv_lens, page_size, heads,
                            kv_heads, head_dim, scale);
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
