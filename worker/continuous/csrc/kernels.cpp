// The engine's CPU kernels, one extension module: it includes every header (decode attention over
// the paged cache, the linear layers' products, sampling and grammar masks), binds what this CPU
// can run (kernels.py says which is which), and holds the Llama decoder, a whole step in C++.
//
// Why a whole step: at one row a step of SmolLM2 is ~600 small torch operations (norms, rotary,
// cache writes, residual adds, SiLU), and their dispatch from Python cost more than the matrix
// products themselves (profiled: docs/serving.md, "Measurements behind the engine's choices").
// Here every layer is its matrix products (the kernels linear.py picked for it) and a handful of
// loops that do the elementwise work in one pass each, with the GIL released.
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>

#include "attention.h"
#include "quantized.h"
#include "sampling.h"
#include "int8.h"
#include "panels.h"
#include "dense_panels.h"

namespace storyteller {

// q: [rows, heads, dim]; k_cache, v_cache: [kv_heads, blocks, block_size, dim];
// tables: [rows, width] int64 block ids; lengths: [rows] int64 tokens each row attends to.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lengths.is_contiguous(), "paged_decode: contiguous tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and the cache must share a dtype");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    decode_for<scalar_t>(q.size(2))(
        q.data_ptr<scalar_t>(), q.size(1) * q.size(2), k_cache.data_ptr<scalar_t>(),
        v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), q.size(0), q.size(1), k_cache.size(0), k_cache.size(1),
        k_cache.size(2), q.size(2), tables.size(1), static_cast<float>(scale));
  });
  return out;
}

// A linear layer as worker/continuous/linear.py holds it: a dense weight (oneDNN-packed bf16, or
// plain; empty where no step uses it) and, for steps of up to `small_rows` rows, another form:
// torch's int4 layout (small == 1: packed, scales_zeros), the file's bytes (q, d, m) for the float
// kernel (2), packed for the integer one (int8.h: 3 Q4_1, 4 Q8_0; panels.h: 5 Q4_1, 6 Q8_0), or
// the dense weight in panels (dense_panels.h: 7).
struct Linear {
  torch::Tensor weight;
  bool onednn;
  int64_t small;
  c10::optional<torch::Tensor> a, b, c;
  int64_t small_rows;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (small == 1 && x.size(0) <= small_rows) return at::_weight_int4pack_mm_for_cpu(x, *a, 32, *b);
    if (small == 2 && x.size(0) <= small_rows) return quantized_linear(x, *a, *b, c);
#ifdef STORYTELLER_INT8
    if ((small == 3 || small == 4) && x.size(0) <= small_rows) return int8_linear(x, *a, small == 3);
#endif
#ifdef STORYTELLER_PANELS
    if ((small == 5 || small == 6) && x.size(0) <= small_rows) return panel_linear(x, *a, small == 5);
#endif
#ifdef STORYTELLER_DENSE_PANELS
    if (small == 7 && x.size(0) <= small_rows) return dense_panel_linear(x, *a);
#endif
    if (!onednn) return at::linear(x, weight);
    // Registered by torch's mkldnn code rather than ATen's own list: called through the dispatcher.
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{x, weight, c10::IValue(), std::string("none"),
                                   c10::List<c10::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

struct Layer {
  torch::Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
};

// Rows of `cols` elements; small steps stay on one thread (a parallel region costs more).
template <typename F>
static void for_rows(int64_t rows, int64_t cols, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

template <typename T>
STORYTELLER_ROW static void rms_norm_row(const T* x, const T* weight, T* o, int64_t cols, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < cols; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float rstd = 1.f / std::sqrt(sum / cols + eps);
  for (int64_t i = 0; i < cols; ++i) o[i] = static_cast<T>(static_cast<float>(x[i]) * rstd * static_cast<float>(weight[i]));
}

template <typename T>
static void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t cols, float eps) {
  for_rows(rows, cols, [&](int64_t r) { rms_norm_row(x + r * cols, weight, out + r * cols, cols, eps); });
}

// Rotates a row's query and key heads in place (halves, as transformers' Llama does), then
// writes its keys and values to their cache slot.
template <typename T>
STORYTELLER_ROW static void rope_and_store_row(T* row, const T* c, const T* s, int64_t slot, T* k_cache,
                                               T* v_cache, int64_t heads, int64_t kv_heads, int64_t dim,
                                               int64_t slots_per_head) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads + kv_heads; ++h) {
    T* x = row + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
      x[i] = static_cast<T>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
      x[i + half] = static_cast<T>(b * static_cast<float>(c[i + half]) + a * static_cast<float>(s[i + half]));
    }
  }
  for (int64_t kv = 0; kv < kv_heads; ++kv) {
    const int64_t at = (kv * slots_per_head + slot) * dim;
    std::copy_n(row + (heads + kv) * dim, dim, k_cache + at);
    std::copy_n(row + (heads + kv_heads + kv) * dim, dim, v_cache + at);
  }
}

template <typename T>
static void rope_and_store(T* qkv, const int64_t* positions, const T* cos, const T* sin,
                           const int64_t* slots, T* k_cache, T* v_cache, int64_t rows, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t slots_per_head) {
  const int64_t cols = (heads + 2 * kv_heads) * dim;
  for_rows(rows, cols, [&](int64_t r) {
    rope_and_store_row(qkv + r * cols, cos + positions[r] * dim, sin + positions[r] * dim, slots[r], k_cache,
                       v_cache, heads, kv_heads, dim, slots_per_head);
  });
}

