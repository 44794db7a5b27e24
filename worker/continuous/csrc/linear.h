// A linear layer as the C++ decoder holds it, and the one table of the kernel paths its products
// can take. worker/continuous/linear.py reads the table (the module's PATHS: name -> code, the
// paths this build runs) instead of keeping codes of its own in step with these by hand: a new
// kernel is a row of PATH_TABLE, a case of Linear::operator(), and linear.py's packing of its weight.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "quantized.h"
#include "int8.h"
#include "panels.h"
#include "dense_panels.h"
#include "kquants_api.h"

namespace storyteller {

// How a layer's small steps (up to Linear::small_rows rows) run; the names are linear.py's (and the
// numerics fingerprint's). "dense": no small path, every step takes the dense product.
enum class Path : int64_t { dense = 0, int4, bytes, int8_avx2, int8_vnni_panels, dense_panels, kquants_vnni, kquants_avx2 };

struct PathRow {
  Path path;
  const char* name;
  bool here;  // compiled into this build (the CPU's instruction sets: the headers' STORYTELLER_* macros)
};

#ifdef STORYTELLER_INT8
constexpr bool HAVE_INT8 = true;
#else
constexpr bool HAVE_INT8 = false;
#endif
#ifdef STORYTELLER_PANELS
constexpr bool HAVE_PANELS = true;
#else
constexpr bool HAVE_PANELS = false;
#endif
#ifdef STORYTELLER_DENSE_PANELS
constexpr bool HAVE_DENSE_PANELS = true;
#else
constexpr bool HAVE_DENSE_PANELS = false;
#endif
#ifdef STORYTELLER_KQUANTS_VNNI
constexpr bool HAVE_KQUANTS_VNNI = true, HAVE_KQUANTS_AVX2 = false;
#elif defined(STORYTELLER_KQUANTS)
constexpr bool HAVE_KQUANTS_VNNI = false, HAVE_KQUANTS_AVX2 = true;
#else
constexpr bool HAVE_KQUANTS_VNNI = false, HAVE_KQUANTS_AVX2 = false;
#endif

constexpr PathRow PATH_TABLE[] = {
    {Path::dense, "dense", true},                        // torch's or oneDNN's product of `weight`
    {Path::int4, "int4", true},                          // torch's int4 layout: a = packed, b = scales_zeros
    {Path::bytes, "bytes", true},                        // quantized.h, the file's bytes: a = q, b = d, c = m
    {Path::int8_avx2, "int8-avx2", HAVE_INT8},           // int8.h: a = packed
    {Path::int8_vnni_panels, "int8-vnni-panels", HAVE_PANELS},  // panels.h: a = packed
    {Path::dense_panels, "dense-panels", HAVE_DENSE_PANELS},    // dense_panels.h: a = packed
    {Path::kquants_vnni, "int8-vnni-kquants", HAVE_KQUANTS_VNNI},  // kquants.h: a = packed, code = its type
    {Path::kquants_avx2, "int8-avx2-kquants", HAVE_KQUANTS_AVX2},  // the same, built for AVX2
};

// The paths this build runs, name -> code (bound as the module's PATHS).
inline std::vector<std::pair<std::string, int64_t>> paths_here() {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const PathRow& row : PATH_TABLE)
    if (row.here) out.emplace_back(row.name, static_cast<int64_t>(row.path));
  return out;
}

// A dense weight (oneDNN-packed bf16, or plain; empty where no step uses it) and, for steps of up to
// `small_rows` rows, the weight in the form `path`'s kernel reads (a, b, c: PATH_TABLE says which).
// `q4_1`: the quantized kernels' weight is Q4_1 (two weights a byte), else Q8_0; `code`: kquants.h's
// type. A stack (`parts`, weights.fuse's matrices of more than one type) is its parts' outputs side
// by side, each part on its own path.
struct Linear {
  Linear() = default;
  torch::Tensor weight;
  bool onednn = false;
  Path path = Path::dense;
  bool q4_1 = false;
  c10::optional<torch::Tensor> a, b, c;
  int64_t small_rows = 0;
  int64_t code = -1;
  std::vector<Linear> parts;

  static Linear stack(std::vector<Linear> parts) {
    TORCH_CHECK(!parts.empty(), "Linear.stack: no parts");
    Linear out;
    out.parts = std::move(parts);
    return out;
  }

