// y = x @ W.T on the CPU with a reduction order that does not depend on the number of rows:
// every output is the same sequence of float32 multiply-adds whether its row is computed
// alone, as one of 64 decode rows or inside a prefill chunk, and whichever thread computes it.
// This is what makes the CPU path deterministic (docs/deterministic.md).
//
// Why our own: torch's int4 kernel unpacks the weights again for every row (64 rows cost ~26
// times one), and its bfloat16 and float32 GEMMs choose kernels, and with them summation
// orders, by the number of rows. Here a tile of 16 output channels is unpacked once per block
// of rows and multiplied into each: fast at one row and at many, and each output's sum is
// fixed by the layout alone.
//
// Weights are tiles of 16 output channels, one channel per 32-bit lane, inputs in pairs
// (k, k + 1) for the bfloat16 dot-product instruction:
//   Integer planes (the GGUF blocks; W = sum_p (q_p - 8) * scale_p + zero_p per group): a
//   4-bit low plane and, for 5- to 8-bit codes, a high plane of HB = 1, 2 or 4 bits (the
//   codes' bits above the low four: 5-bit codes need one, 6-bit two):
//     codes  int32 [tiles, 1, K / 8, 16]: the low plane; lane j holds channel j's codes of
//            inputs k0..k0+7, the even inputs' in bits 0-15 (k0 + 2i in bits 4i..4i+3), the
//            odd ones' in bits 16-31;
//     hi     int32: [0] for one plane; HB = 4: [tiles, K / 8, 16] laid out as the low plane;
//            HB = 1 or 2: [tiles, K HB / 32, 16], input k0 + m of a word's 32 / HB in bits
//            HB m .. HB m + HB - 1 (a pair's two codes side by side);
//     scales float or float16 [tiles, K / group, S, 16] (float16 where every scale is one:
//            the files' own, except K-quants' products of two): S = 2, the low plane's then
//            the high one's; or S = 1, the low plane's, the high plane's being 16 times it
//            (the files' codes are 16 hi + lo);
//     zeros float [tiles, K / group, 16] (the planes' zeros summed); or [tiles, 16], a
//            factor per channel, when every group's zero is that factor times the low
//            plane's scale (symmetric formats: Q8_0's is 8 s, Q5_0's 120 s).
//     An output is, per group in order: the high plane's scale * part, the low plane's, where
//     part sums (q - 8) * x over the group's input pairs in order, then + zero * (x's sum
//     over the group, in order). A high plane's q is its code (0..2^HB - 1), so its layout changes
//     the bytes read, never a product or a sum.
//   dense bfloat16: weight [tiles, K / 2, 32] (lane j: channel j's weights of k and k + 1);
//   dense float32: weight [tiles, K, 16]. An output sums w * x over the inputs (pairs) in
//     order.
// x [M, K] is bfloat16 or float32; y [M, N] has x's dtype, rounded once from float32 (or is
// float32 with float_out: logits). With
// bfloat16 inputs on a CPU with AVX512-BF16 a pair is one vdpbf16ps step; elsewhere two fused
// multiply-adds: the results differ between the two kinds of CPU, never between two runs on
// one.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixlm_cpu {

constexpr int LANES = 16;
// Tiles per unit of work given to a thread.
constexpr int64_t TILES_PER_TASK = 8;
// Inputs per chunk when many rows share a tile's weights (for_each_block).
constexpr int64_t CHUNK_INPUTS = 128;

template <int N>
using Int = std::integral_constant<int, N>;

