// Weight-only-stored, integer-dot quantized linear layers for x86 CPUs with AVX2 + FMA (+ VNNI).
//
// y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias). W is stored per output row in groups of
// 32 input elements (G = K / 32 groups per row), with one fp16 scale (int4: and min) per group:
//   int8: q int8 in -127..127                  w = q * scale
//   int4: q in 0..15, two per byte             w = q * scale + min
//   q5_0: q in 0..31 (GGUF Q5_0 as it is)      w = (q - 16) * scale
//   q6_k: q in 0..63 (GGUF Q6_K as it is)      w = (q - 32) * sub[16 elements] * d[256 elements]
// Rows are stored in blocks of 4 groups (128 elements; the last block zero-padded), interleaved
// so that the 8 int32 lanes of one 32-byte multiply-add hold partial sums of 4 different groups
// (see `interleaved`): lane j of vector i (i = 0..3) holds elements 8i + 4(j / 4) .. + 3 of group
// j % 4. Summing a block's 4 vectors lane-wise and folding the two 128-bit halves gives each
// group's dot product with plain adds, where element-ordered groups need a horizontal-add tree
// per group (vphaddd, several uops each on x86) that had made the multi-row kernel
// compute-bound. int8 blocks are 128 bytes; int4 blocks 64: bytes 32h .. 32h + 31 hold vector 2h
// in their low nibbles and vector 2h + 1 in their high nibbles.
// Each row of x is quantized on the fly to int8 per group of 32 (x ~ xq * d, as llama.cpp's
// Q8_0 activations) into the same interleaved layout, so a group's dot product is 32 integer
// multiply-adds (vpmaddubsw + vpmaddwd). Groups are then scaled 8 at a time: one vector with a
// lane per group, converted once and scaled by 8 weight scales (one vcvtph2ps) times 8
// activation scales. The int4 min term is sum_g min[g] * d[g] * sum(xq over group g), 8 groups per FMA.
// Each output is summed in the same order whatever M is, so results are batch-invariant.
// fp16 scales (as in ggml's Q8_0/Q4_1) keep the int4 format at 5 bits per weight, not 6.
// q5_0 and q6_k hold a GGUF's Q5_0 and Q6_K blocks repacked into this layout, at the file's own
// size (5.5 and 6.5625 bits per weight): the kernel streams no more bytes than the file holds and
// computes on the file's integers, adding no weight error (see Int5Weights, Int6KWeights).
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// With AVX512-VNNI (the `avx512` build of layers/native.py) one vpdpbusd does a group's
// multiply-add-and-widen that takes vpmaddubsw + vpmaddwd + vpaddd on AVX2. The integer sums are
// exact either way, so both builds give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define kVnni 1
#else
#define kVnni 0
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kSuper = 8;  // groups scaled together
constexpr int64_t kBlock = 4;  // groups interleaved together
constexpr int64_t kBlockElems = kBlock * kGroup;

inline int64_t num_blocks(int64_t G) { return (G + kBlock - 1) / kBlock; }

