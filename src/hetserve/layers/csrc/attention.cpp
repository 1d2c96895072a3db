// Attention over the paged KV cache ([slots, KVH, D], fp32 / fp16 / bf16, or int8 q8_0 rows of
// D / 32 * 34 bytes, vec.h): single query rows
// (decodes, speculative verifications, every row in deterministic mode; attend_rows) and the
// longer chunks of prefill (attend_chunk).
#include "kernels.h"
#include "vec.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// The decode attention's K and V rows come from DRAM (a step's weights have evicted them), a
// token's row of a KV head at a time, KVH * D floats apart in the cache ([slots, KVH, D]; 1 KiB
// for the 1.5B) and in pages wherever the block table says: past what the hardware prefetchers
// follow. So the kernel asks for them itself. A row's keys are taken in blocks of kBlock (scores,
// their softmax, the weighted values: an online softmax over the blocks, flash-decoding style),
// and while a block computes, the next block's rows are asked for into L2: its K rows during the
// scores' pass, its V rows during the values' pass, a row per row computed, so the memory system
// streams through both passes and each row is asked for once. Two whole passes over the context
// (K then V, V asked for during the first and read again in the second) decoded 67-69 tok/s at 8k
// tokens of the 0.5B on a Zen 5 EPYC where this does 79-82. Found no faster there, end to end:
// scores with the keys in the vector lanes (no horizontal sums; faster in `bench attention`'s
// loop of layers, not in a decode step), the caches on huge pages. Long rows are split in
// segments (attend_rows).
// Within a block, K rows kRowsAhead ahead are asked for into L1.
constexpr int64_t kRowsAhead = 8;    // tokens ahead in the scores' pass over K, into L1
constexpr int64_t kBlock = 256;      // keys a block (fp16 K and V of a 1.5B head: 128 KiB, in L2)
constexpr int64_t kValueChunk = 32;  // tokens per chunk of the values' pass over V

// A row of D values asked for into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <decltype(_MM_HINT_T0) Hint = _MM_HINT_T0, class T>
HS_PREFETCH void prefetch_row(const T* row, int64_t D) {
  for (int64_t l = 0; l < row_elems<T>(D) * static_cast<int64_t>(sizeof(T)); l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + l, Hint);
}

// The scores' requests at token t of a context of n: K at t + kRowsAhead into L1, the next
// block's K at t + kBlock into L2.
template <class T>
HS_PREFETCH void prefetch_scores(const T* const* k, int64_t t, int64_t n, int64_t D) {
  if (t + kRowsAhead < n) prefetch_row(k[t + kRowsAhead], D);
  if (t + kBlock < n) prefetch_row<_MM_HINT_T1>(k[t + kBlock], D);
}

// The first block's rows (nothing computes before them), K's first rows into L1.
template <class T>
HS_PREFETCH void prefetch_first_block(const T* const* k, const T* const* v, int64_t n, int64_t D) {
  for (int64_t t = 0; t < std::min(n, kBlock); ++t) {
    prefetch_row<_MM_HINT_T1>(k[t], D);
    prefetch_row<_MM_HINT_T1>(v[t], D);
  }
  for (int64_t t = 0; t < std::min(n, kRowsAhead); ++t) prefetch_row(k[t], D);
}

// One head's block of scores s[0 .. nb) into exp(s - m') in place, m' = max(m, the block's max):
// m becomes m', l the running sum (l * alpha + the block's); returns alpha = exp(m - m'), the
// factor for what was summed before (0 on the first block, exactly 1 where the max held).
inline float online_block(float* s, int64_t nb, float& m, float& l) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= nb; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float mb = hmax(mv);
  for (; t < nb; ++t) mb = std::max(mb, s[t]);
  const float m1 = std::max(m, mb);
  const float alpha = m == -INFINITY ? 0.f : m1 == m ? 1.f : exp1(m - m1);
  const __m256 m1v = _mm256_set1_ps(m1);
  __m256 sv = _mm256_setzero_ps();
  t = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // 16 scores an exp16 (exp8's operations a lane), their halves added to the 8-lane sum in the
  // order the 8-lane loop adds them: the same bits, the exponentials in half the instructions.
  const __m512 m1w = _mm512_set1_ps(m1);
  for (; t + 16 <= nb; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m1w));
    _mm512_storeu_ps(s + t, e);
    sv = _mm256_add_ps(_mm256_add_ps(sv, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
#endif
  for (; t + 8 <= nb; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m1v));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; t < nb; ++t) sum += (s[t] = exp1(s[t] - m1));
  l = l * alpha + sum;
  m = m1;
  return alpha;
}

// dst[0 .. D) = src[0 .. D) * f, D a multiple of 8 (dst may be src): a row rescaled or normalized.
inline void scale_row(const float* src, float f, float* dst, int64_t D) {
  const __m256 fv = _mm256_set1_ps(f);
  for (int64_t e = 0; e < D; e += 8) _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_loadu_ps(src + e), fv));
}

