// Fused fp32 CPU ops for the decoder's small per-layer steps. At batch 1 the time a step spends
// outside the matmuls is mostly per-op dispatch: an RMSNorm is 6 torch ops, RoPE on q and k
// plus the KV-cache write about 15. Each of these is one call. Every row is computed alone, in
// a fixed order: results do not depend on the batch.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous fp32 CPU tensor");
}

// 8 values as fp32, from fp32, bf16 (exact: a bf16 is the top half of an fp32) or fp16 (F16C, exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Rounded to fp16 to nearest even, as torch's .to(torch.float16).
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// Rounded to bf16 to nearest even, as torch's .to(torch.bfloat16) (finite values).
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 8 x u16 in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// n values from one float type to another (each rounded as torch's .to() rounds it).
template <class S, class D>
inline void convert_row(const S* src, D* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) store8(dst + j, load8(src + j));
  for (; j < n; ++j) dst[j] = static_cast<D>(static_cast<float>(src[j]));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= H; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; j < H; ++j) ss += x[j] * x[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (j = 0; j + 8 <= H; j += 8)
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(x + j), rv)));
  for (; j < H; ++j) y[j] = w[j] * (x[j] * r);
}

}  // namespace

namespace hetserve {

// RMSNorm of each row of x: w * x / sqrt(mean(x^2) + eps). With `delta`, x += delta first (the
// residual add), in place, and the sum is normalized.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> delta) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "x [T, H] and w [H] expected");
  const bool add = delta && delta->defined();
  if (add) {
    check_f32(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape");
  }
  const int64_t T = x.size(0), H = x.size(1);
  auto y = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = add ? delta->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = xp + t * H;
      if (add)
        for (int64_t j = 0; j < H; ++j) row[j] += dp[t * H + j];
      norm_row(row, wp, yp + t * H, H, static_cast<float>(eps));
    }
  });
  return y;
}

}  // namespace hetserve

namespace {

// NeoX rotation of one head (first half with second half) by a position's cos/sin.
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t half) {
  int64_t j = 0;
  for (; j + 8 <= half; j += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + j), x2 = _mm256_loadu_ps(x + half + j);
    const __m256 cv = _mm256_loadu_ps(c + j), sv = _mm256_loadu_ps(s + j);
    _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    _mm256_storeu_ps(out + half + j, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
  for (; j < half; ++j) {
    const float x1 = x[j], x2 = x[half + j];
    out[j] = x1 * c[j] - x2 * s[j];
    out[half + j] = x2 * c[j] + x1 * s[j];
  }
}

// The caches' element types: fp32, or fp16 / bf16 (half the bytes a step reads; the attention
// widens each row to fp32 before it computes).
void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  for (const auto* t : {&k_cache, &v_cache})
    TORCH_CHECK((t->scalar_type() == torch::kFloat || t->scalar_type() == torch::kHalf ||
                 t->scalar_type() == torch::kBFloat16) && t->is_contiguous() && t->device().is_cpu(),
                "the caches must be contiguous fp32, fp16 or bf16 CPU tensors");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the caches must share a dtype");
}

// f(T*) with the caches' element type.
template <class F>
void with_cache_type(const torch::Tensor& cache, const F& f) {
  switch (cache.scalar_type()) {
    case torch::kHalf: return f(static_cast<at::Half*>(nullptr));
    case torch::kBFloat16: return f(static_cast<at::BFloat16*>(nullptr));
    default: return f(static_cast<float*>(nullptr));
  }
}

}  // namespace