// Position of element e of group g in an interleaved row (int8 bytes; int4 values).
inline int64_t interleaved(int64_t g, int64_t e) {
  return g / kBlock * kBlockElems + 32 * (e / 8) + 4 * (g % kBlock + kBlock * (e / 4 % 2)) + e % 4;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i madd_ones(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

// 8 fp16 values as fp32; past `count` they read as 0 (and nothing past them is read).
inline __m256 load_h8(const at::Half* p, int64_t count) {
  if (count == kSuper) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // Half a super (rows of 4 blocks mod 8, as the 0.5B model's 896 inputs): one 8-byte load.
  if (count == kSuper / 2) return _mm256_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t buf[kSuper] = {0};
  std::memcpy(buf, p, count * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}

// Activations quantized per group: xq int8 (interleaved), d (scale) and s = d * sum(xq) fp32. Each
// row is padded with zero groups to a multiple of 8, so a row's last 8 groups can always be read whole.
// Where asked (q6_k), also h: the integer sums of each group's two halves of 16 (at most 2032).
struct QuantX {
  int64_t G, Gp;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> h;
  const int8_t* row(int64_t m) const { return q.data() + m * Gp * kGroup; }
  const float* drow(int64_t m) const { return d.data() + m * Gp; }
  const float* srow(int64_t m) const { return s.data() + m * Gp; }
  const int16_t* hrow(int64_t m) const { return h.data() + m * Gp * 2; }
};

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// Quantizes group g of a row (32 floats at x) into the interleaved int8 row `q`; where `residual`
// is given, writes x - d * xq there (what the rounding left, for a second pass).
inline void quantize_group(const float* x, int64_t g, int8_t* q, float* d, float* s, int16_t* h,
                           float* residual = nullptr) {
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
  alignas(32) int32_t chunks[8];  // 4 elements each, in element order
  _mm256_store_si256(reinterpret_cast<__m256i*>(chunks),
                     _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  for (int c = 0; c < 8; ++c) std::memcpy(q + interleaved(g, 4 * c), &chunks[c], 4);
  *d = dd;
  // The int4 min term's sum is of the quantized values (d * sum xq, as llama.cpp's bsums), not
  // of x: then sum_i (q_i * scale + min) * xq_i * d is the product with the rounded row, whose
  // error is sum_i w_i e_i. With the exact sum, min * sum_i e_i was left over, and since int4
  // groups carry a large offset (min) that doubled the output error of an int4 linear.
  // (Lane sums of at most 4 * 127 and their total, at most 32 * 127, are exact in fp32.)
  const __m256i first = _mm256_add_epi32(i0, i1), second = _mm256_add_epi32(i2, i3);  // the two halves
  *s = dd * hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(first, second)));
  if (h) {
    h[0] = static_cast<int16_t>(hsum_epi32(first));
    h[1] = static_cast<int16_t>(hsum_epi32(second));
  }
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
QuantX quantize_rows(const float* x, int64_t M, int64_t K, bool half_sums, int64_t passes) {
  const int64_t G = K / kGroup, Gp = (G + kSuper - 1) / kSuper * kSuper, Mq = M * passes;
  QuantX out{G, Gp, std::vector<int8_t>(Mq * Gp * kGroup, 0), std::vector<float>(Mq * Gp, 0.f),
             std::vector<float>(Mq * Gp, 0.f), std::vector<int16_t>(half_sums ? Mq * Gp * 2 : 0, 0)};
  at::parallel_for(0, M * G, 512, [&](int64_t i0, int64_t i1) {
    alignas(32) float left[kGroup];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / G, g = i % G;
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t r = m * passes + p;
        quantize_group(p ? left : x + i * kGroup, g, out.q.data() + r * Gp * kGroup, &out.d[r * Gp + g],
                       &out.s[r * Gp + g], half_sums ? &out.h[(r * Gp + g) * 2] : nullptr,
                       p + 1 < passes ? left : nullptr);
      }
    }
  });
  return out;
}

// The weight formats give, for block b of output row n and R activation rows (pointers at the
// block), one vector per row whose lanes j and j + 4 hold partial dot products of group j: one
// weight load serves all R rows. `scales` gives groups g0 .. g0 + 7's weight scales (the float
// each group's integer dot product is multiplied by) and, where kHasMin, `mins` their offsets.
struct Int8Weights {
  static constexpr bool kHasMin = false, kHalfSums = false;
  static constexpr int kSuperBytes = kSuper * kGroup;  // bytes of weights per 8 groups
  const int8_t* q; const at::Half* scale; const at::Half* min; int64_t K, G, row_bytes;
  const char* bytes(int64_t n, int64_t g0) const { return reinterpret_cast<const char*>(q + n * row_bytes) + g0 * kGroup; }
  __m256 scales(int64_t n, int64_t g0, int64_t count) const { return load_h8(scale + n * G + g0, count); }
  template <int R>
  __attribute__((always_inline)) inline void block(int64_t n, int64_t b, const int8_t* const (&x)[R], __m256i (&acc)[R]) const {
    const int8_t* w = q + n * row_bytes + b * kBlockElems;
    for (int i = 0; i < 4; ++i) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * i));
      const __m256i w_abs = _mm256_sign_epi8(wv, wv);  // |w| as u8; the sign moves onto x
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 32 * i));
#if kVnni
        acc[r] = _mm256_dpbusd_epi32(i ? acc[r] : _mm256_setzero_si256(), w_abs, _mm256_sign_epi8(xv, wv));
