// Prefill chunks' attention on AVX512-BF16 (Zen 4, Zen 5, Sapphire Rapids and later): a tiled,
// flash-attention style kernel whose two products run on vdpbf16ps, 32 bf16 multiply-adds an
// instruction into fp32 sums, where the fp32 kernel (attention.cpp, attend_chunk) does 8 an FMA.
//
// A work item is one KV head and a block of kRows query positions with all g query heads that
// share that KV head. It walks the context's keys in blocks of kBlock (their K and V, 2 x 32 KiB
// at D = 64, stay in L2 while the g heads use them) with an online softmax per row: the block's
// scores S = Q K^T (fp32 sums of bf16 products), the row's running maximum and sum updated, the
// output rows rescaled and P V added (P rounded to bf16). Keys a row may not see (the causal
// triangle, the padding past the context) weigh exactly 0 and blocks no row sees are skipped, and
// the blocks lie at fixed key positions: a row's result depends on neither the chunk's other rows
// nor the threads, as in the fp32 kernel.
//
// Layouts (bf16, packed once a call from the cache's own rows, which may be fp32, fp16, bf16 or
// int8 q8_0): K in groups of 16 keys as [D / 2][16][2] (one vector holds a dimension pair of 16
// keys, so a broadcast query pair scores 16 keys an instruction); V in key pairs as [D][2] (one
// vector holds 16 dimensions of 2 keys, so a broadcast pair of weights adds 2 keys to 16 sums).
//
// The vdpbf16ps intrinsics are compiled for this file's functions alone (target attribute), so
// the avx512 variant still runs on AVX-512 CPUs without BF16; the caller asks first
// (layers/native.py, has_bf16_attention).
#include "kernels.h"
#include "vec.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)

#define HS_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {

constexpr int kRows = 12;       // query positions a tile: 12 x 2 fp32 sums + 2 loads + a broadcast in 32 registers
constexpr int64_t kGroup = 16;  // keys a packed K group (one vector of scores)
constexpr int64_t kBlock = 256; // keys a softmax block

// 2^x for 16 floats x <= 0 (scores in the log2 domain: the queries carry log2(e)): 2^n by
// vscalefps times 2^f, f in [-0.5, 0.5], by its degree-4 Taylor polynomial (relative error under
// 5e-5, a fortieth of the bf16 rounding the weights then take). About half of exp8's
// instructions (vec.h), which took a fifth of this kernel's time.
HS_BF16 inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 32 fp32 values (two vectors) as 32 bf16, rounded to nearest even.
HS_BF16 inline __m512i to_bf16(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

// s[r][0 .. 32) = q_r . k for the kRows rows of q (pairs, [kRows][D / 2] as 32-bit words) against
// two packed K groups (kp, kp + D * 16).
HS_BF16 inline void score_tile(const uint32_t* q, const uint16_t* kp, int64_t D, float* s, int64_t ld) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = D / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * 32);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + (pairs + p) * 32);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(s + r * ld, acc[r][0]);
    _mm512_storeu_ps(s + r * ld + 16, acc[r][1]);
  }
}

// o[r][e .. e + 32) += sum_t p_r[t] v_t over the key pairs [0, n2) of a block, for the kRows rows:
// p as bf16 pairs ([kRows][ld2] 32-bit words), V packed [pairs][D][2], o rows D apart.
HS_BF16 inline void weigh_tile(const uint32_t* p, int64_t ld2, int64_t n2, const uint16_t* vp, int64_t D, float* o) {
  for (int64_t e = 0; e < D; e += 32) {
    __m512 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = _mm512_loadu_ps(o + r * D + e);
      acc[r][1] = _mm512_loadu_ps(o + r * D + e + 16);
    }
    for (int64_t t = 0; t < n2; ++t) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + (t * D + e) * 2);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + (t * D + e + 16) * 2);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * ld2 + t]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(o + r * D + e, acc[r][0]);
      _mm512_storeu_ps(o + r * D + e + 16, acc[r][1]);
    }
  }
}