// ---------------------------------------------------------------------------------------
// Float32 lanes (float32 inputs, and bfloat16 inputs where the CPU has no AVX512-BF16).
// With AVX-512 a register; elsewhere an array whose element-wise loops the compiler
// vectorizes. Each lane is computed with the same fused multiply-adds either way.
#if defined(__AVX512F__)
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec fill(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const at::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  // Channel j's even (low half) or odd (high half) bfloat16 of 32-bit lane j.
  static Vec bf16_half(const at::BFloat16* p, bool odd) {
    const __m512i bits = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
    return {_mm512_castsi512_ps(odd ? _mm512_and_si512(bits, _mm512_set1_epi32(-65536))
                                    : _mm512_slli_epi32(bits, 16))};
  }
  // Nibble at bit `shift` of each lane of codes, as (q - 8).
  static Vec nibble(const int32_t* codes, int shift) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i bits = _mm512_loadu_si512(reinterpret_cast<const void*>(codes));
    // vpermps reads the low 4 bits of each index lane: the shifted lane is its own index.
    return {_mm512_permutexvar_ps(_mm512_srli_epi32(bits, shift), table)};
  }
  // HB-bit code at bit `shift` of each lane of a high plane's word, as (q - 8).
  template <int HB>
  static Vec bits(const int32_t* word, int shift) {
    alignas(64) static const float table[16] = {
        float((0 & ((1 << HB) - 1)) - 8), float((1 & ((1 << HB) - 1)) - 8),
        float((2 & ((1 << HB) - 1)) - 8), float((3 & ((1 << HB) - 1)) - 8),
        float((4 & ((1 << HB) - 1)) - 8), float((5 & ((1 << HB) - 1)) - 8),
        float((6 & ((1 << HB) - 1)) - 8), float((7 & ((1 << HB) - 1)) - 8),
        float((8 & ((1 << HB) - 1)) - 8), float((9 & ((1 << HB) - 1)) - 8),
        float((10 & ((1 << HB) - 1)) - 8), float((11 & ((1 << HB) - 1)) - 8),
        float((12 & ((1 << HB) - 1)) - 8), float((13 & ((1 << HB) - 1)) - 8),
        float((14 & ((1 << HB) - 1)) - 8), float((15 & ((1 << HB) - 1)) - 8)};
    const __m512i w = _mm512_loadu_si512(reinterpret_cast<const void*>(word));
    return {_mm512_permutexvar_ps(_mm512_srli_epi32(w, shift), _mm512_load_ps(table))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  Vec fma(const Vec& a, const Vec& b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }
};
#else
struct Vec {
  float v[LANES];
  static Vec zero() { return fill(0.f); }
  static Vec fill(float x) { Vec r; for (int l = 0; l < LANES; ++l) r.v[l] = x; return r; }
  static Vec load(const float* p) { Vec r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
  static Vec load(const at::Half* p) {
    Vec r;
    for (int l = 0; l < LANES; ++l) r.v[l] = static_cast<float>(p[l]);
    return r;
  }
  static Vec bf16_half(const at::BFloat16* p, bool odd) {
    Vec r;
    for (int l = 0; l < LANES; ++l) r.v[l] = static_cast<float>(p[2 * l + (odd ? 1 : 0)]);
    return r;
  }
  static Vec nibble(const int32_t* codes, int shift) {
    Vec r;
    for (int l = 0; l < LANES; ++l) {
      r.v[l] = static_cast<float>((static_cast<uint32_t>(codes[l]) >> shift) & 15u) - 8.f;
    }
    return r;
  }
  template <int HB>
  static Vec bits(const int32_t* word, int shift) {
    Vec r;
    for (int l = 0; l < LANES; ++l) {
      r.v[l] = static_cast<float>((static_cast<uint32_t>(word[l]) >> shift) &
                                  ((1u << HB) - 1u)) - 8.f;
    }
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  Vec fma(const Vec& a, const Vec& b) const {
    Vec r;
    for (int l = 0; l < LANES; ++l) r.v[l] = std::fma(a.v[l], b.v[l], v[l]);
    return r;
  }
};
#endif

#if defined(__AVX512BF16__)
constexpr bool PAIR_INSTRUCTION = true;
// 32 bfloat16s: entry e is (e mod 16) - 8, so a 16-bit index's 5th bit (the next nibble's
// lowest) does not matter.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int e = 0; e < 32; ++e) t[e] = at::BFloat16(static_cast<float>(e % 16 - 8)).x;
  return _mm512_load_si512(t);
}
// 16 bfloat16 pairs for a high plane of HB bits: entry e holds (e's low code - 8) in its low
// half and (its next code - 8) in its high half, so that a word shifted to a pair's codes is
// its own vpermd index (only the index's low 4 bits count).
template <int HB>
inline __m512i pair_table() {
  alignas(64) uint32_t t[16];
  constexpr uint32_t mask = (1u << HB) - 1u;
  for (uint32_t e = 0; e < 16; ++e) {
    const uint16_t lo = at::BFloat16(static_cast<float>(int(e & mask) - 8)).x;
    const uint16_t hi = at::BFloat16(static_cast<float>(int((e >> HB) & mask) - 8)).x;
    t[e] = lo | (static_cast<uint32_t>(hi) << 16);
  }
  return _mm512_load_si512(t);
}
#else
constexpr bool PAIR_INSTRUCTION = false;
#endif

// A block's running sums stay in registers over its inputs: loaded from out (0 at the first
// input), stored back at the end.
template <int T, int R>
inline void load_sums(Vec (&acc)[T][R], bool first, const float* out, int64_t out_stride) {
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      acc[t][r] = first ? Vec::zero() : Vec::load(out + r * out_stride + t * LANES);
    }
}

template <int T, int R>
inline void store_sums(const Vec (&acc)[T][R], float* out, int64_t out_stride) {
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r].store(out + r * out_stride + t * LANES);
}

