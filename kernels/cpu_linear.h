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
//            HB = 1 or 2 (scales derived, below): [tiles, K HB / 32, 16], of a word's 32 / HB
//            inputs k0 + 2j + e, the even ones' (e = 0) in bits HB j .. HB j + HB - 1 and
//            the odd ones' 16 bits higher, as the low plane keeps a pair 16 bits apart;
//     scales float or float16 [tiles, K / group, S, 16] (float16 where every scale is one:
//            the files' own, but not K-quants' products of two): S = 2, the low plane's
//            then the high one's; or S = 1, the low plane's, the high plane's being 16 times
//            it (the files' codes are 16 hi + lo); or int8 codes [tiles, K / group, S, 16]
//            times scale_base float16 [tiles, K / (group B), 16], one per B groups (K-quants:
//            a sub-block's 6- or 8-bit scale under its 256-input block's d);
//     zeros float [tiles, K / group, 16] (the planes' zeros summed); or [tiles, 16], a
//            factor per channel, when every group's zero is that factor times the low
//            plane's scale (symmetric formats: Q8_0's is 8 s, Q5_0's 120 s), minus, where
//            min_codes int8 [tiles, K / group, 16] and min_base float16 (negated) shaped as
//            scale_base are given, their product (K-quants' mins: Q4_K's zero is 8 s -
//            dmin m).
//     A linear may be several such segments, each a range of its outputs in its own form
//     (planes_linear).
//     An output is, per group in order: the high plane's scale * part, the low plane's, where
//     part sums (q - 8) * x over the group's input pairs in order, then + zero * (x's sum
//     over the group, in order). With a 1- or 2-bit high plane the two are one part, summing
//     (16 hi + lo - 136) * x, the 5- or 6-bit code read whole, times the low plane's scale.
//   dense bfloat16: weight [tiles, K / 2, 32] (lane j: channel j's weights of k and k + 1);
//   dense float32: weight [tiles, K, 16]. An output sums w * x over the inputs (pairs) in
//     order.
// x [M, K] is bfloat16 or float32; y [M, N] has x's dtype, rounded once from float32 (or is
// float32 with float_out: logits). With
// bfloat16 inputs on a CPU with AVX512-BF16 a pair is one vdpbf16ps step; on one with
// AVX512BW or AVX2 but no BF16 the inputs are held as int16 per group (int16_groups) and a
// pair of integer planes is one vpdpwssd step (or vpmaddwd and an add), the group's sums
// exact, so all of these give one set of bits; elsewhere (and for dense weights there) two
// fused multiply-adds. The results differ between these kinds of CPU, never between two runs
// on one.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixlm_cpu {

constexpr int LANES = 16;
// Tiles per unit of work given to a thread.
constexpr int64_t TILES_PER_TASK = 8;
// Inputs per chunk when many rows share a tile's weights (for_each_block): a tile's chunk
// (4 KB of 4-bit codes) stays in the L1 cache while each block of rows uses it. 512 rather
// than 128: a block's call then does four times the work for its fixed cost (64 rows of a
// 3072 x 576 Q4 linear on an Ice Lake VM, 2026-12-07: 7-16% faster; 2048 no faster).
constexpr int64_t CHUNK_INPUTS = 512;

template <int N>
using Int = std::integral_constant<int, N>;

