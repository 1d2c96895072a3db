// Weight-only-stored, integer-dot quantized linear layers for x86 CPUs with AVX2 + FMA (+ VNNI).
//
// y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias). W holds groups of 32 input elements
// (G = K / 32 groups per row) with one fp16 scale (int4, q5_1: and min) per group:
//   int8: q int8 in -128..127                  w = q * scale
//   int4: q in 0..15, two per byte             w = q * scale + min
//   q5_0: q in 0..31 (GGUF Q5_0 as it is)      w = (q - 16) * scale
//   q5_1: q in 0..31 (GGUF Q5_1, Q5_K)         w = q * scale + min
//   q6_k: q in 0..63 (GGUF Q6_K as it is)      w = (q - 32) * sub[16 elements] * d[256 elements]
//   q4_k: q in 0..15 (GGUF Q4_K as it is)      w = q * d[256] * sc[32] - dmin[256] * m[32]
//
// Layout: panels of 16 output rows (the last zero-padded). A panel stores its groups in order,
// each group as 8 "quads" (elements 4k .. 4k + 3, k = 0..7) of 64 bytes: byte 4n + b of quad k
// is element 4k + b of the panel's output n. So one 64-byte vector holds a quad of 16 outputs,
// and a multiply-add against the activation row's quad k broadcast to every 32-bit lane
// (vpdpbusd, or vpmaddubsw on AVX2) leaves each lane n with output n's partial sum: a group's
// 16 dot products come out in 16 lanes with no horizontal adds, and every further activation row
// costs one multiply-add per quad on the same weight vector. (The earlier per-row layout summed
// 4 groups in the lanes of one vector and folded them, about 3x the instructions per row.)
// A group's bytes in a panel:
//   int8 512: the quads as they are (AVX-512 adds 128 to make them unsigned, see Int8Weights);
//   int4 256: 4 vectors of 64 bytes, vector c holding quad 2c in its low, 2c + 1 in its high nibbles;
//   q5_0 320: int4's nibbles, then a 64-byte plane whose byte i holds in bit k the 5th bit of
//             byte i of quad k (k = 0..7): one shift and mask give a quad's 5th bits;
//   q5_1 320: as q5_0;
//   q6_k 416: int4's nibbles (low 4 bits), 2 vectors whose byte i holds the top 2 bits of quads
//             4j .. 4j + 3 (bits 2s, 2s + 1 for quad 4j + s), then per output its two int8
//             sub-scales (the group's first and last 16 elements).
//   q4_k 256: int4's nibbles.
// Scales (and int4's and q5_1's mins) are fp16 [panels, G, 16]; q6_k's d is fp16 [panels, G / 8, 16];
// q4_k's six-bit sc and m are bytes [panels, G, 32] (16 sc, then 16 m) and its d, -dmin fp16
// [panels, G / 8, 32]: the kernel multiplies them out in fp32 (exact: 11 bits times 6).
// Each row of x is quantized on the fly to int8 per group of 32 (x ~ xq * d, as llama.cpp's
// Q8_0 activations), in element order. A group's integer dot product is exact; it is scaled by
// the weight scale times the activation scale and added to the output's fp32 sum (int4, q5_1:
// plus min * d * sum(xq)), group after group: each output is summed in the same order whatever M is
// and whichever instruction set runs, so results are batch-invariant and the same bits on AVX2
// and AVX-512. fp16 scales (as in ggml's Q8_0/Q4_1) keep int4 at 5 bits per weight, not 6.
// q5_0 and q6_k hold a GGUF's Q5_0 and Q6_K blocks repacked, at the file's own size (5.5 and
// 6.5625 bits per weight): the kernel streams no more bytes than the file holds and computes on
// the file's integers, adding no weight error (see weight_formats.py). q5_1 holds Q5_1 exactly
// (6 bits a weight, as the file) and Q5_K with its scales d * sc and dmin * m in fp16, at 6 bits
// against the file's 5.5 (as int4 holds Q4_K at 5 against 4.5).
#include "kernels.h"
#include "vec.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// The `avx512` build (layers/native.py) works on 16 outputs a vector with AVX512-VNNI's
// vpdpbusd; the `avx2` build on 8 (each panel in two halves) with vpmaddubsw +
// vpmaddwd. The integer sums are exact either way, so both give the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define kWide 1
#else
#define kWide 0
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kPanel = 16;                   // output rows per panel
constexpr int kHalves = kWide ? 1 : 2;           // vectors per panel row of 64 bytes
constexpr int kLanes = kPanel / kHalves;         // outputs per vector
constexpr int kMaxRows = kWide ? 8 : 4;          // activation rows per pass over a panel (see W::kRows)

inline int64_t num_panels(int64_t N) { return (N + kPanel - 1) / kPanel; }