// A plane linear's scales, float32 or float16 (widened exactly).
struct ScalesAt {
  const float* f32;
  const at::Half* f16;
  Vec load(int64_t i) const { return f16 != nullptr ? Vec::load(f16 + i) : Vec::load(f32 + i); }
  ScalesAt operator+(int64_t i) const {
    return {f32 != nullptr ? f32 + i : nullptr, f16 != nullptr ? f16 + i : nullptr};
  }
};

// Adds group g's results to the sums: acc += part_p * scale_p for the high plane (p = 1),
// then the low one (p = 0), then acc += zero * xsum. DS: the scales hold the low plane's
// only, the high plane's being 16 times it (computed here: exact, so the sums are those of
// the stored form).
template <int T, int R, int P, bool DS, typename Part>
inline void add_group(Vec (&acc)[T][R], int64_t g, const Part& part, const ScalesAt& scales,
                      const float* zeros, const float* zero_factors, const float* xsum,
                      int64_t groups, int64_t tile_groups) {
  constexpr int S = P == 2 && !DS ? 2 : 1;  // scales stored per group
  for (int t = 0; t < T; ++t) {
    const int64_t s = (t * tile_groups + g) * S * LANES;
    Vec scale[P];
    scale[0] = scales.load(s);
    const Vec zero = zero_factors != nullptr
                         ? Vec::zero().fma(Vec::load(zero_factors + t * LANES), scale[0])
                         : Vec::load(zeros + (t * tile_groups + g) * LANES);
    if constexpr (P == 2) {
      scale[1] = DS ? Vec::zero().fma(scale[0], Vec::fill(16.f)) : scales.load(s + LANES);
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (P == 2) acc[t][r] = acc[t][r].fma(part(t, 1, r), scale[1]);  // high first
      acc[t][r] = acc[t][r].fma(part(t, 0, r), scale[0]);
      acc[t][r] = acc[t][r].fma(zero, Vec::fill(xsum[r * groups + g]));
    }
  }
}

// Where a plane linear's tensors start for a block of tiles (see the header).
struct PlaneTiles {
  const int32_t* codes;  // low plane, [tiles, K / 8, 16]
  const int32_t* hi;     // high plane (HB > 0)
  ScalesAt scales;
  const float* zeros;         // per group, or nullptr with
  const float* zero_factors;  // a factor per channel
  int64_t tile_codes, tile_hi, tile_groups;
};

// The high plane's word holding input k of tile t, and the shift of k's code in it.
template <int HB>
inline const int32_t* hi_word(const PlaneTiles& w, int t, int64_t k, int* shift) {
  if constexpr (HB == 4) {  // the low plane's layout: k is even here (a pair's first)
    *shift = 4 * ((k % 8) / 2);
    return w.hi + t * w.tile_hi + (k / 8) * LANES;
  } else {
    constexpr int per_word = 32 / HB;
    *shift = HB * static_cast<int>(k % per_word);
    return w.hi + t * w.tile_hi + (k / per_word) * LANES;
  }
}