// ---------------------------------------------------------------------------------------
// Float32 lanes (float32 inputs, and bfloat16 inputs where the CPU has no AVX512-BF16).
// With AVX-512 a register; with AVX2 (and FMA, F16C) two 8-lane registers; elsewhere an
// array whose element-wise loops the compiler vectorizes. Each lane is computed with the
// same fused multiply-adds either way. (On AVX2 the array form compiled to scalar widenings
// of the group constants, which took most of a linear's time.)
#if defined(__AVX512F__)
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec fill(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const at::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Vec load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
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
  // A 5- or 6-bit code read whole: its low nibble at bit `shift` of each lane of codes, its
  // HB high bits at bit `hi_shift` of each lane of hi, as (16 hi + lo) - 136, which is
  // 16 (hi - 8) + (lo - 8): the two planes' sum (exact in float32 and in bfloat16).
  // Both parts come from tables, as nibble's does: lo - 8, and 16 hi - 128 from a table
  // that repeats every 2^HB entries (so the bits above hi in the index do not matter); their
  // sum is exact. Five vector operations where widening the joined code took eight.
  template <int HB>
  static Vec joined(const int32_t* codes, int shift, const int32_t* hi, int hi_shift) {
    const __m512 low = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 high = HB == 1 ? _mm512_setr_ps(-128, -112, -128, -112, -128, -112, -128, -112,
                                                 -128, -112, -128, -112, -128, -112, -128, -112)
                                : _mm512_setr_ps(-128, -112, -96, -80, -128, -112, -96, -80,
                                                 -128, -112, -96, -80, -128, -112, -96, -80);
    const __m512i lo =
        _mm512_srli_epi32(_mm512_loadu_si512(reinterpret_cast<const void*>(codes)), shift);
    const __m512i top =
        _mm512_srli_epi32(_mm512_loadu_si512(reinterpret_cast<const void*>(hi)), hi_shift);
    return {_mm512_add_ps(_mm512_permutexvar_ps(lo, low), _mm512_permutexvar_ps(top, high))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  Vec fma(const Vec& a, const Vec& b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Two 8-lane halves (AVX2 with FMA and F16C: x86-64-v3). The same operations lane by lane as
// the other forms: exact widenings, one fused multiply-add.
struct Vec {
  __m256 lo, hi;
  static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec fill(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec load(const at::Half* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(bits)),
            _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1))};
  }
  static Vec load(const int8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
  }
  static Vec bf16_half(const at::BFloat16* p, bool odd) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i mask = _mm256_set1_epi32(-65536);
    return odd ? Vec{_mm256_castsi256_ps(_mm256_and_si256(a, mask)),
                     _mm256_castsi256_ps(_mm256_and_si256(b, mask))}
               : Vec{_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                     _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
  }
  static Vec nibble(const int32_t* codes, int shift) {
    const __m128i count = _mm_cvtsi32_si128(shift);
    const __m256i nib = _mm256_set1_epi32(15);
    const __m256 eight = _mm256_set1_ps(8.f);
    auto half = [&](const int32_t* c) {
      const __m256i q = _mm256_and_si256(
          _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), count),
          nib);
      return _mm256_sub_ps(_mm256_cvtepi32_ps(q), eight);
    };
    return {half(codes), half(codes + 8)};
  }
  template <int HB>
  static Vec joined(const int32_t* codes, int shift, const int32_t* hi, int hi_shift) {
    const __m128i count = _mm_cvtsi32_si128(shift), hi_count = _mm_cvtsi32_si128(hi_shift);
    const __m256i nib = _mm256_set1_epi32(15), top_mask = _mm256_set1_epi32((1 << HB) - 1);
    const __m256 offset = _mm256_set1_ps(136.f);
    auto half = [&](const int32_t* c, const int32_t* h) {
      const __m256i lo = _mm256_and_si256(
          _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), count),
          nib);
      const __m256i top = _mm256_and_si256(
          _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)), hi_count),
          top_mask);
      const __m256i code = _mm256_add_epi32(_mm256_slli_epi32(top, 4), lo);
      return _mm256_sub_ps(_mm256_cvtepi32_ps(code), offset);
    };
    return {half(codes, hi), half(codes + 8, hi + 8)};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  Vec fma(const Vec& a, const Vec& b) const {
    return {_mm256_fmadd_ps(a.lo, b.lo, lo), _mm256_fmadd_ps(a.hi, b.hi, hi)};
  }
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
  static Vec load(const int8_t* p) {
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
  static Vec joined(const int32_t* codes, int shift, const int32_t* hi, int hi_shift) {
    Vec r;
    for (int l = 0; l < LANES; ++l) {
      const uint32_t lo = (static_cast<uint32_t>(codes[l]) >> shift) & 15u;
      const uint32_t top = (static_cast<uint32_t>(hi[l]) >> hi_shift) & ((1u << HB) - 1u);
      r.v[l] = static_cast<float>(16u * top + lo) - 136.f;
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

// The pair instruction: a pair of 16-bit inputs (k, k + 1) times a pair of 16-bit weights,
// both products added to a 32-bit lane, in one instruction. With AVX512-BF16 the inputs are
// the bfloat16 activations and the sums float32 (vdpbf16ps). Elsewhere with AVX512BW or AVX2
// they are the activations as int16 (int16_groups) and the sums int32, exact within a group
// (vpdpwssd with AVX512-VNNI, else vpmaddwd and an add): every such CPU gets the same bits.
// The 512-bit paths read the codes from a 32-entry table with vpermw.
#if defined(__AVX512BF16__)
#define RADIXLM_PAIRS 1
struct Pairs {
  using Sum = __m512;
  static uint16_t entry(int v) { return at::BFloat16(static_cast<float>(v)).x; }
  static Sum zero() { return _mm512_setzero_ps(); }
  static Sum dot(Sum acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
};
#elif defined(__AVX512BW__)
#define RADIXLM_PAIRS 1
struct Pairs {
  using Sum = __m512i;
  static uint16_t entry(int v) { return static_cast<uint16_t>(static_cast<int16_t>(v)); }
  static Sum zero() { return _mm512_setzero_si512(); }
  static Sum dot(Sum acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// (with the 256-bit Vec above, whose halves planes_block_pairs writes)
#define RADIXLM_PAIRS_256 1
#endif

// Whether bfloat16 inputs take a pair instruction, and whether as int16 (int16_groups).
#if defined(RADIXLM_PAIRS) || defined(RADIXLM_PAIRS_256)
constexpr bool PAIR_INSTRUCTION = true;
#else
constexpr bool PAIR_INSTRUCTION = false;
#endif
#if defined(__AVX512BF16__)
constexpr bool INT16_INPUTS = false;
#else
constexpr bool INT16_INPUTS = PAIR_INSTRUCTION;
#endif
// Dense bfloat16 weights take the pair instruction on bfloat16 inputs only.
constexpr bool DENSE_PAIRS = PAIR_INSTRUCTION && !INT16_INPUTS;

// How this build sums bfloat16 inputs times integer planes: "bfloat16" pairs, "int16" pairs
// (one set of bits for the 512- and 256-bit forms) or "float32" lanes.
inline std::string pair_inputs() {
  return !PAIR_INSTRUCTION ? "float32" : INT16_INPUTS ? "int16" : "bfloat16";
}

#if defined(RADIXLM_PAIRS)
// 32 entries: entry e is (e mod 16) - 8, so a 16-bit index's 5th bit (the next nibble's
// lowest) does not matter.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int e = 0; e < 32; ++e) t[e] = Pairs::entry(e % 16 - 8);
  return _mm512_load_si512(t);
}
// 64 entries: entry e is e - 136, a joined 5- or 6-bit code's value (Vec::joined), as the
// two 32-entry halves vpermt2w indexes with 6 bits (vpermw with 5).
inline void joined_tables(__m512i* low, __m512i* high) {
  alignas(64) uint16_t t[64];
  for (int e = 0; e < 64; ++e) t[e] = Pairs::entry(e - 136);
  *low = _mm512_load_si512(t);
  *high = _mm512_load_si512(t + 32);
}
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

// A plane linear's per-group constants (see the header): each group's scales and zero for
// 16 channels, from where a block of tiles starts.
struct GroupConstants {
  // Scales [tiles, G, S, 16]: float32, float16, or int8 codes times a float16 base shared by
  // per_base consecutive groups [tiles, G / per_base, 16] (K-quants: a sub-block's scale
  // under its block's d). Every form widens or multiplies exactly (the products fit in
  // float32's 24 bits), so each holds the same float32 scales.
  const float* f32 = nullptr;
  const at::Half* f16 = nullptr;
  const int8_t* codes = nullptr;
  const at::Half* base = nullptr;
  // Zeros: float32 per group [tiles, G, 16]; or factors [tiles, 16]: a channel's zero is its
  // factor times the low scale, minus (K-quants' mins) int8 min codes [tiles, G, 16] times
  // a float16 base [tiles, G / per_base, 16] (stored negated) where those are given.
  const float* zeros = nullptr;
  const float* factors = nullptr;
  const int8_t* min_codes = nullptr;
  const at::Half* min_base = nullptr;
  int64_t groups = 0, per_base = 1;
  int S = 1;  // scales stored per group

  // Plane p's scales of group g in the block's tile t (`base`: its int8 codes' base).
  Vec scale(int t, int64_t g, int p, const Vec& base) const {
    const int64_t i = ((t * groups + g) * S + p) * LANES;
    if (codes != nullptr) return Vec::zero().fma(Vec::load(codes + i), base);
    return f16 != nullptr ? Vec::load(f16 + i) : Vec::load(f32 + i);
  }
  // Group g's zeros in tile t, given its low plane's scales (`min_base`: its min codes').
  Vec zero(int t, int64_t g, const Vec& low_scale, const Vec& min_base_t) const {
    if (factors == nullptr) return Vec::load(zeros + (t * groups + g) * LANES);
    const Vec z = Vec::zero().fma(Vec::load(factors + t * LANES), low_scale);
    if (min_codes == nullptr) return z;
    return z.fma(Vec::load(min_codes + (t * groups + g) * LANES), min_base_t);
  }
  // Tile t's bases (of the scale codes and of the min codes) for group g's block of groups.
  void bases(int t, int64_t g, Vec* scale_base, Vec* min_base_t) const {
    const int64_t b = (t * (groups / per_base) + g / per_base) * LANES;
    *scale_base = Vec::load(base + b);
    if (min_codes != nullptr) *min_base_t = Vec::load(min_base + b);
  }
  // Moves these constants on to start at tile t0. (In place: a modified copy assigned back
  // was copied with 16-byte loads over its 8-byte stores, which the CPU cannot forward, a
  // stall at every block, 2% of a batched step.)
  void skip_tiles(int64_t t0) {
    const int64_t per_tile = groups * S * LANES, bases = groups / per_base * LANES;
    if (f32 != nullptr) f32 += t0 * per_tile;
    if (f16 != nullptr) f16 += t0 * per_tile;
    if (codes != nullptr) codes += t0 * per_tile, base += t0 * bases;
    if (zeros != nullptr) zeros += t0 * groups * LANES;
    if (factors != nullptr) factors += t0 * LANES;
    if (min_codes != nullptr) min_codes += t0 * groups * LANES, min_base += t0 * bases;
  }
};

// A block of tiles' bases of the int8 scale and min codes for the current block of groups:
// widened once per block of groups (per_base of them), not once per group.
template <int T>
struct Bases {
  Vec scale[T], min[T];
  int64_t block = -1;
};

// Group g's constants for the block's tile t: its planes' scales (the high plane's second)
// and, returned, its zeros. DS: the scales hold the low plane's only, the high plane's being
// 16 times it (computed here: exact, so the sums are those of the stored form). The bases of
// int8 codes are widened once per block of groups (per_base of them), not once per group.
template <int T, int P, bool DS>
inline Vec group_constants(const GroupConstants& c, Bases<T>& bases, int t, int64_t g,
                           Vec (&scale)[P]) {
  if (c.codes != nullptr && g / c.per_base != bases.block) {
    bases.block = g / c.per_base;
    for (int u = 0; u < T; ++u) c.bases(u, g, &bases.scale[u], &bases.min[u]);
  }
  scale[0] = c.scale(t, g, 0, bases.scale[t]);
  if constexpr (P == 2) {
    scale[1] = DS ? Vec::zero().fma(scale[0], Vec::fill(16.f)) : c.scale(t, g, 1, bases.scale[t]);
  }
  return c.zero(t, g, scale[0], bases.min[t]);
}

// Adds group g's results to the sums: acc += part_p * scale_p for the high plane (p = 1),
// then the low one (p = 0), then acc += zero * xsum.
template <int T, int R, int P, bool DS, typename Part>
inline void add_group(Vec (&acc)[T][R], int64_t g, const Part& part, const GroupConstants& c,
                      Bases<T>& bases, const float* xsum, int64_t groups) {
  for (int t = 0; t < T; ++t) {
    Vec scale[P];
    const Vec zero = group_constants<T, P, DS>(c, bases, t, g, scale);
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
  GroupConstants constants;
  int64_t tile_codes, tile_hi;
};

// The high plane's word holding the pair of inputs k, k + 1 (k even) of tile t, and the
// shift of k's code in it (k + 1's is 16 more: HB = 4 has the low plane's layout; HB = 1 or
// 2 keeps the even inputs' codes of 32 / HB inputs in the word's low half, in order, and
// the odd ones' in its high half).
template <int HB>
inline const int32_t* hi_word(const PlaneTiles& w, int t, int64_t k, int* shift) {
  constexpr int per_word = HB == 4 ? 8 : 32 / HB;
  *shift = (HB == 4 ? 4 : HB) * static_cast<int>((k % per_word) / 2);
  return w.hi + t * w.tile_hi + (k / per_word) * LANES;
}

// HB = 8 names a 4-bit high plane with derived scales read together with the low one, each
// 8-bit code whole, by the int16 pair instruction only (planes_segment says when): the
// plane's layout and bits are HB = 4's.
template <int HB>
constexpr int plane_bits() { return HB == 8 ? 4 : HB; }

// Planes summed as one: a high plane of 1 or 2 bits (its scales always derived) is read
// together with the low one, each 5- or 6-bit code whole (Vec::joined), so a group has one
// part, times the low plane's scale; so is a 4-bit one as HB = 8; a 4-bit high plane is
// otherwise a part of its own.
template <int HB>
constexpr int summed_planes() { return HB == 4 ? 2 : 1; }

// T tiles x R rows of a plane linear (HB: the high plane's bits, 0 for none), float32 lanes:
// out[r][t * 16 + lane].
template <int T, int R, int HB, bool DS>
void planes_block(const float* x, const float* xsum, int64_t k_in, int64_t group,
                  int64_t k_begin, int64_t k_end, const PlaneTiles& w, float* out,
                  int64_t out_stride) {
  constexpr int P = summed_planes<HB>();
  const int64_t groups = k_in / group;
  Vec acc[T][R];
  load_sums(acc, k_begin == 0, out, out_stride);
  Bases<T> bases;
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
          if constexpr (HB == 1 || HB == 2) {
            int shift;
            const int32_t* h = hi_word<HB>(w, t, k0 + 2 * i, &shift);
            even[0] = Vec::joined<HB>(c, 4 * i, h, shift);
            odd[0] = Vec::joined<HB>(c, 16 + 4 * i, h, 16 + shift);
          } else {
            even[0] = Vec::nibble(c, 4 * i);
            odd[0] = Vec::nibble(c, 16 + 4 * i);
          }
          if constexpr (HB == 4) {
            int shift;
            const int32_t* h = hi_word<4>(w, t, k0 + 2 * i, &shift);
            even[1] = Vec::nibble(h, shift);
            odd[1] = Vec::nibble(h, 16 + shift);
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
                           w.constants, bases, xsum, groups);
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

#if defined(RADIXLM_PAIRS)
// The same blocks with the pair instruction: x the block's 16-bit inputs (bfloat16, or int16
// times mult per row and group, int16_groups), laid out by interleave_pairs; qsum: their sum
// per row and group, for codes read unsigned. A group's int32 sums
// are exact; widened to float32 (rounded only past 2^24) and times mult (a power of two),
// they take the float32 sums' place.
template <int T, int R, int HB, bool DS>
void planes_block_pairs(const uint16_t* x, const float* mult, const int32_t* qsum,
                        const float* xsum, int64_t k_in, int64_t group, int64_t k_begin,
                        int64_t k_end, const PlaneTiles& pw, float* out, int64_t out_stride) {
  constexpr int P = summed_planes<HB>();
  constexpr bool JOINED = HB == 1 || HB == 2;
  // HB = 8 (int16 inputs only): an 8-bit code 16 hi + lo read unsigned, its offset of 136
  // taken away once per group as the AVX2 version does (sum c q < 2^31 for groups up to 256)
  constexpr bool WHOLE8 = HB == 8;
  const __m512i low_byte = _mm512_set1_epi32(0x00FF00FF);
  const int64_t groups = k_in / group;
  const __m512i table = nibble_table();
  __m512i joined_low = table, joined_high = table;
  if constexpr (JOINED) joined_tables(&joined_low, &joined_high);
  // A joined code's 6-bit index: its low nibble (bits 0-3 of a 16-bit lane) from the low
  // plane, its high bits (4, 5) from the high plane.
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  Vec acc[T][R];
  load_sums(acc, k_begin == 0, out, out_stride);
  Bases<T> bases;
  for (int64_t g = k_begin / group; g < k_end / group; ++g) {
    typename Pairs::Sum part[T][P][R];
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < R; ++r) part[t][p][r] = Pairs::zero();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
      __m512i w[T][2];
      for (int t = 0; t < T; ++t) {
        w[t][0] = _mm512_loadu_si512(
            reinterpret_cast<const void*>(pw.codes + t * pw.tile_codes + (k0 / 8) * LANES));
        if constexpr (HB > 0) {
          int shift;
          w[t][1] = _mm512_loadu_si512(
              reinterpret_cast<const void*>(hi_word<plane_bits<HB>()>(pw, t, k0, &shift)));
          // JOINED: the pair k0, k0 + 1's high bits to bit 0 of each 16-bit lane
          if constexpr (JOINED) w[t][1] = _mm512_srl_epi16(w[t][1], _mm_cvtsi32_si128(shift));
        }
      }
      for (int i = 0; i < 4; ++i) {
        __m512i q[T][P];
        for (int t = 0; t < T; ++t) {
          const __m512i index = i == 0 ? w[t][0] : _mm512_srli_epi16(w[t][0], 4 * i);
          if constexpr (WHOLE8) {
            // the high nibble i to bits 4-7, the low one's bits 0-3 beside it, then the byte
            const __m512i top = i == 0   ? _mm512_slli_epi16(w[t][1], 4)
                                : i == 1 ? w[t][1]
                                         : _mm512_srli_epi16(w[t][1], 4 * i - 4);
            const __m512i code = _mm512_ternarylogic_epi32(nibbles, index, top, 0xCA);
            q[t][0] = i == 3 ? code : _mm512_and_si512(code, low_byte);
          } else if constexpr (JOINED) {
            const int hs = HB * i;  // pair i's high bits, to bits 4..
            const __m512i top = hs <= 4 ? _mm512_slli_epi16(w[t][1], 4 - hs)
                                        : _mm512_srli_epi16(w[t][1], hs - 4);
            const __m512i code = _mm512_ternarylogic_epi32(nibbles, index, top, 0xCA);
            q[t][0] = HB == 1 ? _mm512_permutexvar_epi16(code, joined_low)
                              : _mm512_permutex2var_epi16(joined_low, code, joined_high);
          } else {
            q[t][0] = _mm512_permutexvar_epi16(index, table);
          }
          if constexpr (HB == 4) {
            const __m512i hindex = i == 0 ? w[t][1] : _mm512_srli_epi16(w[t][1], 4 * i);
            q[t][1] = _mm512_permutexvar_epi16(hindex, table);
          }
        }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + (k0 + 2 * i) * R + 2 * r, sizeof(pair));
          const __m512i xs = _mm512_set1_epi32(pair);
          for (int t = 0; t < T; ++t)
            for (int p = 0; p < P; ++p) part[t][p][r] = Pairs::dot(part[t][p][r], q[t][p], xs);
        }
      }
    }
    add_group<T, R, P, DS>(acc, g, [&](int t, int p, int r) {
      if constexpr (INT16_INPUTS) {
        __m512i exact = part[t][p][r];
        if constexpr (WHOLE8) {
          exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(136 * qsum[r * groups + g]));
        }
        return Vec{_mm512_mul_ps(_mm512_cvtepi32_ps(exact),
                                 _mm512_set1_ps(mult[r * groups + g]))};
      } else {
        return Vec{part[t][p][r]};
      }
    }, pw.constants, bases, xsum, groups);
  }
  store_sums(acc, out, out_stride);
}

#endif

#if defined(__AVX512BF16__)
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

// Calls f(Int<R>, r0) for each block of rows of a product, in order: blocks of 8, then at
// most one each of 4, 2 and 1. for_each_block and interleave_pairs split rows alike.
template <typename F>
inline void for_each_row_block(int64_t rows, const F& f) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) f(Int<8>{}, r);
  if (r + 4 <= rows) {
    f(Int<4>{}, r);
    r += 4;
  }
  if (r + 2 <= rows) {
    f(Int<2>{}, r);
    r += 2;
  }
  if (r < rows) f(Int<1>{}, r);
}