// ---- The vector layer: kLanes 32-bit lanes, one output each.
#if kWide
using VI = __m512i;
using VF = __m512;
inline VI loadi(const void* p) { return _mm512_loadu_si512(p); }
inline VI zero() { return _mm512_setzero_si512(); }
inline VI add32(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI sub32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI xor_(VI a, VI b) { return _mm512_xor_si512(a, b); }
inline VI or_and(VI a, VI b, VI c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }  // a | (b & c)
inline VI bytes(char c) { return _mm512_set1_epi8(c); }
inline VI set32(int32_t v) { return _mm512_set1_epi32(v); }
template <int S> inline VI shl16(VI a) { return _mm512_slli_epi16(a, S); }
template <int S> inline VI shr16(VI a) { return _mm512_srli_epi16(a, S); }
template <int S> inline VI shl32(VI a) { return _mm512_slli_epi32(a, S); }
inline VI maddubs(VI u, VI s) { return _mm512_maddubs_epi16(u, s); }
inline VI add16(VI a, VI b) { return _mm512_add_epi16(a, b); }
inline VI madd16(VI a, VI b) { return _mm512_madd_epi16(a, b); }
inline VI widen8(const void* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF setf(float v) { return _mm512_set1_ps(v); }
inline VF zerof() { return _mm512_setzero_ps(); }
inline VF addf(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }
inline void storef(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF load_h(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VF load_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
#else
using VI = __m256i;
using VF = __m256;
inline VI loadi(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline VI zero() { return _mm256_setzero_si256(); }
inline VI add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI sub32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI xor_(VI a, VI b) { return _mm256_xor_si256(a, b); }
inline VI or_and(VI a, VI b, VI c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }
inline VI bytes(char c) { return _mm256_set1_epi8(c); }
inline VI set32(int32_t v) { return _mm256_set1_epi32(v); }
template <int S> inline VI shl16(VI a) { return _mm256_slli_epi16(a, S); }
template <int S> inline VI shr16(VI a) { return _mm256_srli_epi16(a, S); }
template <int S> inline VI shl32(VI a) { return _mm256_slli_epi32(a, S); }
inline VI maddubs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }
inline VI add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
inline VI sub16(VI a, VI b) { return _mm256_sub_epi16(a, b); }
inline VI madd16(VI a, VI b) { return _mm256_madd_epi16(a, b); }
inline VI dp_i16(VI acc, VI a, VI b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline VI shuffle8(VI a, VI idx) { return _mm256_shuffle_epi8(a, idx); }
inline VI widen8(const void* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
inline VI lanes16(__m128i v) { return _mm256_broadcastsi128_si256(v); }
inline VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF setf(float v) { return _mm256_set1_ps(v); }
inline VF zerof() { return _mm256_setzero_ps(); }
inline VF addf(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF loadf(const float* p) { return _mm256_loadu_ps(p); }
inline void storef(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF load_h(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF load_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
#endif
inline VI madd_ones(VI v) { return madd16(v, set32(0x00010001)); }
// Bit Q of each byte of v moved to bit 4 (other bits are left for the caller's mask): quad Q's
// 5th bits in a q5_0 plane.
template <int Q>
__attribute__((always_inline)) inline VI bit_to_4(VI v) {
  if constexpr (Q < 4) return shl16<4 - Q>(v);
  else if constexpr (Q > 4) return shr16<Q - 4>(v);
  else return v;
}
// An activation quad (4 int8) in every 32-bit lane.
inline VI quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return set32(v);
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// Activations quantized per group, in element order: xq int8, d (scale), s = d * sum(xq) fp32,
// sum(xq) itself, the integer sums of each group's two halves of 16 as one word (low 16
// bits: the first half; each at most 2032 in magnitude), and per half a word of the sums of its
// elements 4k, 4k + 1 (low) and 4k + 2, 4k + 3 (high): the AVX2 kernels' 16-bit offsets (the
// AVX-512 build leaves `pairs` empty); on AVX-512, -16 * sum(xq) (`start16`): Q5_0's integer
// offset (the pair tiles start their sums from it, the other tiles add it) and, times 8, int8's.
struct QuantX {
  int64_t G;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum, halves, pairs, start16;
  const int8_t* row(int64_t m) const { return q.data() + m * G * kGroup; }
};

// Quantizes one group (32 floats at x) to q (32 bytes); where `residual` is given, writes
// x - d * xq there (what the rounding left, for a second pass).
inline void quantize_group(const float* x, int8_t* q, float* d, float* s, int32_t* sum, int32_t* halves,
                           int32_t* pairs, int32_t* start16, float* residual = nullptr) {
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
               v3 = _mm256_loadu_ps(x + 24);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const float amax = hmax(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                         _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3))));
  const float dd = amax / 127.f, inv = dd > 0.f ? 1.f / dd : 0.f;
  const __m256 iv = _mm256_set1_ps(inv);
  // Round to nearest even (the default MXCSR mode), as std::nearbyint.
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
  // The packs work per 128-bit lane; the permute puts the 4-byte runs back in element order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = dd;
  // The int4 min term's sum is of the quantized values (d * sum xq, as llama.cpp's bsums), not
  // of x: then sum_i (q_i * scale + min) * xq_i * d is the product with the rounded row, whose
  // error is sum_i w_i e_i. With the exact sum, min * sum_i e_i was left over, and since int4
  // groups carry a large offset (min) that doubled the output error of an int4 linear.
  const int32_t first = hsum8_epi32(_mm256_add_epi32(i0, i1)), second = hsum8_epi32(_mm256_add_epi32(i2, i3));
  *sum = first + second;
  *s = dd * static_cast<float>(first + second);  // exact: at most 32 * 127
  *halves = static_cast<int32_t>((static_cast<uint32_t>(first) & 0xFFFFu) | (static_cast<uint32_t>(second) << 16));
#if kWide
  *start16 = -16 * (first + second);
#else
  // Per half of 16: the sums of elements 4k, 4k + 1 (low word) and 4k + 2, 4k + 3 (high word),
  // what one 16-bit lane of a quad's products covers (see Int5Weights); each at most 1016.
  const __m256i pairs8 = _mm256_hadd_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  const __m128i pairs4 = _mm_add_epi32(_mm256_castsi256_si128(pairs8), _mm256_extracti128_si256(pairs8, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(pairs), _mm_packs_epi32(pairs4, pairs4));
#endif
  if (residual) {
    const __m256 vd = _mm256_set1_ps(dd);
    const __m256 v[4] = {v0, v1, v2, v3};
    const __m256i iq[4] = {i0, i1, i2, i3};
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_ps(residual + 8 * c, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(iq[c]), vd, v[c]));
  }
}

// Rows of x as `passes` (1 or 2) quantized rows each: with 2, row 2m + 1 is the int8 rounding of
// what row 2m's left (x - d * xq, at most d / 2 an element), so the pair carries x to about
// d / 508 instead of d / 2: about 15 bits an element instead of 8 (EngineConfig.activation_rounding).
QuantX quantize_rows(const float* x, int64_t M, int64_t K, int64_t passes) {
  const int64_t G = K / kGroup, Mq = M * passes;
  QuantX out{G, std::vector<int8_t>(Mq * K), std::vector<float>(Mq * G), std::vector<float>(Mq * G),
             std::vector<int32_t>(Mq * G), std::vector<int32_t>(Mq * G), std::vector<int32_t>(kWide ? 0 : 2 * Mq * G),
             std::vector<int32_t>(kWide ? Mq * G : 0)};
  at::parallel_for(0, M * G, 512, [&](int64_t i0, int64_t i1) {
    alignas(32) float left[kGroup];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / G, g = i % G;
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t j = (m * passes + p) * G + g;
        quantize_group(p ? left : x + i * kGroup, out.q.data() + j * kGroup, &out.d[j], &out.s[j], &out.sum[j],
                       &out.halves[j], kWide ? nullptr : &out.pairs[2 * j], kWide ? &out.start16[j] : nullptr,
                       p + 1 < passes ? left : nullptr);
      }
    }
  });
  return out;
}

// The R activation rows of a tile at group g: their quantized elements and per-group values.
template <int R>
struct Rows {
  const int8_t* x[R];
  const float* d[R];
  const float* s[R];
  const int32_t* sum[R];
  const int32_t* halves[R];
  const int32_t* pairs[R];
  const int32_t* start16[R];
  Rows(const QuantX& q, int64_t m0) {
    for (int r = 0; r < R; ++r) {
      const int64_t j = (m0 + r) * q.G;
      x[r] = q.q.data() + j * kGroup;
      d[r] = q.d.data() + j;
      s[r] = q.s.data() + j;
      sum[r] = q.sum.data() + j;
      halves[r] = q.halves.data() + j;
      pairs[r] = kWide ? nullptr : q.pairs.data() + 2 * j;
      start16[r] = kWide ? q.start16.data() + j : nullptr;
    }
  }
};

#if kWide
// AVX-512: unsigned quads against each row's quad k, added into chains[k % C] and the chains'
// sum. Small tiles take two chains a row (C = 2), which halves vpdpbusd's dependency chain; from
// 5 rows on the rows' own chains are enough in flight and one a row leaves registers for 8 rows.
template <int R>
constexpr int kChains = R > 4 ? 1 : 2;

template <int R>
__attribute__((always_inline)) inline void add_quad(VI v, int k, const Rows<R>& x, int64_t g,
                                                    VI (&chains)[kChains<R>][R]) {
  constexpr int C = kChains<R>;
  for (int r = 0; r < R; ++r)
    chains[k % C][r] = _mm512_dpbusd_epi32(chains[k % C][r], v, quad(x.x[r] + g * kGroup + 4 * k));
}

template <int R>
__attribute__((always_inline)) inline void zero_chains(VI (&chains)[kChains<R>][R]) {
  for (int c = 0; c < kChains<R>; ++c)
    for (int r = 0; r < R; ++r) chains[c][r] = zero();
}

template <int R>
__attribute__((always_inline)) inline void unsigned_sums(VI (&chains)[kChains<R>][R], VI (&out)[R]) {
  for (int r = 0; r < R; ++r) {
    out[r] = chains[0][r];
    if constexpr (kChains<R> == 2) out[r] = add32(out[r], chains[1][r]);
  }
}

// A group's exact integer dot products for the R rows, one output a lane, for a format with
// `unsigned_quads` (its 8 quads as unsigned bytes) and kOffset (the signed integer is the
// unsigned one less kOffset: the dot product less kOffset * sum(xq)).
template <int R, class W>
__attribute__((always_inline)) inline void wide_dots(const W& w, const uint8_t* group, const Rows<R>& x, int64_t g,
                                                     VI (&out)[R]) {
  VI v[8], chains[kChains<R>][R];
  w.unsigned_quads(group, v);
  zero_chains<R>(chains);
  for (int k = 0; k < 8; ++k) add_quad<R>(v[k], k, x, g, chains);
  unsigned_sums<R>(chains, out);
  // The offset from the activations' -16 * sum(xq) (see pair_tile): int8's 128 = 16 * 8.
  static_assert(W::kOffset == 0 || W::kOffset == 16 || W::kOffset == 128, "offsets: none, Q5_0's 16 or int8's 128");
  if constexpr (W::kOffset == 16)
    for (int r = 0; r < R; ++r) out[r] = add32(out[r], _mm512_set1_epi32(x.start16[r][g]));
  else if constexpr (W::kOffset == 128)
    for (int r = 0; r < R; ++r) out[r] = add32(out[r], shl32<3>(_mm512_set1_epi32(x.start16[r][g])));
}

// A group's 4 nibble vectors at w (int4, q5_0, q6_k) unpacked: quads 2c (low nibbles) and
// 2c + 1 (high) of vector c. (AVX2 unpacks them one vector at a time, see add_pairs.)
__attribute__((always_inline)) inline void nibbles(const uint8_t* w, VI (&v)[8]) {
  const VI lo4 = bytes(0x0F);
  for (int c = 0; c < 4; ++c) {
    const VI b = loadi(w + 64 * c);
    v[2 * c] = and_(b, lo4);
    v[2 * c + 1] = and_(shr16<4>(b), lo4);
  }
}
#endif

// f(std::integral_constant<int, C>) for C = 0 .. 3: the nibble vectors of a group, each with
// its own compile-time shifts (q5_0's and q6_k's high bits).
template <class F>
__attribute__((always_inline)) inline void each_vector(F&& f) {
  f(std::integral_constant<int, 0>{});
  f(std::integral_constant<int, 1>{});
  f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 3>{});
}

#if !kWide
// AVX2's 16 registers: a group's quads are unpacked one nibble vector at a time (quads 2c and
// 2c + 1), for both halves of the panel, and used at once against every row: each activation
// quad is broadcast once for the panel's 16 outputs. With all 8 quads unpacked first, half by
// half, the compiler spilled most products to the stack, and broadcasting each quad once per
// half of 8 outputs cost a quarter of the kernel's time on a Zen 4 held to AVX2.
// Each row's products of quads lo[h] and hi[h], summed in 16-bit lanes of acc[h].
template <int R>
__attribute__((always_inline)) inline void add_pairs(const VI (&lo)[2], const VI (&hi)[2], int c, const Rows<R>& x,
                                                     int64_t g, VI (&acc)[2][R]) {
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x.x[r] + g * kGroup + 8 * c;
    const VI xl = quad(xr), xh = quad(xr + 4);
    for (int h = 0; h < 2; ++h) acc[h][r] = add16(acc[h][r], add16(maddubs(lo[h], xl), maddubs(hi[h], xh)));
    asm("" : "+x"(acc[0][r]), "+x"(acc[1][r]));  // keeps each sum a chain: reassociated, all products were live at once
  }
}
#endif

// Calls of several tiles a panel on AVX2 decode each panel once (decode_panel) into its groups'
// unsigned quads, as `quads<C>` unpacks them: kDecoded bytes a group, for C = 0 .. 3 the two
// halves' quads 2C then 2C + 1. Their tiles load those bytes where a tile would unpack the group
// itself, once per 4 rows. Same integers, same bits. On a Zen 1 EPYC (the two builds alternated
// in one process, synthetic weights): q5_0 4864 x 896 1.32-1.36x at 512 rows, 1.18x at 16,
// 1.05-1.06x at 5-7; q6_k 8960 x 1536 1.24-1.27x at 512, 1.15x at 16, 1.02x at 6.
constexpr int64_t kDecoded = 8 * 64;

#if !kWide
// Quads 2C (lo) and 2C + 1 (hi) of the group at src, both halves: decoded bytes (kDec) or unpacked.
template <bool kDec, int C, class W>
__attribute__((always_inline)) inline void group_quads(const W& w, const uint8_t* src, VI (&lo)[2], VI (&hi)[2]) {
  if constexpr (kDec) {
    for (int h = 0; h < 2; ++h) {
      lo[h] = loadi(src + 128 * C + 32 * h);
      hi[h] = loadi(src + 128 * C + 64 + 32 * h);
    }
  } else {
    w.template quads<C>(src, lo, hi);
  }
}
#endif

// The weight formats give, for group g of panel p, each tile row's exact integer dot product with
// the group's weights as stored (for q5_0 and int8 with their offsets taken off), one output a
// lane of out[h] (h: the panel's half on AVX2); `scales` the floats each dot product is
// multiplied by, and, where kHasMin, `mins` the offsets times the row's d * sum(xq). With kDec
// (AVX2 formats with kDecodes) the group's quads come from `dec`, the panel's decoded bytes.
struct Int8Weights {
  static constexpr bool kDecodes = false;  // its bytes are its quads: there is nothing to unpack
  static constexpr bool kHasMin = false;
  static constexpr int64_t kBytes = 8 * 64;
  static constexpr int kPrefetchRows = kWide ? 3 : 1;  // see kPrefetchL1
  static constexpr int kRows = kMaxRows;
#if kWide
  // vpdpbusd multiplies unsigned by signed bytes: q + 128 (0..255) is unsigned, and the
  // 128 * sum(xq) it adds is taken off (kOffset).
  static constexpr int kOffset = 128;
  static constexpr bool kPairTiles = false;  // nothing to unpack: slower as pairs (see pair_tile)
  __attribute__((always_inline)) inline void unsigned_quads(const uint8_t* w, VI (&v)[8]) const {
    for (int k = 0; k < 8; ++k) v[k] = xor_(loadi(w + 64 * k), bytes(static_cast<char>(0x80)));
  }
#endif
  const int8_t* q; const at::Half* scale; int64_t G;
  const uint8_t* group(int64_t p, int64_t g) const { return reinterpret_cast<const uint8_t*>(q) + (p * G + g) * kBytes; }
  VF scales(int64_t p, int64_t g, int h) const { return load_h(scale + (p * G + g) * kPanel + h * kLanes); }
  template <int R, bool kDec = false>
  __attribute__((always_inline)) inline void dots(int64_t p, int64_t g, const Rows<R>& x, VI (&out)[kHalves][R],
                                                  const uint8_t* dec = nullptr) const {
    const uint8_t* w = group(p, g);
#if kWide
    wide_dots<R>(*this, w, x, g, out[0]);
#else
    // |q| as unsigned and the sign moved onto x: a pair of products is at most 2 * 128 * 127.
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) out[h][r] = zero();
    for (int k = 0; k < 8; ++k) {
      const VI wv[2] = {loadi(w + 64 * k), loadi(w + 64 * k + 32)};
      const VI w_abs[2] = {_mm256_sign_epi8(wv[0], wv[0]), _mm256_sign_epi8(wv[1], wv[1])};
      for (int r = 0; r < R; ++r) {
        const VI xq = quad(x.x[r] + g * kGroup + 4 * k);
        for (int h = 0; h < 2; ++h)
          out[h][r] = add32(out[h][r], madd_ones(maddubs(w_abs[h], _mm256_sign_epi8(xq, wv[h]))));
      }
    }
#endif
  }
};

// Weights with an fp16 scale and offset (min) per output and group, kGroupBytes a group (int4's
// and the five-bit formats' layout): where group g of panel p and its scales are.
template <int64_t kGroupBytes>
struct ScaledGroups {
  static constexpr int64_t kBytes = kGroupBytes;
  const uint8_t* q; const at::Half* scale; const at::Half* min; int64_t G;
  const uint8_t* group(int64_t p, int64_t g) const { return q + (p * G + g) * kBytes; }
  VF scales(int64_t p, int64_t g, int h) const { return load_h(scale + (p * G + g) * kPanel + h * kLanes); }
  VF mins(int64_t p, int64_t g, int h) const { return load_h(min + (p * G + g) * kPanel + h * kLanes); }
};

struct Int4Weights : ScaledGroups<4 * 64> {
  static constexpr bool kHasMin = true;
  // Its nibbles unpack in 3 instructions a vector, less than loading decoded bytes costs: on a
  // Zen 1, 8960 x 1536, decoded panels ran 1.005x at 512 rows and 0.89-0.94x at 6-16.
  static constexpr bool kDecodes = false;
  static constexpr int kPrefetchRows = 1;
  static constexpr int kRows = kMaxRows;
#if kWide
  static constexpr int kOffset = 0;  // its offset is the min, a float term
  static constexpr bool kPairTiles = true;
  static constexpr bool kSubSums = false;
  static constexpr int kPairRows = 6;  // 12 integer and 12 fp32 sums, 2 weight vectors, a broadcast: 27 registers
  __attribute__((always_inline)) inline void unsigned_quads(const uint8_t* w, VI (&v)[8]) const { nibbles(w, v); }
#endif
  template <int R, bool kDec = false>
  __attribute__((always_inline)) inline void dots(int64_t p, int64_t g, const Rows<R>& x, VI (&out)[kHalves][R],
                                                  const uint8_t* dec = nullptr) const {
    const uint8_t* w = group(p, g);
#if kWide
    wide_dots<R>(*this, w, x, g, out[0]);
#else
    // All 8 quads' products (at most 2 * 15 * 127 a pair, 30480 in all) fit a 16-bit lane.
    const uint8_t* src = kDec ? dec + g * kDecoded : w;
    VI acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = zero();
    each_vector([&](auto c) {
      VI lo[2], hi[2];
      group_quads<kDec, decltype(c)::value>(*this, src, lo, hi);
      add_pairs<R>(lo, hi, decltype(c)::value, x, g, acc);
    });
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) out[h][r] = madd_ones(acc[h][r]);
#endif
  }
#if !kWide
  template <int C>
  __attribute__((always_inline)) inline void quads(const uint8_t* w, VI (&lo)[2], VI (&hi)[2]) const {
    const VI lo4 = bytes(0x0F);
    for (int h = 0; h < 2; ++h) {
      const VI b = loadi(w + 64 * C + 32 * h);
      lo[h] = and_(b, lo4);
      hi[h] = and_(shr16<4>(b), lo4);
    }
  }
#endif
};

