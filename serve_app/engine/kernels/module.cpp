// The Python module of our kernels (built by `python -m serve_app.native_build`).
#include <torch/extension.h>

#include <string>
#include <vector>

#include "common.h"

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n, int64_t bits);
torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n);
torch::Tensor q6k_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor small_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                              const torch::Tensor& visible, int64_t width, double scale);
torch::Tensor cached_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor& k_cache, torch::Tensor& v_cache, const std::vector<int64_t>& slots,
                               const std::vector<int64_t>& starts, const torch::Tensor& visible, int64_t width,
                               int64_t heads, double scale);
void bind_decoder_layers(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The products release the GIL, as torch's own ops do: a server's other Python threads (its event
  // loop, the streaming of tokens) run meanwhile instead of stalling the engine thread for the GIL.
  m.def("q8_linear", &q8_linear, "x @ dequant(Q8 or Q5 weight).T with int8 activations (exact in the rows)",
        py::call_guard<py::gil_scoped_release>());
  m.def("q4k_linear", &q4k_linear, "x @ dequant(Q4_K weight).T with int8 activations (exact in the rows)",
        py::call_guard<py::gil_scoped_release>());
  m.def("q6k_linear", &q6k_linear, "x @ dequant(Q6_K weight).T with int8 activations (exact in the rows)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "weight * x / sqrt(mean(x^2) + eps) per row (float32, exact in the rows)",
        py::call_guard<py::gil_scoped_release>());
  m.def("small_attention", &small_attention,
        "grouped-query attention of few queries over cache views (float32, exact in the rows)",
        py::call_guard<py::gil_scoped_release>());
  m.def("cached_attention", &cached_attention,
        "rotary embedding, KV cache write and attention of a step's queries from the fused qkv (float32)",
        py::call_guard<py::gil_scoped_release>());
  bind_decoder_layers(m);
  m.def("vectorized", [] { return static_cast<bool>(SPECSERVE_AVX2); }, "whether the AVX2 kernels were compiled in");
  m.def("active_isa", [] { return std::string(specserve::active_isa()); },
        "the vector code the products run: amx, avx512, avx2 or scalar");
  m.def("tile_prefetch_rows", [] { return specserve::tile_prefetch_rows(); },
        "from how many rows a pass of the Q8 product prefetches its tiles (0: never; Intel 1, else 4)");
  m.def("set_tile_prefetch", [](int64_t rows) { specserve::set_tile_prefetch(rows); },
        "Q8 tile prefetch from this many rows (0: never, -1: the vendor's default); numbers never change");
  m.def("force_isa", [](const std::string& name) { specserve::force_isa(name.c_str()); },
        "run the products on one path (auto, amx, avx512, avx2, scalar); every path gives the same numbers");
}
