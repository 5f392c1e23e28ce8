// A forward step of a Llama-style decoder on the CPU in one call: every layer's norm, qkv,
// rotary, KV store, attention, o, norm, gate_up, SiLU-and-mul and down, then the final norm
// (or, for a pipeline stage before the last, the residual stream), for any mix of rows: decode tokens, prefill chunks, speculative drafts being verified.
// Gemma 2 and 3 too: (1 + w) norms, a norm after each sublayer as well as before, GELU (tanh),
// soft-capped attention scores, and their local layers' own rotary tables. Mixtures of
// experts too (Mixtral, Qwen2-MoE, Qwen3-MoE): a sparse layer's MLP is `sparse_mlp`.
//
// Why: at batch 1 on a small model each layer is ~40 tensor ops of a few microseconds of work,
// and from Python each costs several microseconds of dispatch; the matmuls are only a third of
// the step. And why every step comes here, not only decode steps: each token row is computed
// by the same code whatever else is in the step, so a request's tokens and logprobs do not
// depend on its batch, its chunking or what the prefix cache held (docs/deterministic.md).
// That takes three things: the linears of cpu_linear.h (each output one fixed sum), per-row
// loops for everything else (norms, rotary, SiLU, a softmax of the row's own keys), and a
// token's attention computed from its own sequence's keys in cache order, the same in a
// prefill chunk as in a decode step.
//
// Rounding: activations are bfloat16 or float32 (the model's dtype, template A). With
// bfloat16, the residual stream, the norm's output, q/k/v, the attention output and the MLP
// activations are bfloat16; each norm, rotary and activation computes in float32 and rounds
// once. Attention computes in float32. A Llama norm rounds the normalized row before its
// weight multiplies it (as the reference does); Gemma's "offset" norms multiply by (1 + w),
// given as float32, and round once.
//
// Inputs (T token rows of S sequences; d hidden; H / Hkv heads of D):
//   hidden [T, d] (A): the token embeddings; cos/sin [T, D/2] float32 at their positions,
//   local_cos/local_sin the same for the layers with a window (Gemma 3 rotates them with
//   their own theta; the same tensors otherwise);
//   layers[i]: {input norm [d], post-attention norm [d], qkv bias ([0] when none), q and k
//     head norms ([D] each, [0] when none: Qwen3, Gemma 3), Gemma's pre- and post-MLP norms
//     ([d] each, [0] when none), then the tensors of qkv, o, gate_up and down}; with
//     the MLP norms, the post-attention norm applies to the attention's output before the
//     residual add, and the post-MLP norm to the MLP's; a norm is of the activations'
//     dtype, or float32 holding 1 + w (Gemma's offset norms); windows[i]: layer i's sliding
//     window (a row at position p attends to positions p - window + 1 .. p; 0: no window);
//     softcap: scores become softcap * tanh(score / softcap) (0: none); gelu: the MLP's
//     activation is GELU (tanh approximation), else SiLU; specs[4 i + j] says how linear j
//     is stored:
//     0: one dense tile tensor (cpu_linear.h); s > 0: integer planes in s segments of
//     seven tensors each (cpu_linear.h's planes_linear);
//     widths[4 i + j]: its output width;
//   k_cache / v_cache [layers, slots, Hkv, D] (A), out_slots [T], token_seq [T] (the row's
//   sequence), positions [T] (the row attends to its sequence's positions 0..position),
//   pages [S, P] int64 (page ids of each sequence's context);
//   LoRA adapters (none: an empty list): lora[12 i .. 12 i + 12) = A, B and part columns of
//     layer i's qkv, o, gate_up and down: A [slots, P R, in] and B [slots, P R, out] (float32
//     or bfloat16; runtime/models/lora/slots.py), int32 cols [P, 2] (the output columns part
//     p's rows of B may write); then, last, int32 ranks [slots] (each slot's adapter rank);
//     and lora_slots [T] int64: each row's slot, -1 for none;
//   experts[i], expert_specs[i]: a sparse layer's router, experts and shared expert's gate
//     (sparse_mlp), both empty for a dense layer; a sparse layer's gate_up and down specs
//     are its shared expert's, or -1 without one;
//   reduce (None without tensor parallelism): called with the o and down projections' partial
//     sums [T, d] over this rank's heads and MLP columns, returns their sum over the ranks.
//     With H, Hkv and the linears this rank's shares, the step is this rank's part of the
//     model's; a reduce whose order of ranks is fixed keeps every row's result independent
//     of the rest of the step (runtime/execution/cpu_decode.py);
//   stored (None without sequence parallelism): called with the layer's index once this
//     step's rows have written their K and V to the cache, before any row attends; it
//     writes the K and V rows other ranks computed for the same step (their slots), so that
//     each row attends to all of its sequence's keys (runtime/parallel/sequence.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/functional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_linear.h"

namespace {

using at::BFloat16;
using at::Tensor;

inline float to_f(BFloat16 x) { return static_cast<float>(x); }
inline float to_f(float x) { return x; }

// Store v as an activation of type A (bfloat16: rounded to nearest even).
template <typename A>
inline A to_a(float v) { return A(v); }

// c10's rounding to bfloat16 (to nearest even; NaN to the quiet NaN 0x7FC0) written without
// its branch, so that the compiler vectorizes loops of it: the same bits for every input.
template <>
inline BFloat16 to_a<BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), BFloat16::from_bits());
}

// Rows of a per-row loop given to one thread at least: a row of a small model is too little
// work to wake a thread for.
constexpr int64_t ROWS_PER_TASK = 8;

// exp(x) for x <= 88, written as plain arithmetic so that the compiler vectorizes loops of it
// and every lane computes the same thing (a library exp may take another path for a loop's
// tail than for its vectors). exp(x) = 2^n exp(r), |r| <= ln2 / 2, exp(r) by its Taylor
// series to r^7 (relative error < 1e-8 before rounding). Its argument is clamped to
// [range.lo, range.hi] = [-87, 88] (exp_range).
struct ExpRange {
  float lo, hi;
};

// exp_fixed's range, read through volatiles once before a loop. Were the bounds constants,
// GCC would split a vectorized loop into its clamped and unclamped cases, fold exp of each
// bound, and compute every case in every lane before blending: SiLU's x / (1 + exp(88)) is a
// denormal for most x, and each vector of denormals costs a microcode assist (SiLU ran six
// times slower). The lanes kept, and so the bits, are the same either way.
inline ExpRange exp_range() {
  static volatile float lo = -87.0f, hi = 88.0f;
  return {lo, hi};
}