// Q4_K: int4's nibbles and dot products; each group's scale d * sc and offset -dmin * m are
// multiplied out here from the file's six-bit sc, m and its fp16 d, dmin per 8 groups.
struct Int4KWeights : Int4Weights {
  const uint8_t* six; const at::Half* supers;
  Int4KWeights(const uint8_t* q, const uint8_t* six, const at::Half* supers, int64_t G)
      : Int4Weights{{q, nullptr, nullptr, G}}, six(six), supers(supers) {}
  VF scales(int64_t p, int64_t g, int h) const { return product(p, g, 0, h); }
  VF mins(int64_t p, int64_t g, int h) const { return product(p, g, kPanel, h); }
  VF product(int64_t p, int64_t g, int64_t half, int h) const {
    return mul(load_h(supers + (p * (G / 8) + g / 8) * 2 * kPanel + half + h * kLanes),
               load_u8(six + (p * G + g) * 2 * kPanel + half + h * kLanes));
  }
};

// Five-bit q = nibble | 5th bit << 4 in 0..31. Q5_0 (kMin false): w = (q - 16) * scale, the
// unsigned q's dot product less 16 * sum(xq), in the integers. Q5_1 / Q5_K (kMin true): w = q *
// scale + min, the unsigned q's dot product and int4's min term.
template <bool kMin>
struct Int5Weights : ScaledGroups<4 * 64 + 8 * 8> {
  static constexpr bool kHasMin = kMin;
  static constexpr bool kDecodes = true;
  static constexpr int kPrefetchRows = 1;
  static constexpr int kRows = kMaxRows;
#if kWide
  static constexpr int kOffset = kMin ? 0 : 16;  // Q5_0: (q - 16) * xq
  static constexpr bool kPairTiles = true;
  static constexpr bool kSubSums = false;
  static constexpr int kPairRows = 6;
  __attribute__((always_inline)) inline void unsigned_quads(const uint8_t* w, VI (&v)[8]) const {
    const VI bit = bytes(0x10);
    const VI plane = loadi(w + 256);
    nibbles(w, v);
    each_vector([&](auto c) {
      constexpr int C = decltype(c)::value;
      v[2 * C] = or_and(v[2 * C], bit_to_4<2 * C>(plane), bit);
      v[2 * C + 1] = or_and(v[2 * C + 1], bit_to_4<2 * C + 1>(plane), bit);
    });
  }
#endif
  template <int R, bool kDec = false>
  __attribute__((always_inline)) inline void dots(int64_t p, int64_t g, const Rows<R>& x, VI (&out)[kHalves][R],
                                                  const uint8_t* dec = nullptr) const {
    const uint8_t* w = group(p, g);
#if kWide
    wide_dots<R>(*this, w, x, g, out[0]);
#else
    // All 8 quads' products summed in 16-bit lanes, wrapping: a lane's true sum S (16 products
    // of q in 0..31) may not fit, but S - 16 * (the lane's activation sum) = sum (q - 16) * xq,
    // at most 16 * 16 * 127 = 32512 in magnitude, does, so the wrapped difference is exact.
    const uint8_t* src = kDec ? dec + g * kDecoded : w;
    VI acc[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) acc[h][r] = zero();
    each_vector([&](auto c) {
      VI lo[2], hi[2];
      group_quads<kDec, decltype(c)::value>(*this, src, lo, hi);
      add_pairs<R>(lo, hi, decltype(c)::value, x, g, acc);
    });
    for (int r = 0; r < R; ++r) {
      const VI off = shl16<4>(add16(set32(x.pairs[r][2 * g]), set32(x.pairs[r][2 * g + 1])));
      for (int h = 0; h < 2; ++h) out[h][r] = madd_ones(sub16(acc[h][r], off));
      if constexpr (kMin)  // q * scale + min: the 16 * sum(xq) taken off above goes back
        for (int h = 0; h < 2; ++h) out[h][r] = add32(out[h][r], shl32<4>(set32(x.sum[r][g])));
    }
#endif
  }
#if !kWide
  template <int C>
  __attribute__((always_inline)) inline void quads(const uint8_t* w, VI (&lo)[2], VI (&hi)[2]) const {
    const VI lo4 = bytes(0x0F), bit = bytes(0x10);
    for (int h = 0; h < 2; ++h) {
      const VI b = loadi(w + 64 * C + 32 * h), plane = loadi(w + 256 + 32 * h);
      lo[h] = or_and(and_(b, lo4), bit_to_4<2 * C>(plane), bit);
      hi[h] = or_and(and_(shr16<4>(b), lo4), bit_to_4<2 * C + 1>(plane), bit);
    }
  }
#endif
};