#else
        const __m256i d = madd_ones(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv, wv)));
        acc[r] = i ? _mm256_add_epi32(acc[r], d) : d;
#endif
      }
    }
  }
};

// Rows' dot products with a block of unsigned values (int4's nibbles, q5_0's 5-bit values) given
// as vectors 2h (lo[h]) and 2h + 1 (hi[h]). A 16-bit lane of one multiply-add holds 2 products
// of at most 31 * 127, so the block's 4 products per lane (at most 15748) sum exactly in 16 bits
// on AVX2: one widening per block, not four.
template <int R>
__attribute__((always_inline)) inline void unsigned_block(const __m256i (&lo)[2], const __m256i (&hi)[2],
                                                          const int8_t* const (&x)[R], __m256i (&acc)[R]) {
#if kVnni
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#else
  __m256i s16[R];
#endif
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < R; ++r) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * h));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * h + 32));
#if kVnni
      acc[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc[r], lo[h], x0), hi[h], x1);
#else
      const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0), _mm256_maddubs_epi16(hi[h], x1));
      s16[r] = h ? _mm256_add_epi16(s16[r], d) : d;
#endif
    }
  }
#if !kVnni
  for (int r = 0; r < R; ++r) acc[r] = madd_ones(s16[r]);
#endif
}

struct Int4Weights {
  static constexpr bool kHasMin = true, kHalfSums = false;
  static constexpr int kSuperBytes = kSuper * kGroup / 2;
  const uint8_t* q; const at::Half* scale; const at::Half* min; int64_t K, G, row_bytes;
  const char* bytes(int64_t n, int64_t g0) const { return reinterpret_cast<const char*>(q + n * row_bytes) + g0 * kGroup / 2; }
  __m256 scales(int64_t n, int64_t g0, int64_t count) const { return load_h8(scale + n * G + g0, count); }
  __m256 mins(int64_t n, int64_t g0, int64_t count, __m256) const { return load_h8(min + n * G + g0, count); }
  template <int R>
  __attribute__((always_inline)) inline void block(int64_t n, int64_t b, const int8_t* const (&x)[R], __m256i (&acc)[R]) const {
    const uint8_t* w = q + n * row_bytes + b * (kBlockElems / 2);
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
      lo[h] = _mm256_and_si256(bytes, lo4);
      hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), lo4);
    }
    unsigned_block<R>(lo, hi, x, acc);
  }
};

// 32 bytes, byte i 0x10 where bit i of `bits` is set: a 5th bit moved into place above a nibble.
inline __m256i fifth_bits(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
#else
  // Byte i gets byte i / 8 of the word, keeps bit i % 8 of it, and becomes 0xFF where that is set.
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

// Q5_0: a block is int4's 64 nibble bytes, then 4 little-endian 32-bit words, word v holding the
// 5th bit of byte i of vector v in its bit i (80 bytes per 128 weights; with the fp16 scale per
// group, Q5_0's 5.5 bits per weight). The values q = nibble | bit << 4 are 0..31 and
// w = (q - 16) * scale, so as int4 the product is scale * sum(q * xq) plus an offset of
// min = -16 * scale against the group's activation sum (exact: a power-of-2 multiple of the scale).
struct Int5Weights {
  static constexpr bool kHasMin = true, kHalfSums = false;
  static constexpr int64_t kBlockBytes = kBlockElems / 2 + 16;
  static constexpr int kSuperBytes = 2 * kBlockBytes;
  const uint8_t* q; const at::Half* scale; int64_t K, G, row_bytes;
  const char* bytes(int64_t n, int64_t g0) const {
    return reinterpret_cast<const char*>(q + n * row_bytes) + g0 / kBlock * kBlockBytes;
  }
  __m256 scales(int64_t n, int64_t g0, int64_t count) const { return load_h8(scale + n * G + g0, count); }
  __m256 mins(int64_t, int64_t, int64_t, __m256 ws) const { return _mm256_mul_ps(ws, _mm256_set1_ps(-16.f)); }
  template <int R>
  __attribute__((always_inline)) inline void block(int64_t n, int64_t b, const int8_t* const (&x)[R], __m256i (&acc)[R]) const {
    const uint8_t* w = q + n * row_bytes + b * kBlockBytes;
    uint32_t bits[4];
    std::memcpy(bits, w + kBlockElems / 2, sizeof(bits));
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
      lo[h] = _mm256_or_si256(_mm256_and_si256(bytes, lo4), fifth_bits(bits[2 * h]));
      hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), lo4), fifth_bits(bits[2 * h + 1]));
    }
    unsigned_block<R>(lo, hi, x, acc);
  }
};