// Always inlined: GCC, left to choose, calls it from a large function's loops, which then
// run a scalar call an element instead of vectors.
__attribute__((always_inline)) inline float exp_fixed(float x, ExpRange range) {
  x = std::min(std::max(x, range.lo), range.hi);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// tanh(x) from exp_fixed, for the same reason: 1 - 2 / (exp(2x) + 1).
__attribute__((always_inline)) inline float tanh_fixed(float x, ExpRange range) {
  return 1.f - 2.f / (exp_fixed(2.f * x, range) + 1.f);
}

// A norm's weight: of the activations' dtype (Llama: the normalized value is rounded before
// the weight multiplies it), or float32 (1 + w) (Gemma's offset norms: no rounding between).
template <typename A>
struct NormWeight {
  const A* a = nullptr;
  const float* offset = nullptr;
  explicit NormWeight(const Tensor& w) {
    if (w.scalar_type() == at::kFloat && !std::is_same_v<A, float>) {
      offset = w.data_ptr<float>();
    } else if (w.numel() > 0) {
      a = w.data_ptr<A>();
    }
  }
  bool given() const { return a != nullptr || offset != nullptr; }
  // The output for normalized value v (x * inv, unrounded) at i.
  A apply(int64_t i, float v) const {
    if (offset != nullptr) return to_a<A>(offset[i] * v);
    return to_a<A>(to_f(a[i]) * to_f(to_a<A>(v)));
  }
  // apply for a row: y[i] = apply(i, x[i] * inv), one loop per form so that each vectorizes.
  void apply_row(const A* x, int64_t d, float inv, A* y) const {
    if (offset != nullptr) {
      for (int64_t i = 0; i < d; ++i) y[i] = to_a<A>(offset[i] * (to_f(x[i]) * inv));
    } else {
      for (int64_t i = 0; i < d; ++i)
        y[i] = to_a<A>(to_f(a[i]) * to_f(to_a<A>(to_f(x[i]) * inv)));
    }
  }
};

// Tensors a stored linear takes: one dense tile tensor (0), seven per segment of integer
// planes, none for a linear the layer does not have (-1: a sparse layer without a shared
// expert has no dense MLP).
size_t stored_tensors(int64_t segments) {
  if (segments < 0) return 0;
  return segments == 0 ? 1 : segments * radixlm_cpu::SEGMENT_TENSORS;
}

// y = x @ W.T for one stored linear starting at tensors[first] (specs: 0 for dense tiles, s
// for s segments of integer planes).
Tensor linear(const Tensor& x, const std::vector<Tensor>& tensors, size_t first,
              int64_t segments, int64_t width) {
  if (segments == 0) return radixlm_cpu::dense_linear(x, tensors[first], width, false);
  const std::vector<Tensor> stored(tensors.begin() + first,
                                   tensors.begin() + first + stored_tensors(segments));
  return radixlm_cpu::planes_linear(x, stored, width, false);
}

// x[i] += add[i] for i in [begin, end), rounded to A per element (the residual add).
template <typename A>
void add_elements(A* x, const A* add, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) x[i] = to_a<A>(to_f(x[i]) + to_f(add[i]));
}

// out[r] = weight * rms_norm(x[r]) (with x[r] += add[r] first when add is given: the
// residual stream then keeps the sum).
template <typename A>
void add_rms_norm(Tensor& x, const Tensor* add, const Tensor& weight, Tensor& out, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  auto* xs = x.data_ptr<A>();
  auto* ys = out.data_ptr<A>();
  const NormWeight<A> w(weight);
  const A* as = add ? add->data_ptr<A>() : nullptr;
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    if (as) add_elements(xs, as, begin * d, end * d);
    // Each row's sum of squares in order, the rows of a block side by side: one row's sum is
    // a chain of dependent additions, eight rows' are eight independent chains. The same
    // sums, so the same bits: one fused multiply-add an element where the CPU has it, as
    // `sum += v * v` compiles there.
    constexpr int64_t BLOCK = 8;
    for (int64_t r0 = begin; r0 < end; r0 += BLOCK) {
      const int64_t n = std::min(BLOCK, end - r0);
      float sum[BLOCK] = {};
      for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const float v = to_f(xs[(r0 + j) * d + i]);
#if defined(FP_FAST_FMAF)
          sum[j] = std::fma(v, v, sum[j]);
#else
          sum[j] += v * v;
#endif
        }
      for (int64_t j = 0; j < n; ++j) {
        const float inv =
            1.f / std::sqrt(sum[j] / static_cast<float>(d) + static_cast<float>(eps));
        w.apply_row(xs + (r0 + j) * d, d, inv, ys + (r0 + j) * d);
      }
    }
  });
}

// x += add, rounded to A per element as add_rms_norm's add rounds.
template <typename A>
void add_into(Tensor& x, const Tensor& add) {
  const int64_t rows = x.size(0), d = x.size(1);
  A* xs = x.data_ptr<A>();
  const A* as = add.data_ptr<A>();
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    add_elements(xs, as, begin * d, end * d);
  });
}

// Normalize (when q_norm and k_norm are given: RMSNorm over each head, rounded as
// add_rms_norm rounds) and rotate the q and k heads of qkv [T, (H + 2 Hkv) * D] in place
// (half-split layout), then write k and v to their cache slots.
template <typename A>
void rotary_and_store(Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, Tensor& k_layer, Tensor& v_layer,
                      const Tensor& out_slots, const Tensor& q_norm, const Tensor& k_norm,
                      double eps) {
  const NormWeight<A> qw(q_norm), kw(k_norm);
  const int64_t rows = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  auto* q = qkv.data_ptr<A>();
  const auto* c = cos.data_ptr<float>();
  const auto* s = sin.data_ptr<float>();
  const auto* slots = out_slots.data_ptr<int64_t>();
  auto* kc = k_layer.data_ptr<A>();
  auto* vc = v_layer.data_ptr<A>();
  const int64_t kv_width = kv_heads * head_dim;
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      A* row = q + r * width;
      const float* cr = c + r * half;
      const float* sr = s + r * half;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        A* x = row + h * head_dim;
        if (qw.given()) {
          const NormWeight<A>& w = h < heads ? qw : kw;
          float sum = 0.f;
          for (int64_t i = 0; i < head_dim; ++i) sum += to_f(x[i]) * to_f(x[i]);
          const float inv =
              1.f / std::sqrt(sum / static_cast<float>(head_dim) + static_cast<float>(eps));
          for (int64_t i = 0; i < head_dim; ++i) x[i] = w.apply(i, to_f(x[i]) * inv);
        }
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
          x[i] = to_a<A>(x1 * cr[i] - x2 * sr[i]);
          x[i + half] = to_a<A>(x2 * cr[i] + x1 * sr[i]);
        }
      }
      const int64_t slot = slots[r];
      std::copy(row + heads * head_dim, row + heads * head_dim + kv_width, kc + slot * kv_width);
      std::copy(row + heads * head_dim + kv_width, row + width, vc + slot * kv_width);
    }
  });
}

// out [T, H * D] = attention of each row's q (the first H heads of qkv) over its sequence's
// positions 0..position (the last `window` of them when window > 0), read straight from
// their cache slots in position order.
//
// A task is a block of up to QUERY_BLOCK consecutive rows of one sequence (a prefill chunk's
// rows share their keys) and one KV head; its queries are the rows' heads of that KV head.
// Keys are taken 16 positions at a time, converted to float32 and transposed (one position per
// lane), and each query's scores for them are one fused multiply-add per dimension in order:
// score(row, position) is the same sum whatever block the row is in. Then each query's softmax
// over its own positions (max, exp_fixed, a sum in 16 lanes by position) and its values
// weighted in position order. Nothing depends on the other rows of the step or on how rows
// were blocked; the blocking of queries into registers only changes how many independent sums
// are in flight.
constexpr int64_t QUERY_BLOCK = 8;