// The pair instruction's inputs [rows, k_in] (16-bit, k_in even) laid out by blocks of rows:
// a block of R rows from row r0 holds input pair (k, k + 1) of its row r0 + j at 16-bit
// element r0 k_in + k R + 2 j. A block's R pairs of one step are then adjacent, at fixed
// offsets from one pointer: each becomes the broadcast operand of its dot-product
// instruction, where row-major inputs took a pointer register per row, more than x86 has
// (the compiler spilled them). The same values, so the same sums.
inline void interleave_pairs(const uint16_t* x, int64_t rows, int64_t k_in, uint16_t* out) {
  for_each_row_block(rows, [&](auto r_const, int64_t r0) {
    constexpr int R = decltype(r_const)::value;
    for (int j = 0; j < R; ++j)
      for (int64_t k = 0; k < k_in; k += 2) {
        std::memcpy(out + r0 * k_in + k * R + 2 * j, x + (r0 + j) * k_in + k, 4);
      }
  });
}

// Where row r's inputs go in that layout: its block's first row r0 and the block's rows R
// (for_each_row_block's blocks).
inline void row_block_of(int64_t rows, int64_t r, int64_t* r0, int* R) {
  for_each_row_block(rows, [&](auto r_const, int64_t first) {
    constexpr int size = decltype(r_const)::value;
    if (r >= first && r < first + size) *r0 = first, *R = size;
  });
}