// Row s[0 .. n) -> exp(s - max) in place (n > 0); returns 1 / their sum (the chunks' softmax).
inline float softmax_row(float* s, int64_t n) {
  float m = -INFINITY, l = 0.f;
  online_block(s, n, m, l);
  return 1.f / l;
}

// Scores of J query heads (rows q + j * D) against one key kt, to p[j * kBlock + t]: J
// independent FMA chains sharing each key load (one chain per dot product was latency-bound).
template <int J, class T>
inline void score_key(const float* q, const T* kt, int64_t D, float sc, float* p, int64_t t) {
  __m256 acc[J];
  for (int j = 0; j < J; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t e = 0; e < D; e += 8) {
    const __m256 kv = load_row8(kt, e);
    for (int j = 0; j < J; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + e), kv, acc[j]);
  }
  for (int j = 0; j < J; ++j) p[j * kBlock + t] = hsum(acc[j]) * sc;
}

// Keys t0 .. t1 of a context of n (a block): scores to p[j * kBlock + t - t0].
template <int J, class T, int DC>
void head_scores(const float* q, const T* const* k, int64_t t0, int64_t t1, int64_t n, int64_t Dr, float sc, float* p) {
  const int64_t D = DC > 0 ? DC : Dr;
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_scores(k, t, n, D);
    score_key<J>(q, k[t], D, sc, p, t - t0);
  }
}

// out[j] += sum_t p[j * kBlock + t - b0] * v[t] over the keys b0 .. b1 of a context of n (a
// block) for J heads: chunks of kValueChunk tokens (in L1 once read), each swept EB vectors of D
// at a time with the J * EB sums in registers (accumulating in memory was bound by stores) and
// kept in `out` between chunks. Each output lane is one FMA chain over t = b0 .. b1 - 1 in order
// whatever the chunking, so the bits are those of a single sweep; where one vector at a time
// swept all the rows, each V line was fetched twice and, past a few hundred tokens, from DRAM
// again. The values' requests: V rows two chunks ahead into L1, the next block's into L2. EB = 2
// (a cache line) fits AVX2's 16 registers up to J = 6 (and needs D a multiple of 16).
template <int J, int EB, class T, int DC>
void head_values(const float* p, const T* const* v, int64_t b0, int64_t b1, int64_t n, int64_t Dr, float* out) {
  const int64_t D = DC > 0 ? DC : Dr;
  for (int64_t t0 = b0; t0 < b1; t0 += kValueChunk) {
    const int64_t t1 = std::min(b1, t0 + kValueChunk);
    for (int64_t t = t0 + 2 * kValueChunk; t < std::min(b1, t0 + 3 * kValueChunk); ++t) prefetch_row(v[t], D);
    for (int64_t t = t0 + kBlock; t < std::min(n, t1 + kBlock); ++t) prefetch_row<_MM_HINT_T1>(v[t], D);
    for (int64_t e = 0; e < D; e += 8 * EB) {
      __m256 acc[J][EB];
      for (int j = 0; j < J; ++j)
        for (int b = 0; b < EB; ++b) acc[j][b] = _mm256_loadu_ps(out + j * D + e + 8 * b);
      for (int64_t t = t0; t < t1; ++t) {
        __m256 vv[EB];
        for (int b = 0; b < EB; ++b) vv[b] = load_row8(v[t], e + 8 * b);
        for (int j = 0; j < J; ++j) {
          const __m256 pj = _mm256_set1_ps(p[j * kBlock + t - b0]);
          for (int b = 0; b < EB; ++b) acc[j][b] = _mm256_fmadd_ps(pj, vv[b], acc[j][b]);
        }
      }
      for (int j = 0; j < J; ++j)
        for (int b = 0; b < EB; ++b) _mm256_storeu_ps(out + j * D + e + 8 * b, acc[j][b]);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 16 values as fp32 (load8's widening, 16 lanes).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Values e .. e + 16 of a cache row (e a multiple of 16), as load_row8 reads them.
template <class T>
inline __m512 load_row16(const T* row, int64_t e) { return load16(row + e); }
inline __m512 load_row16(const int8_t* row, int64_t e) {
  float d;
  const int8_t* q = q8_value(row, e, &d);
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(d));
}

// Values e .. e + 8 of key rows a and b as one register, a's in the low 8 lanes.
template <class T>
inline __m512 key_pair(const T* a, const T* b, int64_t e) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(load_row8(a, e)), load_row8(b, e), 1);
}

// The avx512 build's passes: 16 lanes a register, each lane the same FMA chain as in the AVX2
// functions above (the same products, added in the same order, the same horizontal sums), so
// the bits are the same and only the instruction count differs. Scores: two keys at a time, key
// t in the low 8 lanes and t + 1 in the high 8, against the query broadcast to both halves.
//
// Four keys a pass (two registers of two), so each query load serves two FMAs, and the scores
// of four keys and all J heads are summed together (store_scores4): at 8k tokens of context the
// one-by-one horizontal sums were half the scores pass's instructions.

// The scores of keys t .. t + 3 for J heads, from their 8-lane sums (acc[0][j]: key t | t + 1,
// acc[1][j]: t + 2 | t + 3), each summed in hsum's order ((x0 + x4) + (x2 + x6)) + ((x1 + x5) +
// (x3 + x7)), so the same bits, each shuffle and add serving several sums: x_i + x_{i+4} of a
// head's four keys (a key a 128-bit lane), then the next level of two heads at once, then the
// last of four heads at once, whose vector (a key a lane, a head an element) is transposed and
// scaled into p[j * kBlock + s .. s + 3]. Summed head by head (an hsum of each head's four keys
// together) this took about 17 operations a head and 4 keys; now about 7.
template <int J>
inline void store_scores4(const __m512 (&acc)[2][J], __m512 sc, float* p, int64_t s) {
  __m512 y[J];  // lane k: key t + k's y_i = x_i + x_{i+4}, i = 0 .. 3
  for (int j = 0; j < J; ++j)
    y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0][j], acc[1][j], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(acc[0][j], acc[1][j], _MM_SHUFFLE(3, 1, 3, 1)));
  constexpr int J2 = (J + 1) / 2, J4 = (J + 3) / 4;
  __m512 z[J2];  // lane k: heads 2i and 2i + 1's y0 + y2, y1 + y3
  for (int i = 0; i < J2; ++i) {
    const __m512 a = y[2 * i], b = y[std::min(2 * i + 1, J - 1)];
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Lane k, element h: key t + k's score for head 4i + h; transposed to lane h, element k.
  const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int i = 0; i < J4; ++i) {
    const __m512 a = z[2 * i], b = z[std::min(2 * i + 1, J2 - 1)];
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(transpose, w), sc);
    _mm_storeu_ps(p + (4 * i) * kBlock + s, _mm512_castps512_ps128(v));
    if (4 * i + 1 < J) _mm_storeu_ps(p + (4 * i + 1) * kBlock + s, _mm512_extractf32x4_ps(v, 1));
    if (4 * i + 2 < J) _mm_storeu_ps(p + (4 * i + 2) * kBlock + s, _mm512_extractf32x4_ps(v, 2));
    if (4 * i + 3 < J) _mm_storeu_ps(p + (4 * i + 3) * kBlock + s, _mm512_extractf32x4_ps(v, 3));
  }
}