#if defined(__AVX512F__)
// w[m] = word m of the 16 rows w[l] (16 32-bit words each): a 16 x 16 transpose by register
// shuffles. transposed_keys used vector gathers alone before, which the microcode that
// mitigates gather data sampling makes slow on recent Intel CPUs.
inline void transpose16(__m512i (&w)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 128-bit lane k: row i's words 4k.. with row i + 1's
    t[i] = _mm512_unpacklo_epi32(w[i], w[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(w[i], w[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // w[g + c]'s lane k: word 4k + c of rows g .. g + 3
    w[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    w[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    w[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    w[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes per c
    const __m512i x0 = _mm512_shuffle_i32x4(w[c], w[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(w[c], w[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(w[8 + c], w[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(w[8 + c], w[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);       // word c
    t[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);   // word 4 + c
    t[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);   // word 8 + c
    t[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);  // word 12 + c
  }
  for (int m = 0; m < 16; ++m) w[m] = t[m];
}
#elif defined(__AVX2__)
// The same for 8 rows of 8 words in 256-bit registers (AVX2 without AVX-512).
inline void transpose8(__m256i (&w)[8]) {
  __m256i t[8];
  for (int i = 0; i < 8; i += 2) {  // 128-bit lane k: row i's words 4k.. with row i + 1's
    t[i] = _mm256_unpacklo_epi32(w[i], w[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(w[i], w[i + 1]);
  }
  for (int g = 0; g < 8; g += 4) {  // w[g + c]'s lane k: word 4k + c of rows g .. g + 3
    w[g] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
    w[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
    w[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
    w[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // rows 0..3 from w[c], 4..7 from w[4 + c]: lane 0, then 1
    t[c] = _mm256_permute2x128_si256(w[c], w[4 + c], 0x20);      // word c
    t[4 + c] = _mm256_permute2x128_si256(w[c], w[4 + c], 0x31);  // word 4 + c
  }
  for (int m = 0; m < 8; ++m) w[m] = t[m];
}
#endif

// keys[d * 16 + l] = float32 of dimension d of the key at element offset rows[l] of cache
// (l < count; 0 for the other lanes): 16 positions' keys transposed, one position per lane.
template <typename A>
void transposed_keys(const A* cache, const int64_t* rows, int64_t count, int64_t head_dim,
                     bool offsets_fit_int32, float* keys) {
#if defined(__AVX512F__)
  // 32-bit words of a row: a bfloat16 pair (d, d + 1) or a float
  constexpr int64_t PER_WORD = sizeof(A) == 2 ? 2 : 1;
  if ((head_dim / PER_WORD) % 16 == 0) {
    for (int64_t w0 = 0; w0 < head_dim / PER_WORD; w0 += 16) {
      __m512i w[16];
      for (int64_t l = 0; l < 16; ++l) {
        w[l] = l < count ? _mm512_loadu_si512(reinterpret_cast<const void*>(
                               cache + rows[l] + w0 * PER_WORD))
                         : _mm512_setzero_si512();
      }
      transpose16(w);
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
      for (int64_t m = 0; m < 16; ++m) {
        float* k = keys + (w0 + m) * PER_WORD * 16;
        if constexpr (sizeof(A) == 2) {  // dimension 2 m (the low half), then 2 m + 1
          _mm512_storeu_ps(k, _mm512_castsi512_ps(_mm512_slli_epi32(w[m], 16)));
          _mm512_storeu_ps(k + 16, _mm512_castsi512_ps(_mm512_and_si512(w[m], high)));
        } else {
          _mm512_storeu_ps(k, _mm512_castsi512_ps(w[m]));
        }
      }
    }
    return;
  }
  if (offsets_fit_int32) {
    // One gather per 32-bit word of the 16 rows: a bfloat16 pair (d, d + 1) or a float.
    alignas(64) int32_t offsets[16] = {};
    for (int64_t l = 0; l < count; ++l) offsets[l] = static_cast<int32_t>(rows[l]);
    const __m512i index = _mm512_load_si512(offsets);
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1u);
    const __m512i none = _mm512_setzero_si512();
    if constexpr (sizeof(A) == 2) {
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
      for (int64_t d = 0; d < head_dim; d += 2) {
        const __m512i pair = _mm512_mask_i32gather_epi32(
            none, live, _mm512_add_epi32(index, _mm512_set1_epi32(static_cast<int32_t>(d))),
            cache, 2);
        _mm512_storeu_ps(keys + d * 16, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
        _mm512_storeu_ps(keys + (d + 1) * 16,
                         _mm512_castsi512_ps(_mm512_and_si512(pair, high)));
      }
    } else {
      for (int64_t d = 0; d < head_dim; ++d) {
        const __m512i word = _mm512_mask_i32gather_epi32(
            none, live, _mm512_add_epi32(index, _mm512_set1_epi32(static_cast<int32_t>(d))),
            cache, 4);
        _mm512_storeu_ps(keys + d * 16, _mm512_castsi512_ps(word));
      }
    }
    return;
  }
#elif defined(__AVX2__)
  constexpr int64_t PER_WORD = sizeof(A) == 2 ? 2 : 1;
  if ((head_dim / PER_WORD) % 8 == 0) {  // 8 words of 8 positions at a time, two halves
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    for (int64_t w0 = 0; w0 < head_dim / PER_WORD; w0 += 8) {
      for (int64_t half = 0; half < 16; half += 8) {
        __m256i w[8];
        for (int64_t l = 0; l < 8; ++l) {
          w[l] = half + l < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                        cache + rows[half + l] + w0 * PER_WORD))
                                  : _mm256_setzero_si256();
        }
        transpose8(w);
        for (int64_t m = 0; m < 8; ++m) {
          float* k = keys + (w0 + m) * PER_WORD * 16 + half;
          if constexpr (sizeof(A) == 2) {  // dimension 2 m (the low half), then 2 m + 1
            _mm256_storeu_ps(k, _mm256_castsi256_ps(_mm256_slli_epi32(w[m], 16)));
            _mm256_storeu_ps(k + 16, _mm256_castsi256_ps(_mm256_and_si256(w[m], high)));
          } else {
            _mm256_storeu_ps(k, _mm256_castsi256_ps(w[m]));
          }
        }
      }
    }
    return;
  }
#endif
  for (int64_t l = 0; l < 16; ++l) {
    for (int64_t d = 0; d < head_dim; ++d) {
      keys[d * 16 + l] = l < count ? to_f(cache[rows[l] + d]) : 0.f;
    }
  }
}

// 16 activations as float32 lanes.
inline radixlm_cpu::Vec load16(const float* p) { return radixlm_cpu::Vec::load(p); }
inline radixlm_cpu::Vec load16(const BFloat16* p) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // Vec's two halves
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(bits));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(bits, 1));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
#else
  float f[16];
  for (int l = 0; l < 16; ++l) f[l] = to_f(p[l]);
  return radixlm_cpu::Vec::load(f);
#endif
}

// Calls f(Int<C>{}, first) over 0..count in chunks of at most C_MAX (a compile-time C, so
// that a chunk's sums live in registers).
template <int C_MAX, typename F>
void in_chunks(int64_t count, const F& f) {
  int64_t i = 0;
  for (; i + C_MAX <= count; i += C_MAX) f(std::integral_constant<int, C_MAX>{}, i);
  if constexpr (C_MAX > 1) {
    if (i < count) {
      in_chunks<C_MAX / 2>(count - i, [&](auto c, int64_t j) { f(c, i + j); });
    }
  }
}

// scores[query][j0 + l] for l < 16 of the queries listed: one chain of fused multiply-adds
// over the dimensions per score, C queries at a time.
template <int C>
void score_chunk(const float* q, const int64_t* queries, const float* keys, int64_t head_dim,
                 float scale, float softcap, float* scores, int64_t padded, int64_t j0) {
  using radixlm_cpu::Vec;
  Vec lanes[C];
  const float* qs[C];
  for (int c = 0; c < C; ++c) {
    lanes[c] = Vec::zero();
    qs[c] = q + queries[c] * head_dim;
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    const Vec k = Vec::load(keys + d * 16);
    for (int c = 0; c < C; ++c) lanes[c] = lanes[c].fma(Vec::fill(qs[c][d]), k);
  }
  for (int c = 0; c < C; ++c) {
    float out[16];
    lanes[c].store(out);
    float* sc = scores + queries[c] * padded + j0;
    if (softcap > 0.f) {
      const ExpRange range = exp_range();
      for (int l = 0; l < 16; ++l) sc[l] = softcap * tanh_fixed(out[l] * scale / softcap, range);
    } else {
      for (int l = 0; l < 16; ++l) sc[l] = out[l] * scale;
    }
  }
}

// out[query][d0 .. d0 + 16 V) = (sum over positions j in order of p[query][j] * value[j])
// times inv_sum[query], for the C queries from `query` on: C x V sums in registers. A weight
// below FLT_MIN (0 past the query's own positions, or an exp that underflowed) adds nothing a
// float32 sum keeps, and denormal arithmetic costs ~100 cycles an operation on x86: it is
// skipped. Not inlined: inside attention's body GCC kept the C x V sums in memory, not
// registers.
template <typename A, int C, int V>
__attribute__((noinline)) void value_chunk(const float* scores, int64_t padded, int64_t query,
                                           const float* inv_sum, const A* values,
                                           const int64_t* value_rows, int64_t first,
                                           int64_t longest, int64_t d0, A* const* outs) {
  using radixlm_cpu::Vec;
  Vec acc[C][V];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) acc[c][v] = Vec::zero();
  for (int64_t j = first; j < longest; ++j) {
    const A* row = values + value_rows[j] + d0;
    Vec value[V];
    for (int v = 0; v < V; ++v) value[v] = load16(row + 16 * v);
    for (int c = 0; c < C; ++c) {
      const float p = scores[(query + c) * padded + j];
      if (p < FLT_MIN) continue;
      const Vec weight = Vec::fill(p);
      for (int v = 0; v < V; ++v) acc[c][v] = acc[c][v].fma(weight, value[v]);
    }
  }
  for (int c = 0; c < C; ++c) {
    float out[16 * V];
    const float inv = inv_sum[query + c];
    for (int v = 0; v < V; ++v) acc[c][v].store(out + 16 * v);
    A* o = outs[c] + d0;
    for (int64_t d = 0; d < 16 * V; ++d) o[d] = to_a<A>(out[d] * inv);
  }
}

// Sums of value_chunk held in registers: 16 lane vectors are 16 of AVX-512's 32 registers,
// but two 8-lane registers each on AVX2, which has 16 in all (the values and the weight
// need some too).
#if defined(__AVX512F__)
constexpr int VALUE_SUMS = 16;
#else
constexpr int VALUE_SUMS = 4;
#endif

// One task of a step's attention: a block of consecutive rows of one sequence and one KV head.
template <typename A>
struct AttentionTask {
  int64_t r0 = 0, n = 0, kvh = 0, longest = 0, padded = 0, queries = 0, block_first = 0;
  std::vector<int64_t> slot_rows;  // element offset of position j's head kvh in the layers
  std::vector<float> q;            // query r * group + h: row r's head kvh * group + h
  std::vector<float> scores;       // [queries][padded]: the scores, then their exponentials
  std::vector<float> inv_sum;      // [queries]
  std::vector<A*> outs;            // [queries]: where each query's output goes
};

// A step's attention, in stages a task runs in order: its scores (any split of its positions),
// each query's softmax, and the weighted values (any split of the dimensions). No stage's
// result depends on how the stages are split or which thread runs them.
template <typename A>
struct StepAttention {
  const A* q_all;
  const A* kc;
  const A* vc;
  A* out_all;
  const int64_t* page_ids;
  const int64_t* seqs;
  const int64_t* pos;
  const int64_t* starts;  // row blocks: consecutive rows of one sequence
  int64_t width, group, num_pages, page_size, q_width, kv_width, head_dim, window;
  float scale, softcap;
  bool offsets_fit_int32;

  // Position j of row r is seen when first_of(r) <= j <= pos(r); a block's rows are in
  // position order, so its first row has the earliest first position.
  int64_t first_of(const AttentionTask<A>& t, int64_t r) const {
    return window > 0 ? std::max<int64_t>(0, pos[t.r0 + r] - window + 1) : int64_t(0);
  }

  // Sizes a task's buffers (the scores are not cleared: each stage reads only what an earlier
  // one wrote), and takes its queries as float32.
  void prepare(AttentionTask<A>& t, int64_t block, int64_t kvh) const {
    t.r0 = starts[block];
    t.n = starts[block + 1] - t.r0;
    t.kvh = kvh;
    t.longest = pos[t.r0 + t.n - 1] + 1;
    t.padded = (t.longest + 15) / 16 * 16;
    t.queries = t.n * group;
    t.block_first = first_of(t, 0) / 16 * 16;
    t.slot_rows.resize(t.longest);
    t.q.resize(t.queries * head_dim);
    t.outs.resize(t.queries);
    t.scores.resize(t.queries * t.padded);
    t.inv_sum.resize(t.queries);
    for (int64_t r = 0; r < t.n; ++r) {
      const A* qr = q_all + (t.r0 + r) * width + kvh * group * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) {
        t.q[r * group * head_dim + i] = to_f(qr[i]);
      }
      for (int64_t h = 0; h < group; ++h) {
        t.outs[r * group + h] = out_all + (t.r0 + r) * q_width + (kvh * group + h) * head_dim;
      }
    }
  }

  // The slots and scores of positions [begin, end): begin is block_first plus a multiple of
  // 16, end is longest or a multiple of 16 from begin. keys: head_dim * 16 floats.
  void score(AttentionTask<A>& t, int64_t begin, int64_t end, float* keys,
             std::vector<int64_t>& live) const {
    const int64_t s = seqs[t.r0];
    for (int64_t j = begin; j < end; ++j) {
      t.slot_rows[j] = (page_ids[s * num_pages + j / page_size] * page_size + j % page_size) *
                           kv_width + t.kvh * head_dim;
    }
    for (int64_t j0 = begin; j0 < end; j0 += 16) {
      const int64_t count = std::min<int64_t>(16, end - j0);
      transposed_keys(kc, t.slot_rows.data() + j0, count, head_dim, offsets_fit_int32, keys);
      live.clear();  // queries of the rows whose context reaches these positions
      for (int64_t r = 0; r < t.n; ++r) {
        if (pos[t.r0 + r] < j0 || first_of(t, r) >= j0 + 16) continue;
        for (int64_t h = 0; h < group; ++h) live.push_back(r * group + h);
      }
      in_chunks<8>(static_cast<int64_t>(live.size()), [&](auto c, int64_t first) {
        score_chunk<decltype(c)::value>(t.q.data(), live.data() + first, keys, head_dim, scale,
                                        softcap, t.scores.data(), t.padded, j0);
      });
    }
  }

  // Query i's scores become their exponentials, and inv_sum[i] one over their sum.
  void softmax(AttentionTask<A>& t, int64_t i) const {
    const int64_t r = i / group, len = pos[t.r0 + r] + 1, first = first_of(t, r);
    float* sc = t.scores.data() + i * t.padded;
    // The largest score, in 16 lanes (one chain of maxima was a seventh of attention's time
    // at a long context): the same maximum, as no order changes a maximum (but that of zeros'
    // signs, which the exponentials below do not see).
    float tops[16];
    for (int l = 0; l < 16; ++l) tops[l] = -INFINITY;
    int64_t j = first;
    for (; j + 16 <= len; j += 16)
      for (int l = 0; l < 16; ++l) tops[l] = std::max(tops[l], sc[j + l]);
    for (; j < len; ++j) tops[0] = std::max(tops[0], sc[j]);
    float top = -INFINITY;
    for (int l = 0; l < 16; ++l) top = std::max(top, tops[l]);
    const ExpRange range = exp_range();
    float lanes[16] = {};
    for (j = 0; j < t.padded; j += 16) {
      for (int l = 0; l < 16; ++l) {
        const float e = j + l < len && j + l >= first ? exp_fixed(sc[j + l] - top, range) : 0.f;
        sc[j + l] = e;
        lanes[l] += e;
      }
    }
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += lanes[l];
    t.inv_sum[i] = 1.f / sum;
  }

  // Every query's output at dimensions [begin, end) (multiples of 16).
  void weigh(AttentionTask<A>& t, int64_t begin, int64_t end) const {
    for (int64_t d0 = begin; d0 < end; d0 += 64) {
      auto slice = [&](auto v_const) {
        constexpr int V = decltype(v_const)::value;
        in_chunks<std::max(1, VALUE_SUMS / V)>(t.queries, [&](auto c, int64_t first) {
          value_chunk<A, decltype(c)::value, V>(t.scores.data(), t.padded, first,
                                                t.inv_sum.data(), vc, t.slot_rows.data(),
                                                t.block_first, t.longest, d0,
                                                t.outs.data() + first);
        });
      };
      switch (std::min<int64_t>(4, (end - d0) / 16)) {
        case 4: slice(std::integral_constant<int, 4>{}); break;
        case 3: slice(std::integral_constant<int, 3>{}); break;
        case 2: slice(std::integral_constant<int, 2>{}); break;
        default: slice(std::integral_constant<int, 1>{}); break;
      }
    }
  }
};

// Positions a scoring unit takes when a step's attention runs stage by stage, and the most
// scores (floats) such a step may hold at once.
constexpr int64_t SCORE_SPAN = 128;
constexpr int64_t STAGED_SCORES_MAX = int64_t(1) << 22;

template <typename A>
Tensor attention(const Tensor& qkv, const Tensor& k_layer, const Tensor& v_layer,
                 const Tensor& pages, const Tensor& token_seq, const Tensor& positions,
                 int64_t page_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 double scale, double softcap, int64_t window) {
  TORCH_CHECK(head_dim % 16 == 0, "head_dim: a multiple of 16");
  const int64_t rows = qkv.size(0), group = heads / kv_heads;
  const auto* seqs = token_seq.data_ptr<int64_t>();
  const auto* pos = positions.data_ptr<int64_t>();
  // Row blocks: consecutive rows of one sequence (a step lists each sequence's rows together,
  // in position order).
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < rows; ++t) {
    if (t == 0 || seqs[t] != seqs[t - 1] || t - starts.back() == QUERY_BLOCK) {
      starts.push_back(t);
    }
  }
  const int64_t blocks = static_cast<int64_t>(starts.size());
  starts.push_back(rows);
  Tensor out = at::empty({rows, heads * head_dim}, qkv.options());
  const StepAttention<A> step{
      qkv.data_ptr<A>(), k_layer.data_ptr<A>(), v_layer.data_ptr<A>(), out.data_ptr<A>(),
      pages.data_ptr<int64_t>(), seqs, pos, starts.data(), qkv.size(1), group, pages.size(1),
      page_size, heads * head_dim, kv_heads * head_dim, head_dim, window,
      static_cast<float>(scale), static_cast<float>(softcap),
      k_layer.numel() + head_dim < (int64_t(1) << 31)};
  const int64_t tasks = blocks * kv_heads;
  int64_t step_scores = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    step_scores += (starts[b + 1] - starts[b]) * group * (pos[starts[b + 1] - 1] + 16) * kv_heads;
  }
  if (tasks >= 4 * at::get_num_threads() || step_scores > STAGED_SCORES_MAX) {
    // Enough tasks to keep every thread busy: each runs its stages in turn.
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      AttentionTask<A> t;
      std::vector<float> keys(head_dim * 16);
      std::vector<int64_t> live;
      for (int64_t task = begin; task < end; ++task) {
        step.prepare(t, task / kv_heads, task % kv_heads);
        step.score(t, t.block_first, t.longest, keys.data(), live);
        for (int64_t i = 0; i < t.queries; ++i) step.softmax(t, i);
        step.weigh(t, 0, head_dim);
      }
    });
    return out;
  }
  // A few tasks (a decode step of a few sequences) would leave threads idle: each stage is a
  // parallel loop of its own over all tasks, split into finer units.
  // The calling thread's buffers, named here: in the loops below, a thread_local would be the
  // worker's own.
  static thread_local std::vector<AttentionTask<A>> buffers;
  std::vector<AttentionTask<A>>& staged = buffers;
  staged.resize(tasks);
  std::vector<std::pair<int64_t, int64_t>> spans, queries;  // (task, first position / query)
  for (int64_t task = 0; task < tasks; ++task) {
    AttentionTask<A>& t = staged[task];
    step.prepare(t, task / kv_heads, task % kv_heads);
    for (int64_t j = t.block_first; j < t.longest; j += SCORE_SPAN) spans.emplace_back(task, j);
    for (int64_t i = 0; i < t.queries; ++i) queries.emplace_back(task, i);
  }
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys(head_dim * 16);
    std::vector<int64_t> live;
    for (int64_t u = begin; u < end; ++u) {
      AttentionTask<A>& t = staged[spans[u].first];
      const int64_t j = spans[u].second;
      step.score(t, j, std::min(j + SCORE_SPAN, t.longest), keys.data(), live);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(queries.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) step.softmax(staged[queries[u].first], queries[u].second);
  });
  // Dimensions in slices of 32: a 64-byte line of a bfloat16 value row.
  const int64_t slices = (head_dim + 31) / 32;
  at::parallel_for(0, tasks * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t d0 = u % slices * 32;
      step.weigh(staged[u / slices], d0, std::min(d0 + 32, head_dim));
    }
  });
  return out;
}

// out[c] = sum of a[i] * xs[c][i] over i < n, for C rows at once (a read once for all of
// them): per row 16 lanes of fused multiply-adds over i in order, then the lanes and the tail
// in order. A row's sum is the same whatever C is and whatever the other rows hold.
template <int C, typename W>
void dots(const W* a, const float* const* xs, int64_t n, float* out) {
  using radixlm_cpu::Vec;
  Vec acc[C];
  for (int c = 0; c < C; ++c) acc[c] = Vec::zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Vec va = load16(a + i);
    for (int c = 0; c < C; ++c) acc[c] = acc[c].fma(va, Vec::load(xs[c] + i));
  }
  for (int c = 0; c < C; ++c) {
    float lanes[16];
    acc[c].store(lanes);
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += lanes[l];
    for (int64_t t = i; t < n; ++t) sum += to_f(a[t]) * xs[c][t];
    out[c] = sum;
  }
}

// Rows of one adapter that share a pass over its weights.
constexpr int64_t LORA_ROWS = 8;

// out[r] += B[s] @ (A[s] @ x[r]) for each row r with a slot s >= 0: two float32 sums per
// output (dots) over the row's own values, rounded once into out. Consecutive rows of one
// slot go through the weights together, up to LORA_ROWS at a time. Rows without an adapter
// are left alone, so a base-model row is the same with or without adapter rows beside it.
// Only the slot's rank of each part is read, and an output reads only the parts that may
// write it (the rest of B is zeros). W: the slots' dtype (float32, or bfloat16 for half the
// bytes; widened exactly, so the sums are the same either way for the same weights).
template <typename A, typename W>
void lora_add(Tensor& out, const Tensor& x, const Tensor& la, const Tensor& lb,
              const Tensor& cols, const int32_t* ranks, const int64_t* slots) {
  const int64_t rows = x.size(0), in = x.size(1), k = la.size(1), n = out.size(1);
  const int64_t parts = cols.size(0), stride = k / parts;
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && la.size(2) == in &&
                  lb.size(1) == k && lb.size(2) == n && k % parts == 0 &&
                  cols.scalar_type() == at::kInt,
              "lora: shapes do not match the layer");
  const int32_t* col = cols.data_ptr<int32_t>();
  const W* a = la.data_ptr<W>();
  const W* b = lb.data_ptr<W>();
  const A* xs = x.data_ptr<A>();
  A* os = out.data_ptr<A>();
  // Blocks (first row, rows) of up to LORA_ROWS consecutive rows with one slot.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t r = 0; r < rows; ++r) {
    if (slots[r] < 0) continue;
    auto& last = spans.empty() ? spans.emplace_back(r, 0) : spans.back();
    if (last.first + last.second == r && slots[last.first] == slots[r] &&
        last.second < LORA_ROWS) {
      ++last.second;
    } else {
      spans.emplace_back(r, 1);
    }
  }
  const int64_t blocks = static_cast<int64_t>(spans.size());
  if (blocks == 0) return;
  std::vector<float> xf(rows * in), u(rows * k);
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (slots[r] < 0) continue;
      for (int64_t i = 0; i < in; ++i) xf[r * in + i] = to_f(xs[r * in + i]);
    }
  });
  // One task: a block's rows through `outputs` consecutive rows of A [slots, k, in], but
  // the rank padding of each part.
  auto pass = [&](const std::vector<float>& inputs, int64_t width, const W* weights,
                  int64_t total, int64_t per_task, auto&& store) {
    const int64_t tasks_per_block = (total + per_task - 1) / per_task;
    at::parallel_for(0, blocks * tasks_per_block, 1, [&](int64_t begin, int64_t end) {
      const float* in_rows[LORA_ROWS];
      float col[LORA_ROWS];
      for (int64_t task = begin; task < end; ++task) {
        const auto [r0, count] = spans[task / tasks_per_block];
        const int64_t s = slots[r0], j0 = task % tasks_per_block * per_task;
        for (int64_t c = 0; c < count; ++c) in_rows[c] = inputs.data() + (r0 + c) * width;
        for (int64_t j = j0; j < std::min(total, j0 + per_task); ++j) {
          if (j % stride >= ranks[s]) continue;  // never read by the expand below
          in_chunks<8>(count, [&](auto chunk, int64_t first) {
            dots<decltype(chunk)::value>(weights + (s * total + j) * width, in_rows + first,
                                         width, col + first);
          });
          for (int64_t c = 0; c < count; ++c) store(r0 + c, j, col[c]);
        }
      }
    });
  };
  pass(xf, in, a, k, 4, [&](int64_t r, int64_t j, float v) { u[r * k + j] = v; });
  // out[r][o] += sum over j in order of u[r][j] * B[s][j][o]: 16 outputs per vector.
  constexpr int64_t OUTPUTS_PER_TASK = 64;
  const int64_t tasks_per_block = (n + OUTPUTS_PER_TASK - 1) / OUTPUTS_PER_TASK;
  at::parallel_for(0, blocks * tasks_per_block, 1, [&](int64_t begin, int64_t end) {
    using radixlm_cpu::Vec;
    for (int64_t task = begin; task < end; ++task) {
      const auto [r0, count] = spans[task / tasks_per_block];
      const int64_t s = slots[r0], o_begin = task % tasks_per_block * OUTPUTS_PER_TASK;
      const int64_t o_end = std::min(n, o_begin + OUTPUTS_PER_TASK);
      // The rows of B that may write these outputs: each overlapping part's first ranks.
      int64_t firsts[8], used = 0;
      for (int64_t p = 0; p < parts && used < 8; ++p) {
        if (col[2 * p] < o_end && col[2 * p + 1] > o_begin) firsts[used++] = p * stride;
      }
      const int64_t rank = ranks[s];
      for (int64_t r = r0; r < r0 + count; ++r) {
        const float* ur = u.data() + r * k;
        A* y = os + r * n;
        int64_t o = o_begin;
        for (; o + 16 <= o_end; o += 16) {
          Vec acc = Vec::zero();
          for (int64_t q = 0; q < used; ++q) {
            for (int64_t j = firsts[q]; j < firsts[q] + rank; ++j) {
              acc = acc.fma(Vec::fill(ur[j]), load16(b + (s * k + j) * n + o));
            }
          }
          float lanes[16];
          acc.store(lanes);
          for (int l = 0; l < 16; ++l) y[o + l] = to_a<A>(to_f(y[o + l]) + lanes[l]);
        }
        for (; o < o_end; ++o) {
          float sum = 0.f;
          for (int64_t q = 0; q < used; ++q) {
            for (int64_t j = firsts[q]; j < firsts[q] + rank; ++j) {
              sum = std::fma(ur[j], to_f(b[(s * k + j) * n + o]), sum);
            }
          }
          y[o] = to_a<A>(to_f(y[o]) + sum);
        }
      }
    }
  });
}