// Q6_K: q in 0..63, w = (q - 32) * sub * d with an int8 sub-scale per 16 weights and an fp16 d per
// 256 (8 groups: one scale vector per 8 groups, broadcast). A block is int4's 64 nibble bytes (the
// low 4 bits), 32 bytes whose byte i holds the top 2 bits of byte i of vector v in bits 2v, 2v + 1,
// and the block's 8 sub-scales by group, each group's first 16 weights' (vectors 0, 1), then its
// last 16's (vectors 2, 3). 104 bytes per 128 weights plus d: Q6_K's 210 bytes per 256.
// The kernel multiplies the unsigned q (0..63) and takes the offset off afterwards: a group's
// sum(sub * (q - 32) * xq) = sum(sub * q * xq) - 32 * (sub_0 * h_0 + sub_1 * h_1), h the row's
// integer sums over each half (QuantX::h). Pairs of q * xq (at most 2 * 63 * 127) and the two
// vectors of a half (32004) are exact in 16 bits, the sub-scales are applied in the integers
// (vpmaddwd), and the group's result (at most 32 * 32 * 128 * 127 < 2^24) is exact in fp32 too.
// (Multiplying q - 32 instead, signed, took two sign operations per vector and row.)
struct Int6KWeights {
  static constexpr bool kHasMin = false, kHalfSums = true;
  static constexpr int64_t kBlockBytes = kBlockElems / 2 + 32 + 8;
  static constexpr int kSuperBytes = 2 * kBlockBytes;
  const uint8_t* q; const at::Half* d; int64_t K, G, row_bytes;
  const char* bytes(int64_t n, int64_t g0) const {
    return reinterpret_cast<const char*>(q + n * row_bytes) + g0 / kBlock * kBlockBytes;
  }
  __m256 scales(int64_t n, int64_t g0, int64_t) const {
    return _mm256_set1_ps(_cvtsh_ss(reinterpret_cast<const uint16_t*>(d)[(n * G + g0) / kSuper]));
  }
  // 32 * (sub_0 * h_0 + sub_1 * h_1) for groups g0 .. g0 + 7 (two blocks: K is a multiple of 256).
  __m256i offsets(int64_t n, int64_t g0, const int16_t* h) const {
    const uint8_t* s = q + n * row_bytes + g0 / kBlock * kBlockBytes + kBlockElems / 2 + 32;
    const __m128i subs = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)),
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + kBlockBytes)));
    const __m256i hs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
    return _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(subs), hs), 5);
  }
  template <int R>
  __attribute__((always_inline)) inline void block(int64_t n, int64_t b, const int8_t* const (&x)[R], __m256i (&acc)[R]) const {
    const uint8_t* w = q + n * row_bytes + b * kBlockBytes;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlockElems / 2));
    // 16-bit lanes 2j, 2j + 1 feed 32-bit lane j, which holds group j % 4: each gets its group's sub-scale.
    const __m128i pairs = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + kBlockElems / 2 + 32)),
                                           _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 1, 1, 3, 3, 5, 5, 7, 7));
    const __m256i sub = _mm256_cvtepi8_epi16(pairs);  // first halves' scales, then second halves'
    const __m256i sub_h[2] = {_mm256_permute2x128_si256(sub, sub, 0x00), _mm256_permute2x128_si256(sub, sub, 0x11)};
    const __m256i top_bits[4] = {_mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 2), hb, _mm256_srli_epi16(hb, 2)};
    for (int h = 0; h < 2; ++h) {  // vectors 2h, 2h + 1: half h of each group
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
      const __m256i a = _mm256_or_si256(_mm256_and_si256(bytes, lo4), _mm256_and_si256(top_bits[2 * h], top));
      const __m256i c = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), lo4),
                                        _mm256_and_si256(top_bits[2 * h + 1], top));
      for (int r = 0; r < R; ++r) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * h));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * h + 32));
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(a, x0), _mm256_maddubs_epi16(c, x1));
#if kVnni
        acc[r] = h ? _mm256_dpwssd_epi32(acc[r], p, sub_h[h]) : _mm256_madd_epi16(p, sub_h[h]);
