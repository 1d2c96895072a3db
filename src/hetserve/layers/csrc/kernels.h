// The extension's entry points that other sources call: the quantized linears (qlinear.cpp), the
// fused per-layer ops (cpu_ops.cpp) and attention (attention.cpp), which decode_layers.cpp chains
// into a decoder's layers.
#pragma once
#include <torch/extension.h>

namespace hetserve {

// x [M, K] against `rows` outputs held in panels of 16 (qlinear.cpp describes the layout).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor min, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes);
torch::Tensor q5_0_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes);
torch::Tensor q5_1_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor min, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes);
torch::Tensor q4_k_linear(torch::Tensor x, torch::Tensor q, torch::Tensor six, torch::Tensor supers, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes);
torch::Tensor q6_k_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, int64_t rows,
                          c10::optional<torch::Tensor> bias, int64_t passes);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> delta);
torch::Tensor rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
void attend_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                 torch::Tensor rows, torch::Tensor ctx_lens, torch::Tensor tables, int64_t page_size, double scale);
void attend_chunk(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale);

}  // namespace hetserve