// act [T, I] = act(gate) * up from gate_up [T, 2 I], act SiLU or GELU (tanh approximation),
// rounding as the eager path does (the activation once, the product once).
template <typename A>
Tensor act_and_mul(const Tensor& gate_up, bool gelu) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  Tensor out = at::empty({rows, inter}, gate_up.options());
  const A* in = gate_up.data_ptr<A>();
  A* o = out.data_ptr<A>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const A* g = in + r * 2 * inter;
      const A* u = g + inter;
      A* y = o + r * inter;
      // one loop per activation, each branch-free so that it vectorizes
      const ExpRange range = exp_range();
      if (gelu) {
        for (int64_t i = 0; i < inter; ++i) {
          const float x = to_f(g[i]);
          const float act =
              0.5f * x * (1.f + tanh_fixed(0.7978845608f * (x + 0.044715f * x * x * x), range));
          y[i] = to_a<A>(to_f(to_a<A>(act)) * to_f(u[i]));
        }
      } else {
        for (int64_t i = 0; i < inter; ++i) {
          const float x = to_f(g[i]);
          y[i] = to_a<A>(to_f(to_a<A>(x / (1.f + exp_fixed(-x, range)))) * to_f(u[i]));
        }
      }
    }
  });
  return out;
}

// The sparse MLP of a mixture-of-experts layer (runtime/models/moe.py) for x [T, d]:
//   spec = {E, top_k, renormalize, then (segments, width) of the router, the experts'
//           gate_up and down, and the shared expert's gate (-1, 0: none)};
//   t = the router's tensors, then gate_up's and down's, each stacked over the experts
//       ([E, ...], expert e's at e: runtime/models/quantization/gguf_experts.py), then the
//       shared expert's gate's;
//   shared: the shared expert's output [T, d] (undefined without one).
// Each row's softmax over the router's logits (float32), its top_k experts (the larger
// probability first, the lower expert on a tie), their weights rescaled to sum to one with
// renormalize. An expert runs its SiLU-gated MLP once over all the rows that chose it (each
// row's sums are its own: cpu_linear.h); a row's output is its experts' outputs times their
// weights in float32, summed in the order of the experts' ids and rounded once, as
// layers/moe.py's grouped path rounds. With a shared expert: + sigmoid(gate(x)) * shared,
// each rounded to A. Nothing a row gets depends on the other rows.
template <typename A>
Tensor sparse_mlp(const Tensor& x, const std::vector<Tensor>& t, const std::vector<int64_t>& spec,
                  const Tensor& shared, const std::function<Tensor(const Tensor&)>& reduce) {
  TORCH_CHECK(spec.size() == 11, "expert specs: eleven numbers per sparse layer");
  const int64_t experts = spec[0], top_k = spec[1], rows = x.size(0), d = x.size(1);
  const bool renormalize = spec[2] != 0;
  const int64_t *router = spec.data() + 3, *gate_up = router + 2, *down = gate_up + 2,
                *shared_gate = down + 2;
  TORCH_CHECK(top_k >= 1 && top_k <= experts && router[1] == experts &&
                  t.size() == stored_tensors(router[0]) + stored_tensors(gate_up[0]) +
                                  stored_tensors(down[0]) + stored_tensors(shared_gate[0]),
              "sparse layer: the specs do not match its tensors");
  const Tensor logits = linear(x, t, 0, router[0], experts).contiguous();
  const A* lg = logits.data_ptr<A>();
  // Each row's choices (expert ids and weights), in the order of the ids.
  std::vector<int64_t> chosen(rows * top_k);
  std::vector<float> weight(rows * top_k);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> by_expert(experts);  // (row, choice)
  std::vector<float> probs(experts);
  std::vector<std::pair<float, int64_t>> order(experts);
  const ExpRange range = exp_range();
  for (int64_t r = 0; r < rows; ++r) {
    float top = -FLT_MAX;
    for (int64_t e = 0; e < experts; ++e) top = std::max(top, to_f(lg[r * experts + e]));
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) {
      probs[e] = exp_fixed(to_f(lg[r * experts + e]) - top, range);
      sum += probs[e];
    }
    for (int64_t e = 0; e < experts; ++e) order[e] = {probs[e] / sum, e};
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [](const auto& a, const auto& b) {
                        return a.first > b.first || (a.first == b.first && a.second < b.second);
                      });
    float total = 0.f;
    for (int64_t j = 0; j < top_k; ++j) total += order[j].first;
    std::sort(order.begin(), order.begin() + top_k,
              [](const auto& a, const auto& b) { return a.second < b.second; });
    for (int64_t j = 0; j < top_k; ++j) {
      chosen[r * top_k + j] = order[j].second;
      weight[r * top_k + j] = renormalize ? order[j].first / total : order[j].first;
      by_expert[order[j].second].emplace_back(r, j);
    }
  }
  // Expert e's linear: the slices at e of its stacked tensors.
  const size_t gate_up_at = stored_tensors(router[0]);
  const size_t down_at = gate_up_at + stored_tensors(gate_up[0]);
  auto expert_linear = [&](const Tensor& in, size_t first, const int64_t* linear_spec,
                           int64_t e) {
    std::vector<Tensor> slices;
    for (size_t k = 0; k < stored_tensors(linear_spec[0]); ++k) {
      slices.push_back(t[first + k].select(0, e));
    }
    return linear(in, slices, 0, linear_spec[0], linear_spec[1]);
  };
  // Each (row, choice)'s weighted output, float32.
  std::vector<float> weighted(rows * top_k * d);
  const A* xs = x.data_ptr<A>();
  auto run_expert = [&](int64_t e) {
    const auto& picks = by_expert[e];
    const int64_t n = static_cast<int64_t>(picks.size());
    Tensor in = at::empty({n, d}, x.options());
    A* ins = in.data_ptr<A>();
    for (int64_t i = 0; i < n; ++i) {
      std::copy(xs + picks[i].first * d, xs + (picks[i].first + 1) * d, ins + i * d);
    }
    const Tensor act = act_and_mul<A>(expert_linear(in, gate_up_at, gate_up, e), false);
    const Tensor out = expert_linear(act, down_at, down, e).contiguous();
    const A* os = out.data_ptr<A>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pair = picks[i].first * top_k + picks[i].second;
      const float w = weight[pair];
      float* dst = weighted.data() + pair * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = to_f(os[i * d + c]) * w;
    }
  };
  // The active experts, most rows first.
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e) {
    if (!by_expert[e].empty()) active.push_back(e);
  }
  std::stable_sort(active.begin(), active.end(), [&](int64_t a, int64_t b) {
    return by_expert[a].size() > by_expert[b].size();
  });
  const int64_t threads = at::get_num_threads();
  if (static_cast<int64_t>(active.size()) >= 2 * threads) {
    // Enough experts to share out whole: one parallel region for the layer, each thread
    // taking the next expert as it finishes one (a decode step's experts each have a row or
    // two: split across threads, their small linears would pay a wake-up each). Where an
    // expert runs does not change what it computes.
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < static_cast<int64_t>(active.size()); i = next++) {
        run_expert(active[i]);
      }
    });
  } else {
    for (int64_t e : active) run_expert(e);  // each linear split across the threads
  }
  Tensor out = at::empty({rows, d}, x.options());
  A* o = out.data_ptr<A>();
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < d; ++c) {
        float sum = 0.f;
        for (int64_t j = 0; j < top_k; ++j) sum += weighted[(r * top_k + j) * d + c];
        o[r * d + c] = to_a<A>(sum);
      }
    }
  });
  if (reduce) out = reduce(out).contiguous();
  if (!shared.defined()) return out;
  // out += sigmoid(gate(x)) * shared, each step rounded to A.
  const size_t gate_at = down_at + stored_tensors(down[0]);
  const Tensor gate = linear(x, t, gate_at, shared_gate[0], 1).contiguous();
  const Tensor sh = shared.contiguous();
  const A* g = gate.data_ptr<A>();
  const A* sv = sh.data_ptr<A>();
  o = out.data_ptr<A>();
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = to_f(to_a<A>(1.f / (1.f + exp_fixed(-to_f(g[r]), range))));
    for (int64_t c = 0; c < d; ++c) {
      o[r * d + c] = to_a<A>(to_f(o[r * d + c]) + to_f(to_a<A>(scale * to_f(sv[r * d + c]))));
    }
  }
  return out;
}