#else
        const __m256i part = _mm256_madd_epi16(p, sub_h[h]);
        acc[r] = h ? _mm256_add_epi32(acc[r], part) : part;
#endif
      }
    }
  }
};

// Integer dot products of groups g0 .. g0 + 7 (g0 a multiple of 8) of output row n with R
// activation rows, as one vector per row with a lane per group: two blocks, each folded by halves.
template <int R, class W>
__attribute__((always_inline)) inline void sums8(const W& w, int64_t n, int64_t g0, const int8_t* const (&x)[R], __m256i (&out)[R]) {
  __m256i a[R], c[R];
  const int64_t b = g0 / kBlock;
  w.template block<R>(n, b, x, a);
  if (b + 1 < num_blocks(w.G)) {
    const int8_t* x2[R];
    for (int r = 0; r < R; ++r) x2[r] = x[r] + kBlockElems;
    w.template block<R>(n, b + 1, x2, c);
  } else {
    for (int r = 0; r < R; ++r) c[r] = _mm256_setzero_si256();
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm256_add_epi32(_mm256_permute2x128_si256(a[r], c[r], 0x20), _mm256_permute2x128_si256(a[r], c[r], 0x31));
}

// Software prefetch distance in the weight stream. Each thread reads its output rows' weights
// as one sequential stream, yet the hardware prefetcher alone left the kernel short of memory
// bandwidth: asking for the bytes 2 KiB ahead made a 1.5B model's matmuls 6% faster at 1 row
// and 13-17% at 2-4 rows (scratch benchmark over 352 MB of distinct weights; 1, 4 and 8 KiB
// did about as well, rows-ahead distances too). Prefetches never fault, so the last rows'
// reach past the end of the weights is harmless.
constexpr int64_t kPrefetchAhead = 2048;

// Output rows n .. n + C - 1 against R input rows. Each output's sum runs in the same order
// whatever R and C are: C only interleaves independent sums, for more work in flight per weight
// (one input row alone, as in decode, otherwise leaves the core waiting on each sum's latency).
template <int R, int C, class W>
inline void tile(const W& w, const QuantX& x, int64_t m0, int64_t n, int64_t N, const float* bias, float* y) {
  const int64_t G = w.G;
  __m256 acc[C][R], off[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = off[c][r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < G; g0 += kSuper) {
    const int64_t count = std::min(kSuper, G - g0);
    const int8_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x.row(m0 + r) + g0 * kGroup;
    for (int c = 0; c < C; ++c) {
      const char* ahead = w.bytes(n + c, g0) + kPrefetchAhead;
      for (int l = 0; l < W::kSuperBytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      __m256i dots[R];
      sums8<R>(w, n + c, g0, xr, dots);
      if constexpr (W::kHalfSums)
        for (int r = 0; r < R; ++r) dots[r] = _mm256_sub_epi32(dots[r], w.offsets(n + c, g0, x.hrow(m0 + r) + 2 * g0));
      const __m256 ws = w.scales(n + c, g0, count);
      for (int r = 0; r < R; ++r)
        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(ws, _mm256_loadu_ps(x.drow(m0 + r) + g0)),
                                    acc[c][r]);
      if constexpr (W::kHasMin) {
        const __m256 wm = w.mins(n + c, g0, count, ws);
        for (int r = 0; r < R; ++r) off[c][r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(x.srow(m0 + r) + g0), off[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      y[(m0 + r) * N + n + c] = hsum(acc[c][r]) + hsum(off[c][r]) + (bias ? bias[n + c] : 0.f);
}

// With 2 passes each row runs as its two quantized rows (one weight load serves both, as any
// rows of a tile), and their outputs are added, then the bias: in the same order for every row.
template <class W>
torch::Tensor run(const W& w, const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias,
                  int64_t passes) {
  TORCH_CHECK(passes == 1 || passes == 2, "activation passes must be 1 or 2");
  const int64_t K = x.size(1), M = x.size(0) * passes;
  const QuantX xq = quantize_rows(x.data_ptr<float>(), x.size(0), K, W::kHalfSums, passes);
  auto y = torch::empty({M, N}, x.options());
  const bool has_bias = bias && bias->defined();
  const float* bp = has_bias && passes == 1 ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Output rows in order (one sequential stream of weights); a row is read from memory once and
  // stays in L1 for every tile of up to 4 input rows.
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (M == 1)
      for (; n + 2 <= n1; n += 2) tile<1, 2>(w, xq, 0, n, N, bp, yp);
    for (; n < n1; ++n) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<4, 1>(w, xq, m, n, N, bp, yp);
      switch (M - m) {
        case 3: tile<3, 1>(w, xq, m, n, N, bp, yp); break;
        case 2: tile<2, 1>(w, xq, m, n, N, bp, yp); break;
        case 1: tile<1, 1>(w, xq, m, n, N, bp, yp); break;
        default: break;
      }
    }
  });
  if (passes == 1) return y;
  auto pairs = y.view({x.size(0), 2, N});
  auto out = pairs.select(1, 0) + pairs.select(1, 1);
  return has_bias ? out.add_(*bias) : out;
}

// x [M, K] against weights q [N, ceil(G/4) * block_bytes] (G = K/32 groups, `block_bytes` per
// block of 4) with an fp16 scale per `per_scale` groups: q's width fixes G up to a block, the
// scale's size exactly.
void check(const torch::Tensor& x, const torch::Tensor& q, int64_t block_bytes, const torch::Tensor& scale,
           int64_t per_scale = 1) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D fp32 CPU tensor");
  const int64_t N = q.size(0), K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % (kGroup * per_scale) == 0 && q.size(1) == num_blocks(G) * block_bytes &&
              scale.numel() * per_scale == N * G,
              "input width must equal the weight's and be a multiple of ", kGroup * per_scale);
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && scale.is_contiguous(), "scales must be contiguous fp16");
}

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (bias && bias->defined())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
}

}  // namespace

