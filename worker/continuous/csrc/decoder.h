// The decoder: every layer of a step in C++, its tokens the rows (decodes and prompt tokens alike),
// for the model families the engine runs (llama, mistral, qwen2, qwen3, gemma3, phi3). A layer is
// its matrix products (the kernels linear.py picked, linear.h) and a handful of loops that do the
// elementwise work in one pass each, with the GIL released.
//
// Why a whole step: at one row a step of SmolLM2 is ~600 small torch operations (norms, rotary,
// cache writes, residual adds, SiLU), and their dispatch from Python cost more than the matrix
// products themselves (profiled: docs/serving.md, "Measurements behind the engine's choices").
//
// What the families differ in is options of a layer, each applied row by row: a bias on q/k/v
// (qwen2), RMS norms of each query and key head (qwen3, gemma3), rotary over part of a head (phi3)
// with tables of the layer's own (gemma3's local and global layers have different bases), a
// sliding window (mistral, gemma3's local layers), norms after attention and after the MLP
// (gemma3), and the MLP's activation (SiLU, or GELU with the tanh approximation: gemma3).
// Every row's work is a function of its own on 64-byte-aligned data (rowwise.h), so a row's bits
// never depend on the rows beside it (tests/test_decoder.py checks them with every option on).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention.h"
#include "linear.h"
#include "rowwise.h"

namespace storyteller {

// Rows of `cols` elements; small steps stay on one thread (a parallel region costs more).
template <typename F>
static void for_rows(int64_t rows, int64_t cols, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

template <typename T>
static bool on_a_line(const T* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 64 == 0;
}

// A row of a step's tensor where its vectorised loops split as every row's do: itself where it starts
// on a 64-byte line (every row, when a row's bytes are a multiple of 64), else a copy that does (one
// a thread and type: a row's work takes one such input at a time).
template <typename T>
static const T* aligned_row(const T* p, int64_t n) {
  if (on_a_line(p)) return p;
  thread_local aligned_vector<T> copy;
  copy.assign(p, p + n);
  return copy.data();
}

template <typename T>
STORYTELLER_ROW static void rms_norm_row(const T* x, const T* weight, T* o, int64_t cols, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < cols; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float rstd = 1.f / std::sqrt(sum / cols + eps);
  for (int64_t i = 0; i < cols; ++i) o[i] = static_cast<T>(static_cast<float>(x[i]) * rstd * static_cast<float>(weight[i]));
}

// x and out may be one tensor (the post-attention and post-MLP norms run in place).
template <typename T>
static void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t cols, float eps) {
  for_rows(rows, cols, [&](int64_t r) { rms_norm_row(aligned_row(x + r * cols, cols), weight, out + r * cols, cols, eps); });
}

// One row of the fused q/k/v product, in place, then its keys and values to their cache slot: the
// bias added (if any), each query and key head RMS-normed over the head (if q_norm / k_norm), its
// first `rot` dimensions rotated by halves as transformers' rotate_half does (the rest as they are),
// all in float32 and rounded once (to the cache's type C, where it is not T's, from T's value).
// `f`: a head's worth of aligned scratch.
template <typename T, typename C>
STORYTELLER_ROW static void qkv_row(T* row, const T* bias, const T* q_norm, const T* k_norm, const T* c, const T* s,
                                    int64_t rot, int64_t slot, C* k_cache, C* v_cache, int64_t heads,
                                    int64_t kv_heads, int64_t dim, int64_t slots_per_head, float eps, float* f) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads + kv_heads; ++h) {
    T* x = row + h * dim;
    for (int64_t i = 0; i < dim; ++i) f[i] = static_cast<float>(x[i]);
    if (bias)
      for (int64_t i = 0; i < dim; ++i) f[i] += static_cast<float>(bias[h * dim + i]);
    if (const T* w = h < heads ? q_norm : k_norm) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += f[i] * f[i];
      const float rstd = 1.f / std::sqrt(sum / dim + eps);
      for (int64_t i = 0; i < dim; ++i) f[i] = f[i] * rstd * static_cast<float>(w[i]);
    }
    for (int64_t i = 0; i < half; ++i) {
      const float a = f[i], b = f[i + half];
      x[i] = static_cast<T>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
      x[i + half] = static_cast<T>(b * static_cast<float>(c[i + half]) + a * static_cast<float>(s[i + half]));
    }
    if (bias || q_norm || k_norm)  // else the rest of the head is as it came
      for (int64_t i = rot; i < dim; ++i) x[i] = static_cast<T>(f[i]);
  }
  if (bias)
    for (int64_t i = (heads + kv_heads) * dim; i < (heads + 2 * kv_heads) * dim; ++i)
      row[i] = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(bias[i]));
  for (int64_t kv = 0; kv < kv_heads; ++kv) {
    const int64_t at = (kv * slots_per_head + slot) * dim;
    const T *k = row + (heads + kv) * dim, *v = row + (heads + kv_heads + kv) * dim;
    for (int64_t i = 0; i < dim; ++i) {
      k_cache[at + i] = static_cast<C>(static_cast<float>(k[i]));  // exact where C is T
      v_cache[at + i] = static_cast<C>(static_cast<float>(v[i]));
    }
  }
}