template <typename A>
Tensor forward_rows(Tensor hidden, const Tensor& cos, const Tensor& sin,
                    const Tensor& local_cos, const Tensor& local_sin,
                    const std::vector<std::vector<Tensor>>& layers,
                    const std::vector<int64_t>& specs, const std::vector<int64_t>& widths,
                    const std::vector<int64_t>& windows, Tensor k_cache, Tensor v_cache,
                    const Tensor& out_slots,
                    const Tensor& token_seq, const Tensor& positions, const Tensor& pages,
                    const Tensor& final_norm, int64_t page_size, int64_t heads,
                    int64_t kv_heads, int64_t head_dim, double eps, double scale,
                    double softcap, bool gelu,
                    const std::vector<Tensor>& lora, const Tensor& lora_slots,
                    const std::vector<std::vector<Tensor>>& experts,
                    const std::vector<std::vector<int64_t>>& expert_specs,
                    const std::function<Tensor(const Tensor&)>& reduce,
                    const std::function<void(int64_t)>& stored) {
  const int64_t* slots = lora.empty() ? nullptr : lora_slots.data_ptr<int64_t>();
  const int32_t* ranks = lora.empty() ? nullptr : lora.back().data_ptr<int32_t>();
  // y = the stored linear j of layer i at x, plus the rows' adapter updates.
  auto project = [&](const Tensor& x, const std::vector<Tensor>& t, size_t at, int64_t planes,
                     int64_t width, size_t i, int j) {
    Tensor y = linear(x, t, at, planes, width);
    if (slots != nullptr && lora[12 * i + 3 * j].numel() > 0) {
      y = y.contiguous();
      const size_t at = 12 * i + 3 * j;
      if (lora[at].scalar_type() == at::kBFloat16) {
        lora_add<A, BFloat16>(y, x.contiguous(), lora[at], lora[at + 1], lora[at + 2], ranks,
                              slots);
      } else {
        lora_add<A, float>(y, x.contiguous(), lora[at], lora[at + 1], lora[at + 2], ranks,
                           slots);
      }
    }
    return y;
  };
  Tensor h = hidden.clone();
  Tensor x = at::empty_like(h);
  Tensor residual_in;  // the previous layer's MLP output, added to h by the next norm
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i];
    const int64_t* p = specs.data() + 4 * i;  // segments of qkv, o, gate_up, down
    const int64_t* n = widths.data() + 4 * i;
    const bool sandwich = t[5].numel() > 0;  // Gemma: norms after the sublayers too
    add_rms_norm<A>(h, residual_in.defined() ? &residual_in : nullptr, t[0], x, eps);
    size_t at_ = 7;
    Tensor qkv = project(x, t, at_, p[0], n[0], i, 0);
    at_ += stored_tensors(p[0]);
    if (t[2].numel() > 0) qkv.add_(t[2]);
    qkv = qkv.contiguous();
    Tensor k_layer = k_cache[i], v_layer = v_cache[i];
    const bool local = windows[i] > 0;
    rotary_and_store<A>(qkv, local ? local_cos : cos, local ? local_sin : sin, heads, kv_heads,
                        head_dim, k_layer, v_layer, out_slots, t[3], t[4], eps);
    if (stored) stored(static_cast<int64_t>(i));
    Tensor attn = attention<A>(qkv, k_layer, v_layer, pages, token_seq, positions, page_size,
                               heads, kv_heads, head_dim, scale, softcap, windows[i]);
    Tensor o = project(attn, t, at_, p[1], n[1], i, 1);
    if (reduce) o = reduce(o);
    at_ += stored_tensors(p[1]);
    if (sandwich) {  // h += post_norm(o); x = pre_mlp_norm(h)
      o = o.contiguous();
      Tensor normed = at::empty_like(o);
      add_rms_norm<A>(o, nullptr, t[1], normed, eps);
      add_rms_norm<A>(h, &normed, t[5], x, eps);
    } else {
      add_rms_norm<A>(h, &o, t[1], x, eps);
    }
    Tensor mlp;  // a dense layer's MLP, or a sparse layer's shared expert
    if (p[2] >= 0) {
      Tensor gate_up = project(x, t, at_, p[2], n[2], i, 2);
      at_ += stored_tensors(p[2]);
      mlp = project(act_and_mul<A>(gate_up, gelu), t, at_, p[3], n[3], i, 3);
      if (reduce) mlp = reduce(mlp);
    }
    if (!experts[i].empty()) mlp = sparse_mlp<A>(x, experts[i], expert_specs[i], mlp, reduce);
    residual_in = mlp;
    if (sandwich) {  // the next norm adds post_mlp_norm(down) to h
      Tensor normed = at::empty_like(residual_in);
      Tensor down = residual_in.contiguous();
      add_rms_norm<A>(down, nullptr, t[6], normed, eps);
      residual_in = normed;
    }
  }
  if (final_norm.numel() == 0) {
    // A pipeline stage before the last: the residual stream, its pending add rounded as the
    // next layer's norm would round it.
    if (residual_in.defined()) add_into<A>(h, residual_in);
    return h;
  }
  Tensor out = at::empty_like(h);
  add_rms_norm<A>(h, residual_in.defined() ? &residual_in : nullptr, final_norm, out, eps);
  return out;
}