// Q6_K: q in 0..63, w = (q - 32) * sub * d, an int8 sub-scale per 16 elements (quads 0-3, 4-7)
// and an fp16 d per 8 groups. AVX2 sums each half's (q - 32) * xq in 16 bits and multiplies it
// by the half's sub-scale in vpmaddwd; AVX-512 sums each half's q * xq in 32 bits (vpdpbusd),
// multiplies in vpmulld and takes off 32 * (sub_0 * h_0 + sub_1 * h_1), with h the row's half
// sums: the same integers.
// A group's result, at most 32 * 32 * 127 * 128 < 2^24, is exact in fp32.
struct Int6KWeights {
  static constexpr bool kHasMin = false;
  static constexpr bool kDecodes = true;
  static constexpr int64_t kBytes = 4 * 64 + 2 * 64 + 32;
  static constexpr int kPrefetchRows = 1;
  // Two sums a row (one per sub-scale) and the 8 unpacked vectors leave AVX-512's 32 registers
  // room for 6 rows: at 8 they spilled (1.6x slower); summing the halves one after the other
  // fit 8 rows but was no faster at 8 and 5-10% slower at 5 and 512.
  static constexpr int kRows = kWide ? 6 : kMaxRows;
#if kWide
  static constexpr int kOffset = 0;  // its offsets are per sub-scale (kSubSums)
  static constexpr bool kPairTiles = true;
  static constexpr bool kSubSums = true;
  static constexpr int kPairRows = 4;  // 16 integer and 8 fp32 sums (5 rows spilled: 0.42x)
  __attribute__((always_inline)) inline void unsigned_quads(const uint8_t* w, VI (&v)[8]) const {
    nibbles(w, v);
    const VI top = bytes(0x30), t0 = loadi(w + 256), t1 = loadi(w + 320);
    const VI tops[8] = {shl16<4>(t0), shl16<2>(t0), t0, shr16<2>(t0), shl16<4>(t1), shl16<2>(t1), t1, shr16<2>(t1)};
    for (int k = 0; k < 8; ++k) v[k] = or_and(v[k], tops[k], top);
  }
#endif
  const uint8_t* q; const at::Half* d; int64_t G;
  const uint8_t* group(int64_t p, int64_t g) const { return q + (p * G + g) * kBytes; }
  static const uint8_t* sub_scales(const uint8_t* group) { return group + 384; }
  VF scales(int64_t p, int64_t g, int h) const { return load_h(d + (p * (G / 8) + g / 8) * kPanel + h * kLanes); }
  template <int R, bool kDec = false>
  __attribute__((always_inline)) inline void dots(int64_t p, int64_t g, const Rows<R>& x, VI (&out)[kHalves][R],
                                                  const uint8_t* dec = nullptr) const {
    const uint8_t* w = group(p, g);
    // 16-bit lanes 2n, 2n + 1: output n's two sub-scales (those of the group's first and last 16
    // elements); per half on AVX2.
    VI subs[kHalves];
    for (int h = 0; h < kHalves; ++h) subs[h] = widen8(sub_scales(w) + h * 16);
#if kWide
    // vpdpbusd sums each half of 16 elements in 32 bits (at most 16 * 63 * 127), which vpmulld
    // multiplies by the half's sub-scale: 8 + 2 instructions a row where the 16-bit route took 16.
    VI v[8];
    unsigned_quads(w, v);
    const VI sub0 = _mm512_srai_epi32(shl32<16>(subs[0]), 16), sub1 = _mm512_srai_epi32(subs[0], 16);
    VI chains[2][R];
    for (int r = 0; r < R; ++r) chains[0][r] = chains[1][r] = zero();
    for (int k = 0; k < 8; ++k)
      for (int r = 0; r < R; ++r)
        chains[k / 4][r] = _mm512_dpbusd_epi32(chains[k / 4][r], v[k], quad(x.x[r] + g * kGroup + 4 * k));
    for (int r = 0; r < R; ++r)
      out[0][r] = sub32(add32(_mm512_mullo_epi32(chains[0][r], sub0), _mm512_mullo_epi32(chains[1][r], sub1)),
                        shl32<5>(madd16(subs[0], set32(x.halves[r][g]))));
#else
    // Each half's sub-scale broadcast to both 16-bit lanes of its output, for vpmaddwd.
    VI first[2], second[2];
    for (int h = 0; h < 2; ++h) {
      first[h] = shuffle8(subs[h], lanes16(_mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13)));
      second[h] = shuffle8(subs[h], lanes16(_mm_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15)));
    }
    // Each sub-block's 4 quads summed in 16-bit lanes, wrapping: less 32 * the lane's activation
    // sum that is sum (q - 32) * xq over 8 products, at most 8 * 32 * 127 = 32512 in magnitude,
    // exact in the wrapped lane; vpmaddwd then multiplies it by the sub-scale, once a sub-block.
    const uint8_t* src = kDec ? dec + g * kDecoded : w;
    VI acc[2][R];
    each_vector([&](auto c) {
      constexpr int C = decltype(c)::value;
      if constexpr (C % 2 == 0)
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < R; ++r) acc[h][r] = zero();
      VI lo[2], hi[2];
      group_quads<kDec, C>(*this, src, lo, hi);
      add_pairs<R>(lo, hi, C, x, g, acc);
      if constexpr (C % 2 == 1)
        for (int r = 0; r < R; ++r) {
          const VI off = shl16<5>(set32(x.pairs[r][2 * g + C / 2]));
          for (int h = 0; h < 2; ++h) {
            const VI t = madd16(sub16(acc[h][r], off), C < 2 ? first[h] : second[h]);
            out[h][r] = C < 2 ? t : add32(out[h][r], t);
          }
        }
    });
#endif
  }