namespace hetserve {

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                          int64_t passes) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(),
              "q must be contiguous int8 [N, ceil(K/128) * 128]");
  check(x, q, kBlockElems, scale);
  const int64_t N = q.size(0), K = x.size(1);
  check_bias(bias, N);
  return run(Int8Weights{q.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), nullptr, K, K / kGroup, q.size(1)}, x, N,
             bias, passes);
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor min,
                          c10::optional<torch::Tensor> bias, int64_t passes) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte && q.is_contiguous(),
              "q must be contiguous uint8 [N, ceil(K/128) * 64]");
  check(x, q, kBlockElems / 2, scale);
  TORCH_CHECK(min.scalar_type() == torch::kHalf && min.is_contiguous() && min.numel() == scale.numel(),
              "min must be contiguous fp16 [N, K/32]");
  const int64_t N = q.size(0), K = x.size(1);
  check_bias(bias, N);
  return run(Int4Weights{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), min.data_ptr<at::Half>(), K, K / kGroup,
                         q.size(1)},
             x, N, bias, passes);
}

torch::Tensor q5_0_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                          int64_t passes) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte && q.is_contiguous(),
              "q must be contiguous uint8 [N, ceil(K/128) * 80]");
  check(x, q, Int5Weights::kBlockBytes, scale);
  const int64_t N = q.size(0), K = x.size(1);
  check_bias(bias, N);
  return run(Int5Weights{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), K, K / kGroup, q.size(1)}, x, N, bias,
             passes);
}

torch::Tensor q6_k_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, c10::optional<torch::Tensor> bias,
                          int64_t passes) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte && q.is_contiguous(),
              "q must be contiguous uint8 [N, K/128 * 104]");
  check(x, q, Int6KWeights::kBlockBytes, d, kSuper);  // d: one scale per 8 groups, [N, K/256]
  const int64_t N = q.size(0), K = x.size(1);
  check_bias(bias, N);
  return run(Int6KWeights{q.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), K, K / kGroup, q.size(1)}, x, N, bias,
             passes);
}

}  // namespace hetserve

