// A decoder's layers in one call, for steps whose every row attends alone over its pages
// (decodes and speculative verifications: the steps of at most a few rows a sequence).
//
// Such a step is some 200 small calls from Python: per layer two norms, the QKV parts, RoPE with
// the KV write, attention, O, gate/up, SiLU-and-mul and down. Their Python dispatch (argument
// conversion, the wrappers' bookkeeping, the interpreter's own state, evicted by each step's
// stream of weights) took 5-7 ms of a 1.5B decode step of 70 ms. Here the same kernels run in the
// same order on the same tensors as models/decoder.py's per-op path, so the results are the same
// bits; only the dispatch between them is gone.
#include "kernels.h"

#include <string>
#include <tuple>
#include <vector>

namespace {

using Tensor = torch::Tensor;
using OptTensor = c10::optional<Tensor>;

enum class Format { kInt8, kInt4, kQ5_0, kQ5_1, kQ6K, kQ4K };

Format parse_format(const std::string& name) {
  if (name == "int8") return Format::kInt8;
  if (name == "int4") return Format::kInt4;
  if (name == "q5_0") return Format::kQ5_0;
  if (name == "q5_1") return Format::kQ5_1;
  if (name == "q6_k") return Format::kQ6K;
  if (name == "q4_k") return Format::kQ4K;
  TORCH_CHECK(false, "no native kernel for weight format ", name);
}

// One block of output rows in one format (layers/weight_formats.QuantizedWeight).
struct Part {
  Format fmt;
  Tensor q, scale;
  OptTensor min;
  int64_t rows;
};

// A linear: its parts side by side (a StackedWeight's, or one), then the bias.
struct Linear {
  std::vector<Part> parts;
  OptTensor bias;
};

// As Python gives them: ([(format, q, scale, min or None, rows), ...], bias or None).
using PartSpec = std::tuple<std::string, Tensor, Tensor, OptTensor, int64_t>;
using LinearSpec = std::tuple<std::vector<PartSpec>, OptTensor>;
// (attn_norm, mlp_norm, qkv, o, gate_up, down)
using LayerSpec = std::tuple<Tensor, Tensor, LinearSpec, LinearSpec, LinearSpec, LinearSpec>;

Linear make_linear(const LinearSpec& spec) {
  Linear l{{}, std::get<1>(spec)};
  for (const auto& [fmt, q, scale, min, rows] : std::get<0>(spec)) {
    l.parts.push_back({parse_format(fmt), q, scale, min, rows});
    const Format f = l.parts.back().fmt;
    TORCH_CHECK((f != Format::kInt4 && f != Format::kQ5_1 && f != Format::kQ4K) || (min && min->defined()), fmt,
                " weights need their min");
  }
  TORCH_CHECK(!l.parts.empty(), "a linear needs at least one part");
  return l;
}

Tensor apply_part(const Part& p, const Tensor& x, const OptTensor& bias, int64_t passes) {
  switch (p.fmt) {
    case Format::kInt8: return hetserve::int8_linear(x, p.q, p.scale, p.rows, bias, passes);
    case Format::kInt4: return hetserve::int4_linear(x, p.q, p.scale, *p.min, p.rows, bias, passes);
    case Format::kQ5_0: return hetserve::q5_0_linear(x, p.q, p.scale, p.rows, bias, passes);
    case Format::kQ5_1: return hetserve::q5_1_linear(x, p.q, p.scale, *p.min, p.rows, bias, passes);
    case Format::kQ6K: return hetserve::q6_k_linear(x, p.q, p.scale, p.rows, bias, passes);
    case Format::kQ4K: return hetserve::q4_k_linear(x, p.q, p.scale, *p.min, p.rows, bias, passes);
  }
  TORCH_CHECK(false, "unknown format");
}

// QuantizedWeight.matmul / StackedWeight.matmul: one part takes the bias in its kernel; several
// are concatenated and the bias added after.
Tensor apply(const Linear& l, const Tensor& x, int64_t passes) {
  if (l.parts.size() == 1) return apply_part(l.parts[0], x, l.bias, passes);
  std::vector<Tensor> ys;
  ys.reserve(l.parts.size());
  for (const Part& p : l.parts) ys.push_back(apply_part(p, x, c10::nullopt, passes));
  Tensor y = torch::cat(ys, 1);
  if (l.bias && l.bias->defined()) y.add_(*l.bias);
  return y;
}

struct Layer {
  Tensor attn_norm, mlp_norm;
  Linear qkv, o, gate_up, down;
};

class DecodeLayers {
 public:
  DecodeLayers(const std::vector<LayerSpec>& layers, double eps, int64_t heads, double scale)
      : eps_(eps), heads_(heads), scale_(scale) {
    for (const auto& [attn_norm, mlp_norm, qkv, o, gate_up, down] : layers)
      layers_.push_back({attn_norm, mlp_norm, make_linear(qkv), make_linear(o), make_linear(gate_up),
                         make_linear(down)});
  }

  // DecoderModel.forward's layer loop and final norm for a step whose rows are all `rows` of
  // AttentionMetadata.one_query_rows(): h [T, hidden] is the residual stream (updated in place);
  // returns the final norm's output.
  Tensor run(Tensor h, const Tensor& final_norm, const Tensor& cos, const Tensor& sin,
             const std::vector<std::tuple<Tensor, Tensor>>& caches, const Tensor& slots, const Tensor& rows,
             const Tensor& ctx_lens, const Tensor& tables, int64_t page_size, int64_t passes) const {
    TORCH_CHECK(caches.size() == layers_.size(), "one (k, v) cache pair per layer");
    TORCH_CHECK(rows.numel() == h.size(0), "every row of the step must attend alone");
    OptTensor delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const Tensor &k_cache = std::get<0>(caches[i]), &v_cache = std::get<1>(caches[i]);
      Tensor x = hetserve::rms_norm(h, l.attn_norm, eps_, delta);
      const Tensor q = hetserve::rope_kv_write(apply(l.qkv, x, passes), cos, sin, k_cache, v_cache, slots, heads_);
      Tensor attn = torch::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
      hetserve::attend_rows(q, k_cache, v_cache, attn, rows, ctx_lens, tables, page_size, scale_);
      delta = apply(l.o, attn, passes);
      x = hetserve::rms_norm(h, l.mlp_norm, eps_, delta);
      delta = apply(l.down, hetserve::silu_mul(apply(l.gate_up, x, passes)), passes);
    }
    return hetserve::rms_norm(h, final_norm, eps_, delta);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Layer> layers_;
  double eps_;
  int64_t heads_;
  double scale_;
};

}  // namespace

void register_decode_layers(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeLayers>(m, "DecodeLayers", "a decoder's layers run in one call for one-query-row steps")
      .def(py::init<const std::vector<LayerSpec>&, double, int64_t, double>(), py::arg("layers"), py::arg("eps"),
           py::arg("heads"), py::arg("scale"))
      .def("run", &DecodeLayers::run, py::arg("h"), py::arg("final_norm"), py::arg("cos"), py::arg("sin"),
           py::arg("caches"), py::arg("slots"), py::arg("rows"), py::arg("ctx_lens"), py::arg("tables"),
           py::arg("page_size"), py::arg("passes"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecodeLayers::num_layers);
}
