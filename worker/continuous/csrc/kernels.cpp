// The engine's CPU kernels, one extension module: this unit includes every header but kquants.h,
// whose products are built in kquants.cpp and reached through kquants_api.h (decode attention over
// the paged cache, the linear layers' products and their table of paths, the decoder, sampling and
// grammar masks), and binds what this CPU can run (kernels.py says which is which).
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: the whole C++ frontend, 12 s more to parse a build
#include <pybind11/stl.h>

#include "attention.h"
#include "decoder.h"
#include "linear.h"
#include "sampling.h"

namespace storyteller {

// q: [rows, heads, dim]; k_cache, v_cache: [kv_heads, blocks, block_size, dim];
// tables: [rows, width] int64 block ids; lengths: [rows] int64 tokens each row attends to (a row's
// own position + 1); window > 0: only the last `window` of them (a sliding-window layer).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lengths, double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "paged_decode: window must be 0 (none) or a number of positions");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lengths.is_contiguous(), "paged_decode: contiguous tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: the keys and values must share a dtype");
  auto out = torch::empty_like(q);
  with_cache_type(q.scalar_type(), k_cache.scalar_type(), "paged_decode", [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    decode_for<T, C>(q.size(2))(
        q.data_ptr<T>(), q.size(1) * q.size(2), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), tables.data_ptr<int64_t>(),
        lengths.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0), q.size(1), k_cache.size(0), k_cache.size(1),
        k_cache.size(2), q.size(2), tables.size(1), static_cast<float>(scale), window);
  });
  return out;
}

// The decoder's row-wise steps on their own, for tests: a row's norm and rotation.
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps) {
  x = x.contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm_rows", [&] {
    rms_norm(x.data_ptr<scalar_t>(), weight.contiguous().data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
             x.size(1), static_cast<float>(eps));
  });
  return out;
}

}  // namespace storyteller

// Classes are module_local: a process may load the native build and the --kernel-isa avx2 one side by
// side (the tests do), and pybind11 would otherwise refuse a second "Linear".
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace storyteller;
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lengths"), py::arg("scale"),
        py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  // The kernel paths this build runs, name -> code (linear.h's PATH_TABLE): what Linear's `path` takes.
  py::dict paths;
  for (const auto& [name, code] : paths_here()) paths[py::str(name)] = code;
  m.attr("PATHS") = paths;
  py::class_<Linear>(m, "Linear", py::module_local())
      .def(py::init<torch::Tensor, bool, int64_t, bool, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, int64_t, int64_t>(),
           py::arg("weight"), py::arg("onednn"), py::arg("path"), py::arg("q4_1"), py::arg("a"), py::arg("b"),
           py::arg("c"), py::arg("small_rows"), py::arg("code") = -1)
      .def_static("stack", &Linear::stack, "a stack of layers, their outputs side by side", py::arg("parts"))
      .def("__call__", &Linear::operator(), "the layer's product, as the decoder runs it (tests)",
           py::call_guard<py::gil_scoped_release>());
  m.def("quantized_linear", &quantized_linear, "x @ w.T for a Q4_1 (uint8) or Q8_0 (int8) weight (CPU)",
        py::call_guard<py::gil_scoped_release>());
#ifdef STORYTELLER_PANELS
  m.def("panel_linear", &panel_linear, "x @ w.T with x rounded to 8 bits per group of 32, 16 features a vector (AVX-512 VNNI)",
        py::call_guard<py::gil_scoped_release>());
#endif
#ifdef STORYTELLER_DENSE_PANELS
  m.def("dense_panel_linear", &dense_panel_linear, "x @ w.T for a dense weight in panels, summed over k in order (AVX-512 or AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dense_panel_dtypes", &dense_panel_dtypes, "the dtypes dense_panel_linear takes on this CPU");