// T tiles x R rows of a plane linear (HB: the high plane's bits, 0 for none), float32 lanes:
// out[r][t * 16 + lane].
template <int T, int R, int HB, bool DS>
void planes_block(const float* x, const float* xsum, int64_t k_in, int64_t group,
                  int64_t k_begin, int64_t k_end, const PlaneTiles& w, float* out,
                  int64_t out_stride) {
  constexpr int P = HB == 0 ? 1 : 2;
  const int64_t groups = k_in / group;
  Vec acc[T][R];
  load_sums(acc, k_begin == 0, out, out_stride);
  for (int64_t g = k_begin / group; g < k_end / group; ++g) {
    Vec part[T][P][R];
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < R; ++r) part[t][p][r] = Vec::zero();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
      for (int i = 0; i < 4; ++i) {
        for (int t = 0; t < T; ++t) {
          const int32_t* c = w.codes + t * w.tile_codes + (k0 / 8) * LANES;
          Vec even[P], odd[P];
          even[0] = Vec::nibble(c, 4 * i);
          odd[0] = Vec::nibble(c, 16 + 4 * i);
          if constexpr (HB == 4) {
            int shift;
            const int32_t* h = hi_word<4>(w, t, k0 + 2 * i, &shift);
            even[1] = Vec::nibble(h, shift);
            odd[1] = Vec::nibble(h, 16 + shift);
          } else if constexpr (HB > 0) {
            int shift;
            const int32_t* h = hi_word<HB>(w, t, k0 + 2 * i, &shift);
            even[1] = Vec::bits<HB>(h, shift);
            odd[1] = Vec::bits<HB>(h, shift + HB);
          }
          for (int p = 0; p < P; ++p)
            for (int r = 0; r < R; ++r) {
              const float* xr = x + r * k_in + k0 + 2 * i;
              part[t][p][r] = part[t][p][r].fma(even[p], Vec::fill(xr[0]))
                                           .fma(odd[p], Vec::fill(xr[1]));
            }
        }
      }
    }
    add_group<T, R, P, DS>(acc, g, [&](int t, int p, int r) { return part[t][p][r]; },
                           w.scales, w.zeros, w.zero_factors, xsum, groups, w.tile_groups);
  }
  store_sums(acc, out, out_stride);
}

// T tiles x R rows of a dense bfloat16 (pairs layout) or float32 linear, float32 lanes.
template <int T, int R>
void dense_block(const float* x, int64_t k_in, int64_t k_begin, int64_t k_end,
                 const at::BFloat16* w_bf16, const float* w_f32, int64_t tile_stride,
                 float* out, int64_t out_stride) {
  Vec acc[T][R];
  load_sums(acc, k_begin == 0, out, out_stride);
  for (int64_t k = k_begin; k < k_end; k += 2) {
    for (int t = 0; t < T; ++t) {
      Vec even, odd;
      if (w_bf16 != nullptr) {
        const at::BFloat16* w = w_bf16 + t * tile_stride + k * LANES;
        even = Vec::bf16_half(w, false);
        odd = Vec::bf16_half(w, true);
      } else {
        even = Vec::load(w_f32 + t * tile_stride + k * LANES);
        odd = Vec::load(w_f32 + t * tile_stride + (k + 1) * LANES);
      }
      for (int r = 0; r < R; ++r) {
        acc[t][r] = acc[t][r].fma(even, Vec::fill(x[r * k_in + k]))
                             .fma(odd, Vec::fill(x[r * k_in + k + 1]));
      }
    }
  }
  store_sums(acc, out, out_stride);
}