#if !kWide
  template <int C>
  __attribute__((always_inline)) inline void quads(const uint8_t* w, VI (&lo)[2], VI (&hi)[2]) const {
    const VI lo4 = bytes(0x0F), top = bytes(0x30);
    for (int h = 0; h < 2; ++h) {
      const VI b = loadi(w + 64 * C + 32 * h), t = loadi(w + 256 + 64 * (C / 2) + 32 * h);
      // Top vector C / 2 holds quad 2C's bits at 2s, 2s + 1 with s = 2C % 4, quad 2C + 1's at s + 1.
      lo[h] = or_and(and_(b, lo4), C % 2 ? t : shl16<4>(t), top);
      hi[h] = or_and(and_(shr16<4>(b), lo4), C % 2 ? shr16<2>(t) : shl16<2>(t), top);
    }
  }
#endif
};

// Software prefetches in the weight stream. Each thread reads its panels' weights as one
// sequential stream, yet the hardware prefetchers alone left the kernel short of memory
// bandwidth. Each group's bytes are asked for twice: 8 KiB ahead into L2, which covers the
// memory's latency, and 1 KiB ahead into L1, from L2. With one prefetch into L1 2 KiB ahead
// (the best single distance), q6_k streamed at 13-15 GB/s against int4's 17-19 and fell further
// with each row; both prefetches (then 4 KiB into L2) brought q6_k to 18-20 GB/s and made the
// 1.5B's verification steps of 2-4 rows 7-11% faster on a Sapphire Rapids class Xeon (1, 2, 4,
// 6 or 8 KiB into L1 alone, or 3-8 KiB into L2 alone, did worse; scratch benchmark over 0.7 GB
// of distinct weights a format). On a Zen 4 EPYC, whose threads read about 1.5x faster, 8 KiB
// into L2 made single-stream decode 4-7% faster on the 0.5B and 6-24% on the 1.5B than 4 KiB
// (one process, the distances alternated between generations; 2 KiB into L1 or 12-16 KiB
// into L2 were no better), and 4-row kernels 3-13%. Not re-measured on the Xeon.
// The AVX-512 kernel's int8 at 1 and 2 rows is the exception (W::kPrefetchRows): its group is
// the least work a byte (a load, an xor and a vpdpbusd a vector), and 16 prefetches a group held
// it back. On the Zen 4, weights on huge pages (as the engine places them), one process, the two
// alternated: 1 row 28.6 against 23.3 GB/s (the read probe at 30) and 44 against 33 (probe at
// 55); the 0.5B's linears at 1 row (its Q8_0 output head is 37% of their bytes) 1.135x. From 3
// rows on its prefetches pay again (4 rows 28.5 against 27.1). The AVX2 kernel keeps them at
// every row count: on the Zen 4 held to AVX2 they made no difference from memory, and on an
// AVX2-only Zen 1 EPYC (weaker hardware prefetchers) the 0.5B's Q8_0 head streamed at 22.7
// against 12.8 GB/s at 1 row with them (6 alternated rounds, the read probe at 25).
// Tiles of 1 row on a Zen 4 with the AVX-512 kernels are the other exception, set at load
// (native.one_row_prefetch): 4 KiB ahead into L1 and nothing into L2. A 1-row tile is the least
// work a byte after int8's, and its prefetches into L2 held a core's stream at about 23 GB/s
// where a plain read ran at 28-30; into L1 alone it reached the plain read's rate. One thread,
// weights on huge pages, 24 layers of the 0.5B's linears (10 of the 1.5B's for q6_k), 15
// alternated rounds, median of the paired ratios (2026-12-04): int4 1.23x (28.1 against 23.3
// GB/s), q5_0 1.07x, q6_k 1.16x; 3, 6 or 8 KiB did about as well. The draft model (0.5B, int4)
// decoded at 78.6-81.0 tok/s on 1 thread against 66.5-69.4 (3 rounds). At 2 and 4 rows L1 alone
// was 0.87-0.89x (both prefetches stay there), and the AVX2 kernels on the same Zen 4 gained or
// lost by format (int8 1.26x, int4 1.09x, q5_0 0.90x, q6_k 0.85x), so they keep the default.
// On a Zen 5 EPYC tiles of 2 rows stream best with the 1-row distances too (g_light_rows 2, set
// at load: native.light_rows): a 1.5B forward of 2 rows 1.07x, the 0.5B's 1.05x, its int4 draft's
// 1.04x; 3-4 rows 1.01-1.03x, 5 and 8 rows 0.98x, so those keep both prefetches (the distances
// alternated forward by forward in one process, 25 pairs each). A speculative 1.5B + 0.5B
// generation (2-row verifications and draft catch-ups) ran 1.015x.
// Prefetches never fault, so the last panels' reach past the end is harmless.
struct PrefetchDistances {
  int64_t l1 = 1024, l2 = 8192;  // bytes ahead; 0: none at that level
};
PrefetchDistances g_prefetch[2];  // [0]: tiles of up to g_light_rows rows, [1]: of more (native.py sets [0] at load)
int64_t g_light_rows = 1;

// The `bytes` of a group, asked for l2 bytes ahead into L2 and l1 ahead into L1 (0: none).
HS_PREFETCH void prefetch_group(const uint8_t* group, int64_t bytes, int64_t l1, int64_t l2) {
  const char* here = reinterpret_cast<const char*>(group);
  if (l2)
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(here + l2 + l, _MM_HINT_T1);
  if (l1)
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(here + l1 + l, _MM_HINT_T0);
}

// Sums of outputs n0 .. n0 + kLanes - 1 (those below N) for rows m0 .. m0 + R - 1 into y, plus the bias.
template <int R>
__attribute__((always_inline)) inline void store_lanes(const VF (&acc)[R], int64_t m0, int64_t n0, int64_t N,
                                                       const float* bias, float* y) {
  const int64_t valid = std::min<int64_t>(kLanes, N - n0);
  // A whole panel (half on AVX2): one vector a row, the bias or + 0 added as the loop below adds
  // them (the same bits). The loop alone took about 2% of q5_0's time at 512 rows and K = 896, and
  // 5-20% of 1-row tiles on weights in cache (Zen 5, both builds alternated in one process).
  if (valid == kLanes) {
    const VF b = bias ? loadf(bias + n0) : zerof();
    for (int r = 0; r < R; ++r) storef(y + (m0 + r) * N + n0, addf(acc[r], b));
    return;
  }
  for (int r = 0; r < R && valid > 0; ++r) {
    alignas(64) float out[kLanes];
    storef(out, acc[r]);
    float* yr = y + (m0 + r) * N + n0;
    for (int64_t j = 0; j < valid; ++j) yr[j] = out[j] + (bias ? bias[n0 + j] : 0.f);
  }
}

// Panel p's outputs against activation rows m0 .. m0 + R - 1, group after group. On AVX2 a
// panel's two halves of 8 outputs run in the same pass over its groups (tiles of up to 4 rows
// keep both halves' sums in registers): in two passes, memory sat idle during the second.
template <int R, class W, bool kDec = false>
void tile(const W& w, const QuantX& xq, int64_t m0, int64_t p, int64_t N, const float* bias, float* y,
          const uint8_t* dec = nullptr) {
  const Rows<R> x(xq, m0);
  VF acc[kHalves][R];
  for (int h = 0; h < kHalves; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = zerof();
  const PrefetchDistances& pf = g_prefetch[R > g_light_rows];
  const int64_t l1 = pf.l1, l2 = pf.l2;
  for (int64_t g = 0; g < w.G; ++g) {
    if constexpr (R >= W::kPrefetchRows && !kDec) prefetch_group(w.group(p, g), W::kBytes, l1, l2);
    VI dots[kHalves][R];
    w.template dots<R, kDec>(p, g, x, dots, dec);
    for (int h = 0; h < kHalves; ++h) {
      const VF ws = w.scales(p, g, h);
      for (int r = 0; r < R; ++r) acc[h][r] = fmadd(cvt(dots[h][r]), mul(ws, setf(x.d[r][g])), acc[h][r]);
      if constexpr (W::kHasMin) {
        const VF wm = w.mins(p, g, h);
        for (int r = 0; r < R; ++r) acc[h][r] = fmadd(wm, setf(x.s[r][g]), acc[h][r]);
      }
    }
  }
  for (int h = 0; h < kHalves; ++h) store_lanes<R>(acc[h], m0, p * kPanel + h * kLanes, N, bias, y);
}

// f(std::integral_constant<int, left>) for a run-time 0 <= left <= R (0: nothing): a call's last
// rows (fewer than a tile's) as one tile of a compile-time row count.
template <int R, class F>
__attribute__((always_inline)) inline void last_rows(int64_t left, const F& f) {
  if constexpr (R > 0) {
    if (left == R) f(std::integral_constant<int, R>{});
    else last_rows<R - 1>(left, f);
  }
}

// Panel p against all M rows: tiles of W::kRows, then the rest as one tile.
template <class W, bool kDec = false>
void panel_rows(const W& w, const QuantX& xq, int64_t M, int64_t p, int64_t N, const float* bias, float* y,
                const uint8_t* dec = nullptr) {
  int64_t m = 0;
  for (; m + W::kRows <= M; m += W::kRows) tile<W::kRows, W, kDec>(w, xq, m, p, N, bias, y, dec);
  last_rows<W::kRows - 1>(M - m, [&](auto r) { tile<decltype(r)::value, W, kDec>(w, xq, m, p, N, bias, y, dec); });
}

// Rows from this many on (two tiles a panel or more) decode each panel once, on AVX2: see kDecoded.
constexpr int64_t kDecodeRows = kMaxRows + 1;

#if !kWide
// Panel p's groups decoded to their unsigned quads at out (kDecoded bytes a group).
template <class W>
void decode_panel(const W& w, int64_t p, uint8_t* out) {
  const int64_t l1 = g_prefetch[1].l1, l2 = g_prefetch[1].l2;
  for (int64_t g = 0; g < w.G; ++g, out += kDecoded) {
    const uint8_t* src = w.group(p, g);
    prefetch_group(src, W::kBytes, l1, l2);
    each_vector([&](auto c) {
      constexpr int C = decltype(c)::value;
      VI lo[2], hi[2];
      w.template quads<C>(src, lo, hi);
      for (int h = 0; h < 2; ++h) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * C + 32 * h), lo[h]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * C + 64 + 32 * h), hi[h]);
      }
    });
  }
}
#endif