// K and V of one KV head, packed as the header says; keys past C are zero.
template <class E>
HS_BF16 void pack_head(const E* k, const E* v, int64_t C, int64_t KVH, int64_t h, int64_t D, uint16_t* kp,
                       uint16_t* vp, int64_t g0, int64_t g1) {
  const int64_t RE = row_elems<E>(D);
  alignas(64) float kr[2][256], vr[2][256];
  for (int64_t grp = g0; grp < g1; ++grp) {
    uint16_t* kg = kp + grp * kGroup * D;
    for (int64_t i = 0; i < kGroup; i += 2) {
      const int64_t t = grp * kGroup + i;
      for (int j = 0; j < 2; ++j) {
        if (t + j < C) {
          const E* kr_src = k + ((t + j) * KVH + h) * RE;
          const E* vr_src = v + ((t + j) * KVH + h) * RE;
          for (int64_t e = 0; e < D; e += 8) {
            _mm256_store_ps(kr[j] + e, load_row8(kr_src, e));
            _mm256_store_ps(vr[j] + e, load_row8(vr_src, e));
          }
        } else {
          std::fill(kr[j], kr[j] + D, 0.f);
          std::fill(vr[j], vr[j] + D, 0.f);
        }
      }
      // K: key t + j, dimension pair p -> kg[(p * 16 + i + j) * 2 + {0, 1}]
      for (int j = 0; j < 2; ++j)
        for (int64_t e = 0; e < D; e += 32) {
          const __m512i b = to_bf16(_mm512_load_ps(kr[j] + e), _mm512_load_ps(kr[j] + e + 16));
          alignas(64) uint32_t w[16];
          _mm512_store_si512(w, b);
          for (int64_t p = 0; p < 16; ++p)
            reinterpret_cast<uint32_t*>(kg)[(e / 2 + p) * kGroup + i + j] = w[p];
        }
      // V: keys (t, t + 1), dimension e -> vp[(t / 2 * D + e) * 2 + {0, 1}]
      uint16_t* vt = vp + (t / 2) * D * 2;
      for (int64_t e = 0; e < D; e += 16) {
        const __m512i b = to_bf16(_mm512_load_ps(vr[0] + e), _mm512_load_ps(vr[1] + e));  // [t: 16][t+1: 16]
        const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                             23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        _mm512_storeu_si512(vt + e * 2, _mm512_permutexvar_epi16(idx, b));
      }
    }
  }
}

// The lanes of scores t .. t + 16 (in a block) that a row seeing keys up to lim (in the block)
// sees; every lane where no row's limit falls inside the block.
HS_BF16 inline __mmask16 live_lanes(bool masked, int64_t lim, int64_t t) {
  if (!masked || lim - t >= 15) return _cvtu32_mask16(0xFFFFu);
  return _cvtu32_mask16(lim - t < 0 ? 0u : (1u << (lim - t + 1)) - 1);
}

struct ChunkShape {
  int64_t T, H, D, C, KVH, g, first, padded;
};

// One work item: KV head h, query positions b0 .. b0 + kRows (those past T computed and dropped).
HS_BF16 void attend_block(const ChunkShape& sh, const float* qsrc, const uint16_t* kp, const uint16_t* vp, float sc,
                          int64_t h, int64_t b0, float* out, std::vector<uint32_t>& qb, std::vector<float>& o,
                          std::vector<float>& s, std::vector<uint32_t>& pb) {
  const int64_t D = sh.D, g = sh.g, pairs = D / 2;
  const int64_t rows = std::min<int64_t>(kRows, sh.T - b0);
  // The g heads' query rows as bf16 pairs, times the scale and log2(e); rows past T zero.
  for (int64_t j = 0; j < g; ++j)
    for (int r = 0; r < kRows; ++r) {
      uint32_t* dst = qb.data() + (j * kRows + r) * pairs;
      if (r >= rows) {
        std::fill(dst, dst + pairs, 0u);
        continue;
      }
      const float* src = qsrc + ((b0 + r) * sh.H + h * g + j) * D;
      const __m512 scv = _mm512_set1_ps(sc);
      for (int64_t e = 0; e < D; e += 32) {
        const __m512i b = to_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + e), scv),
                                  _mm512_mul_ps(_mm512_loadu_ps(src + e + 16), scv));
        _mm512_storeu_si512(dst + e / 2, b);
      }
    }
  std::fill(o.begin(), o.end(), 0.f);
  float m[64 * kRows], l[64 * kRows];
  std::fill(m, m + g * kRows, -INFINITY);
  std::fill(l, l + g * kRows, 0.f);
  const int64_t last = sh.first + b0 + rows - 1;  // the last key any row sees
  const int64_t ld2 = kBlock / 2;
  for (int64_t k0 = 0; k0 <= last; k0 += kBlock) {
    const int64_t n = std::min(kBlock, last + 1 - k0);  // keys of this block some row sees
    const int64_t n32 = (n + 31) / 32 * 32;
    const bool masked = k0 + n32 - 1 > sh.first + b0;  // some row's limit falls inside
    const uint16_t* kb = kp + k0 * D;
    const uint16_t* vb = vp + k0 * D;
    for (int64_t j = 0; j < g; ++j) {
      const uint32_t* qj = qb.data() + j * kRows * pairs;
      for (int64_t t = 0; t < n32; t += 32) score_tile(qj, kb + t * D, D, s.data() + t, kBlock);
      float* oj = o.data() + j * kRows * D;
      for (int r = 0; r < kRows; ++r) {
        float* sr = s.data() + r * kBlock;
        const int64_t lim = std::min<int64_t>(sh.first + b0 + std::min<int64_t>(r, rows - 1), last) - k0;  // last key seen, in block
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < n32; t += 16)
          mv = _mm512_mask_max_ps(mv, live_lanes(masked, lim, t), mv, _mm512_loadu_ps(sr + t));
        const float mi = m[j * kRows + r], mn = std::max(mi, _mm512_reduce_max_ps(mv));
        if (mn == -INFINITY) {  // no key of this block is seen by the row
          std::fill(pb.data() + r * ld2, pb.data() + r * ld2 + n32 / 2, 0u);
          continue;
        }
        const float alpha = mi == -INFINITY ? 0.f : exp2_16(_mm512_set1_ps(mi - mn))[0];
        const __m512 mb = _mm512_set1_ps(mn);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n32; t += 32) {
          const __m512 e0 = _mm512_maskz_mov_ps(live_lanes(masked, lim, t),
                                                exp2_16(_mm512_sub_ps(_mm512_loadu_ps(sr + t), mb)));
          const __m512 e1 = _mm512_maskz_mov_ps(live_lanes(masked, lim, t + 16),
                                                exp2_16(_mm512_sub_ps(_mm512_loadu_ps(sr + t + 16), mb)));
          const __m512i b = to_bf16(e0, e1);
          _mm512_storeu_si512(pb.data() + r * ld2 + t / 2, b);
          // The sum of the weights as rounded (what P V adds up), in fp32.
          const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16));
          const __m512 r1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16));
          sum = _mm512_add_ps(sum, _mm512_add_ps(r0, r1));
        }
        m[j * kRows + r] = mn;
        l[j * kRows + r] = l[j * kRows + r] * alpha + _mm512_reduce_add_ps(sum);
        if (alpha != 1.f) {
          const __m512 av = _mm512_set1_ps(alpha);
          for (int64_t e = 0; e < D; e += 16)
            _mm512_storeu_ps(oj + r * D + e, _mm512_mul_ps(_mm512_loadu_ps(oj + r * D + e), av));
        }
      }
      weigh_tile(pb.data(), ld2, n32 / 2, vb, D, oj);
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = out + ((b0 + r) * sh.H + h * g + j) * D;
      const float* src = o.data() + (j * kRows + r) * D;
      const __m512 iv = _mm512_set1_ps(1.f / l[j * kRows + r]);
      for (int64_t e = 0; e < D; e += 16) _mm512_storeu_ps(dst + e, _mm512_mul_ps(_mm512_loadu_ps(src + e), iv));
    }
}

}  // namespace