#if defined(__AVX512BF16__)
// The same blocks for bfloat16 inputs, one vdpbf16ps per input pair.
template <int T, int R, int HB, bool DS>
void planes_block_pairs(const at::BFloat16* x, const float* xsum, int64_t k_in, int64_t group,
                        int64_t k_begin, int64_t k_end, const PlaneTiles& pw, float* out,
                        int64_t out_stride) {
  constexpr int P = HB == 0 ? 1 : 2;
  const int64_t groups = k_in / group;
  const __m512i table = nibble_table();
  __m512i hi_table = table;
  if constexpr (HB == 1 || HB == 2) hi_table = pair_table<HB>();
  Vec acc[T][R];
  load_sums(acc, k_begin == 0, out, out_stride);
  for (int64_t g = k_begin / group; g < k_end / group; ++g) {
    __m512 part[T][P][R];
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < R; ++r) part[t][p][r] = _mm512_setzero_ps();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
      __m512i w[T][P];
      int shift = 0;  // of input k0's code in its high-plane word (HB 1 or 2)
      for (int t = 0; t < T; ++t) {
        w[t][0] = _mm512_loadu_si512(
            reinterpret_cast<const void*>(pw.codes + t * pw.tile_codes + (k0 / 8) * LANES));
        if constexpr (HB > 0) {
          w[t][1] = _mm512_loadu_si512(
              reinterpret_cast<const void*>(hi_word<HB>(pw, t, k0, &shift)));
        }
      }
      for (int i = 0; i < 4; ++i) {
        __m512bh q[T][P];
        for (int t = 0; t < T; ++t) {
          const __m512i index = i == 0 ? w[t][0] : _mm512_srli_epi16(w[t][0], 4 * i);
          q[t][0] = (__m512bh)_mm512_permutexvar_epi16(index, table);
          if constexpr (HB == 4) {
            const __m512i hindex = i == 0 ? w[t][1] : _mm512_srli_epi16(w[t][1], 4 * i);
            q[t][1] = (__m512bh)_mm512_permutexvar_epi16(hindex, table);
          } else if constexpr (HB > 0) {
            const __m512i hindex = _mm512_srli_epi32(w[t][1], shift + 2 * HB * i);
            q[t][1] = (__m512bh)_mm512_permutexvar_epi32(hindex, hi_table);
          }
        }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * k_in + k0 + 2 * i, sizeof(pair));
          const __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
          for (int t = 0; t < T; ++t)
            for (int p = 0; p < P; ++p) {
              part[t][p][r] = _mm512_dpbf16_ps(part[t][p][r], q[t][p], xs);
            }
        }
      }
    }
    add_group<T, R, P, DS>(acc, g, [&](int t, int p, int r) { return Vec{part[t][p][r]}; },
                           pw.scales, pw.zeros, pw.zero_factors, xsum, groups,
                           pw.tile_groups);
  }
  store_sums(acc, out, out_stride);
}

template <int T, int R>
void dense_block_pairs(const at::BFloat16* x, int64_t k_in, int64_t k_begin, int64_t k_end,
                       const at::BFloat16* weight, int64_t tile_stride, float* out,
                       int64_t out_stride) {
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      acc[t][r] = k_begin == 0 ? _mm512_setzero_ps()
                               : _mm512_loadu_ps(out + r * out_stride + t * LANES);
    }
  for (int64_t k = k_begin; k < k_end; k += 2) {
    __m512bh w[T];
    for (int t = 0; t < T; ++t) {
      w[t] = (__m512bh)_mm512_loadu_si512(
          reinterpret_cast<const void*>(weight + t * tile_stride + k * LANES));
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k_in + k, sizeof(pair));
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < T; ++t) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], w[t], xs);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride + t * LANES, acc[t][r]);
}
#endif

// Calls block(T, R, first_tile, first_row, k_begin, k_end) over every tile, row and input of
// a product: the sums of T tiles x R rows over inputs [k_begin, k_end), continuing what the
// earlier inputs left in the output. T and R are chosen for speed only: how many sums are in
// flight (tiles_per_block) and how often a tile's unpacked weights are reused (R). With
// more than one block of rows the inputs go in chunks so that a chunk of the tiles' weights
// stays in the L1 cache while every row block uses it. No output's own sum depends on any of
// this: it always runs over the inputs in order.
// Tiles per block at R rows: as many as the registers hold (R * SUMS running sums and two
// unpacked weight registers per tile), a power of two so that they divide a task's tiles.
constexpr int tiles_per_block(int rows, int sums) {
  const int fit = 28 / (rows * sums + 2);
  return fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
}