#if kWide
// ---- Many rows (prefill) on AVX-512: panels unpacked once, tiles of 2 panels x W::kPairRows rows.
// tile() unpacks a panel's groups again for each tile of rows and spends each broadcast
// activation quad on one vpdpbusd; the unpacking and the broadcasts compete with vpdpbusd for
// the vector pipes. Here a pair of panels is unpacked once into unsigned bytes (kDecoded a group,
// in cache for every tile of rows) and each broadcast feeds both panels: a quad's 12
// multiply-adds cost 2 loads and 6 broadcasts where tile() spent 8 broadcasts on 8. The integer
// offset (kOffset * sum(xq)) starts each sum instead of being taken off after. The integers, and
// the order of the fp32 sums over groups, are tile()'s: the same bits at every row count, so a
// row's result does not depend on which path its step took.
// Every format but int8 takes it. On a Zen 5 EPYC, 512 rows, both builds in one process,
// alternated 3-4 times: the 0.5B's q5_0 linears 1.37 against 1.15 TOP/s (1.19x), the 1.5B's q4_k
// 1.28 against 1.22 (1.05x; tiles of 5 rows or of one panel x 8 were slower) and its q6_k 1.18
// against 0.93 (1.27x, tiles of 4 rows; 3: 1.07x). int8 (nothing to unpack) ran 0.7x as pairs,
// and at 32 rows q4_k 0.8x (a panel pair unpacked for few tiles), hence kPairMinRows.
constexpr int kPairPanels = 2;
constexpr int64_t kPairMinRows = 64;  // from here a call takes the pair path (formats with kPairTiles)

// Q4_K's scales and mins are products (its six-bit sc and m times d and dmin, 8 operations a
// group and panel): the pair path unpacks them once a panel, as fp32, not once a tile of rows.
// On a Zen 5 EPYC, both builds alternated in one process: the 1.5B's q4_k linears at 512 rows
// 1.30 against 1.23 TOP/s (8 rounds), its 512-token prefill 427 against 407 tok/s (6 rounds).
// The other formats' scales cost a conversion or none, and a bigger slot costs more: Q6_K with
// its sub-scales and scales unpacked too ran 0.91x (a tile reads its panels' slots from L2).
template <class W>
constexpr bool kUnpackedScales = std::is_same_v<W, Int4KWeights>;

// A format's decoded bytes a group and panel: its quads; for Q6_K (kSubSums) its 32 sub-scale
// bytes after them (a 64-byte slot); where kUnpackedScales, the fp32 scales, then mins.
template <class W>
constexpr int64_t kPairScales = kDecoded + (W::kSubSums ? 64 : 0);
template <class W>
constexpr int64_t kPairBytes = kPairScales<W> + (kUnpackedScales<W> ? 2 * 64 : 0);

// P panels from p0 unpacked: group g's quads of panel p0 + j at dec + (g * P + j) * kPairBytes<W>.
template <int P, class W>
void decode_panels(const W& w, int64_t p0, uint8_t* dec) {
  const int64_t l1 = g_prefetch[1].l1, l2 = g_prefetch[1].l2;
  for (int64_t g = 0; g < w.G; ++g)
    for (int j = 0; j < P; ++j) {
      const uint8_t* src = w.group(p0 + j, g);
      prefetch_group(src, W::kBytes, l1, l2);
      VI v[8];
      w.unsigned_quads(src, v);
      uint8_t* out = dec + (g * P + j) * kPairBytes<W>;
      for (int k = 0; k < 8; ++k) _mm512_storeu_si512(out + 64 * k, v[k]);
      if constexpr (W::kSubSums) std::memcpy(out + kDecoded, w.sub_scales(src), 32);
      if constexpr (kUnpackedScales<W>) {
        float* scales = reinterpret_cast<float*>(out + kPairScales<W>);
        storef(scales, w.scales(p0 + j, g, 0));
        storef(scales + kPanel, w.mins(p0 + j, g, 0));
      }
    }
}

// Panels p0 .. p0 + P - 1 against rows m0 .. m0 + R - 1, from their decoded quads. Q6_K
// (kSubSums) keeps a sum for each half of a group's quads (one per sub-scale), each started at
// -32 * the row's half sum, and multiplies them by the sub-scales after: tile()'s integers.
template <int P, int R, class W>
void pair_tile(const W& w, const uint8_t* dec, const QuantX& xq, int64_t m0, int64_t p0, int64_t N,
               const float* bias, float* y) {
  constexpr int S = W::kSubSums ? 2 : 1;  // sums a row and panel
  constexpr int64_t kStride = kPairBytes<W>;
  const Rows<R> x(xq, m0);
  VF acc[P][R];
  for (int j = 0; j < P; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = zerof();
  for (int64_t g = 0; g < w.G; ++g) {
    const uint8_t* v = dec + g * P * kStride;
    VI sums[S][P][R];
    // Q5_0's start is a broadcast from the row's `start16` (a load, where computing it took a
    // scalar multiply and a move to the vector unit: q5_0 1.03x at 512 rows); Q6_K's two halves
    // stay computed (as loads too they ran 0.92x: its tiles load more a group).
    static_assert(W::kSubSums || W::kOffset == 0 || W::kOffset == 16, "pair tiles' offsets: none, Q5_0's 16 or Q6_K's halves");
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < S; ++h) {
        VI start = zero();
        if constexpr (W::kSubSums) {  // the half's sum, a signed 16-bit half of `halves`
          const int32_t offset = -32 * static_cast<int16_t>(static_cast<uint32_t>(x.halves[r][g]) >> (16 * h));
          start = offset ? set32(offset) : zero();
        } else if constexpr (W::kOffset != 0) {
          start = _mm512_set1_epi32(x.start16[r][g]);
        }
        for (int j = 0; j < P; ++j) sums[h][j][r] = start;
      }
    for (int k = 0; k < 8; ++k) {
      VI wv[P];
      for (int j = 0; j < P; ++j) wv[j] = loadi(v + j * kStride + 64 * k);
      for (int r = 0; r < R; ++r) {
        const VI b = quad(x.x[r] + g * kGroup + 4 * k);
        for (int j = 0; j < P; ++j) sums[k * S / 8][j][r] = _mm512_dpbusd_epi32(sums[k * S / 8][j][r], wv[j], b);
      }
    }
    for (int j = 0; j < P; ++j) {
      if constexpr (W::kSubSums) {
        const VI subs = widen8(v + j * kStride + kDecoded);
        const VI sub0 = _mm512_srai_epi32(shl32<16>(subs), 16), sub1 = _mm512_srai_epi32(subs, 16);
        for (int r = 0; r < R; ++r)
          sums[0][j][r] = add32(_mm512_mullo_epi32(sums[0][j][r], sub0), _mm512_mullo_epi32(sums[S - 1][j][r], sub1));
      }
      VF ws, wm = zerof();
      if constexpr (kUnpackedScales<W>) {
        const float* unpacked = reinterpret_cast<const float*>(v + j * kStride + kPairScales<W>);
        ws = loadf(unpacked);
        wm = loadf(unpacked + kPanel);
      } else {
        ws = w.scales(p0 + j, g, 0);
        if constexpr (W::kHasMin) wm = w.mins(p0 + j, g, 0);
      }
      for (int r = 0; r < R; ++r) acc[j][r] = fmadd(cvt(sums[0][j][r]), mul(ws, setf(x.d[r][g])), acc[j][r]);
      if constexpr (W::kHasMin) {
        for (int r = 0; r < R; ++r) acc[j][r] = fmadd(wm, setf(x.s[r][g]), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < P; ++j) store_lanes<R>(acc[j], m0, (p0 + j) * kPanel, N, bias, y);
}

// Panels p0 .. p0 + P - 1 against all M rows: tiles of W::kPairRows, then the rest as one tile.
template <int P, class W>
void pair_rows(const W& w, const uint8_t* dec, const QuantX& xq, int64_t M, int64_t p0, int64_t N,
               const float* bias, float* y) {
  int64_t m = 0;
  for (; m + W::kPairRows <= M; m += W::kPairRows) pair_tile<P, W::kPairRows>(w, dec, xq, m, p0, N, bias, y);
  last_rows<W::kPairRows - 1>(M - m, [&](auto r) { pair_tile<P, decltype(r)::value>(w, dec, xq, m, p0, N, bias, y); });
}

// The panels from p0 (P of them, fewer at the end) decoded, then against all M rows.
template <int P, class W>
void pair_panels(const W& w, uint8_t* dec, const QuantX& xq, int64_t M, int64_t p0, int64_t panels, int64_t N,
                 const float* bias, float* y) {
  if constexpr (P > 0) {
    if (p0 + P <= panels) {
      decode_panels<P>(w, p0, dec);
      pair_rows<P>(w, dec, xq, M, p0, N, bias, y);
    } else {
      pair_panels<P - 1>(w, dec, xq, M, p0, panels, N, bias, y);
    }
  }
}
#endif

// Panels 0 .. n - 1 shared among the threads: each starts on its own contiguous range and walks
// it front to back (one sequential stream of weights, as the hardware prefetchers want); a
// thread done with its range takes panels from the back of another's. With fixed halves the
// thread that finished first waited at every kernel's end: on a 2-vCPU KVM guest, whose vCPUs
// run unevenly, 10-20% of each thread's time in a decode step went to that wait. Panels are
// claimed kClaim at a time (one compare-exchange each): claimed one by one, the 0.5B's small
// matrices (70 panels a thread) made its decode layers 3% slower than with fixed halves.
// Which thread computes a panel never changes its bits (a panel's sums are its own).
constexpr int64_t kClaim = 4;

// A range's front (low 32 bits) and back (high 32): the owner moves the front, thieves the back.
struct alignas(64) PanelRange {
  std::atomic<uint64_t> ends;
};

inline uint64_t pack(uint64_t front, uint64_t back) { return front | (back << 32); }

// Claims up to `count` panels from the front (or back) of r; false when it is empty.
inline bool claim(PanelRange& r, int64_t count, bool from_back, int64_t* p0, int64_t* p1) {
  uint64_t v = r.ends.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t front = v & 0xFFFFFFFFu, back = v >> 32;
    if (front >= back) return false;
    *p0 = from_back ? std::max(front, back - count) : front;
    *p1 = from_back ? back : std::min(back, front + count);
    const uint64_t next = from_back ? pack(front, *p0) : pack(*p1, back);
    if (r.ends.compare_exchange_weak(v, next, std::memory_order_relaxed)) return true;
  }
}

template <class F>
void parallel_panels(int64_t n, const F& fn) {
  const int64_t T = std::min<int64_t>(at::get_num_threads(), n);
  if (T <= 1 || at::in_parallel_region()) return fn(0, n);
  std::vector<PanelRange> ranges(T);
  for (int64_t t = 0; t < T; ++t) ranges[t].ends.store(pack(n * t / T, n * (t + 1) / T));
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    int64_t p0, p1;
    for (int64_t t = t0; t < t1; ++t) {
      while (claim(ranges[t], kClaim, false, &p0, &p1)) fn(p0, p1);
      for (int64_t v = 1; v < T; ++v)
        while (claim(ranges[(t + v) % T], kClaim, true, &p0, &p1)) fn(p0, p1);
    }
  });
}

