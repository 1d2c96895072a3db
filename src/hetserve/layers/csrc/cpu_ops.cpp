// Fused fp32 CPU ops for the decoder's small per-layer steps (attention: attention.cpp). At batch 1 the time a step spends
// outside the matmuls is mostly per-op dispatch: an RMSNorm is 6 torch ops, RoPE on q and k
// plus the KV-cache write about 15. Each of these is one call. Every row is computed alone, in
// a fixed order: results do not depend on the batch.
#include "kernels.h"
#include "vec.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

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

}  // namespace

namespace hetserve {

// qkv [T, (H + 2 KVH) * D] from the fused projection; cos, sin [T, D/2]. Rotates q and k, writes
// k and v into the caches [slots, KVH, D] at slot_mapping [T] (rounded to the caches' dtype; int8
// caches [slots, KVH, D / 32 * 34] take q8_0 rows, K and q turned by hadamard_blocks, vec.h);
// returns q [T, H, D].
torch::Tensor rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t heads) {
  for (auto* t : {&qkv, &cos, &sin}) check_f32(*t, "qkv, cos and sin");
  check_cache(k_cache, v_cache);
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.dim() == 1, "slots: int64 [T]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "caches [slots, kv_heads, row]");
  const int64_t T = qkv.size(0), KVH = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(qkv.dim() == 2 && heads > 0 && qkv.size(1) % (heads + 2 * KVH) == 0, "qkv width does not match");
  const int64_t D = qkv.size(1) / (heads + 2 * KVH), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "odd head size");
  TORCH_CHECK(cos.numel() == T * half && sin.numel() == T * half && slots.size(0) == T, "cos/sin/slots: one per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "slot out of range");
  auto q = torch::empty({T, heads, D}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t W = qkv.size(1);
  with_cache_type(k_cache, [&](auto* type) {
    using C = std::remove_pointer_t<decltype(type)>;
    const int64_t R = row_elems<C>(D);
    TORCH_CHECK(k_cache.size(2) == R && (!std::is_same_v<C, int8_t> || D % kQ8Block == 0),
                "the caches' rows do not match the head size (int8: a multiple of 32)");
    C *kc = static_cast<C*>(k_cache.data_ptr()), *vc = static_cast<C*>(v_cache.data_ptr());
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      std::vector<float> rotated(D);
      for (int64_t t = t0; t < t1; ++t) {
        const float* row = xp + t * W;
        const float *c = cp + t * half, *s = snp + t * half;
        for (int64_t h = 0; h < heads; ++h) {
          rotate(row + h * D, c, s, qp + (t * heads + h) * D, half);
          if constexpr (std::is_same_v<C, int8_t>) hadamard_blocks(qp + (t * heads + h) * D, D);
        }
        for (int64_t h = 0; h < KVH; ++h) {
          C* k = kc + (sp[t] * KVH + h) * R;
          if constexpr (std::is_same_v<C, float>) {
            rotate(row + (heads + h) * D, c, s, k, half);
          } else {
            rotate(row + (heads + h) * D, c, s, rotated.data(), half);
            if constexpr (std::is_same_v<C, int8_t>) hadamard_blocks(rotated.data(), D);
            store_row(rotated.data(), k, D);
          }
          store_row(row + (heads + KVH + h) * D, vc + (sp[t] * KVH + h) * R, D);
        }
      }
    });
  });
  return q;
}

}  // namespace hetserve

namespace {

template <class T>
void silu_mul_rows(const T* xp, T* yp, int64_t T_, int64_t I) {
  at::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T *g = xp + t * 2 * I, *u = g + I;
      T* o = yp + t * I;
      int64_t j = 0;
#if defined(__AVX512F__)
      // 16 lanes a pass where the rows are fp32 (kernel prefill's gate_up), each lane the 8-lane
      // pass's operations: the same bits. The 0.5B's SiLU of a 512-token chunk took 5% of its prefill.
      if constexpr (std::is_same_v<T, float>)
        for (; j + 16 <= I; j += 16) {
          const __m512 gv = _mm512_loadu_ps(g + j);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
          _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                                _mm512_loadu_ps(u + j)));
        }
#endif
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
}
