// Weight-only-stored, integer-dot quantized linear layers for x86 CPUs with AVX2 + FMA.
//
// y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias). W is stored per output row in groups of
// 32 input elements:
//   int8: q int8 [N, K] in -127..127, scale fp16 [N, K/32]               w = q * scale
//   int4: q uint8 [N, K/2], scale and min fp16 [N, K/32], q in 0..15        w = q * scale + min
//         byte j of a group holds element j (low nibble) and element j + 16 (high nibble).
// Each row of x is quantized on the fly to int8 per group of 32 (x ~ xq * d, as llama.cpp's
// Q8_0 activations), so a group's dot product is 32 integer multiply-adds (vpmaddubsw +
// vpmaddwd) and one fp32 FMA: about a quarter of the instructions of converting every weight
// to fp32, which made the fp32-activation kernel compute-bound here. The int4 min term uses
// the exact fp32 sum of x over the group.
// A block of output rows is read from memory once and reused from L1 for every tile of input
// rows. Each output is summed in the same order whatever M is: results are batch-invariant.
// fp16 scales (as in ggml's Q8_0/Q4_1) keep the int4 format at 5 bits per weight, not 6.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i sum_i16_pairs(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

// Activations quantized per group: xq int8 [M, K], d (scale) and s (exact sum) fp32 [M, K/32].
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t K;
  const int8_t* row(int64_t m, int64_t g) const { return q.data() + m * K + g * kGroup; }
};

QuantX quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantX out{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G), K};
  at::parallel_for(0, M * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xi = x + i * kGroup;  // rows are contiguous, so group i of the flat array
      float amax = 0.f, sum = 0.f;
      for (int j = 0; j < kGroup; ++j) { amax = std::max(amax, std::fabs(xi[j])); sum += xi[j]; }
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < kGroup; ++j) out.q[i * kGroup + j] = static_cast<int8_t>(std::nearbyint(xi[j] * inv));
      out.d[i] = d;
      out.s[i] = sum;
    }
  });
  return out;
}

inline float h2f(const at::Half* p, int64_t i) { return _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[i]); }

struct Int8Weights {
  const int8_t* q; const at::Half* scale; int64_t K;
  // Integer dot of group g of output row n with 32 int8 activations.
  inline __m256i dot(int64_t n, int64_t g, __m256i w_abs, __m256i w, const int8_t* xq) const {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    return sum_i16_pairs(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)));
  }
  inline __m256i load(int64_t n, int64_t g) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * K + g * kGroup));
  }
  static inline __m256i prepare(__m256i w) { return _mm256_sign_epi8(w, w); }  // |w| as u8
  inline float s(int64_t n, int64_t g) const { return h2f(scale, n * (K / kGroup) + g); }
  inline float offset(int64_t, int64_t) const { return 0.f; }
};

struct Int4Weights {
  const uint8_t* q; const at::Half* scale; const at::Half* min; int64_t K;
  inline __m256i load(int64_t n, int64_t g) const {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + g * (kGroup / 2)));
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), lo4), _mm_and_si128(b, lo4));
  }
  static inline __m256i prepare(__m256i w) { return w; }  // already unsigned
  inline __m256i dot(int64_t, int64_t, __m256i w_u8, __m256i, const int8_t* xq) const {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    return sum_i16_pairs(_mm256_maddubs_epi16(w_u8, x));
  }
  inline float s(int64_t n, int64_t g) const { return h2f(scale, n * (K / kGroup) + g); }
  inline float offset(int64_t n, int64_t g) const { return h2f(min, n * (K / kGroup) + g); }
};