// A buffer of n Ts owned by the calling thread and reused by its later calls (SLOT tells a
// call's buffers apart), so that a linear's inputs in their other forms are neither zeroed
// nor faulted in afresh at every step (about 3% of a batched step's samples went to that).
// Its contents are undefined; it keeps the largest size it was asked for.
template <typename T, int SLOT>
inline T* scratch(int64_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

template <int SUMS, typename Block>
void for_each_block(int64_t rows, int64_t tiles, int64_t k_in, int64_t chunk,
                    const Block& block) {
  // Many rows: a tile a task, since the threads' shares then balance better (a task is
  // still all the rows of a tile; one tile rather than two: +3.5% for 64 prompts on a
  // 2-core AVX2 EPYC, alternated in one process).
  const int64_t per_task = rows > 8 ? 1 : TILES_PER_TASK;
  const int64_t units = (tiles + per_task - 1) / per_task;
  if (rows <= 8) chunk = k_in;
  auto all_rows = [&](auto t_const, int64_t t, int64_t k_begin, int64_t k_end) {
    for_each_row_block(rows, [&](auto r_const, int64_t r0) {
      block(t_const, r_const, t, r0, k_begin, k_end);
    });
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
  if (rows > 8) {
    // Threads take the small tasks as they finish them (a shared counter), rather than an
    // equal share each: a thread slowed by its core's other work (a virtual machine's
    // neighbours, the Python thread) then no longer leaves the other waiting at the end.
    // Which thread runs a tile changes no sum.
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1))
        tiles_of(Int<8>{}, u * per_task, std::min((u + 1) * per_task, tiles));
    });
    return;
  }
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