// With 2 passes each row runs as its two quantized rows (one weight load serves both, as any
// rows of a tile), and their outputs are added, then the bias: in the same order for every row.
template <class W>
torch::Tensor run(const W& w, const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias,
                  int64_t passes) {
  TORCH_CHECK(passes == 1 || passes == 2, "activation passes must be 1 or 2");
  const int64_t K = x.size(1), M = x.size(0) * passes;
  const QuantX xq = quantize_rows(x.data_ptr<float>(), x.size(0), K, passes);
  auto y = torch::empty({M, N}, x.options());
  const bool has_bias = bias && bias->defined();
  const float* bp = has_bias && passes == 1 ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const auto finish = [&]() -> torch::Tensor {  // two passes: each row's pair added, then the bias
    if (passes == 1) return y;
    auto pairs = y.view({x.size(0), 2, N});
    auto out = pairs.select(1, 0) + pairs.select(1, 1);
    return has_bias ? out.add_(*bias) : out;
  };
  const int64_t panels = num_panels(N);
#if kWide
  if constexpr (W::kPairTiles) {
    if (M >= kPairMinRows) {
      parallel_panels((panels + kPairPanels - 1) / kPairPanels, [&](int64_t q0, int64_t q1) {
        static thread_local std::vector<uint8_t> dec;
        dec.resize(kPairPanels * w.G * kPairBytes<W>);
        for (int64_t q = q0; q < q1; ++q)
          pair_panels<kPairPanels>(w, dec.data(), xq, M, q * kPairPanels, panels, N, bp, yp);
      });
      return finish();
    }
  }
#endif
  // Panels in order (one sequential stream of weights); a panel is read from memory once, for
  // its first tile of rows, and stays in cache for the others.
  parallel_panels(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
#if !kWide
      if constexpr (W::kDecodes) {
        if (M >= kDecodeRows) {
          static thread_local std::vector<uint8_t> dec;
          dec.resize(w.G * kDecoded);
          decode_panel(w, p, dec.data());
          panel_rows<W, true>(w, xq, M, p, N, bp, yp, dec.data());
          continue;
        }
      }
#endif
      panel_rows(w, xq, M, p, N, bp, yp);
    }
  });
  return finish();
}

// x [M, K] against `rows` outputs held as q [ceil(rows / 16), G * group_bytes] (G = K / 32),
// with one fp16 scale per output per `per_scale` groups.
void check(const torch::Tensor& x, const torch::Tensor& q, int64_t rows, int64_t group_bytes,
           const torch::Tensor& scale, int64_t per_scale = 1) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && rows > 0 && q.size(0) == num_panels(rows),
              "weights must be contiguous, one row per panel of 16 outputs");
  const int64_t K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K > 0 && K % (kGroup * per_scale) == 0 && q.size(1) == G * group_bytes &&
              scale.numel() * per_scale == q.size(0) * kPanel * G,
              "input width must equal the weight's and be a multiple of ", kGroup * per_scale);
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && scale.is_contiguous(), "scales must be contiguous fp16");
}

// int4's and q5_1's offsets: one per scale.
void check_min(const torch::Tensor& min, const torch::Tensor& scale) {
  TORCH_CHECK(min.scalar_type() == torch::kHalf && min.is_contiguous() && min.numel() == scale.numel(),
              "min must be contiguous fp16, shaped as the scales");
}

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (bias && bias->defined())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
}

// The integer unit's peak, for the limit column of quantized prefill (bench/limits.py): the
// variant's byte multiply-add as the kernels issue it (AVX-512: vpdpbusd, 64 a vector; AVX2:
// vpmaddubsw, 32 a vector, its pairs added into 16-bit sums with vpaddw) in kChains independent
// chains from registers, on every thread. No kernel on the file's blocks can beat it; torch's own
// int8 GEMM is no reference on a CPU without VNNI (on a Zen 1 EPYC `torch._int_mm` ran at 2 GOP/s
// where these instructions allow 156). Each chain feeds its own sum back in as the unsigned
// operand, which keeps the chains apart (one shared operand would be computed once) and costs
// nothing: the values are never read. Each thread runs for `seconds`; returns multiply-adds x 2
// a second over the whole call's wall time (a thread that starts late counts against it).
double int8_dot_peak(double seconds) {
  constexpr int kChains = 12;  // >= latency (4-5 cycles) x throughput (1-2 a cycle)
  constexpr int64_t kBlock = 4096;
  using clock = std::chrono::steady_clock;
  const int threads = at::get_num_threads();
  std::atomic<int64_t> blocks{0};
  std::atomic<int32_t> sink{0};
  const auto t0 = clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      VI acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = set32(c + 1);
      VI s = bytes(3);
      const auto start = clock::now();
      int64_t n = 0;
      while (std::chrono::duration<double>(clock::now() - start).count() < seconds) {
        for (int64_t i = 0; i < kBlock; ++i) {
          asm("" : "+x"(s));
          for (int c = 0; c < kChains; ++c)
#if kWide
            acc[c] = _mm512_dpbusd_epi32(acc[c], acc[c], s);
#else
            acc[c] = add16(acc[c], maddubs(acc[c], s));
#endif
        }
        ++n;
      }
      VI total = acc[0];
      for (int c = 1; c < kChains; ++c) total = add32(total, acc[c]);
      alignas(64) int32_t lanes[sizeof(VI) / 4];
      std::memcpy(lanes, &total, sizeof(VI));
      sink += lanes[0];
      blocks += n;
    }
  });
  const double dt = std::chrono::duration<double>(clock::now() - t0).count();
  return 2.0 * blocks.load() * kBlock * kChains * sizeof(VI) / dt;  // a byte multiply-add a byte of the vector
}