template <int SUMS, typename Block>
void for_each_block(int64_t rows, int64_t tiles, int64_t k_in, int64_t chunk,
                    const Block& block) {
  // Many rows: small tasks, since the threads' shares of the tiles then balance better.
  const int64_t per_task = rows > 8 ? 2 : TILES_PER_TASK;
  const int64_t units = (tiles + per_task - 1) / per_task;
  if (rows <= 8) chunk = k_in;
  auto all_rows = [&](auto t_const, int64_t t, int64_t k_begin, int64_t k_end) {
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) block(t_const, Int<8>{}, t, r, k_begin, k_end);
    if (r + 4 <= rows) {
      block(t_const, Int<4>{}, t, r, k_begin, k_end);
      r += 4;
    }
    if (r + 2 <= rows) {
      block(t_const, Int<2>{}, t, r, k_begin, k_end);
      r += 2;
    }
    if (r < rows) block(t_const, Int<1>{}, t, r, k_begin, k_end);
  };
  auto tile_block = [&](auto t_const, int64_t t) {
    for (int64_t k = 0; k < k_in; k += chunk) all_rows(t_const, t, k, std::min(k + chunk, k_in));
  };
  auto tiles_of = [&](auto r_const, int64_t t_begin, int64_t t_end) {
    constexpr int T = tiles_per_block(decltype(r_const)::value, SUMS);
    int64_t t = t_begin;
    for (; t + T <= t_end; t += T) tile_block(Int<T>{}, t);
    for (; t < t_end; ++t) tile_block(Int<1>{}, t);
  };
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    const int64_t t_begin = begin * per_task;
    const int64_t t_end = std::min(end * per_task, tiles);
    if (rows >= 8) {
      tiles_of(Int<8>{}, t_begin, t_end);
    } else if (rows >= 4) {
      tiles_of(Int<4>{}, t_begin, t_end);
    } else if (rows >= 2) {
      tiles_of(Int<2>{}, t_begin, t_end);
    } else {
      tiles_of(Int<1>{}, t_begin, t_end);
    }
  });
}

// The product's float32 [rows, width] as [rows, n_out] of dtype (rounded once).
inline at::Tensor rounded(const at::Tensor& out, int64_t n_out, at::ScalarType dtype) {
  if (dtype == at::kFloat && out.size(1) == n_out) return out;
  return out.narrow(1, 0, n_out).to(dtype, false, true).contiguous();
}

inline std::vector<float> as_float(const at::Tensor& x) {
  const int64_t n = x.numel();
  std::vector<float> out(n);
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), x.data_ptr<float>(), n * sizeof(float));
  } else {
    const auto* p = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
  }
  return out;
}

// y [M, N] = x @ W.T for integer planes (see the header); N = n_out, the tiles hold it
// rounded up to 16.
inline at::Tensor planes_linear(const at::Tensor& x_in, const at::Tensor& codes,
                                const at::Tensor& hi, const at::Tensor& scales,
                                const at::Tensor& zeros, int64_t n_out, bool float_out) {
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k_in = x.size(1);
  const int64_t tiles = codes.size(0), groups = scales.size(1), group = k_in / groups;
  TORCH_CHECK(codes.size(1) == 1 && codes.size(2) * 8 == k_in && group % 8 == 0 &&
                  groups * group == k_in,
              "planes_linear: shapes");
  const int hb = hi.numel() == 0 ? 0 : static_cast<int>(hi.size(1) * 32 / k_in);
  const bool derived = hb > 0 && scales.size(2) == 1;
  TORCH_CHECK(hb == 0 || ((hb == 1 || hb == 2 || hb == 4) && hi.size(0) == tiles &&
                          hi.size(1) * 32 == hb * k_in),
              "planes_linear: a high plane of 1, 2 or 4 bits");
  TORCH_CHECK(scales.size(2) == (hb > 0 && !derived ? 2 : 1), "planes_linear: scales");
  const std::vector<float> xf = as_float(x);
  std::vector<float> xsum(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xf[r * k_in + k];
      xsum[r * groups + g] = s;
    }
  const int64_t width = tiles * LANES;
  const bool factors = zeros.dim() == 2;
  TORCH_CHECK(zeros.size(0) == tiles && (factors || zeros.size(1) == groups),
              "planes_linear: zeros");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scales.scalar_type() == at::kFloat, "planes_linear: scales' dtype");
  const ScalesAt scales_at{half ? nullptr : scales.data_ptr<float>(),
                           half ? scales.data_ptr<at::Half>() : nullptr};
  const PlaneTiles all{codes.data_ptr<int32_t>(), hb > 0 ? hi.data_ptr<int32_t>() : nullptr,
                       scales_at, factors ? nullptr : zeros.data_ptr<float>(),
                       factors ? zeros.data_ptr<float>() : nullptr, (k_in / 8) * LANES,
                       hb > 0 ? hi.size(1) * LANES : 0, groups};
  const int64_t tile_scales = groups * scales.size(2) * LANES;
  // Not zeroed: every block writes its outputs before it reads them.
  const at::Tensor out_t = at::empty({rows, width}, at::kFloat);
  float* out = out_t.data_ptr<float>();
  const bool pairs = PAIR_INSTRUCTION && x.scalar_type() == at::kBFloat16;
  auto run = [&](auto hb_const, auto ds_const) {
    constexpr int HB = decltype(hb_const)::value;
    constexpr bool DS = decltype(ds_const)::value;
    const int64_t chunk = std::max(group, CHUNK_INPUTS / group * group);
    for_each_block<(HB > 0 ? 2 : 1) + 1>(
        rows, tiles, k_in, chunk,
        [&](auto t_const, auto r_const, int64_t t0, int64_t r0, int64_t k0, int64_t k1) {
          constexpr int T = decltype(t_const)::value, R = decltype(r_const)::value;
          float* o = out + r0 * width + t0 * LANES;
          PlaneTiles w = all;
          w.codes += t0 * all.tile_codes;
          if (HB > 0) w.hi += t0 * all.tile_hi;
          w.scales = all.scales + t0 * tile_scales;
          if (factors) {
            w.zero_factors += t0 * LANES;
          } else {
            w.zeros += t0 * groups * LANES;
          }
#if defined(__AVX512BF16__)
          if (pairs) {
            planes_block_pairs<T, R, HB, DS>(x.data_ptr<at::BFloat16>() + r0 * k_in,
                                             xsum.data() + r0 * groups, k_in, group, k0, k1,
                                             w, o, width);
            return;
          }
#endif
          planes_block<T, R, HB, DS>(xf.data() + r0 * k_in, xsum.data() + r0 * groups, k_in,
                                     group, k0, k1, w, o, width);
        });
  };
  using Yes = std::true_type;
  using No = std::false_type;
  switch (hb) {
    case 0: run(Int<0>{}, No{}); break;
    case 1: derived ? run(Int<1>{}, Yes{}) : run(Int<1>{}, No{}); break;
    case 2: derived ? run(Int<2>{}, Yes{}) : run(Int<2>{}, No{}); break;
    default: derived ? run(Int<4>{}, Yes{}) : run(Int<4>{}, No{}); break;
  }
  return rounded(out_t, n_out, float_out ? at::kFloat : x.scalar_type());
}