// x (contiguous) as float32: its own data, or widened into a scratch buffer.
inline const float* as_float(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  const int64_t n = x.numel();
  float* out = scratch<float, 0>(n);
  const auto* p = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}

// Each row's inputs as int16 times a power of two per group of `group` inputs (mult, one per
// row and group): q = x / mult rounded to the nearest integer (ties to even), mult chosen so
// that the group's largest |q| is below 2^15. A bfloat16 input within 2^7 of its group's
// largest is held exactly (its 8 significant bits fit); a smaller one is rounded to a
// multiple of mult, an error below 2^-15 of the group's largest. A function of the row alone,
// as every sum here is. A NaN or infinity makes its group's mult NaN, so that the outputs
// are NaN as the float32 sums' would be. qsum: each group's exact sum of q; xsum: mult times
// it, for the zeros' term: the codes' offsets and the zeros then cancel as they do in the
// weights, whatever the rounding (an exact sum of x there would leave the offset, up to 136
// times a code, times the rounding).
template <typename In>
inline void int16_row(const In* x, int64_t k_in, int64_t group, uint16_t* q, int64_t pair_step,
                      float* mult, int32_t* qsum, float* xsum) {
  // A group's values, contiguous (so that its loops vectorize), then to their pairs' places
  std::vector<int32_t> values(group);
  for (int64_t g = 0; g < k_in / group; ++g, x += group) {
    // The largest |x|'s float32 bits (ordered as |x| for finite values; NaN's above all).
    uint32_t top = 0;
    for (int64_t i = 0; i < group; ++i) {
      const float v = static_cast<float>(x[i]);  // exact
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof(bits));
      top = std::max(top, bits & 0x7FFFFFFFu);
    }
    const int field = static_cast<int>(top >> 23);  // its exponent
    if (field == 255) {
      mult[g] = NAN, qsum[g] = 0, xsum[g] = NAN;
      for (int64_t i = 0; i < group; ++i) q[(g * group + i) / 2 * pair_step + i % 2] = 0;
      continue;
    }
    // |x| < 2^(field - 126), so x * 2^(141 - field) < 2^15; kept to normal float32 powers
    // (groups of |x| < 2^-112 lose precision, nothing else).
    const int up = std::min(141 - field, 126);
    const uint32_t scale_bits = static_cast<uint32_t>(up + 127) << 23;
    float scale;
    std::memcpy(&scale, &scale_bits, sizeof(scale));
    mult[g] = std::ldexp(1.f, -up);
    int32_t sum = 0;
    for (int64_t i = 0; i < group; ++i) {
      // x * scale is exact (a power of two); adding and taking away 1.5 * 2^23 rounds it to
      // an integer, to nearest, ties to even (|x * scale| < 2^15).
      const float rounded = (static_cast<float>(x[i]) * scale + 12582912.f) - 12582912.f;
      values[i] = static_cast<int32_t>(rounded);
      sum += values[i];
    }
    // input k = g group + i: its pair's place, then its half of the pair (group is even)
    uint16_t* pairs = q + g * group / 2 * pair_step;
    for (int64_t i = 0; i < group; i += 2) {
      pairs[i / 2 * pair_step] = static_cast<uint16_t>(static_cast<int16_t>(values[i]));
      pairs[i / 2 * pair_step + 1] = static_cast<uint16_t>(static_cast<int16_t>(values[i + 1]));
    }
    // |sum| < 2^15 group: exact in float32 for groups up to 2^9
    qsum[g] = sum;
    xsum[g] = static_cast<float>(sum) * mult[g];
  }
}

// int16_row for every row of x [rows, k_in] (bfloat16 or float32), rows in parallel, into
// q in the pair layout (interleave_pairs'); mult, qsum and xsum [rows, k_in / group].
inline void int16_groups(const at::Tensor& x, int64_t group, uint16_t* q, float* mult,
                         int32_t* qsum, float* xsum) {
  const int64_t rows = x.size(0), k_in = x.size(1), groups = k_in / group;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t r0;
      int R;
      row_block_of(rows, r, &r0, &R);
      uint16_t* row_q = q + r0 * k_in + 2 * (r - r0);
      const int64_t at = r * groups;
      if (x.scalar_type() == at::kFloat) {
        int16_row(x.data_ptr<float>() + r * k_in, k_in, group, row_q, 2 * R, mult + at,
                  qsum + at, xsum + at);
      } else {
        int16_row(x.data_ptr<at::BFloat16>() + r * k_in, k_in, group, row_q, 2 * R,
                  mult + at, qsum + at, xsum + at);
      }
    }
  });
}