void set_weight_prefetch(int64_t rows, int64_t l1, int64_t l2) {
  TORCH_CHECK(l1 >= 0 && l2 >= 0 && l1 <= (1 << 20) && l2 <= (1 << 20), "prefetch distances must be 0 .. 1 MiB");
  g_prefetch[rows > g_light_rows] = {l1, l2};
}

void set_light_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "light tiles: 1 ..", kMaxRows, " rows");
  g_light_rows = rows;
}

std::tuple<int64_t, int64_t> weight_prefetch(int64_t rows) {
  const PrefetchDistances& pf = g_prefetch[rows > g_light_rows];
  return {pf.l1, pf.l2};
}

}  // namespace

namespace hetserve {

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes) {
  TORCH_CHECK(q.scalar_type() == torch::kChar, "q must be int8");
  check(x, q, rows, Int8Weights::kBytes, scale);
  check_bias(bias, rows);
  return run(Int8Weights{q.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), x.size(1) / kGroup}, x, rows, bias, passes);
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor min, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes) {
  TORCH_CHECK(q.scalar_type() == torch::kByte, "q must be uint8");
  check(x, q, rows, Int4Weights::kBytes, scale);
  check_min(min, scale);
  check_bias(bias, rows);
  return run(Int4Weights{{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), min.data_ptr<at::Half>(), x.size(1) / kGroup}},
             x, rows, bias, passes);
}

torch::Tensor q4_k_linear(torch::Tensor x, torch::Tensor q, torch::Tensor six, torch::Tensor supers, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes) {
  TORCH_CHECK(q.scalar_type() == torch::kByte, "q must be uint8");
  check(x, q, rows, Int4KWeights::kBytes, supers, 4);  // 32 values (d, -dmin of 16 outputs) per 8 groups
  const int64_t G = x.size(1) / kGroup;
  TORCH_CHECK(G % 8 == 0, "q4_k input width must be a multiple of 256");
  TORCH_CHECK(six.scalar_type() == torch::kByte && six.is_contiguous() && six.numel() == q.size(0) * G * 2 * kPanel,
              "q4_k scales and mins must be contiguous uint8 [panels, groups, 32]");
  check_bias(bias, rows);
  return run(Int4KWeights{q.data_ptr<uint8_t>(), six.data_ptr<uint8_t>(), supers.data_ptr<at::Half>(), G}, x, rows,
             bias, passes);
}

torch::Tensor q5_0_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes) {
  TORCH_CHECK(q.scalar_type() == torch::kByte, "q must be uint8");
  check(x, q, rows, Int5Weights<false>::kBytes, scale);
  check_bias(bias, rows);
  return run(Int5Weights<false>{{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), nullptr, x.size(1) / kGroup}}, x,
             rows, bias, passes);
}

torch::Tensor q5_1_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor min, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes) {
  TORCH_CHECK(q.scalar_type() == torch::kByte, "q must be uint8");
  check(x, q, rows, Int5Weights<true>::kBytes, scale);
  check_min(min, scale);
  check_bias(bias, rows);
  return run(Int5Weights<true>{{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), min.data_ptr<at::Half>(),
                                x.size(1) / kGroup}},
             x, rows, bias, passes);
}

torch::Tensor q6_k_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes) {
  TORCH_CHECK(q.scalar_type() == torch::kByte, "q must be uint8");
  check(x, q, rows, Int6KWeights::kBytes, d, 8);  // d: one scale per 8 groups
  check_bias(bias, rows);
  return run(Int6KWeights{q.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), x.size(1) / kGroup}, x, rows, bias, passes);
}

}  // namespace hetserve

namespace {

// Quantizers: one pass over the fp32 weights, to integers in element order (weight_formats.py
// packs them into panels). Values are rounded against the fp16 scale (and min) actually stored,
// so dequantization reproduces exactly what the kernel multiplies.
inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

void check_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(w.size(1) % kGroup == 0, "the input width must be a multiple of 32");
}

std::vector<torch::Tensor> quantize_int8(torch::Tensor w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1), G = K / kGroup;
  auto q = torch::empty({N, K}, w.options().dtype(torch::kChar));
  auto scale = torch::empty({N, G}, w.options().dtype(torch::kHalf));
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  at::parallel_for(0, N * G, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* g = wp + i * kGroup;
      float amax = 0.f;
      for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(g[j]));
      sp[i] = f2h(amax / 127.f);
      const float d = _cvtsh_ss(sp[i]), inv = d > 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < kGroup; ++j)
        qp[i * kGroup + j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(g[j] * inv))));
    }
  });
  return {q, scale};
}

std::vector<torch::Tensor> quantize_int4(torch::Tensor w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1), G = K / kGroup;
  auto q = torch::empty({N, K}, w.options().dtype(torch::kByte));
  auto scale = torch::empty({N, G}, w.options().dtype(torch::kHalf));
  auto min = torch::empty({N, G}, w.options().dtype(torch::kHalf));
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  uint16_t* mp = reinterpret_cast<uint16_t*>(min.data_ptr<at::Half>());
  at::parallel_for(0, N * G, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* g = wp + i * kGroup;
      float lo = g[0], hi = g[0];
      for (int j = 1; j < kGroup; ++j) { lo = std::min(lo, g[j]); hi = std::max(hi, g[j]); }
      mp[i] = f2h(lo);
      sp[i] = f2h((hi - lo) / 15.f);
      const float m = _cvtsh_ss(mp[i]), d = _cvtsh_ss(sp[i]), inv = d > 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < kGroup; ++j)
        qp[i * kGroup + j] = static_cast<uint8_t>(std::max(0.f, std::min(15.f, std::nearbyint((g[j] - m) * inv))));
    }
  });
  return {q, scale, min};
}

}  // namespace

void register_cpu_ops(pybind11::module& m);      // cpu_ops.cpp: fused norm / RoPE / KV-write
void register_attention(pybind11::module& m);    // attention.cpp: decode rows and prefill chunks
void register_f32_linear(pybind11::module& m);  // f32linear.cpp: fixed-order fp32 linear
void register_decode_layers(pybind11::module& m);  // decode_layers.cpp: a decoder's layers in one call
void register_flash_bf16(pybind11::module& m);  // flash_bf16.cpp: prefill chunks on AVX512-BF16

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace hetserve;
  register_cpu_ops(m);
  register_attention(m);
  register_f32_linear(m);
  register_decode_layers(m);
  register_flash_bf16(m);
  namespace py = pybind11;
  m.def("int8_linear", &int8_linear, "x . int8 group-wise weights in panels (int8 activations per group of 32)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("rows"), py::arg("bias"), py::arg("passes") = 1);
  m.def("int4_linear", &int4_linear, "x . int4 group-wise asymmetric weights in panels",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("min"), py::arg("rows"), py::arg("bias"),
        py::arg("passes") = 1);
  m.def("q5_0_linear", &q5_0_linear, "x . GGUF Q5_0 weights in panels", py::arg("x"), py::arg("q"),
        py::arg("scale"), py::arg("rows"), py::arg("bias"), py::arg("passes") = 1);
  m.def("q5_1_linear", &q5_1_linear, "x . five-bit weights with scale and min (GGUF Q5_1, Q5_K) in panels",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("min"), py::arg("rows"), py::arg("bias"),
        py::arg("passes") = 1);
  m.def("q4_k_linear", &q4_k_linear, "x . GGUF Q4_K weights in panels", py::arg("x"), py::arg("q"), py::arg("six"),
        py::arg("supers"), py::arg("rows"), py::arg("bias"), py::arg("passes") = 1);
  m.def("q6_k_linear", &q6_k_linear, "x . GGUF Q6_K weights in panels", py::arg("x"), py::arg("q"), py::arg("d"),
        py::arg("rows"), py::arg("bias"), py::arg("passes") = 1);
  m.def("set_weight_prefetch", &set_weight_prefetch, "bytes ahead of the weight stream prefetched into L1 and L2 (0: none)",
        py::arg("rows"), py::arg("l1"), py::arg("l2"));
  m.def("set_light_rows", &set_light_rows, "tiles of up to this many rows take set_weight_prefetch(1, ...)'s distances",
        py::arg("rows"));
  m.def("weight_prefetch", &weight_prefetch, "(L1, L2) prefetch distances in bytes", py::arg("rows"));
  m.def("int8_dot_peak", &int8_dot_peak, "multiply-adds x 2 a second of the kernels' byte dot instruction on every thread",
        py::arg("seconds"));
  m.def("quantize_int8", &quantize_int8, "fp32 [N, K] -> (q int8 [N, K] in element order, scale fp16 [N, K/32])");
  m.def("quantize_int4", &quantize_int4, "fp32 [N, K] -> (q uint8 [N, K] 0..15 in element order, scale, min fp16 [N, K/32])");
}