template <int J, class T, int DC>
void head_scores_wide(const float* q, const T* const* k, int64_t t0, int64_t t1, int64_t n, int64_t Dr, float sc,
                      float* p) {
  const int64_t D = DC > 0 ? DC : Dr;
  int64_t t = t0;
  const __m512 scw = _mm512_set1_ps(sc);
  for (; t + 4 <= t1; t += 4) {
    for (int64_t i = 0; i < 4; ++i) prefetch_scores(k, t + i, n, D);
    __m512 acc[2][J];
    for (int j = 0; j < J; ++j) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
    const auto step = [&](__m512 k0, __m512 k1, int64_t e) {
      for (int j = 0; j < J; ++j) {
        const __m512 qb = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + j * D + e));
        acc[0][j] = _mm512_fmadd_ps(qb, k0, acc[0][j]);
        acc[1][j] = _mm512_fmadd_ps(qb, k1, acc[1][j]);
      }
    };
    if constexpr (std::is_same_v<T, int8_t>) {
      // q8_0 rows a block of 32 at a time: the four keys' scales read once a block, two keys'
      // values widened as one register (load_row8's values: q * d, exact in fp32).
      for (int64_t b = 0; b < D; b += kQ8Block) {
        float d[4];
        const int8_t* qv[4];
        for (int i = 0; i < 4; ++i) qv[i] = q8_value(k[t + i], b, &d[i]);
        const __m512 d01 = _mm512_insertf32x8(_mm512_set1_ps(d[0]), _mm256_set1_ps(d[1]), 1);
        const __m512 d23 = _mm512_insertf32x8(_mm512_set1_ps(d[2]), _mm256_set1_ps(d[3]), 1);
        const auto pair = [&](int i, int64_t e, __m512 dd) {
          const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qv[i] + e)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qv[i + 1] + e)));
          return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), dd);
        };
        for (int64_t e = 0; e < kQ8Block; e += 8) step(pair(0, e, d01), pair(2, e, d23), b + e);
      }
    } else {
      for (int64_t e = 0; e < D; e += 8)
        step(key_pair(k[t], k[t + 1], e), key_pair(k[t + 2], k[t + 3], e), e);
    }
    store_scores4<J>(acc, scw, p, t - t0);
  }
  for (; t + 2 <= t1; t += 2) {
    prefetch_scores(k, t, n, D);
    prefetch_scores(k, t + 1, n, D);
    __m512 acc[J];
    for (int j = 0; j < J; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 8) {
      const __m512 kv = key_pair(k[t], k[t + 1], e);
      for (int j = 0; j < J; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(q + j * D + e)), kv, acc[j]);
    }
    for (int j = 0; j < J; ++j) {
      p[j * kBlock + t - t0] = hsum(_mm512_castps512_ps256(acc[j])) * sc;
      p[j * kBlock + t - t0 + 1] = hsum(_mm512_extractf32x8_ps(acc[j], 1)) * sc;
    }
  }
  if (t < t1) {
    prefetch_scores(k, t, n, D);
    score_key<J>(q, k[t], D, sc, p, t - t0);
  }
}