#if defined(RADIXLM_PAIRS_256)
// planes_block_pairs on AVX2 (no AVX-512): int16 inputs, a pair of codes times a pair of
// inputs in one vpmaddwd (vpdpwssd with AVX-VNNI). A tile's 16 channels are two 8-lane
// halves, summed one after the other over a group so that a half's running sums fit the 16
// registers. Codes are read unsigned (the low nibble, and a joined code's high bits above
// it: 5-, 6- or, with HB = 8, 8-bit codes) and their offset taken away once per group:
// sum (c - offset) q = sum c q - offset sum q, exact in int32, so the sums and the bits are
// those of the 512-bit int16 path.
#if !defined(__AVXVNNI__)
// sum + vpmaddwd(c, the int16 pair at `pair` in every lane), as one asm statement. Written
// as intrinsics, GCC hoisted a step's R broadcasts ahead of their products, ran out of the
// 16 registers and kept some of the running sums on the stack: a store and a load around
// each add, a loop-carried chain through memory that bounded the loop (a third of the
// multiply rate, measured on a Zen 4 without AVX-512). Integer sums: the same bits.
inline __m256i madd_pair(__m256i sum, __m256i c, const uint16_t* pair) {
  __m256i product;
  asm("vpbroadcastd %[pair], %[product]\n\t"
      "vpmaddwd %[c], %[product], %[product]\n\t"
      "vpaddd %[product], %[sum], %[sum]"
      : [sum] "+x"(sum), [product] "=&x"(product)
      : [c] "x"(c), [pair] "m"(*reinterpret_cast<const int32_t*>(pair)));
  return sum;
}
#endif

// Group g's integer sums on half h (lanes 8h..8h+7) of the block's tiles: sum[t][p][r],
// each starting at row r's start[r * stride] (group_starts).
template <int T, int R, int HB>
inline void half_group_sums(const uint16_t* x, const int32_t* start, int64_t stride,
                            int64_t group, int64_t g, int h, const PlaneTiles& pw,
                            __m256i (&sum)[T][summed_planes<HB>()][R]) {
  constexpr int P = summed_planes<HB>();
  constexpr int BITS = plane_bits<HB>();  // of the high plane
  constexpr bool JOINED = HB == 1 || HB == 2 || HB == 8;
  const __m256i nibbles = _mm256_set1_epi16(0x000F);
  const __m256i high_bits = _mm256_set1_epi16(static_cast<int16_t>(((1 << BITS) - 1) << 4));
  for (int r = 0; r < R; ++r) {
    const __m256i first = _mm256_set1_epi32(start[r * stride]);
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p) sum[t][p][r] = first;
  }
  for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
    __m256i w[T][2];
    for (int t = 0; t < T; ++t) {
      w[t][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          pw.codes + t * pw.tile_codes + (k0 / 8) * LANES + 8 * h));
      if constexpr (HB > 0) {
        int shift;
        w[t][1] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(hi_word<BITS>(pw, t, k0, &shift) + 8 * h));
        // JOINED: the pair k0, k0 + 1's high bits to bit 0 of each 16-bit lane (HB = 8's
        // are there already: k0 is a multiple of a word's 8 inputs)
        if constexpr (JOINED && HB != 8) {
          w[t][1] = _mm256_srl_epi16(w[t][1], _mm_cvtsi32_si128(shift));
        }
      }
      if constexpr (HB == 8) {
        // Pair i's code is low nibble i of w[t][0] and high nibble i of w[t][1]. Joined
        // into bytes, pairs 0 and 2 (then 1 and 3) share a 16-bit lane, each code one
        // and or one shift away: 12 operations for a tile's four pairs, not 20.
        const __m256i low = _mm256_set1_epi16(0x0F0F);
        const __m256i high = _mm256_set1_epi16(static_cast<int16_t>(0xF0F0));
        const __m256i even = _mm256_or_si256(_mm256_and_si256(w[t][0], low),
                                             _mm256_and_si256(_mm256_slli_epi16(w[t][1], 4), high));
        w[t][1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w[t][0], 4), low),
                                  _mm256_and_si256(w[t][1], high));
        w[t][0] = even;
      }
    }
    for (int i = 0; i < 4; ++i) {
      __m256i c[T][P];
      for (int t = 0; t < T; ++t) {
        if constexpr (HB == 8) {
          const __m256i both = w[t][i % 2];  // pairs i and i + 2's codes
          c[t][0] = i < 2 ? _mm256_and_si256(both, _mm256_set1_epi16(0x00FF))
                          : _mm256_srli_epi16(both, 8);
          continue;
        }
        c[t][0] = _mm256_and_si256(_mm256_srli_epi16(w[t][0], 4 * i), nibbles);
        if constexpr (JOINED) {
          const int hs = BITS * i;  // pair i's high bits, to bits 4..
          const __m256i top = hs <= 4 ? _mm256_slli_epi16(w[t][1], 4 - hs)
                                      : _mm256_srli_epi16(w[t][1], hs - 4);
          c[t][0] = _mm256_or_si256(c[t][0], _mm256_and_si256(top, high_bits));
        }
        if constexpr (HB == 4) {
          c[t][1] = _mm256_and_si256(_mm256_srli_epi16(w[t][1], 4 * i), nibbles);
        }
      }
      for (int r = 0; r < R; ++r) {
        const uint16_t* pair = x + (k0 + 2 * i) * R + 2 * r;
#if defined(__AVXVNNI__)
        int32_t bits;
        std::memcpy(&bits, pair, sizeof(bits));
        const __m256i xs = _mm256_set1_epi32(bits);
        for (int t = 0; t < T; ++t)
          for (int p = 0; p < P; ++p)
            sum[t][p][r] = _mm256_dpwssd_avx_epi32(sum[t][p][r], c[t][p], xs);
#else
        for (int t = 0; t < T; ++t)
          for (int p = 0; p < P; ++p) sum[t][p][r] = madd_pair(sum[t][p][r], c[t][p], pair);
#endif
      }
    }
  }
}

// Where each row's integer sums of groups g_begin.. start: minus the codes' offset (Vec::
// joined's, Vec::nibble's) times the row's inputs' sum, [R, groups g_begin..g_end) (exact
// int32). Computed once a call, so that a group's start is a broadcast from memory.
template <int R, int HB>
inline const int32_t* group_starts(const int32_t* qsum, int64_t groups, int64_t g_begin,
                                   int64_t g_end) {
  constexpr int OFFSET = HB == 1 || HB == 2 || HB == 8 ? 136 : 8;
  const int64_t n = g_end - g_begin;
  int32_t* start = scratch<int32_t, 0>(R * n);
  for (int r = 0; r < R; ++r)
    for (int64_t g = g_begin; g < g_end; ++g)
      start[r * n + g - g_begin] = -OFFSET * qsum[r * groups + g];
  return start;
}

// A group's exact integer sum as float32 (rounded only past 2^24), times mult (a power of two)
inline __m256 widened(__m256i sum, __m256 mult) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), mult);
}