namespace hetserve {

// qkv [T, (H + 2 KVH) * D] from the fused projection; cos, sin [T, D/2]. Rotates q and k, writes
// k and v into the caches [slots, KVH, D] at slot_mapping [T] (rounded to the caches' dtype);
// returns q [T, H, D].
torch::Tensor rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t heads) {
  for (auto* t : {&qkv, &cos, &sin}) check_f32(*t, "qkv, cos and sin");
  check_cache(k_cache, v_cache);
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.dim() == 1, "slots: int64 [T]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "caches [slots, kv_heads, head_dim]");
  const int64_t T = qkv.size(0), KVH = k_cache.size(1), D = k_cache.size(2), half = D / 2, S = k_cache.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * KVH) * D && D % 2 == 0, "qkv width does not match");
  TORCH_CHECK(cos.numel() == T * half && sin.numel() == T * half && slots.size(0) == T, "cos/sin/slots: one per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "slot out of range");
  auto q = torch::empty({T, heads, D}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t W = qkv.size(1);
  with_cache_type(k_cache, [&](auto* type) {
    using C = std::remove_pointer_t<decltype(type)>;
    C *kc = static_cast<C*>(k_cache.data_ptr()), *vc = static_cast<C*>(v_cache.data_ptr());
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      std::vector<float> rotated(D);
      for (int64_t t = t0; t < t1; ++t) {
        const float* row = xp + t * W;
        const float *c = cp + t * half, *s = snp + t * half;
        for (int64_t h = 0; h < heads; ++h) rotate(row + h * D, c, s, qp + (t * heads + h) * D, half);
        for (int64_t h = 0; h < KVH; ++h) {
          C* k = kc + (sp[t] * KVH + h) * D;
          if constexpr (std::is_same_v<C, float>) {
            rotate(row + (heads + h) * D, c, s, k, half);
          } else {
            rotate(row + (heads + h) * D, c, s, rotated.data(), half);
            convert_row(rotated.data(), k, D);
          }
        }
        convert_row(row + (heads + KVH) * D, vc + sp[t] * KVH * D, KVH * D);
      }
    });
  });
  return q;
}

}  // namespace hetserve

namespace {


// exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 minimax
// polynomial (the Cephes expf coefficients), 2^n built in the exponent bits. Inputs below
// -87.3 give 0-ish, above 88.3 are clamped (softmax and SiLU never need more).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float exp1(float x) {  // the same function, one value (tails of rows)
  alignas(32) float b[8] = {x};
  _mm256_store_ps(b, exp8(_mm256_load_ps(b)));
  return b[0];
}

template <class T>
void silu_mul_rows(const T* xp, T* yp, int64_t T_, int64_t I) {
  at::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T *g = xp + t * 2 * I, *u = g + I;
      T* o = yp + t * I;
      int64_t j = 0;
      for (; j + 8 <= I; j += 8) {
        const __m256 gv = load8(g + j);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        store8(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)), load8(u + j)));
      }
      for (; j < I; ++j) {
        const float gj = static_cast<float>(g[j]);
        o[j] = static_cast<T>(gj / (1.f + exp1(-gj)) * static_cast<float>(u[j]));
      }
    }
  });
}

}  // namespace

namespace hetserve {

// SwiGLU's gate: gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I], computed in fp32.
// bf16 in (a bf16 GEMM's output) gives bf16 out: the same values as converting the input to
// fp32, running the fp32 op and rounding its result to bf16 for the next bf16 GEMM, without the
// two conversion passes over [T, 2I] and [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  const bool bf16 = gate_up.scalar_type() == torch::kBFloat16;
  if (!bf16) check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.device().is_cpu(), "gate_up must be a contiguous CPU tensor");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [T, 2I] expected");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = torch::empty({T, I}, gate_up.options());
  if (bf16)
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), T, I);
  else
    silu_mul_rows(gate_up.data_ptr<float>(), y.data_ptr<float>(), T, I);
  return y;
}

}  // namespace hetserve