  Linear(torch::Tensor weight, bool onednn, int64_t path, bool q4_1, c10::optional<torch::Tensor> a,
         c10::optional<torch::Tensor> b, c10::optional<torch::Tensor> c, int64_t small_rows, int64_t code)
      : weight(std::move(weight)), onednn(onednn), path(static_cast<Path>(path)), q4_1(q4_1), a(std::move(a)),
        b(std::move(b)), c(std::move(c)), small_rows(small_rows), code(code) {
    bool known = false;
    for (const PathRow& row : PATH_TABLE) known |= row.here && static_cast<int64_t>(row.path) == path;
    TORCH_CHECK(known, "Linear: kernel path ", path, " is not one this build runs (see the module's PATHS)");
    TORCH_CHECK(this->path == Path::dense || this->a.has_value(), "Linear: the small steps' weight is missing");
    TORCH_CHECK(this->path != Path::kquants_vnni && this->path != Path::kquants_avx2 || code >= 0,
                "Linear: a K-quant path needs its type's code");
    TORCH_CHECK(this->path != Path::int4 && this->path != Path::bytes || this->b.has_value(),
                "Linear: the small steps' scales are missing");
  }

  // The weight bytes a product of `rows` rows reads first and how many there are, where its kernel
  // reads them as stored (the K-quant panels; nullptr elsewhere): rowwise.h's upcoming hint.
  std::pair<const uint8_t*, int64_t> first_bytes(int64_t rows) const {
    if (!parts.empty()) return parts.front().first_bytes(rows);
    if (rows > small_rows || (path != Path::kquants_vnni && path != Path::kquants_avx2)) return {nullptr, 0};
    return {a->data_ptr<uint8_t>(), a->numel()};
  }

  // This product comes after the one about to run: that one's threads fetch ahead its first bytes.
  void comes_next(int64_t rows) const {
    const auto bytes = first_bytes(rows);
    expect(bytes.first, bytes.second);
  }

  // Whether every part of a stack is a K-quant that takes a step of `rows` rows, a step of a few:
  // then the stack is one call, in one parallel region (kquant_stack). A larger step's parts fetch
  // each other's bytes ahead (operator() below), which the one region does not need.
  bool kquant_stack_takes(int64_t rows) const {
#ifdef STORYTELLER_KQUANTS
    bool all = !parts.empty() && rows <= kquant_stack_rows();
#else
    bool all = false;
#endif
    for (const Linear& part : parts)
      all &= (part.path == Path::kquants_vnni || part.path == Path::kquants_avx2) && rows <= part.small_rows;
    return all;
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
#ifdef STORYTELLER_KQUANTS
    if (kquant_stack_takes(x.size(0))) {
      std::vector<torch::Tensor> ws;
      std::vector<int64_t> types;
      for (const Linear& part : parts) ws.push_back(*part.a), types.push_back(part.code);
      return kquant_stack(x, ws, types);
    }
#endif
    if (!parts.empty()) {  // each part's threads fetch the next part's bytes, the last part's what follows
      const Upcoming& u = upcoming();
      const uint8_t* after = u.at.load();
      const int64_t after_bytes = u.bytes.load();
      std::vector<torch::Tensor> outs;
      for (size_t i = 0; i < parts.size(); ++i) {
        if (i + 1 < parts.size()) parts[i + 1].comes_next(x.size(0));
        else expect(after, after_bytes);
        outs.push_back(parts[i](x));
      }
      return at::cat(outs, 1);
    }
    if (x.size(0) <= small_rows) switch (path) {
        case Path::int4: return at::_weight_int4pack_mm_for_cpu(x, *a, 32, *b);
        case Path::bytes: return quantized_linear(x, *a, *b, c);
#ifdef STORYTELLER_INT8
        case Path::int8_avx2: return int8_linear(x, *a, q4_1);
#endif
#ifdef STORYTELLER_PANELS
        case Path::int8_vnni_panels: return panel_linear(x, *a, q4_1);
#endif
#ifdef STORYTELLER_DENSE_PANELS
        case Path::dense_panels: return dense_panel_linear(x, *a);
#endif
#ifdef STORYTELLER_KQUANTS
        case Path::kquants_vnni:
        case Path::kquants_avx2: return kquant_linear(x, *a, code);
#endif
        default: break;  // dense (the constructor refused a path this build lacks)
      }
    if (!onednn) return at::linear(x, weight);
    // Registered by torch's mkldnn code rather than ATen's own list: called through the dispatcher.
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{x, weight, c10::IValue(), std::string("none"),
                                   c10::List<c10::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

}  // namespace storyteller