Tensor forward(Tensor hidden, const Tensor& cos, const Tensor& sin, const Tensor& local_cos,
               const Tensor& local_sin, const std::vector<std::vector<Tensor>>& layers,
               const std::vector<int64_t>& specs, const std::vector<int64_t>& widths,
               const std::vector<int64_t>& windows, Tensor k_cache, Tensor v_cache,
               const Tensor& out_slots,
               const Tensor& token_seq, const Tensor& positions, const Tensor& pages,
               const Tensor& final_norm, int64_t page_size, int64_t heads, int64_t kv_heads,
               int64_t head_dim, double eps, double scale, double softcap, bool gelu,
               const std::vector<Tensor>& lora, const Tensor& lora_slots,
               const std::vector<std::vector<Tensor>>& experts,
               const std::vector<std::vector<int64_t>>& expert_specs,
               const std::function<Tensor(const Tensor&)>& reduce,
               const std::function<void(int64_t)>& stored) {
  TORCH_CHECK(hidden.is_contiguous() && hidden.scalar_type() == k_cache.scalar_type(),
              "hidden must be contiguous, of the KV cache's dtype");
  for (const auto& t : layers) {
    TORCH_CHECK(t.size() >= 7 && (t[5].numel() > 0) == (t[6].numel() > 0),
                "layers: seven tensors before the linears' (both MLP norms or neither)");
  }
  TORCH_CHECK(specs.size() == 4 * layers.size() && widths.size() == specs.size() &&
                  windows.size() == layers.size(),
              "specs and widths: four entries per layer; windows: one");
  TORCH_CHECK(heads / kv_heads <= 64, "at most 64 query heads per KV head");  // inv_sum
  TORCH_CHECK(experts.size() == layers.size() && expert_specs.size() == layers.size(),
              "experts and expert_specs: one entry per layer (empty for a dense one)");
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(specs[4 * i + 2] >= 0 || !experts[i].empty(), "a layer without an MLP");
  }
  TORCH_CHECK(lora.empty() || (lora.size() == 12 * layers.size() + 1 &&
                               lora_slots.numel() == hidden.size(0) &&
                               lora.back().scalar_type() == at::kInt),
              "lora: twelve tensors per layer, the ranks, and a slot per row");
  if (hidden.scalar_type() == at::kFloat) {
    return forward_rows<float>(hidden, cos, sin, local_cos, local_sin, layers, specs, widths,
                               windows, k_cache, v_cache, out_slots, token_seq, positions, pages,
                               final_norm, page_size, heads, kv_heads, head_dim, eps, scale,
                               softcap, gelu, lora, lora_slots, experts, expert_specs, reduce,
                               stored);
  }
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "hidden: bfloat16 or float32");
  return forward_rows<BFloat16>(hidden, cos, sin, local_cos, local_sin, layers, specs, widths,
                                windows, k_cache, v_cache, out_slots, token_seq, positions,
                                pages, final_norm, page_size, heads, kv_heads, head_dim, eps,
                                scale, softcap, gelu, lora, lora_slots, experts, expert_specs,
                                reduce, stored);
}