namespace {

// The decode attention's K and V rows come from DRAM (a step's weights have evicted them), a
// token's row of a KV head at a time, KVH * D floats apart in the cache ([slots, KVH, D]; 1 KiB
// for the 1.5B) and in pages wherever the block table says: past what the hardware prefetchers
// follow. Asking for the rows a few tokens ahead cut a 600-token context's attention by a third
// (cold caches). The scores' pass asks twice, as the weight stream does (qlinear.cpp): K and V
// rows kFarAhead tokens ahead into L2, K rows kRowsAhead ahead into L1. The far requests keep
// more lines in flight than L1's miss buffers hold, and V is in L2 by the values' pass: 10-25%
// off a 600-token context's attention on a Zen 4 EPYC (cold caches, 0.5B and 1.5B heads).
constexpr int64_t kRowsAhead = 8;     // tokens ahead in the scores' pass over K, into L1
constexpr int64_t kFarAhead = 32;     // tokens ahead in the scores' pass over K and V, into L2
constexpr int64_t kValueChunk = 32;  // tokens per chunk of the values' pass over V

// Always inlined: GCC's IPA takes a function that only prefetches for one without side effects
// and deletes its calls (a separate prefetch_ahead lost every prefetch of the scores' pass).
#define HS_PREFETCH __attribute__((always_inline)) inline

// A row of D values asked for into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <decltype(_MM_HINT_T0) Hint = _MM_HINT_T0, class T>
HS_PREFETCH void prefetch_row(const T* row, int64_t D) {
  for (int64_t l = 0; l < D * static_cast<int64_t>(sizeof(T)); l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + l, Hint);
}

// The scores' requests for token t's rows: K at t + kRowsAhead into L1, K and V at t + kFarAhead
// into L2; the pass starts by asking for the first kRowsAhead K rows.
template <class T>
HS_PREFETCH void prefetch_ahead(const T* const* k, const T* const* v, int64_t t, int64_t n, int64_t D) {
  if (t + kRowsAhead < n) prefetch_row(k[t + kRowsAhead], D);
  if (t + kFarAhead < n) {
    prefetch_row<_MM_HINT_T1>(k[t + kFarAhead], D);
    prefetch_row<_MM_HINT_T1>(v[t + kFarAhead], D);
  }
}

template <class T>
HS_PREFETCH void prefetch_start(const T* const* k, int64_t n, int64_t D) {
  for (int64_t t = 0; t < std::min(n, kRowsAhead); ++t) prefetch_row(k[t], D);
}

// Scores of J query heads (rows q + j * D) against keys k[0 .. n): one pass over the keys, J
// independent FMA chains sharing each key load (one chain per dot product was latency-bound).
template <int J, class T>
inline void score_key(const float* q, const T* kt, int64_t D, float sc, float* p, int64_t n, int64_t t) {
  __m256 acc[J];
  for (int j = 0; j < J; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t e = 0; e < D; e += 8) {
    const __m256 kv = load8(kt + e);
    for (int j = 0; j < J; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + e), kv, acc[j]);
  }
  for (int j = 0; j < J; ++j) p[j * n + t] = hsum(acc[j]) * sc;
}

template <int J, class T>
void head_scores(const float* q, const T* const* k, const T* const* v, int64_t n, int64_t D, float sc, float* p) {
  for (int64_t t = 0; t < n; ++t) {
    prefetch_ahead(k, v, t, n, D);
    score_key<J>(q, k[t], D, sc, p, n, t);
  }
}

