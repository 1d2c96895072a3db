// fp32 linear layer whose every output is summed in one fixed order: deterministic mode's fp32
// path (layers/linear.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). Why each y[m, n] is batch-invariant by
// construction: it is accumulated in 16 lanes (lane j takes k = j, j + 16, j + 32, ... with one
// fused multiply-add each, in increasing k; a ragged tail reads as zeros), then the 16 lanes are
// added in one fixed tree (j + j+8, then + 4, + 2, + 1), then the bias is added. Nothing in that
// sequence depends on M, on which other rows share a register tile, on the tile's shape, on the
// cache blocking or on the thread that computes it: tiles only decide which independent
// accumulators live in registers together. A CPU BLAS gives no such promise (its edge kernels
// for leftover rows and its K-splitting vary with the shape, and between libraries and CPUs).
//
// A 16-lane vector is one zmm register with AVX-512 and two ymm registers with AVX2, with the
// same lanes, the same FMAs and the same tree, so both builds give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

namespace {

#ifdef __AVX512F__
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 load_tail(const float* p, int n) { return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)}; }
  static V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  __m256 fold8() const {  // lane j + lane j + 8
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};
constexpr int kRows = 4, kCols = 4;  // 16 accumulators of the 32 zmm registers
#else
struct V16 {
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V16 load_tail(const float* p, int n) {
    alignas(32) float buf[16] = {0};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    return load(buf);
  }
  static V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  __m256 fold8() const { return _mm256_add_ps(lo, hi); }
};
constexpr int kRows = 2, kCols = 3;  // 12 of the 16 ymm registers
#endif

inline float reduce(const V16& a) {
  const __m256 v = a.fold8();
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // + 4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // + 2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                           // + 1
  return _mm_cvtss_f32(s);
}

// Rows m0 .. m0 + R - 1 of x against output rows n0 .. n0 + C - 1 of w.
template <int R, int C>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0) {
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V16::zero();
  const int64_t body = K / 16 * 16;
  for (int64_t k = 0; k < body; k += 16) {
    V16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = V16::load(w + (n0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      const V16 xv = V16::load(x + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = V16::fma(xv, wv[c], acc[r][c]);
    }
  }
  if (body < K) {
    const int n = static_cast<int>(K - body);
    for (int r = 0; r < R; ++r) {
      const V16 xv = V16::load_tail(x + (m0 + r) * K + body, n);
      for (int c = 0; c < C; ++c) acc[r][c] = V16::fma(xv, V16::load_tail(w + (n0 + c) * K + body, n), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = reduce(acc[r][c]) + (bias ? bias[n0 + c] : 0.f);
}

template <int C>
inline void rows(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t m1, int64_t n0) {
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows) tile<kRows, C>(x, w, bias, y, K, N, m, n0);
  for (; m < m1; ++m) tile<1, C>(x, w, bias, y, K, N, m, n0);
}

// Rows of x are taken in blocks that stay in L2 while every output row streams past them once.
constexpr int64_t kBlockBytes = 512 * 1024;

torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be a contiguous fp32 [N, K] tensor with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t block = std::max<int64_t>(kRows, kBlockBytes / (K * 4) / kRows * kRows);
  const int64_t col_tiles = (N + kCols - 1) / kCols;
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    at::parallel_for(0, col_tiles, 8, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kCols;
        if (n0 + kCols <= N) {
          rows<kCols>(xp, wp, bp, yp, K, N, m0, m1, n0);
        } else {
          for (int64_t n = n0; n < N; ++n) rows<1>(xp, wp, bp, yp, K, N, m0, m1, n);
        }
      }
    });
  }
  return y;
}

}  // namespace

void register_f32_linear(pybind11::module& m) {
  m.def("f32_linear", &f32_linear, "x . w^T (+ bias) in fp32, each output summed in one fixed order");
}