// Values: 32 floats of D at a time, each 16-lane register two of head_values' 8-lane vectors
// (needs D a multiple of 32); 32 registers hold J = 8 heads' sums.
template <int J, class T, int DC>
void head_values_wide(const float* p, const T* const* v, int64_t b0, int64_t b1, int64_t n, int64_t Dr, float* out) {
  const int64_t D = DC > 0 ? DC : Dr;
  for (int64_t t0 = b0; t0 < b1; t0 += kValueChunk) {
    const int64_t t1 = std::min(b1, t0 + kValueChunk);
    for (int64_t t = t0 + 2 * kValueChunk; t < std::min(b1, t0 + 3 * kValueChunk); ++t) prefetch_row(v[t], D);
    for (int64_t t = t0 + kBlock; t < std::min(n, t1 + kBlock); ++t) prefetch_row<_MM_HINT_T1>(v[t], D);
    for (int64_t e = 0; e < D; e += 32) {
      __m512 acc[J][2];
      for (int j = 0; j < J; ++j)
        for (int b = 0; b < 2; ++b) acc[j][b] = _mm512_loadu_ps(out + j * D + e + 16 * b);
      for (int64_t t = t0; t < t1; ++t) {
        const __m512 v0 = load_row16(v[t], e), v1 = load_row16(v[t], e + 16);
        for (int j = 0; j < J; ++j) {
          const __m512 pj = _mm512_set1_ps(p[j * kBlock + t - b0]);
          acc[j][0] = _mm512_fmadd_ps(pj, v0, acc[j][0]);
          acc[j][1] = _mm512_fmadd_ps(pj, v1, acc[j][1]);
        }
      }
      for (int j = 0; j < J; ++j)
        for (int b = 0; b < 2; ++b) _mm512_storeu_ps(out + j * D + e + 16 * b, acc[j][b]);
    }
  }
}
#endif

// The two passes for J = 1..8 heads at a time (a compile-time count of register chains), over
// caches of T (fp32, or fp16 / bf16 widened as each row is loaded).
template <class T>
using ScoresFn = void (*)(const float*, const T* const*, int64_t, int64_t, int64_t, int64_t, float, float*);
template <class T>
using ValuesFn = void (*)(const float*, const T* const*, int64_t, int64_t, int64_t, int64_t, float*);
// [kDims] the head size the passes take: 0 any (a run-time D), 1 D = 64, 2 D = 128, each loop
// over D unrolled at compile time. At 8k tokens of context this took a layer's decode attention
// on a Zen 5 from 134 to 120 us (the 0.5B's heads, in cache) and 1.05-1.18x from memory.
constexpr int kDims = 3;
inline int dims_slot(int64_t D) { return D == 64 ? 1 : D == 128 ? 2 : 0; }
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define HS_SCORES(DC)                                                                           \
  {head_scores_wide<1, T, DC>, head_scores_wide<2, T, DC>, head_scores_wide<3, T, DC>,             \
   head_scores_wide<4, T, DC>, head_scores_wide<5, T, DC>, head_scores_wide<6, T, DC>,             \
   head_scores_wide<7, T, DC>, head_scores_wide<8, T, DC>}
#define HS_VALUES(DC)                                                                           \
  {head_values_wide<1, T, DC>, head_values_wide<2, T, DC>, head_values_wide<3, T, DC>,             \
   head_values_wide<4, T, DC>, head_values_wide<5, T, DC>, head_values_wide<6, T, DC>,             \
   head_values_wide<7, T, DC>, head_values_wide<8, T, DC>}
constexpr int64_t kWideValues = 32;
#else
#define HS_SCORES(DC)                                                                           \
  {head_scores<1, T, DC>, head_scores<2, T, DC>, head_scores<3, T, DC>, head_scores<4, T, DC>,     \
   head_scores<5, T, DC>, head_scores<6, T, DC>, head_scores<7, T, DC>, head_scores<8, T, DC>}