// The attention of one step on its own (tests and benchmarks): qkv [T, width] of the rows, the
// layer's caches [slots, kv_heads * head_dim] holding their keys and values already.
Tensor step_attention(const Tensor& qkv, const Tensor& k_layer, const Tensor& v_layer,
                      const Tensor& pages, const Tensor& token_seq, const Tensor& positions,
                      int64_t page_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      double scale, double softcap, int64_t window) {
  TORCH_CHECK(qkv.is_contiguous() && k_layer.is_contiguous() && v_layer.is_contiguous() &&
                  qkv.scalar_type() == k_layer.scalar_type() &&
                  v_layer.scalar_type() == k_layer.scalar_type(),
              "qkv and the caches: contiguous, of one dtype");
  if (qkv.scalar_type() == at::kFloat) {
    return attention<float>(qkv, k_layer, v_layer, pages, token_seq, positions, page_size,
                            heads, kv_heads, head_dim, scale, softcap, window);
  }
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "qkv: bfloat16 or float32");
  return attention<BFloat16>(qkv, k_layer, v_layer, pages, token_seq, positions, page_size,
                             heads, kv_heads, head_dim, scale, softcap, window);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "One forward step of a Llama-style decoder (see the file's header)");
  m.def("attention", &step_attention, "The attention of one step's rows over their cache");
  m.def("planes_linear", &radixlm_cpu::planes_linear,
        "x @ W.T for int4 planes in tiles (cpu_linear.h)");
  m.def("dense_linear", &radixlm_cpu::dense_linear,
        "x @ W.T for dense tiles (cpu_linear.h)");
  m.def("pair_inputs", &radixlm_cpu::pair_inputs,
        "how this build sums bfloat16 inputs times integer planes (cpu_linear.h)");
}