template <int T, int R, int HB, bool DS>
void planes_block_pairs(const uint16_t* x, const float* mult, const int32_t* qsum,
                        const float* xsum, int64_t k_in, int64_t group, int64_t k_begin,
                        int64_t k_end, const PlaneTiles& pw, float* out, int64_t out_stride) {
  constexpr int P = summed_planes<HB>();
  const int64_t groups = k_in / group;
  const int64_t g_begin = k_begin / group, g_end = k_end / group;
  const int32_t* start = group_starts<R, HB>(qsum, groups, g_begin, g_end);
  Bases<T> bases;
  if constexpr (R < 4) {
    // Few rows: both halves' float32 sums stay in registers, and each group's constants are
    // read once for both halves.
    Vec acc[T][R];
    load_sums(acc, k_begin == 0, out, out_stride);
    for (int64_t g = g_begin; g < g_end; ++g) {
      Vec part[T][P][R];
      for (int h = 0; h < 2; ++h) {
        __m256i sum[T][P][R];
        half_group_sums<T, R, HB>(x, start + g - g_begin, g_end - g_begin, group, g, h, pw,
                                  sum);
        for (int r = 0; r < R; ++r) {
          const __m256 m = _mm256_set1_ps(mult[r * groups + g]);
          for (int t = 0; t < T; ++t)
            for (int p = 0; p < P; ++p)
              (h == 0 ? part[t][p][r].lo : part[t][p][r].hi) = widened(sum[t][p][r], m);
        }
      }
      add_group<T, R, P, DS>(acc, g, [&](int t, int p, int r) { return part[t][p][r]; },
                             pw.constants, bases, xsum, groups);
    }
    store_sums(acc, out, out_stride);
    return;
  }
  // Many rows: one half at a time over all of the block's groups, its float32 sums in
  // memory (in the L1 cache), read and written once a group: the 16 registers then hold the
  // integer sums, the codes and the products. (With both halves' float sums held across the
  // inner loop, nothing was left for them: spilled, a third of the time went outside it.)
  // In a buffer of their own rather than in out, whose rows can lie a multiple of 4 KB
  // apart: each row's load would then wait on the row before's store (4K aliasing).
  alignas(32) float acc[T][R][8];
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r)
        _mm256_store_ps(acc[t][r], k_begin == 0 ? _mm256_setzero_ps()
                                                : _mm256_loadu_ps(out + r * out_stride +
                                                                  t * LANES + 8 * h));
    for (int64_t g = g_begin; g < g_end; ++g) {
      __m256i sum[T][P][R];
      half_group_sums<T, R, HB>(x, start + g - g_begin, g_end - g_begin, group, g, h, pw,
                                sum);
      // add_group's steps on this half's lanes: the high plane's part first
      for (int t = 0; t < T; ++t) {
        Vec scale[P];
        const Vec zero = group_constants<T, P, DS>(pw.constants, bases, t, g, scale);
        __m256 s[P];
        for (int p = 0; p < P; ++p) s[p] = h == 0 ? scale[p].lo : scale[p].hi;
        const __m256 z = h == 0 ? zero.lo : zero.hi;
        for (int r = 0; r < R; ++r) {
          const __m256 m = _mm256_set1_ps(mult[r * groups + g]);
          __m256 a = _mm256_load_ps(acc[t][r]);
          for (int p = P - 1; p >= 0; --p) a = _mm256_fmadd_ps(widened(sum[t][p][r], m), s[p], a);
          a = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[r * groups + g]), a);
          _mm256_store_ps(acc[t][r], a);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r)
        _mm256_storeu_ps(out + r * out_stride + t * LANES + 8 * h, _mm256_load_ps(acc[t][r]));
  }
}
#endif

// A plane linear's tensors (see the header), SEGMENT_TENSORS per segment of its outputs:
// codes, hi, scales, scale_base, zeros, min_codes, min_base ([0] where not used).
constexpr size_t SEGMENT_TENSORS = 7;