// EB = 2 where it fits (J <= 6, D a multiple of 16), else 1.
#define HS_VALUES(DC)                                                                           \
  {head_values<1, 2, T, DC>, head_values<2, 2, T, DC>, head_values<3, 2, T, DC>,                   \
   head_values<4, 2, T, DC>, head_values<5, 2, T, DC>, head_values<6, 2, T, DC>,                   \
   head_values<7, 1, T, DC>, head_values<8, 1, T, DC>}
constexpr int64_t kWideValues = 16;
#endif
template <class T>
constexpr ScoresFn<T> kHeadScores[kDims][8] = {HS_SCORES(0), HS_SCORES(64), HS_SCORES(128)};
// kHeadValues<T>[0]: one vector at a time, any D; [1 + dims_slot(D)] where D is a multiple of
// kWideValues.
template <class T>
constexpr ValuesFn<T> kHeadValues[1 + kDims][8] = {
    {head_values<1, 1, T, 0>, head_values<2, 1, T, 0>, head_values<3, 1, T, 0>, head_values<4, 1, T, 0>,
     head_values<5, 1, T, 0>, head_values<6, 1, T, 0>, head_values<7, 1, T, 0>, head_values<8, 1, T, 0>},
    HS_VALUES(0), HS_VALUES(64), HS_VALUES(128)};
#undef HS_SCORES
#undef HS_VALUES

}  // namespace