// out[j] = sum_t p[j * n + t] * v[t] for J heads: chunks of kValueChunk tokens (in L1 once
// read), each swept EB vectors of D at a time with the J * EB sums in registers (accumulating in
// memory was bound by stores) and kept in `out` between chunks. Each output lane is one FMA chain
// over t = 0 .. n - 1 in order whatever the chunking, so the bits are those of a single sweep;
// where one vector at a time swept all n rows, each V line was fetched twice and, past a few
// hundred tokens, from DRAM again. EB = 2 (a cache line) fits AVX2's 16 registers up to J = 6
// (and needs D a multiple of 16).
template <int J, int EB, class T>
void head_values(const float* p, const T* const* v, int64_t n, int64_t D, float* out) {
  std::fill(out, out + J * D, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kValueChunk) {
    const int64_t t1 = std::min(n, t0 + kValueChunk);
    for (int64_t t = t0 + 2 * kValueChunk; t < std::min(n, t0 + 3 * kValueChunk); ++t) prefetch_row(v[t], D);
    for (int64_t e = 0; e < D; e += 8 * EB) {
      __m256 acc[J][EB];
      for (int j = 0; j < J; ++j)
        for (int b = 0; b < EB; ++b) acc[j][b] = _mm256_loadu_ps(out + j * D + e + 8 * b);
      for (int64_t t = t0; t < t1; ++t) {
        __m256 vv[EB];
        for (int b = 0; b < EB; ++b) vv[b] = load8(v[t] + e + 8 * b);
        for (int j = 0; j < J; ++j) {
          const __m256 pj = _mm256_set1_ps(p[j * n + t]);
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

// The avx512 build's passes: 16 lanes a register, each lane the same FMA chain as in the AVX2
// functions above (the same products, added in the same order, the same horizontal sums), so
// the bits are the same and only the instruction count differs. Scores: two keys at a time, key
// t in the low 8 lanes and t + 1 in the high 8, against the query broadcast to both halves.
template <int J, class T>
void head_scores_wide(const float* q, const T* const* k, const T* const* v, int64_t n, int64_t D, float sc, float* p) {
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    prefetch_ahead(k, v, t, n, D);
    prefetch_ahead(k, v, t + 1, n, D);
    __m512 acc[J];
    for (int j = 0; j < J; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 8) {
      const __m512 kv = _mm512_insertf32x8(_mm512_castps256_ps512(load8(k[t] + e)), load8(k[t + 1] + e), 1);
      for (int j = 0; j < J; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(q + j * D + e)), kv, acc[j]);
    }
    for (int j = 0; j < J; ++j) {
      p[j * n + t] = hsum(_mm512_castps512_ps256(acc[j])) * sc;
      p[j * n + t + 1] = hsum(_mm512_extractf32x8_ps(acc[j], 1)) * sc;
    }
  }
  if (t < n) score_key<J>(q, k[t], D, sc, p, n, t);
}

// Values: 32 floats of D at a time, each 16-lane register two of head_values' 8-lane vectors
// (needs D a multiple of 32); 32 registers hold J = 8 heads' sums.
template <int J, class T>
void head_values_wide(const float* p, const T* const* v, int64_t n, int64_t D, float* out) {
  std::fill(out, out + J * D, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kValueChunk) {
    const int64_t t1 = std::min(n, t0 + kValueChunk);
    for (int64_t t = t0 + 2 * kValueChunk; t < std::min(n, t0 + 3 * kValueChunk); ++t) prefetch_row(v[t], D);
    for (int64_t e = 0; e < D; e += 32) {
      __m512 acc[J][2];
      for (int j = 0; j < J; ++j)
        for (int b = 0; b < 2; ++b) acc[j][b] = _mm512_loadu_ps(out + j * D + e + 16 * b);
      for (int64_t t = t0; t < t1; ++t) {
        const __m512 v0 = load16(v[t] + e), v1 = load16(v[t] + e + 16);
        for (int j = 0; j < J; ++j) {
          const __m512 pj = _mm512_set1_ps(p[j * n + t]);
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
using ScoresFn = void (*)(const float*, const T* const*, const T* const*, int64_t, int64_t, float, float*);
template <class T>
using ValuesFn = void (*)(const float*, const T* const*, int64_t, int64_t, float*);
template <class T>
constexpr ScoresFn<T> kHeadScores[8] = {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    head_scores_wide<1, T>, head_scores_wide<2, T>, head_scores_wide<3, T>, head_scores_wide<4, T>,
    head_scores_wide<5, T>, head_scores_wide<6, T>, head_scores_wide<7, T>, head_scores_wide<8, T>};
#else
    head_scores<1, T>, head_scores<2, T>, head_scores<3, T>, head_scores<4, T>,
    head_scores<5, T>, head_scores<6, T>, head_scores<7, T>, head_scores<8, T>};
#endif
// EB = 2 where it fits (J <= 6, D a multiple of 16), else 1.
// kHeadValues<T>[1] where D is a multiple of kWideValues.
template <class T>
constexpr ValuesFn<T> kHeadValues[2][8] = {
    {head_values<1, 1, T>, head_values<2, 1, T>, head_values<3, 1, T>, head_values<4, 1, T>,
     head_values<5, 1, T>, head_values<6, 1, T>, head_values<7, 1, T>, head_values<8, 1, T>},
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    {head_values_wide<1, T>, head_values_wide<2, T>, head_values_wide<3, T>, head_values_wide<4, T>,
     head_values_wide<5, T>, head_values_wide<6, T>, head_values_wide<7, T>, head_values_wide<8, T>}};
constexpr int64_t kWideValues = 32;
#else
    {head_values<1, 2, T>, head_values<2, 2, T>, head_values<3, 2, T>, head_values<4, 2, T>,
     head_values<5, 2, T>, head_values<6, 2, T>, head_values<7, 1, T>, head_values<8, 1, T>}};
constexpr int64_t kWideValues = 16;
#endif

}  // namespace

namespace hetserve {

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
  TORCH_CHECK(k_cache.size(2) == D && D % 8 == 0 && H % KVH == 0, "head sizes do not match (D a multiple of 8)");
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
  TORCH_CHECK(g <= 64, "at most 64 query heads per KV head");
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  with_cache_type(k_cache, [&](auto* type) {
    using C = std::remove_pointer_t<decltype(type)>;
    const C *kc = static_cast<const C*>(k_cache.data_ptr()), *vc = static_cast<const C*>(v_cache.data_ptr());
    at::parallel_for(0, R * KVH, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> p, acc(g * D);
      std::vector<const C*> krow, vrow;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / KVH, h = i % KVH, n = cp[r];
        const int64_t* table = tp + r * P;
        const float* qh = qp + (rp[r] * H + h * g) * D;
        p.resize(g * n);
        krow.resize(n);
        vrow.resize(n);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t off = ((table[t / page_size] * page_size + t % page_size) * KVH + h) * D;
          krow[t] = kc + off;
          vrow[t] = vc + off;
        }
        prefetch_start(krow.data(), n, D);
        for (int64_t j0 = 0; j0 < g; j0 += 8)
          kHeadScores<C>[std::min<int64_t>(8, g - j0) - 1](qh + j0 * D, krow.data(), vrow.data(), n, D, sc,
                                                           p.data() + j0 * n);
        float inv_sum[64];
        for (int64_t j = 0; j < g; ++j) {
          float* pj = p.data() + j * n;
          float m = pj[0];
          for (int64_t t = 1; t < n; ++t) m = std::max(m, pj[t]);
          const __m256 mv = _mm256_set1_ps(m);
          __m256 sv = _mm256_setzero_ps();
          int64_t t = 0;
          for (; t + 8 <= n; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pj + t), mv));
            _mm256_storeu_ps(pj + t, e);
            sv = _mm256_add_ps(sv, e);
          }
          float sum = hsum(sv);
          for (; t < n; ++t) sum += (pj[t] = exp1(pj[t] - m));
          inv_sum[j] = 1.f / sum;
        }
        for (int64_t j0 = 0; j0 < g; j0 += 8)
          kHeadValues<C>[D % kWideValues == 0][std::min<int64_t>(8, g - j0) - 1](p.data() + j0 * n, vrow.data(), n, D,
                                                                                 acc.data() + j0 * D);
        for (int64_t j = 0; j < g; ++j) {
          float* o = op + rp[r] * H * D + (h * g + j) * D;
          const __m256 iv = _mm256_set1_ps(inv_sum[j]);
          for (int64_t e = 0; e < D; e += 8) _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + j * D + e), iv));
        }
      }
    });
  });
}

}  // namespace hetserve