// act(gate) * up, from a row of the fused [gate | up] product.
template <typename T>
STORYTELLER_ROW static void silu_mul_row(const T* g, T* o, int64_t inner) {
  const T* u = g + inner;
  for (int64_t i = 0; i < inner; ++i) {
    const float a = static_cast<float>(g[i]);
    o[i] = static_cast<T>(a / (1.f + std::exp(-a)) * static_cast<float>(u[i]));
  }
}

// GELU with the tanh approximation, as torch's F.gelu(approximate="tanh") computes it.
template <typename T>
STORYTELLER_ROW static void gelu_tanh_mul_row(const T* g, T* o, int64_t inner) {
  constexpr float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2 / pi)
  const T* u = g + inner;
  for (int64_t i = 0; i < inner; ++i) {
    const float a = static_cast<float>(g[i]);
    o[i] = static_cast<T>(0.5f * a * (1.f + std::tanh(beta * (a + kappa * a * a * a))) * static_cast<float>(u[i]));
  }
}

// A row's exp or tanh may be a vector library's or the scalar one's by where the vector loop starts:
// both the row's input and its output are on 64-byte lines (the output through a copy if it is not).
template <typename T, typename Row>
static void gated(const T* gate_up, T* out, int64_t rows, int64_t inner, const Row& row) {
  for_rows(rows, inner, [&](int64_t r) {
    const T* g = aligned_row(gate_up + r * 2 * inner, 2 * inner);
    T* o = out + r * inner;
    if (on_a_line(o)) return row(g, o, inner);
    thread_local aligned_vector<T> staged;
    staged.resize(inner);
    row(g, staged.data(), inner);
    std::copy_n(staged.data(), inner, o);
  });
}

enum class Activation { silu, gelu_tanh };

struct DecoderLayer {
  torch::Tensor norm1;
  Linear qkv;
  c10::optional<torch::Tensor> qkv_bias, q_norm, k_norm;
  Linear o;
  c10::optional<torch::Tensor> post_attn_norm;
  torch::Tensor norm2;
  Linear gate_up, down;
  c10::optional<torch::Tensor> post_ffn_norm;
  torch::Tensor cos, sin;  // [positions, rotary dims]
  int64_t window;          // 0: attends to every position
};

static c10::optional<torch::Tensor> contiguous(const c10::optional<torch::Tensor>& t) {
  return t ? c10::optional<torch::Tensor>(t->contiguous()) : c10::nullopt;
}

