// The K-quant products' entry points (kquants_api.h says what each does), in a translation unit of
// their own beside kernels.cpp.
#include "kquants.h"
#include "kquants_api.h"

#ifdef STORYTELLER_KQUANTS
namespace storyteller {

// x_in and a packed weight checked against each other.
static void check(const torch::Tensor& x_in, const torch::Tensor& w, int64_t type) {
  const int64_t block = kquants::row_step(type) ? 256 : kquants::GROUP;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % block == 0,
              "kquant_linear: x [rows, K], K a multiple of 256 (Q5_0, Q5_1: of 32)");
  const int64_t K = x_in.size(1), expected = kquants::panel_bytes(type, K / kquants::GROUP);
  TORCH_CHECK(expected > 0, "kquant_linear: unknown type code ", type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) == expected,
              "kquant_linear: w must be [N / 16, ", expected, "] uint8 for this type and K");
}

// y [rows, N] in x_in's type, made by run(x, y) on the pointers of x as the kernels read it (bf16 or
// float32) and of y in that type.
template <typename Run>
static torch::Tensor into_y(const torch::Tensor& x_in, int64_t N, const Run& run) {
  const torch::Tensor x = x_in.scalar_type() == torch::kBFloat16 ? x_in.contiguous() : x_in.to(torch::kFloat32).contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y.to(x_in.scalar_type());
  if (x.scalar_type() == torch::kBFloat16)
    run(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  else
    run(x.data_ptr<float>(), y.data_ptr<float>());
  return y.to(x_in.scalar_type());
}

torch::Tensor kquant_linear(const torch::Tensor& x_in, const torch::Tensor& w, int64_t type) {
  check(x_in, w, type);
  const int64_t rows = x_in.size(0), K = x_in.size(1), N = w.size(0) * kquants::LANES;
  return into_y(x_in, N, [&](const auto* x, auto* y) { kquants::dispatch(type, x, rows, K, w.data_ptr<uint8_t>(), y, N); });
}

torch::Tensor kquant_stack(const torch::Tensor& x_in, const std::vector<torch::Tensor>& ws,
                           const std::vector<int64_t>& types) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "kquant_stack: as many types as weights, one at least");
  bool alike = true;
  for (const int64_t type : types) alike &= kquants::row_step(type) == kquants::row_step(types[0]);
  if (x_in.dim() != 2 || x_in.size(0) > kquant_stack_rows() || !alike) {  // each part a product of its own
    std::vector<torch::Tensor> outs;
    for (size_t i = 0; i < ws.size(); ++i) outs.push_back(kquant_linear(x_in, ws[i], types[i]));
    return at::cat(outs, 1);
  }
  const int64_t rows = x_in.size(0), K = x_in.size(1);
  std::vector<kquants::Part> parts;
  int64_t N = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    check(x_in, ws[i], types[i]);
    parts.push_back(kquants::part_of(types[i], ws[i].data_ptr<uint8_t>(), ws[i].size(0) * kquants::LANES, N, K / kquants::GROUP));
    N += ws[i].size(0) * kquants::LANES;
  }
  return into_y(x_in, N, [&](const auto* x, auto* y) { kquants::stack_rows(x, rows, K, kquants::row_step(types[0]), parts, y, N); });
}

int64_t kquant_stack_rows() { return kquants::ROWS; }

torch::Tensor kquant_rows(const torch::Tensor& w, int64_t type, int64_t K, const torch::Tensor& ids_in) {
  const int64_t expected = kquants::panel_bytes(type, K / kquants::GROUP);
  TORCH_CHECK(expected > 0 && K % kquants::GROUP == 0, "kquant_rows: unknown type code ", type, " or K not a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) == expected,
              "kquant_rows: w must be [N / 16, ", expected, "] uint8 for this type and K");
  const torch::Tensor ids = ids_in.to(torch::kInt64).contiguous();
  const int64_t n = ids.numel(), N = w.size(0) * kquants::LANES, *p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(p[i] >= 0 && p[i] < N, "kquant_rows: id ", p[i], " out of [0, ", N, ")");
  auto out = torch::empty({n, K}, torch::kFloat32);
  const uint8_t* weights = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (type) {
    case kquants::Q4_K: kquants::feature_rows<kquants::Q4_K>(weights, K, p, n, o); break;
    case kquants::Q5_K: kquants::feature_rows<kquants::Q5_K>(weights, K, p, n, o); break;
    case kquants::Q6_K: kquants::feature_rows<kquants::Q6_K>(weights, K, p, n, o); break;
    case kquants::Q5_0: kquants::feature_rows<kquants::Q5_0>(weights, K, p, n, o); break;
    case kquants::Q5_1: kquants::feature_rows<kquants::Q5_1>(weights, K, p, n, o); break;
  }
  return out;
}

bool kquant_tiles(c10::optional<bool> enable, c10::optional<int64_t> rows) {
#ifdef STORYTELLER_KQUANTS_AMX
  auto& tiles = kquants::tiles();
  if (enable) tiles.enabled = *enable && kquants::Tiles::available();
  return tiles.enabled && (!rows || kquants::tiles_pay(*rows));
#else
  return false;
#endif
}

bool kquant_few_rows_fetch(c10::optional<bool> enable) {
  auto& on = kquants::few_rows_fetch().enabled;
  if (enable) on = *enable;
  return on;
}

bool kquant_columns(c10::optional<bool> enable, c10::optional<int64_t> rows) {
#ifdef STORYTELLER_KQUANTS_COLUMNS
  auto& on = kquants::columns_enabled();
  if (enable) on = *enable;
  return on && (!rows || kquants::columns_pay(*rows));
#else
  return false;
#endif
}

}  // namespace storyteller
#endif