// y [M, N] = x @ W.T for dense tiles: bfloat16 [tiles, K / 2, 32] or float32 [tiles, K, 16].
inline at::Tensor dense_linear(const at::Tensor& x_in, const at::Tensor& weight,
                               int64_t n_out, bool float_out) {
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k_in = x.size(1), tiles = weight.size(0);
  TORCH_CHECK(weight.numel() == tiles * k_in * LANES && k_in % 2 == 0, "dense_linear: shapes");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t width = tiles * LANES, tile_stride = k_in * LANES;
  // Not zeroed: every block writes its outputs before it reads them.
  const at::Tensor out_t = at::empty({rows, width}, at::kFloat);
  float* out = out_t.data_ptr<float>();
  const bool pairs = PAIR_INSTRUCTION && bf16 && x.scalar_type() == at::kBFloat16;
  const std::vector<float> xf = pairs ? std::vector<float>() : as_float(x);
  for_each_block<1>(rows, tiles, k_in, CHUNK_INPUTS, [&](auto t_const, auto r_const,
                                                         int64_t t0, int64_t r0, int64_t k0,
                                                         int64_t k1) {
    constexpr int T = decltype(t_const)::value, R = decltype(r_const)::value;
    float* o = out + r0 * width + t0 * LANES;
#if defined(__AVX512BF16__)
    if (pairs) {
      dense_block_pairs<T, R>(x.data_ptr<at::BFloat16>() + r0 * k_in, k_in, k0, k1,
                              weight.data_ptr<at::BFloat16>() + t0 * tile_stride, tile_stride,
                              o, width);
      return;
    }
#endif
    dense_block<T, R>(xf.data() + r0 * k_in, k_in, k0, k1,
                      bf16 ? weight.data_ptr<at::BFloat16>() + t0 * tile_stride : nullptr,
                      bf16 ? nullptr : weight.data_ptr<float>() + t0 * tile_stride,
                      tile_stride, o, width);
  });
  return rounded(out_t, n_out, float_out ? at::kFloat : x.scalar_type());
}

}  // namespace radixlm_cpu