template <typename T>
static const T* data_or_null(const c10::optional<torch::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

class Decoder {
 public:
  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, const std::string& activation)
      : heads_(heads), kv_heads_(kv_heads), dim_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "Decoder: heads must be a multiple of kv_heads");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
                "Decoder: activation must be \"silu\" or \"gelu_tanh\", not \"", activation, "\"");
    activation_ = activation == "silu" ? Activation::silu : Activation::gelu_tanh;
  }

  void add_layer(torch::Tensor norm1, Linear qkv, c10::optional<torch::Tensor> qkv_bias,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, Linear o,
                 c10::optional<torch::Tensor> post_attn_norm, torch::Tensor norm2, Linear gate_up, Linear down,
                 c10::optional<torch::Tensor> post_ffn_norm, torch::Tensor cos, torch::Tensor sin, int64_t window) {
    const int64_t width = (heads_ + 2 * kv_heads_) * dim_;
    TORCH_CHECK(!qkv_bias || qkv_bias->numel() == width, "Decoder: qkv_bias must have (heads + 2 * kv_heads) * head_dim = ",
                width, " elements");
    TORCH_CHECK((!q_norm || q_norm->numel() == dim_) && (!k_norm || k_norm->numel() == dim_),
                "Decoder: q_norm and k_norm must have head_dim elements");
    TORCH_CHECK(window >= 0, "Decoder: window must be 0 (none) or a number of positions");
    check_rotary(cos, sin);
    layers_.push_back({norm1.contiguous(), qkv, contiguous(qkv_bias), contiguous(q_norm), contiguous(k_norm), o,
                       contiguous(post_attn_norm), norm2.contiguous(), gate_up, down, contiguous(post_ffn_norm),
                       cos.contiguous(), sin.contiguous(), window});
  }

  // x: [rows, hidden], each row one token at `positions`; its keys and values go to `slots` and it
  // attends to `lengths` tokens (its window's last ones) through `tables`. The cache: [layers,
  // kv_heads, blocks, block_size, dim], of x's dtype or float16 / bfloat16 beside float32. Returns
  // the hidden states after the last layer (x, updated in place). `cos`/`sin`, where given, stand
  // for every layer's tables (LlamaDecoder's call).
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor slots, torch::Tensor tables, torch::Tensor lengths, double scale,
                        const torch::Tensor* cos = nullptr, const torch::Tensor* sin = nullptr) {
    TORCH_CHECK(x.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous() &&
                positions.is_contiguous() && slots.is_contiguous() && lengths.is_contiguous(),
                "Decoder: contiguous tensors only");
    TORCH_CHECK(k_cache.size(0) == static_cast<int64_t>(layers_.size()) && k_cache.size(1) == kv_heads_ &&
                k_cache.size(4) == dim_ && v_cache.sizes() == k_cache.sizes(),
                "Decoder: the cache must be [layers, kv_heads, blocks, block_size, head_dim]");
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "Decoder: the keys and values must share a dtype");
    const int64_t rows = x.size(0);
    TORCH_CHECK(positions.numel() == rows && slots.numel() == rows && lengths.numel() == rows && tables.size(0) == rows,
                "Decoder: positions, slots, lengths and tables need a row per row of x");
    if (cos) check_rotary(*cos, *sin);
    const int64_t* p = positions.data_ptr<int64_t>();
    const int64_t furthest = rows ? *std::max_element(p, p + rows) : 0;
    for (const DecoderLayer& layer : layers_) {
      const torch::Tensor& c = cos ? *cos : layer.cos;
      TORCH_CHECK(c.scalar_type() == x.scalar_type(), "Decoder: the rotary tables must have x's dtype");
      TORCH_CHECK(furthest < c.size(0), "Decoder: a position past the rotary tables (", furthest, ")");
    }
    with_cache_type(x.scalar_type(), k_cache.scalar_type(), "Decoder", [&](auto t, auto c) {
      run<decltype(t), decltype(c)>(x, positions, k_cache, v_cache, slots, tables, lengths, static_cast<float>(scale), cos, sin);
    });
    return x;
  }

 private:
  void check_rotary(const torch::Tensor& cos, const torch::Tensor& sin) const {
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) % 2 == 0 && cos.size(1) <= dim_ &&
                cos.scalar_type() == sin.scalar_type(),
                "Decoder: cos and sin must be [positions, rotary_dim], rotary_dim even and at most head_dim");
  }

  template <typename T, typename C>
  void run(torch::Tensor& x, const torch::Tensor& positions, torch::Tensor& k_cache, torch::Tensor& v_cache,
           const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lengths, float scale,
           const torch::Tensor* cos_all, const torch::Tensor* sin_all) {
    const int64_t rows = x.size(0), hidden = x.size(1);
    const int64_t blocks = k_cache.size(2), block_size = k_cache.size(3), slots_per_head = blocks * block_size;
    const int64_t layer_size = kv_heads_ * slots_per_head * dim_;
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    auto normed = torch::empty_like(x);
    auto attn = torch::empty({rows, heads_ * dim_}, x.options());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const DecoderLayer& layer = layers_[l];
      const torch::Tensor cos = (cos_all ? *cos_all : layer.cos).contiguous();
      const torch::Tensor sin = (sin_all ? *sin_all : layer.sin).contiguous();
      C* k_layer = k_cache.data_ptr<C>() + l * layer_size;
      C* v_layer = v_cache.data_ptr<C>() + l * layer_size;

      rms_norm(x.data_ptr<T>(), layer.norm1.data_ptr<T>(), normed.data_ptr<T>(), rows, hidden, eps_);
      layer.o.comes_next(rows);
      torch::Tensor qkv = layer.qkv(normed).contiguous();
      const int64_t cols = qkv.size(1), rot = cos.size(1);
      const T *bias = data_or_null<T>(layer.qkv_bias), *q_norm = data_or_null<T>(layer.q_norm),
              *k_norm = data_or_null<T>(layer.k_norm), *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
      for_rows(rows, cols, [&](int64_t r) {
        thread_local aligned_vector<float> head;
        head.resize(dim_);
        qkv_row(qkv.data_ptr<T>() + r * cols, bias, q_norm, k_norm, c + pos[r] * rot, s + pos[r] * rot, rot, slot[r],
                k_layer, v_layer, heads_, kv_heads_, dim_, slots_per_head, eps_, head.data());
      });
      decode_for<T, C>(dim_)(qkv.data_ptr<T>(), cols, k_layer, v_layer, tables.data_ptr<int64_t>(),
                          lengths.data_ptr<int64_t>(), attn.data_ptr<T>(), rows, heads_, kv_heads_, blocks, block_size,
                          dim_, tables.size(1), scale, layer.window);
      layer.gate_up.comes_next(rows);
      x.add_(post_norm(layer.o(attn), layer.post_attn_norm));

      rms_norm(x.data_ptr<T>(), layer.norm2.data_ptr<T>(), normed.data_ptr<T>(), rows, hidden, eps_);
      layer.down.comes_next(rows);
      torch::Tensor gate_up = layer.gate_up(normed).contiguous();
      const int64_t inner = gate_up.size(1) / 2;
      auto act = torch::empty({rows, inner}, x.options());
      if (activation_ == Activation::silu)
        gated(gate_up.data_ptr<T>(), act.data_ptr<T>(), rows, inner, silu_mul_row<T>);
      else
        gated(gate_up.data_ptr<T>(), act.data_ptr<T>(), rows, inner, gelu_tanh_mul_row<T>);
      if (l + 1 < layers_.size()) layers_[l + 1].qkv.comes_next(rows);
      else expect(nullptr, 0);
      x.add_(post_norm(layer.down(act), layer.post_ffn_norm));
    }
  }

  // A product's output normed in place where the layer has a norm after it (gemma3), as it is where not.
  torch::Tensor post_norm(torch::Tensor y, const c10::optional<torch::Tensor>& weight) const {
    if (!weight) return y;
    y = y.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, y.scalar_type(), "post_norm", [&] {
      rms_norm(y.data_ptr<scalar_t>(), weight->data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), y.size(0), y.size(1), eps_);
    });
    return y;
  }

  int64_t heads_, kv_heads_, dim_;
  float eps_;
  Activation activation_;
  std::vector<DecoderLayer> layers_;
};

// Today's Llama binding, a case of Decoder: no biases, no q/k norms, no post norms, SiLU, full
// rotary with one pair of tables for every layer (given at each call), no window.
class LlamaDecoder {
 public:
  LlamaDecoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : decoder_(heads, kv_heads, head_dim, eps, "silu"), dim_(head_dim) {}

  void add_layer(torch::Tensor norm1, Linear qkv, Linear o, torch::Tensor norm2, Linear gate_up, Linear down) {
    // Placeholder tables (forward's stand for them): [0, head_dim].
    const auto none = torch::empty({0, dim_}, norm1.options());
    decoder_.add_layer(norm1, qkv, c10::nullopt, c10::nullopt, c10::nullopt, o, c10::nullopt, norm2, gate_up, down,
                       c10::nullopt, none, none, 0);
  }

  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables,
                        torch::Tensor lengths, double scale) {
    TORCH_CHECK(cos.size(1) == dim_, "LlamaDecoder: rotary over the whole head");
    return decoder_.forward(x, positions, k_cache, v_cache, slots, tables, lengths, scale, &cos, &sin);
  }

 private:
  Decoder decoder_;
  int64_t dim_;
};

}  // namespace storyteller