#endif
#ifdef STORYTELLER_KQUANTS
  m.def("kquant_rows", &kquant_rows, "rows of a K-quant, Q5_0 or Q5_1 weight packed in panels, as float32 (a tied head's embedding)",
        py::arg("w"), py::arg("type"), py::arg("K"), py::arg("ids"), py::call_guard<py::gil_scoped_release>());
  m.def("kquant_linear", &kquant_linear, "x @ w.T for a K-quant, Q5_0 or Q5_1 weight packed in panels, x rounded to 8 bits per group of 32",
        py::arg("x"), py::arg("w"), py::arg("type"), py::call_guard<py::gil_scoped_release>());
  m.def("kquant_stack", &kquant_stack, "a stack's K-quant parts side by side, each as kquant_linear makes it; a step of a few "
        "rows in one parallel region", py::arg("x"), py::arg("ws"), py::arg("types"), py::call_guard<py::gil_scoped_release>());
  m.def("kquant_stack_rows", &kquant_stack_rows, "the most rows of a step kquant_stack runs in one parallel region");
  m.def("kquant_tiles", &kquant_tiles, "whether K-quant steps of many rows take AMX tiles (same bits); enable: turn them on or off; "
        "rows: whether a step of that many rows takes them", py::arg("enable") = py::none(), py::arg("rows") = py::none());
  m.def("kquant_few_rows_fetch", &kquant_few_rows_fetch, "whether a K-quant pass of 1-4 rows prefetches its weights further ahead "
        "(same bits; on by default on every CPU but a Zen 4); enable: turn it on or off", py::arg("enable") = py::none());
  m.def("kquant_columns", &kquant_columns, "whether K-quant steps of 8-32 rows take the AVX2 kernel of 8 rows a vector (same bits); "
        "enable: turn it on or off; rows: whether a step of that many rows takes it", py::arg("enable") = py::none(), py::arg("rows") = py::none());
#endif
#ifdef STORYTELLER_INT8
  m.def("int8_linear", &int8_linear, "x @ w.T with x rounded to 8 bits per group of 32 (AVX-512 VNNI or AVX2)",
        py::call_guard<py::gil_scoped_release>());
#endif
  m.def("fetch_ahead", &fetch_ahead, "whether threads fetch ahead: those with no piece left of a product the next one's first bytes, and a K-quant pass of 9 rows or more its thread's next pair of panels (on AMX tiles, up to 128 rows, its next panel) (no bits change); enable: turn it on or off",
        py::arg("enable") = py::none());
  m.def("rms_norm_rows", &rms_norm_rows, "the decoder's RMS norm, row by row (tests)");
  m.def("sample_rows", &sample_rows, "a token per row from softmax(logits / temperature), by inverse CDF",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_rows", &mask_rows, "-inf in place on each token a row's grammar bitmask does not allow",
        py::call_guard<py::gil_scoped_release>());
  py::class_<Decoder>(m, "Decoder", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, std::string>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("activation"))
      .def("add_layer", &Decoder::add_layer, py::arg("norm1"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("o"), py::arg("post_attn_norm"), py::arg("norm2"), py::arg("gate_up"),
           py::arg("down"), py::arg("post_ffn_norm"), py::arg("cos"), py::arg("sin"), py::arg("window"))
      .def("forward",
           [](Decoder& d, torch::Tensor x, torch::Tensor positions, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots, torch::Tensor tables, torch::Tensor lengths, double scale) {
             return d.forward(x, positions, k_cache, v_cache, slots, tables, lengths, scale);
           },
           "every layer of a step whose tokens are its rows", py::arg("x"), py::arg("positions"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("slots"), py::arg("tables"), py::arg("lengths"), py::arg("scale"),
           py::call_guard<py::gil_scoped_release>());
  py::class_<LlamaDecoder>(m, "LlamaDecoder", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("forward", &LlamaDecoder::forward, "every layer of a step of one-token decodes",
           py::call_guard<py::gil_scoped_release>());
}