namespace {


// Greedy sampling's argmax over a 152k vocabulary: torch's CPU argmax took 0.35 ms a row (1.4 ms
// for 8), about 1% of a 0.5B decode step per row; this takes 0.05 (0.2). One pass finds the
// maximum 8 lanes at a time, a second the first index holding it: torch.argmax's answer, ties to
// the first index. A NaN is the maximum there, as in torch: a row with one gives its first NaN's.
int64_t argmax_row(const float* x, int64_t V) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx = _mm256_max_ps(mx, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float best = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (float l : lanes) best = std::max(best, l);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < V; ++j) {
    any_nan |= std::isnan(x[j]);
    best = std::max(best, x[j]);
  }
  if (any_nan) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 b = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= V; i += 8) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
    if (m) return i + __builtin_ctz(m);
  }
  for (; i < V; ++i)
    if (x[i] == best) return i;
  return 0;  // V == 0 is refused before; every value -inf equals best: found above
}

torch::Tensor argmax_rows(torch::Tensor x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [rows, V] with V > 0");
  const int64_t M = x.size(0), V = x.size(1);
  auto out = torch::empty({M}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) op[m] = argmax_row(xp + m * V, V);
  });
  return out;
}

}  // namespace

void register_cpu_ops(pybind11::module& m) {
  using namespace hetserve;
  m.def("argmax_rows", &argmax_rows, "the first index of each fp32 row's maximum (a NaN's where a row has one)");
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows, optionally after an in-place residual add");
  m.def("rope_kv_write", &rope_kv_write, "RoPE on q and k of a fused qkv, k and v written to the KV cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate_up (fp32, or bf16 in and out)");
  m.def("attend_rows", &attend_rows, "attention of single query rows over paged KV, in place");
}