// R input rows x NB output rows; each weight group is loaded once and used R times.
template <int R, int NB, class W>
inline void tile(const W& w, const QuantX& x, int64_t m0, int64_t n0, int64_t N, const float* bias, float* y) {
  const int64_t G = x.K / kGroup;
  __m256 acc[NB][R];
  float off[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) { acc[b][r] = _mm256_setzero_ps(); off[b][r] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    for (int b = 0; b < NB; ++b) {
      const __m256i wv = w.load(n0 + b, g);
      const __m256i wp = W::prepare(wv);
      const float ws = w.s(n0 + b, g), wo = w.offset(n0 + b, g);
      for (int r = 0; r < R; ++r) {
        const int64_t xi = (m0 + r) * G + g;
        const __m256 dot = _mm256_cvtepi32_ps(w.dot(n0 + b, g, wp, wv, x.row(m0 + r, g)));
        acc[b][r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(ws * x.d[xi]), acc[b][r]);
        off[b][r] += wo * x.s[xi];
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r)
      y[(m0 + r) * N + n0 + b] = hsum(acc[b][r]) + off[b][r] + (bias ? bias[n0 + b] : 0.f);
}

// One block of 4 output rows against every input row: tiles of 4 input rows (as two 4x2
// tiles, 8 accumulators each), then the remainder with 4 output rows at once so that even one
// input row has 4 independent chains.
template <class W>
inline void block4(const W& w, const QuantX& x, int64_t M, int64_t n0, int64_t N, const float* bias, float* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    tile<4, 2>(w, x, m, n0, N, bias, y);
    tile<4, 2>(w, x, m, n0 + 2, N, bias, y);
  }
  switch (M - m) {
    case 3: tile<3, 2>(w, x, m, n0, N, bias, y); tile<3, 2>(w, x, m, n0 + 2, N, bias, y); break;
    case 2: tile<2, 4>(w, x, m, n0, N, bias, y); break;
    case 1: tile<1, 4>(w, x, m, n0, N, bias, y); break;
    default: break;
  }
}

template <class W>
torch::Tensor run(const W& w, const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  const QuantX xq = quantize_rows(x.data_ptr<float>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const float* bp = bias && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / 4;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block4(w, xq, M, b * 4, N, bp, yp);
  });
  for (int64_t n = blocks * 4; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) tile<1, 1>(w, xq, m, n, N, bp, yp);
  return y;
}

void check(const torch::Tensor& x, int64_t K, const torch::Tensor& scale, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(x.size(1) == K && K % kGroup == 0, "input width must equal the weight's and be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && scale.is_contiguous() && scale.numel() == N * (K / kGroup),
              "scale must be contiguous fp16 [N, K/32]");
}

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (bias && bias->defined())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  check(x, K, scale, N);
  check_bias(bias, N);
  return run(Int8Weights{q.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), K}, x, N, bias);
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor min,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte && q.is_contiguous(), "q must be contiguous uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2;
  check(x, K, scale, N);
  TORCH_CHECK(min.scalar_type() == torch::kHalf && min.is_contiguous() && min.numel() == scale.numel(),
              "min must be contiguous fp16 [N, K/32]");
  check_bias(bias, N);
  return run(Int4Weights{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), min.data_ptr<at::Half>(), K}, x, N, bias);
}

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
  auto q = torch::empty({N, K / 2}, w.options().dtype(torch::kByte));
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
      uint8_t v[kGroup];
      for (int j = 0; j < kGroup; ++j)
        v[j] = static_cast<uint8_t>(std::max(0.f, std::min(15.f, std::nearbyint((g[j] - m) * inv))));
      for (int j = 0; j < kGroup / 2; ++j) qp[i * (kGroup / 2) + j] = v[j] | (v[j + kGroup / 2] << 4);
    }
  });
  return {q, scale, min};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x . int8 group-wise weights (int8 activations per group of 32)");
  m.def("quantize_int8", &quantize_int8, "fp32 [N, K] -> (q int8 [N, K], scale fp16 [N, K/32])");
  m.def("quantize_int4", &quantize_int4, "fp32 [N, K] -> (q uint8 [N, K/2], scale, min fp16 [N, K/32])");
  m.def("int4_linear", &int4_linear, "x . int4 group-wise asymmetric weights (int8 activations per group of 32)");
}