namespace hetserve {

// Long contexts are split into segments, each a work item over all of the row's KV heads: a
// segment's K rows of every head lie together in the cache (a page holds a token's heads side by
// side), so a thread walks one contiguous run of memory, where split by head (as short rows are)
// each thread read every other pair of cache lines of the same pages. A row of n > g_split_tokens
// tokens takes an even count of segments of equal length, 2 * ceil(n / (2 * g_split_tokens)) (two
// threads share them evenly), each with its own online softmax, merged after in segment order.
// The split depends on n alone, never on the threads, so a row's bits do too (a verification row
// is the same decode row). 0.5B decode on a Zen 5 EPYC, the two alternated in one process: 36.8
// against 39.3 tok/s at 32000 tokens of context, 69.6 against 70.6 at 8192.
int64_t g_split_tokens = 2048;  // set_attention_split moves it (0: never), for tests

inline int64_t segments(int64_t n) {
  const int64_t s = g_split_tokens;
  return s > 0 && n > s ? 2 * ((n + 2 * s - 1) / (2 * s)) : 1;
}

void set_attention_split(int64_t tokens) {
  TORCH_CHECK(tokens >= 0, "split length must be >= 0 (0: never split)");
  g_split_tokens = tokens;
}

int64_t attention_split() { return g_split_tokens; }

// Attention of single query rows over their paged contexts, read in place from the caches
// [slots, KVH, D] (slot = page * page_size + offset). Row r is q[rows[r]] and sees the first
// ctx_lens[r] tokens of block table tables[r]. The g = H / KVH query heads of a KV head share
// each K and V row as it is read (GQA without repeating K/V). Writes out[rows[r]] ([T, H * D]).
// fp16 and bf16 rows are widened to fp32 as each pass loads them (F16C, or a shift for bf16),
// so the passes compute what they compute over an fp32 cache of the same values, bit for bit,
// from half the bytes. (Widened into a scratch first, in a pass of their own, they were slower
// than fp32: that pass waited on memory with nothing to compute.)
void attend_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                 torch::Tensor rows, torch::Tensor ctx_lens, torch::Tensor tables, int64_t page_size, double scale) {
  for (auto* t : {&q, &out}) check_f32(*t, "q and out");
  check_cache(k_cache, v_cache);
  for (auto* t : {&rows, &ctx_lens, &tables})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(), "rows, ctx_lens, tables: contiguous int64");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "q [T, H, D], caches [S, KVH, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(D % 8 == 0 && H % KVH == 0, "head sizes do not match (D a multiple of 8)");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == H * D, "out [T, H * D] expected");
  const int64_t R = rows.size(0), P = tables.dim() == 2 ? tables.size(1) : 0;
  TORCH_CHECK(ctx_lens.numel() == R && tables.dim() == 2 && tables.size(0) == R && page_size > 0, "one table per row");
  const int64_t *rp = rows.data_ptr<int64_t>(), *cp = ctx_lens.data_ptr<int64_t>(), *tp = tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < T && cp[r] > 0 && cp[r] <= P * page_size, "row or context length out of range");
    for (int64_t i = 0; i < (cp[r] + page_size - 1) / page_size; ++i)
      TORCH_CHECK(tp[r * P + i] >= 0 && (tp[r * P + i] + 1) * page_size <= S, "page out of range");
  }
  const int64_t g = H / KVH;
  const int dims = dims_slot(D);
  TORCH_CHECK(g <= 64, "at most 64 query heads per KV head");
  // Work items: a short row's KV heads one by one over its whole context, a long row's segments
  // over all its heads. A segment leaves its heads' running max, sum and weighted values in
  // `parts` ([H] max, [H] sum, [H * D] values an item) for the merge.
  struct Item {
    int64_t r, h0, h1, t0, t1, part;  // row, heads [h0, h1), tokens [t0, t1), index in parts (-1: none)
  };
  std::vector<Item> items;
  int64_t split = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = cp[r], ns = segments(n);
    if (ns == 1)
      for (int64_t h = 0; h < KVH; ++h) items.push_back({r, h, h + 1, 0, n, -1});
    else
      for (int64_t s = 0; s < ns; ++s) items.push_back({r, 0, KVH, n * s / ns, n * (s + 1) / ns, split++});
  }
  const int64_t part_floats = H * (D + 2);
  std::vector<float> parts(split * part_floats);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  with_cache_type(k_cache, [&](auto* type) {
    using C = std::remove_pointer_t<decltype(type)>;
    const int64_t RE = row_elems<C>(D);
    TORCH_CHECK(k_cache.size(2) == RE && (!std::is_same_v<C, int8_t> || D % kQ8Block == 0),
                "the caches' rows do not match the head size (int8: a multiple of 32)");
    const C *kc = static_cast<const C*>(k_cache.data_ptr()), *vc = static_cast<const C*>(v_cache.data_ptr());
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> p(g * kBlock), acc(KVH * g * D), m(KVH * g), l(KVH * g);
      std::vector<std::vector<const C*>> krows(KVH), vrows(KVH);
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = items[i];
        const int64_t n = cp[it.r], t0 = it.t0, t1 = it.t1, e = std::min(n, t1 + kBlock);
        const int64_t* table = tp + it.r * P;
        // Row pointers for tokens t0 .. e (e: the next block past the item's, for its
        // prefetches), kept as k[t - t0]: the passes index k + ... - t0 with absolute t.
        for (int64_t h = it.h0; h < it.h1; ++h) {
          auto &krow = krows[h], &vrow = vrows[h];
          krow.resize(e - t0);
          vrow.resize(e - t0);
          for (int64_t t = t0; t < e;) {  // a page at a time: no division a token
            const int64_t page = t / page_size, first = page * page_size, end = std::min(e, first + page_size);
            const int64_t base = (table[page] * page_size * KVH + h) * RE;
            for (; t < end; ++t) {
              krow[t - t0] = kc + base + (t - first) * KVH * RE;
              vrow[t - t0] = vc + base + (t - first) * KVH * RE;
            }
          }
          prefetch_first_block(krow.data(), vrow.data(), t1 - t0, D);
        }
        std::fill(m.begin(), m.end(), -INFINITY);
        std::fill(l.begin(), l.end(), 0.f);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t b0 = t0; b0 < t1; b0 += kBlock) {
          const int64_t b1 = std::min(t1, b0 + kBlock);
          for (int64_t h = it.h0; h < it.h1; ++h) {
            const float* qh = qp + (rp[it.r] * H + h * g) * D;
            const C* const* kr = krows[h].data() - t0;
            const C* const* vr = vrows[h].data() - t0;
            float *mh = m.data() + h * g, *lh = l.data() + h * g, *ah = acc.data() + h * g * D;
            for (int64_t j0 = 0; j0 < g; j0 += 8)
              kHeadScores<C>[dims][std::min<int64_t>(8, g - j0) - 1](qh + j0 * D, kr, b0, b1, e, D, sc,
                                                               p.data() + j0 * kBlock);
            for (int64_t j = 0; j < g; ++j) {
              const float alpha = online_block(p.data() + j * kBlock, b1 - b0, mh[j], lh[j]);
              if (b0 > t0 && alpha != 1.f) scale_row(ah + j * D, alpha, ah + j * D, D);
            }
            for (int64_t j0 = 0; j0 < g; j0 += 8)
              kHeadValues<C>[D % kWideValues == 0 ? 1 + dims : 0][std::min<int64_t>(8, g - j0) - 1](
                  p.data() + j0 * kBlock, vr, b0, b1, e, D, ah + j0 * D);
          }
        }
        for (int64_t h = it.h0; h < it.h1; ++h)
          for (int64_t j = h * g; j < (h + 1) * g; ++j) {
            if (it.part >= 0) {
              float* part = parts.data() + it.part * part_floats;
              part[j] = m[j];
              part[H + j] = l[j];
              std::copy(acc.data() + j * D, acc.data() + (j + 1) * D, part + 2 * H + j * D);
              continue;
            }
            scale_row(acc.data() + j * D, 1.f / l[j], op + rp[it.r] * H * D + j * D, D);
          }
      }
    });
  });
  // A split row's segments merged in order: each segment's sums scaled by exp(its max - the
  // row's max), the values' sum divided by the weights' sum.
  for (int64_t r = 0, part = 0; r < R; ++r) {
    const int64_t ns = segments(cp[r]);
    if (ns == 1) continue;
    const float* first = parts.data() + part * part_floats;
    for (int64_t j = 0; j < H; ++j) {
      float mx = -INFINITY, sum = 0.f;
      for (int64_t s = 0; s < ns; ++s) mx = std::max(mx, first[s * part_floats + j]);
      float* o = op + rp[r] * H * D + j * D;
      std::fill(o, o + D, 0.f);
      for (int64_t s = 0; s < ns; ++s) {
        const float* pt = first + s * part_floats;
        const float f = exp1(pt[j] - mx);
        sum = std::fma(pt[H + j], f, sum);
        const __m256 fv = _mm256_set1_ps(f);
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_loadu_ps(pt + 2 * H + j * D + d), fv, _mm256_loadu_ps(o + d)));
      }
      scale_row(o, 1.f / sum, o, D);
    }
    part += ns;
  }
}

}  // namespace hetserve