// SiLU(gate) * up, from the fused [gate | up] product.
template <typename T>
STORYTELLER_ROW static void silu_mul_row(const T* g, T* o, int64_t inner) {
  const T* u = g + inner;
  for (int64_t i = 0; i < inner; ++i) {
    const float a = static_cast<float>(g[i]);
    o[i] = static_cast<T>(a / (1.f + std::exp(-a)) * static_cast<float>(u[i]));
  }
}

template <typename T>
static void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  for_rows(rows, inner, [&](int64_t r) { silu_mul_row(gate_up + r * 2 * inner, out + r * inner, inner); });
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

class LlamaDecoder {
 public:
  LlamaDecoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), dim_(head_dim), eps_(static_cast<float>(eps)) {}

  void add_layer(torch::Tensor norm1, Linear qkv, Linear o, torch::Tensor norm2, Linear gate_up,
                 Linear down) {
    layers_.push_back({norm1.contiguous(), norm2.contiguous(), qkv, o, gate_up, down});
  }

  // x: [rows, hidden], each row one decode token at `positions`; its keys and values go to `slots`
  // and it attends to `lengths` tokens through `tables`. The cache: [layers, kv_heads, blocks,
  // block_size, dim]. Returns the hidden states after the last layer (x, updated in place).
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                        torch::Tensor tables, torch::Tensor lengths, double scale) {
    TORCH_CHECK(x.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                cos.is_contiguous() && sin.is_contiguous() && tables.is_contiguous(),
                "LlamaDecoder: contiguous tensors only");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "llama_decode", [&] {
      run<scalar_t>(x, positions, cos, sin, k_cache, v_cache, slots, tables, lengths, static_cast<float>(scale));
    });
    return x;
  }

 private:
  template <typename T>
  void run(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos,
           const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
           const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lengths,
           float scale) {
    const int64_t rows = x.size(0), hidden = x.size(1);
    const int64_t blocks = k_cache.size(2), block_size = k_cache.size(3);
    const int64_t layer_size = kv_heads_ * blocks * block_size * dim_;
    auto normed = torch::empty_like(x);
    auto attn = torch::empty({rows, heads_ * dim_}, x.options());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      T* k_layer = k_cache.data_ptr<T>() + l * layer_size;
      T* v_layer = v_cache.data_ptr<T>() + l * layer_size;
      rms_norm(x.data_ptr<T>(), layer.norm1.data_ptr<T>(), normed.data_ptr<T>(), rows, hidden, eps_);
      torch::Tensor qkv = layer.qkv(normed).contiguous();
      rope_and_store(qkv.data_ptr<T>(), positions.data_ptr<int64_t>(), cos.data_ptr<T>(), sin.data_ptr<T>(),
                     slots.data_ptr<int64_t>(), k_layer, v_layer, rows, heads_, kv_heads_, dim_,
                     blocks * block_size);
      decode_for<T>(dim_)(qkv.data_ptr<T>(), qkv.size(1), k_layer, v_layer, tables.data_ptr<int64_t>(),
                          lengths.data_ptr<int64_t>(), attn.data_ptr<T>(), rows, heads_, kv_heads_,
                          blocks, block_size, dim_, tables.size(1), scale);
      x.add_(layer.o(attn));
      rms_norm(x.data_ptr<T>(), layer.norm2.data_ptr<T>(), normed.data_ptr<T>(), rows, hidden, eps_);
      torch::Tensor gate_up = layer.gate_up(normed).contiguous();
      const int64_t inner = gate_up.size(1) / 2;
      auto act = torch::empty({rows, inner}, x.options());
      silu_mul(gate_up.data_ptr<T>(), act.data_ptr<T>(), rows, inner);
      x.add_(layer.down(act));
    }
  }

  int64_t heads_, kv_heads_, dim_;
  float eps_;
  std::vector<Layer> layers_;
};

}  // namespace storyteller

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace storyteller;
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU)",
        py::call_guard<py::gil_scoped_release>());
  py::class_<Linear>(m, "Linear")
      .def(py::init<torch::Tensor, bool, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, int64_t>());
  m.def("quantized_linear", &quantized_linear, "x @ w.T for a Q4_1 (uint8) or Q8_0 (int8) weight (CPU)",
        py::call_guard<py::gil_scoped_release>());
#ifdef STORYTELLER_PANELS
  m.def("panel_linear", &panel_linear, "x @ w.T with x rounded to 8 bits per group of 32, 16 features a vector (AVX-512 VNNI)",
        py::call_guard<py::gil_scoped_release>());
#endif
#ifdef STORYTELLER_DENSE_PANELS
  m.def("dense_panel_linear", &dense_panel_linear, "x @ w.T for a dense weight in panels, summed over k in order (AVX-512)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dense_panel_dtypes", &dense_panel_dtypes, "the dtypes dense_panel_linear takes on this CPU");
#endif
#ifdef STORYTELLER_INT8
  m.def("int8_linear", &int8_linear, "x @ w.T with x rounded to 8 bits per group of 32 (AVX-512 VNNI or AVX2)",
        py::call_guard<py::gil_scoped_release>());
#endif
  m.def("rms_norm_rows", &rms_norm_rows, "the decoder's RMS norm, row by row (tests)");
  m.def("sample_rows", &sample_rows, "a token per row from softmax(logits / temperature), by inverse CDF",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_rows", &mask_rows, "-inf in place on each token a row's grammar bitmask does not allow",
        py::call_guard<py::gil_scoped_release>());
  py::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("forward", &LlamaDecoder::forward, "every layer of a step of one-token decodes",
           py::call_guard<py::gil_scoped_release>());
}
