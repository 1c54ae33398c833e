// A decode or verify step's decoder layers in one call (float32 activations, quantized matrices).
//
// In Python a layer of such a step is ~15 calls (two norms, four products through their weight
// classes, the one-call attention, SiLU, the multiply, two residual adds), each a few microseconds of
// interpreter and dispatch on 2 cores: ~3 ms of a 28-layer target step and ~2.5 ms of a 24-layer
// draft step. Here the same calls run from C++, in the same order, on the same kernels and ATen ops,
// so every number is the Python form's, bit for bit (tests/engine/test_decoder_layers.py); only the
// interpreter's share goes.
//
// A layer holds its weights as products: the parts of a matrix stacked by output rows (the GGUF may
// keep q and k in Q4_K and v in Q6_K), each part one of our kernels, its inputs zero-padded where the
// part was quantized with padded inputs (a draft's 896-wide matrices in Q4_K), and an optional bias.

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n, int64_t bits);
torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n);
torch::Tensor q6k_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor cached_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor& k_cache, torch::Tensor& v_cache, const std::vector<int64_t>& slots,
                               const std::vector<int64_t>& starts, const torch::Tensor& visible, int64_t width,
                               int64_t heads, double scale);

namespace {

// A part's kernel (serve_app/engine/native_layers.py names them).
enum Kind : int64_t { kQ8 = 0, kQ5 = 1, kQ4K = 2, kQ6K = 3 };

struct Part {
  int64_t kind;
  torch::Tensor tiles;
  int64_t out_features;
  int64_t padded_in;  // the inputs the tiles hold (> the activations' width: zeros appended)
};

struct Product {
  std::vector<Part> parts;
  std::optional<torch::Tensor> bias;

  // x [B, T, in] -> [B, T, out]: each part's product on the flattened rows, the parts' outputs side
  // by side, then the bias (as weights.linear: out + bias).
  torch::Tensor operator()(const torch::Tensor& x) const {
    const int64_t in = x.size(-1);
    auto flat = x.reshape({-1, in});  // [M, in]
    std::vector<torch::Tensor> outs;
    outs.reserve(parts.size());
    for (const Part& p : parts) {
      auto rows = p.padded_in > in ? torch::constant_pad_nd(flat, {0, p.padded_in - in}) : flat;
      switch (p.kind) {
        case kQ8: outs.push_back(q8_linear(rows, p.tiles, p.out_features, 8)); break;
        case kQ5: outs.push_back(q8_linear(rows, p.tiles, p.out_features, 5)); break;
        case kQ4K: outs.push_back(q4k_linear(rows, p.tiles, p.out_features)); break;
        case kQ6K: outs.push_back(q6k_linear(rows, p.tiles, p.out_features)); break;
        default: TORCH_CHECK(false, "decoder_layers: unknown product kind ", p.kind);
      }
    }
    auto out = outs.size() == 1 ? outs[0] : torch::cat(outs, -1);  // [M, out]
    auto shaped = out.view({x.size(0), x.size(1), out.size(1)});
    return bias ? shaped + *bias : shaped;
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  Product qkv, o, gate_up, down;
};

using PartSpec = std::tuple<int64_t, torch::Tensor, int64_t, int64_t>;  // kind, tiles, out, padded inputs

Product make_product(const std::vector<PartSpec>& specs, const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!specs.empty(), "decoder_layers: a product needs at least one part");
  Product product;
  for (const auto& [kind, tiles, out, padded] : specs) {
    TORCH_CHECK(kind >= kQ8 && kind <= kQ6K, "decoder_layers: unknown product kind ", kind);
    product.parts.push_back(Part{kind, tiles, out, padded});
  }
  product.bias = bias;
  return product;
}

}  // namespace

// One model's layers, built once at load; run() is a step's forward through any of them in order.
class DecoderLayers {
 public:
  DecoderLayers(int64_t heads, double scale, double eps) : heads_(heads), scale_(scale), eps_(eps) {}

  void add_layer(const torch::Tensor& attn_norm, const torch::Tensor& mlp_norm, const std::vector<PartSpec>& qkv,
                 const std::optional<torch::Tensor>& qkv_bias, const std::vector<PartSpec>& o,
                 const std::optional<torch::Tensor>& o_bias, const std::vector<PartSpec>& gate_up,
                 const std::optional<torch::Tensor>& gate_up_bias, const std::vector<PartSpec>& down,
                 const std::optional<torch::Tensor>& down_bias) {
    layers_.push_back(Layer{attn_norm, mlp_norm, make_product(qkv, qkv_bias), make_product(o, o_bias),
                            make_product(gate_up, gate_up_bias), make_product(down, down_bias)});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, T, hidden] float32 through the layers named by `which` (indices into this model's layers and
  // into k_caches / v_caches); the other arguments are cached_attention's. Returns the last layer's
  // output (not normed).
  torch::Tensor run(torch::Tensor x, const std::vector<int64_t>& which, std::vector<torch::Tensor>& k_caches,
                    std::vector<torch::Tensor>& v_caches, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& visible, int64_t width, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& starts) const {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3, "decoder_layers: x must be float32 [B, T, H]");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "decoder_layers: one key and one value cache per layer");
    for (const int64_t i : which) {
      TORCH_CHECK(i >= 0 && i < size(), "decoder_layers: no layer ", i);
      const Layer& layer = layers_[i];
      auto qkv = layer.qkv(rms_norm(x, layer.attn_norm, eps_));  // [B, T, (H + 2 H_kv) D]
      auto attn = cached_attention(qkv, cos, sin, k_caches[i], v_caches[i], slots, starts, visible, width, heads_,
                                   scale_);  // [B, T, H D]
      x = x + layer.o(attn);
      auto gate_up = layer.gate_up(rms_norm(x, layer.mlp_norm, eps_)).chunk(2, -1);  // 2 x [B, T, I]
      x = x + layer.down(torch::silu(gate_up[0]) * gate_up[1]);
    }
    return x;
  }

 private:
  int64_t heads_;
  double scale_, eps_;
  std::vector<Layer> layers_;
};

void bind_decoder_layers(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecoderLayers>(m, "DecoderLayers",
                            "a model's decoder layers for one-call decode and verify steps (float32, quantized)")
      .def(py::init<int64_t, double, double>(), py::arg("heads"), py::arg("scale"), py::arg("eps"))
      .def("add_layer", &DecoderLayers::add_layer)
      .def("__len__", &DecoderLayers::size)
      // the step releases the GIL, as the products do: the server's other threads run meanwhile
      .def("run", &DecoderLayers::run, py::call_guard<py::gil_scoped_release>());
}