namespace {

// ---- Prefill chunks. torch's fp32 SDPA (its flash kernel) ran a 512-token causal chunk of the
// 0.5B's heads at about a fifth of the FMA unit's peak on a Zen 1 EPYC. Here each KV head's K is
// packed once, transposed, into tiles of kKeys keys ([D][kKeys] each, zero past the context) and
// V widened to fp32 rows. A tile of kChunkRows query rows of one head computes its scores against
// each key tile with kChunkRows x 2 sums in registers (each K vector load serves the rows), an
// exact softmax per row over the keys it sees, and the weighted V rows with the same row tile
// (each V load serves the rows; a row's weights past its own keys are zero, which adds nothing).
// A block of kTiles row tiles walks the keys in blocks of about 32 KiB of K or V, each block
// used by every tile while it is in L1, where one row tile at a time read all of K and V (1 MiB
// a KV head of the 0.5B at 2048 tokens, past L2) again for every tile: 96 against 104 ms for a
// 512-token chunk at 2048 (one run each, `hetserve bench attention`). The weighted sums are kept
// in the output rows between key blocks, in key order: the blocks change no bits.
constexpr int kChunkRows = 6;   // query rows a tile: 2 x 6 sums + 2 K vectors + a broadcast fit AVX2's 16 registers
constexpr int64_t kTiles = 4;   // row tiles a block
constexpr int64_t kKeys = 16;   // keys a scores tile (two vectors)

// s_r[0 .. 16) = q_r . k_t for the R rows q (D apart) against a K tile kt ([D][16]); rows of s ld apart.
template <int R>
inline void score_tile(const float* q, const float* kt, int64_t D, float* s, int64_t ld) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t e = 0; e < D; ++e) {
    const __m256 k0 = _mm256_loadu_ps(kt + e * kKeys), k1 = _mm256_loadu_ps(kt + e * kKeys + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * D + e);
      acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * ld, acc[r][0]);
    _mm256_storeu_ps(s + r * ld + 8, acc[r][1]);
  }
}

// o_r[0 .. D) += sum_t p_r[t] v_t over keys t0 .. t1 for the R rows p (ld apart; V rows [.][D]
// fp32), in key order, 16 values of D at a time; rows of o ostride apart.
template <int R>
inline void weigh_tile(const float* p, int64_t ld, int64_t t0, int64_t t1, const float* v, int64_t D, float* o,
                       int64_t ostride) {
  for (int64_t e = 0; e < D; e += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + r * ostride + e);
      acc[r][1] = _mm256_loadu_ps(o + r * ostride + e + 8);
    }
    for (int64_t t = t0; t < t1; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v + t * D + e), v1 = _mm256_loadu_ps(v + t * D + e + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pb = _mm256_broadcast_ss(p + r * ld + t);
        acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * ostride + e, acc[r][0]);
      _mm256_storeu_ps(o + r * ostride + e + 8, acc[r][1]);
    }
  }
}

}  // namespace

