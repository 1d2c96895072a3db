// SIMD helpers shared by the extension's sources (AVX2 + FMA + F16C): fp32 loads and stores of
// fp32 / fp16 / bf16 values, horizontal sum and maximum, exp, and the KV caches' checks. Internal to each
// source that includes it (an unnamed namespace): the sources are one extension.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

// For every function that only prefetches: always inlined. GCC's IPA takes such a function for
// one without side effects and deletes its calls: a separate prefetch function lost every
// prefetch of attention's scores' pass, and qlinear.cpp's prefetch_group, plain `inline` from
// 2026-12-05 on, every weight prefetch (tests/test_native_prefetch.py now looks for them).
#define HS_PREFETCH __attribute__((always_inline)) inline

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

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// widens each row to fp32 before it computes; int8 rows are q8_0 blocks, below).
void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  for (const auto* t : {&k_cache, &v_cache})
    TORCH_CHECK((t->scalar_type() == torch::kFloat || t->scalar_type() == torch::kHalf ||
                 t->scalar_type() == torch::kBFloat16 || t->scalar_type() == torch::kChar) &&
                    t->is_contiguous() && t->device().is_cpu(),
                "the caches must be contiguous fp32, fp16, bf16 or int8 (q8_0) CPU tensors");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the caches must share a dtype");
}

// The prefill-chunk kernels' shared contract (attend_chunk, attend_chunk_bf16): q [T, H, D] fp32,
// k and v [C, KVH, row] of one cache dtype, the chunk's T queries the last of the C context
// tokens, out [T, H * D] fp32; D a multiple of `multiple` up to `max_d` (0: any), the query
// heads a whole number of KV heads.
void check_chunk(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                 int64_t multiple, int64_t max_d) {
  check_f32(q, "q");
  check_f32(out, "out");
  check_cache(k, v);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [T, H, D], k and v [C, KVH, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), C = k.size(0), KVH = k.size(1);
  TORCH_CHECK(D % multiple == 0 && (max_d == 0 || D <= max_d) && KVH > 0 && H % KVH == 0,
              "head sizes do not match (D a multiple of ", multiple,
              max_d ? ", at most " + std::to_string(max_d) : std::string(), ")");
  TORCH_CHECK(T > 0 && C >= T, "the chunk's queries must be the last of its context");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == H * D, "out [T, H * D] expected");
}

// f(T*) with the caches' element type.
template <class F>
void with_cache_type(const torch::Tensor& cache, const F& f) {
  switch (cache.scalar_type()) {
    case torch::kHalf: return f(static_cast<at::Half*>(nullptr));
    case torch::kBFloat16: return f(static_cast<at::BFloat16*>(nullptr));
    case torch::kChar: return f(static_cast<int8_t*>(nullptr));
    default: return f(static_cast<float*>(nullptr));
  }
}

// int8 caches (--kv-cache-dtype int8) hold each row of D values as llama.cpp's q8_0 blocks: per
// 32 values an fp16 scale d, then the 32 int8 q, value = q * d (34 bytes for 32 values). A
// value widened is exact in fp32 (an 8-bit times an 11-bit significand), so a kernel computes
// over an int8 row what it computes over an fp32 row of the dequantized values, bit for bit.
constexpr int64_t kQ8Block = 32, kQ8Bytes = 34;

// Elements of T a row of D values takes in a cache (the caches' last dimension).
template <class T>
constexpr int64_t row_elems(int64_t D) {
  return std::is_same_v<T, int8_t> ? D / kQ8Block * kQ8Bytes : D;
}

// Where value e of an int8 row lies (its q) and its block's scale d.
inline const int8_t* q8_value(const int8_t* row, int64_t e, float* d) {
  const int8_t* b = row + e / kQ8Block * kQ8Bytes;
  *d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b));
  return b + 2 + e % kQ8Block;
}

// Values e .. e + 8 of a cache row (e a multiple of 8) as fp32.
template <class T>
inline __m256 load_row8(const T* row, int64_t e) { return load8(row + e); }
inline __m256 load_row8(const int8_t* row, int64_t e) {
  float d;
  const int8_t* q = q8_value(row, e, &d);
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d));
}

// K rows bound for an int8 cache, and the queries that meet them, are turned by the normalized
// 32-point Walsh-Hadamard transform of each block (its own inverse; q . k is unchanged): Qwen2's
// K rows have a few channels far larger than the rest (the K bias), which set each block's scale
// and left the others a few levels. Spread over the block first, the 0.5B's perplexity at 8192
// tokens is +0.36% against an fp16 cache instead of +0.91% (`hetserve bench kv-cache`). In
// place, x[0 .. D).
inline void hadamard_blocks(float* x, int64_t D) {
  for (int64_t b = 0; b < D; b += kQ8Block) {
    float* y = x + b;
    for (int len = 1; len < kQ8Block; len <<= 1)
      for (int i = 0; i < kQ8Block; i += 2 * len)
        for (int j = i; j < i + len; ++j) {
          const float u = y[j], v = y[j + len];
          y[j] = u + v;
          y[j + len] = u - v;
        }
    for (int j = 0; j < kQ8Block; ++j) y[j] *= 0.17677669529663687f;  // 1 / sqrt(32)
  }
}

// A row of D fp32 values into a cache row of T: rounded as torch's .to(); for int8 quantized
// as q8_0 (d = max |x| / 127 in fp32, q = x * (1 / d) rounded to nearest even, d stored fp16
// rounded to nearest even), as layers/kv_quant.py does in torch, bit for bit.
template <class T>
inline void store_row(const float* x, T* dst, int64_t D) { convert_row(x, dst, D); }
inline void store_row(const float* x, int8_t* dst, int64_t D) {
  for (int64_t b = 0; b < D; b += kQ8Block, dst += kQ8Bytes) {
    float amax = 0.f;
    for (int64_t j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(dst, &h, 2);
    for (int64_t j = 0; j < kQ8Block; ++j) dst[2 + j] = static_cast<int8_t>(std::nearbyint(x[b + j] * id));
  }
}


// exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 minimax
// polynomial (the Cephes expf coefficients), 2^n built in the exponent bits. Inputs below
// -87.3 give 0-ish, above 88.3 are clamped (softmax and SiLU never need more). exp16 (AVX-512)
// runs the same operations on 16 lanes: the same bits a lane.
constexpr float kExpLo = -87.3f, kExpHi = 88.3f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f,
                kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

inline float exp1(float x) {  // the same function, one value (tails of rows)
  alignas(32) float b[8] = {x};
  _mm256_store_ps(b, exp8(_mm256_load_ps(b)));
  return b[0];
}

}  // namespace