namespace hetserve {

// attend_chunk's contract (attention.cpp) in bf16 products with fp32 sums; D a multiple of 32 up
// to 256, at most 64 query heads a KV head.
void attend_chunk_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale) {
  check_chunk(q, k, v, out, 32, 256);
  ChunkShape sh{q.size(0), q.size(1), q.size(2), k.size(0), k.size(1), 0, 0, 0};
  sh.g = sh.H / sh.KVH;
  TORCH_CHECK(sh.g <= 64, "at most 64 query heads per KV head");
  sh.first = sh.C - sh.T;
  sh.padded = (sh.C + kBlock - 1) / kBlock * kBlock;
  const int64_t D = sh.D, groups = sh.padded / kGroup;
  std::vector<uint16_t> kp(sh.KVH * sh.padded * D), vp(sh.KVH * sh.padded * D);
  with_cache_type(k, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    TORCH_CHECK(k.size(2) == row_elems<E>(D), "k and v rows do not match the head size");
    const E *kc = static_cast<const E*>(k.data_ptr()), *vc = static_cast<const E*>(v.data_ptr());
    at::parallel_for(0, sh.KVH * groups, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1;) {
        const int64_t h = i / groups, g0 = i % groups, g1 = std::min(groups, g0 + (i1 - i));
        pack_head(kc, vc, sh.C, sh.KVH, h, D, kp.data() + h * sh.padded * D, vp.data() + h * sh.padded * D, g0, g1);
        i += g1 - g0;
      }
    });
  });
  const int64_t blocks = (sh.T + kRows - 1) / kRows, items = sh.KVH * blocks;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale) * 1.44269504088896341f;  // scores in the log2 domain
  // Items in an order whose contiguous shares cost about the same: within a KV head, blocks from
  // both ends of the chunk in turn (a block's cost grows with its position).
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint32_t> qb(sh.g * kRows * D / 2), pb(kRows * kBlock / 2);
    std::vector<float> o(sh.g * kRows * D), s(kRows * kBlock);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / blocks, j = i % blocks, b = j % 2 == 0 ? j / 2 : blocks - 1 - j / 2;
      attend_block(sh, qp, kp.data() + h * sh.padded * D, vp.data() + h * sh.padded * D, sc, h, b * kRows, op, qb, o,
                   s, pb);
    }
  });
}

bool has_bf16_attention() { return true; }

}  // namespace hetserve

#else  // the avx2 variant: no AVX-512 in this build

namespace hetserve {
void attend_chunk_bf16(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "attend_chunk_bf16 needs the avx512 variant of the kernels");
}
bool has_bf16_attention() { return false; }
}  // namespace hetserve

#endif

void register_flash_bf16(pybind11::module& m) {
  using namespace hetserve;
  m.def("attend_chunk_bf16", &attend_chunk_bf16,
        "causal attention of a prefill chunk over its context, bf16 products (AVX512-BF16 CPUs only)");
  m.def("has_bf16_attention", &has_bf16_attention, "whether this variant holds attend_chunk_bf16");
}