namespace hetserve {

// Causal attention of a prefill chunk: q [T, H, D] fp32, query i at position C - T + i seeing keys
// 0 .. C - T + i of k, v [C, KVH, D] (fp32, fp16 or bf16, contiguous: the context's slots read in
// place or gathered); the H / KVH query heads of a KV head share its K and V. Writes out [T, H * D].
// Each row's sums run in a fixed order over its own keys: a row's result depends on neither the
// chunk's other rows nor the threads.
void attend_chunk(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale) {
  check_chunk(q, k, v, out, 16, 0);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), C = k.size(0), KVH = k.size(1);
  const int64_t g = H / KVH, first = C - T, tiles = (C + kKeys - 1) / kKeys, ld = tiles * kKeys;
  std::vector<float> kt(KVH * tiles * D * kKeys, 0.f), vf(KVH * C * D);
  with_cache_type(k, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    const int64_t RE = row_elems<E>(D);
    TORCH_CHECK(k.size(2) == RE && (!std::is_same_v<E, int8_t> || D % kQ8Block == 0),
                "k and v rows do not match the head size (int8: a multiple of 32)");
    const E *kp = static_cast<const E*>(k.data_ptr()), *vp = static_cast<const E*>(v.data_ptr());
    at::parallel_for(0, KVH * C, 256, [&](int64_t i0, int64_t i1) {
      alignas(32) float row[8];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t h = i / C, t = i % C, src = (t * KVH + h) * RE;
        float* tile = kt.data() + ((h * tiles + t / kKeys) * D) * kKeys + t % kKeys;
        for (int64_t e = 0; e < D; e += 8) {
          _mm256_storeu_ps(vf.data() + (h * C + t) * D + e, load_row8(vp + src, e));
          _mm256_store_ps(row, load_row8(kp + src, e));
          for (int j = 0; j < 8; ++j) tile[(e + j) * kKeys] = row[j];
        }
      }
    });
  });
  const float sc = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rows = kTiles * kChunkRows, blocks = (T + rows - 1) / rows;
  const int64_t span = std::max<int64_t>(1, 8192 / (D * kKeys)) * kKeys;  // keys a block: 32 KiB of fp32 K or V
  // Work items (query head, row block), head-major: each thread's contiguous share holds whole
  // heads (with the blocks' growing costs) wherever the threads divide the heads.
  at::parallel_for(0, H * blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(rows * ld), qs(rows * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t hq = i / blocks, b0 = i % blocks * rows, B = std::min(rows, T - b0), h = hq / g;
      const float* kh = kt.data() + h * tiles * D * kKeys;
      const float* vh = vf.data() + h * C * D;
      float* ob = op + (b0 * H + hq) * D;
      for (int64_t r = 0; r < B; ++r) {
        for (int64_t e = 0; e < D; ++e) qs[r * D + e] = qp[((b0 + r) * H + hq) * D + e] * sc;
        std::fill(ob + r * H * D, ob + r * H * D + D, 0.f);
      }
      // Tile j: rows j * kChunkRows .. + R of the block, seeing keys 0 .. n(j) (its last row's).
      auto tile_rows = [&](int64_t j) { return std::min<int64_t>(kChunkRows, B - j * kChunkRows); };
      auto tile_keys = [&](int64_t j) { return first + b0 + j * kChunkRows + tile_rows(j); };
      const int64_t nt = (B + kChunkRows - 1) / kChunkRows;
      for (int64_t k0 = 0; k0 < tile_keys(nt - 1); k0 += span)
        for (int64_t j = 0; j < nt; ++j) {
          const int64_t R = tile_rows(j), k1 = std::min(k0 + span, tile_keys(j));
          const float* qj = qs.data() + j * kChunkRows * D;
          float* sj = s.data() + j * kChunkRows * ld;
          for (int64_t t = k0; t < k1; t += kKeys) {
            if (R == kChunkRows) score_tile<kChunkRows>(qj, kh + t * D, D, sj + t, ld);
            else
              for (int64_t r = 0; r < R; ++r) score_tile<1>(qj + r * D, kh + t * D, D, sj + r * ld + t, ld);
          }
        }
      float inv[rows];
      for (int64_t r = 0; r < B; ++r) {
        float* sr = s.data() + r * ld;
        const int64_t nr = first + b0 + r + 1;
        inv[r] = softmax_row(sr, nr);
        std::fill(sr + nr, sr + tile_keys(r / kChunkRows), 0.f);  // keys the row does not see weigh nothing
      }
      for (int64_t k0 = 0; k0 < tile_keys(nt - 1); k0 += span)
        for (int64_t j = 0; j < nt; ++j) {
          const int64_t R = tile_rows(j), k1 = std::min(k0 + span, tile_keys(j));
          if (k1 <= k0) continue;
          const float* pj = s.data() + j * kChunkRows * ld;
          float* oj = ob + j * kChunkRows * H * D;
          if (R == kChunkRows) weigh_tile<kChunkRows>(pj, ld, k0, k1, vh, D, oj, H * D);
          else
            for (int64_t r = 0; r < R; ++r) weigh_tile<1>(pj + r * ld, ld, k0, k1, vh, D, oj + r * H * D, H * D);
        }
      for (int64_t r = 0; r < B; ++r) scale_row(ob + r * H * D, inv[r], ob + r * H * D, D);
    }
  });
}

}  // namespace hetserve

void register_attention(pybind11::module& m) {
  using namespace hetserve;
  m.def("attend_rows", &attend_rows, "attention of single query rows over paged KV, in place");
  m.def("attend_chunk", &attend_chunk, "causal attention of a prefill chunk over its context");
  m.def("set_attention_split", &set_attention_split,
        "context length past which a decode row splits into segments (0: never)", pybind11::arg("tokens"));
  m.def("attention_split", &attention_split, "the context length past which a decode row splits into segments");
}