// One segment's sums: out[r][col0 + n] for its outputs n (its tiles), out's rows `width`
// apart. x: the input (bfloat16 for the pair instruction); xf: it as float32 [rows, k_in]
// (as_float), nullptr for the int16 pair path, which reads x itself.
inline void planes_segment(const at::Tensor& x, const float* xf,
                           const at::Tensor* t, float* out, int64_t width, int64_t col0) {
  const at::Tensor &codes = t[0], &hi = t[1], &scales = t[2], &scale_base = t[3],
                   &zeros = t[4], &min_codes = t[5], &min_base = t[6];
  const int64_t rows = x.size(0), k_in = x.size(1);
  const int64_t tiles = codes.size(0), groups = scales.size(1), group = k_in / groups;
  TORCH_CHECK(codes.size(1) == 1 && codes.size(2) * 8 == k_in && group % 8 == 0 &&
                  groups * group == k_in && col0 + tiles * LANES <= width,
              "planes_linear: shapes");
  const int hb = hi.numel() == 0 ? 0 : static_cast<int>(hi.size(1) * 32 / k_in);
  const bool derived = hb > 0 && scales.size(2) == 1;
  TORCH_CHECK(hb == 0 || ((hb == 1 || hb == 2 || hb == 4) && hi.size(0) == tiles &&
                          hi.size(1) * 32 == hb * k_in),
              "planes_linear: a high plane of 1, 2 or 4 bits");
  TORCH_CHECK(scales.size(2) == (hb > 0 && !derived ? 2 : 1), "planes_linear: scales");
  TORCH_CHECK(hb == 0 || hb == 4 || derived,
              "planes_linear: a 1- or 2-bit high plane's scales are derived");
  const bool pairs = PAIR_INSTRUCTION && x.scalar_type() == at::kBFloat16;
  // Each group's sum of inputs, for the zeros' term. The int16 path sums its own int16
  // inputs instead (int16_groups), so that a code's offset cancels exactly.
  std::vector<float> xsum(rows * groups);
  if (!(pairs && INT16_INPUTS))
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xf[r * k_in + k];
        xsum[r * groups + g] = s;
      }
  GroupConstants all;
  all.groups = groups;
  all.S = static_cast<int>(scales.size(2));
  const auto dtype = scales.scalar_type();
  if (dtype == at::kChar) {
    const int64_t bases = scale_base.numel() / (tiles * LANES);
    TORCH_CHECK(bases > 0 && groups % bases == 0 && scale_base.scalar_type() == at::kHalf &&
                    scale_base.numel() == tiles * bases * LANES,
                "planes_linear: int8 scales need a float16 base per block of groups");
    all.codes = scales.data_ptr<int8_t>();
    all.base = scale_base.data_ptr<at::Half>();
    all.per_base = groups / bases;
  } else if (dtype == at::kHalf) {
    all.f16 = scales.data_ptr<at::Half>();
  } else {
    TORCH_CHECK(dtype == at::kFloat, "planes_linear: scales' dtype");
    all.f32 = scales.data_ptr<float>();
  }
  TORCH_CHECK(zeros.size(0) == tiles && (zeros.dim() == 2 || zeros.size(1) == groups),
              "planes_linear: zeros");
  if (zeros.dim() == 2) {
    all.factors = zeros.data_ptr<float>();
    if (min_codes.numel() > 0) {
      TORCH_CHECK(dtype == at::kChar && min_codes.scalar_type() == at::kChar &&
                      min_codes.numel() == tiles * groups * LANES &&
                      min_base.scalar_type() == at::kHalf &&
                      min_base.numel() == scale_base.numel(),
                  "planes_linear: mins are int8 codes beside int8 scales, with a base");
      all.min_codes = min_codes.data_ptr<int8_t>();
      all.min_base = min_base.data_ptr<at::Half>();
    }
  } else {
    all.zeros = zeros.data_ptr<float>();
  }
  const PlaneTiles first{codes.data_ptr<int32_t>(), hb > 0 ? hi.data_ptr<int32_t>() : nullptr,
                         all, (k_in / 8) * LANES, hb > 0 ? hi.size(1) * LANES : 0};
  // The pair instruction's inputs: x's bfloat16s, or them as int16 per group (with mult),
  // interleaved by blocks of rows (one row is its own layout).
  std::vector<float> mult;
  std::vector<int32_t> qsum;
  const uint16_t* x_pairs = nullptr;
  if (pairs && INT16_INPUTS) {
    uint16_t* q = scratch<uint16_t, 0>(rows * k_in);
    mult.resize(rows * groups);
    qsum.resize(rows * groups);
    int16_groups(x, group, q, mult.data(), qsum.data(), xsum.data());
    x_pairs = q;
  } else if (pairs) {
    x_pairs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    if (rows > 1) {
      uint16_t* interleaved = scratch<uint16_t, 1>(rows * k_in);
      interleave_pairs(x_pairs, rows, k_in, interleaved);
      x_pairs = interleaved;
    }
  }
  (void)x_pairs;  // unused where no pair instruction is built
  auto run = [&](auto hb_const, auto ds_const) {
    constexpr int HB = decltype(hb_const)::value;
    constexpr bool DS = decltype(ds_const)::value;
    const int64_t chunk = std::max(group, CHUNK_INPUTS / group * group);
    for_each_block<summed_planes<HB>() + 1>(
        rows, tiles, k_in, chunk,
        [&](auto t_const, auto r_const, int64_t t0, int64_t r0, int64_t k0, int64_t k1) {
          constexpr int T = decltype(t_const)::value, R = decltype(r_const)::value;
          float* o = out + r0 * width + col0 + t0 * LANES;
          PlaneTiles w = first;
          w.codes += t0 * first.tile_codes;
          if (HB > 0) w.hi += t0 * first.tile_hi;
          w.constants.skip_tiles(t0);
#if defined(RADIXLM_PAIRS) || defined(RADIXLM_PAIRS_256)
          if (pairs) {
            planes_block_pairs<T, R, HB, DS>(
                x_pairs + r0 * k_in, INT16_INPUTS ? mult.data() + r0 * groups : nullptr,
                INT16_INPUTS ? qsum.data() + r0 * groups : nullptr, xsum.data() + r0 * groups,
                k_in, group, k0, k1, w, o, width);
            return;
          }
#endif
          if constexpr (HB != 8) {
            planes_block<T, R, HB, DS>(xf + r0 * k_in, xsum.data() + r0 * groups, k_in,
                                       group, k0, k1, w, o, width);
          }
        });
  };
  using Yes = std::true_type;
  using No = std::false_type;
  // 8-bit codes (a 4-bit high plane, derived scales) read whole with int16 inputs, where a
  // group's sums of them fit int32: half the products of two planes (HB = 8)
  const bool whole8 = hb == 4 && derived && pairs && INT16_INPUTS && group <= 256;
  switch (hb) {
    case 0: run(Int<0>{}, No{}); break;
    case 1: derived ? run(Int<1>{}, Yes{}) : run(Int<1>{}, No{}); break;
    case 2: derived ? run(Int<2>{}, Yes{}) : run(Int<2>{}, No{}); break;
    default:
      if constexpr (INT16_INPUTS) {
        if (whole8) {
          run(Int<8>{}, Yes{});
          break;
        }
      }
      derived ? run(Int<4>{}, Yes{}) : run(Int<4>{}, No{});
      break;
  }
}

// y [M, N] = x @ W.T for integer planes (see the header), given as SEGMENT_TENSORS tensors
// per segment: consecutive ranges of the outputs, each in its own form (a merged layer's
// parts of different GGUF types), every segment but the last a whole number of tiles.
// N = n_out; the last segment's tiles hold its outputs rounded up to 16.
inline at::Tensor planes_linear(const at::Tensor& x_in, const std::vector<at::Tensor>& tensors,
                                int64_t n_out, bool float_out) {
  TORCH_CHECK(!tensors.empty() && tensors.size() % SEGMENT_TENSORS == 0,
              "planes_linear: seven tensors per segment");
  const at::Tensor x = x_in.contiguous();
  int64_t width = 0;
  for (size_t s = 0; s < tensors.size(); s += SEGMENT_TENSORS) width += tensors[s].size(0);
  width *= LANES;
  // The int16 pair path reads x itself (int16_groups)
  const bool int16_pairs = INT16_INPUTS && x.scalar_type() == at::kBFloat16;
  const float* xf = int16_pairs ? nullptr : as_float(x);
  // Not zeroed: every block writes its outputs before it reads them. A scratch buffer unless
  // the float32 sums are themselves the result (rounded copies them out).
  const bool sums_returned = float_out && width == n_out;
  const at::Tensor out_t =
      sums_returned ? at::empty({x.size(0), width}, at::kFloat)
                    : at::from_blob(scratch<float, 1>(x.size(0) * width), {x.size(0), width},
                                    at::kFloat);
  int64_t col0 = 0;
  for (size_t s = 0; s < tensors.size(); s += SEGMENT_TENSORS) {
    planes_segment(x, xf, tensors.data() + s, out_t.data_ptr<float>(), width, col0);
    col0 += tensors[s].size(0) * LANES;
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
  const bool pairs = DENSE_PAIRS && bf16 && x.scalar_type() == at::kBFloat16;
  const float* xf = pairs ? nullptr : as_float(x);
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
    dense_block<T, R>(xf + r0 * k_in, k_in, k0, k1,
                      bf16 ? weight.data_ptr<at::BFloat16>() + t0 * tile_stride : nullptr,
                      bf16 ? nullptr : weight.data_ptr<float>() + t0 * tile_stride,
                      tile_stride, o, width);
  });
  return rounded(out_t, n_out, float_out ? at::kFloat : x.scalar_type());
}

}  // namespace radixlm_cpu
