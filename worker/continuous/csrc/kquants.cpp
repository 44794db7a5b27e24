// The K-quant products' entry points (kquants_api.h says what each does), in a translation unit of
// their own beside kernels.cpp.
#include "kquants.h"
#include "kquants_api.h"

#ifdef STORYTELLER_KQUANTS
namespace storyteller {

// x_in and a packed weight checked against each other; x as the kernels read it (bf16 or float32).
static torch::Tensor checked(const torch::Tensor& x_in, const torch::Tensor& w, int64_t type) {
  const int64_t block = kquants::row_step(type) ? 256 : kquants::GROUP;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % block == 0,
              "kquant_linear: x [rows, K], K a multiple of 256 (Q5_0, Q5_1: of 32)");
  const int64_t K = x_in.size(1), expected = kquants::panel_bytes(type, K / kquants::GROUP);
  TORCH_CHECK(expected > 0, "kquant_linear: unknown type code ", type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) == expected,
              "kquant_linear: w must be [N / 16, ", expected, "] uint8 for this type and K");
  return x_in.scalar_type() == torch::kBFloat16 ? x_in.contiguous() : x_in.to(torch::kFloat32).contiguous();
}

torch::Tensor kquant_linear(const torch::Tensor& x_in, const torch::Tensor& w, int64_t type) {
  const torch::Tensor x = checked(x_in, w, type);
  const int64_t K = x.size(1);
  const int64_t rows = x.size(0), N = w.size(0) * kquants::LANES;
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y.to(x_in.scalar_type());
  if (x.scalar_type() == torch::kBFloat16)
    kquants::dispatch(type, x.data_ptr<c10::BFloat16>(), rows, K, w.data_ptr<uint8_t>(), y.data_ptr<c10::BFloat16>(), N);
  else
    kquants::dispatch(type, x.data_ptr<float>(), rows, K, w.data_ptr<uint8_t>(), y.data_ptr<float>(), N);
  return y.to(x_in.scalar_type());
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
  torch::Tensor x;
  std::vector<kquants::Part> parts;
  int64_t N = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    x = checked(x_in, ws[i], types[i]);
    parts.push_back(kquants::part_of(types[i], ws[i].data_ptr<uint8_t>(), ws[i].size(0) * kquants::LANES, N, x.size(1) / kquants::GROUP));
    N += ws[i].size(0) * kquants::LANES;
  }
  const int64_t rows = x.size(0), K = x.size(1);
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y.to(x_in.scalar_type());
  if (x.scalar_type() == torch::kBFloat16)
    kquants::stack_rows(x.data_ptr<c10::BFloat16>(), rows, K, kquants::row_step(types[0]), parts, y.data_ptr<c10::BFloat16>(), N);
  else
    kquants::stack_rows(x.data_ptr<float>(), rows, K, kquants::row_step(types[0]), parts, y.data_ptr<float>(), N);
  return y.to(x_in.scalar_type());
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