namespace {

// Quantizers: one pass over the fp32 weights. Values are rounded against the fp16 scale (and
// min) actually stored, so dequantization reproduces exactly what the kernel multiplies.
inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

void check_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(w.size(1) % kGroup == 0, "the input width must be a multiple of 32");
}

std::vector<torch::Tensor> quantize_int8(torch::Tensor w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1), G = K / kGroup, row_bytes = num_blocks(G) * kBlockElems;
  auto q = torch::zeros({N, row_bytes}, w.options().dtype(torch::kChar));  // padding groups stay 0
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
      int8_t* out = qp + i / G * row_bytes;
      for (int j = 0; j < kGroup; ++j)
        out[interleaved(i % G, j)] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(g[j] * inv))));
    }
  });
  return {q, scale};
}

std::vector<torch::Tensor> quantize_int4(torch::Tensor w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1), G = K / kGroup, row_bytes = num_blocks(G) * kBlockElems / 2;
  auto q = torch::zeros({N, row_bytes}, w.options().dtype(torch::kByte));  // padding groups stay 0
  auto scale = torch::empty({N, G}, w.options().dtype(torch::kHalf));
  auto min = torch::empty({N, G}, w.options().dtype(torch::kHalf));
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  uint16_t* mp = reinterpret_cast<uint16_t*>(min.data_ptr<at::Half>());
  // By rows: the groups of a block share bytes, so one thread writes a whole row.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t i = n0 * G; i < n1 * G; ++i) {
      const float* g = wp + i * kGroup;
      float lo = g[0], hi = g[0];
      for (int j = 1; j < kGroup; ++j) { lo = std::min(lo, g[j]); hi = std::max(hi, g[j]); }
      mp[i] = f2h(lo);
      sp[i] = f2h((hi - lo) / 15.f);
      const float m = _cvtsh_ss(mp[i]), d = _cvtsh_ss(sp[i]), inv = d > 0.f ? 1.f / d : 0.f;
      uint8_t* out = qp + i / G * row_bytes;
      for (int j = 0; j < kGroup; ++j) {
        // Interleaved position p: vector p / 32 of its block, byte p % 32; vectors 2h and 2h + 1
        // share bytes 32h .. 32h + 31 (low and high nibbles).
        const int64_t p = interleaved(i % G, j), v = p % kBlockElems / 32;
        out[p / kBlockElems * (kBlockElems / 2) + v / 2 * 32 + p % 32] |= static_cast<uint8_t>(
            static_cast<uint8_t>(std::max(0.f, std::min(15.f, std::nearbyint((g[j] - m) * inv)))) << (v % 2 * 4));
      }
    }
  });
  return {q, scale, min};
}

}  // namespace

void register_cpu_ops(pybind11::module& m);      // cpu_ops.cpp: fused norm / RoPE / KV-write
void register_f32_linear(pybind11::module& m);  // f32linear.cpp: fixed-order fp32 linear
void register_decode_layers(pybind11::module& m);  // decode_layers.cpp: a decoder's layers in one call

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace hetserve;
  register_cpu_ops(m);
  register_f32_linear(m);
  register_decode_layers(m);
  namespace py = pybind11;
  m.def("int8_linear", &int8_linear, "x . int8 group-wise weights (int8 activations per group of 32; passes: 1 or 2)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias"), py::arg("passes") = 1);
  m.def("quantize_int8", &quantize_int8, "fp32 [N, K] -> (q int8 [N, ceil(K/128) * 128], scale fp16 [N, K/32])");
  m.def("quantize_int4", &quantize_int4, "fp32 [N, K] -> (q uint8 [N, ceil(K/128) * 64], scale, min fp16 [N, K/32])");
  m.def("int4_linear", &int4_linear, "x . int4 group-wise asymmetric weights (int8 activations per group of 32)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("min"), py::arg("bias"), py::arg("passes") = 1);
  m.def("q5_0_linear", &q5_0_linear, "x . GGUF Q5_0 weights repacked (int8 activations per group of 32)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias"), py::arg("passes") = 1);
  m.def("q6_k_linear", &q6_k_linear, "x . GGUF Q6_K weights repacked (int8 activations per group of 32)",
        py::arg("x"), py::arg("q"), py::arg("d"), py::arg("bias"), py::arg("passes") = 1);
}
