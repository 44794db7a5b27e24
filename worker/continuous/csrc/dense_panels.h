// The step's one matrix product for dense weights (a local Hugging Face model), any number of rows,
// one row's bits the same whatever the step holds: panels.h's layout with float weights.
//
// oneDNN's and torch's products pick their blocking, and so their order of summation, by the
// shape: a row's sums change with the number of rows beside it. Here every output is summed over
// k in order, in one lane of one register, by the same instructions at any number of rows:
// float32 weights with a multiply-add per k (AVX-512F), bfloat16 ones with `vdpbf16ps`, two k at a
// time (AVX512_BF16: Zen 4, Sapphire Rapids and later). 16 output features to a panel, the rows of
// x broadcast, 8 rows per pass over a panel's weights.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "rowwise.h"

#if defined(__AVX512F__)
#define STORYTELLER_DENSE_PANELS 1
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

namespace storyteller {
namespace dense_panels {

constexpr int64_t LANES = PANEL;  // rowwise.h
constexpr int64_t ROWS = PANEL_ROWS;

// float32 x and weights [K][16] of one panel: out [R][16].
template <int R>
static void rows_f32(const float* x, int64_t K, const float* w, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wk = _mm512_loadu_ps(w + k * LANES);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wk, _mm512_set1_ps(x[r * K + k]), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * LANES, acc[r]);
}

#if defined(__AVX512BF16__)
#define STORYTELLER_DENSE_BF16 1
// bfloat16 x and weights [K / 2][16][2] of one panel (pairs of k per lane): out [R][16].
template <int R>
static void rows_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const __m512bh wk = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + k * LANES));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + k, sizeof(pair));
      acc[r] = _mm512_dpbf16_ps(acc[r], wk, reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * LANES, acc[r]);
}
#endif

template <typename T, size_t... R>
static constexpr auto row_tiles(std::index_sequence<R...>) {
  using F = void (*)(const T*, int64_t, const T*, float*);
  if constexpr (std::is_same_v<T, float>) {
    return std::array<F, sizeof...(R)>{rows_f32<static_cast<int>(R) + 1>...};
  } else {
#ifdef STORYTELLER_DENSE_BF16
    return std::array<F, sizeof...(R)>{rows_bf16<static_cast<int>(R) + 1>...};
#else
    return std::array<F, sizeof...(R)>{};
#endif
  }
}

template <typename T>
static void linear(const T* x, int64_t rows, int64_t K, const T* w, T* y, int64_t N) {
  static constexpr auto by_rows = row_tiles<T>(std::make_index_sequence<ROWS>());
  over_panels(rows, K, N, y, [&](int64_t p, int64_t r0, int64_t n, float* out) {
    by_rows[n - 1](x + r0 * K, K, w + p * K * LANES, out);
  });
}

}  // namespace dense_panels

// x: [rows, K]; w: [N / 16, K * 16] of x's type (float32, or bfloat16 where the CPU has
// AVX512_BF16), packed by worker/continuous/linear.py (pack_dense_panels). Returns [rows, N].
static torch::Tensor dense_panel_linear(const torch::Tensor& x_in, const torch::Tensor& w) {
  const torch::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == x.scalar_type() &&
              w.size(1) == x.size(1) * dense_panels::LANES,
              "dense_panel_linear: x [rows, K]; w [N / 16, K * 16] of x's dtype");
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0) * dense_panels::LANES;
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y;
  if (x.scalar_type() == torch::kFloat32) {
    dense_panels::linear(x.data_ptr<float>(), rows, K, w.data_ptr<float>(), y.data_ptr<float>(), N);
#ifdef STORYTELLER_DENSE_BF16
  } else if (x.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(K % 2 == 0, "dense_panel_linear: bfloat16 takes an even K");
    dense_panels::linear(x.data_ptr<c10::BFloat16>(), rows, K, w.data_ptr<c10::BFloat16>(),
                         y.data_ptr<c10::BFloat16>(), N);
#endif
  } else {
    TORCH_CHECK(false, "dense_panel_linear: float32, or bfloat16 on a CPU with AVX512_BF16");
  }
  return y;
}

// The dtypes dense_panel_linear takes on this CPU.
static std::vector<std::string> dense_panel_dtypes() {
#ifdef STORYTELLER_DENSE_BF16
  return {"float32", "bfloat16"};
#else
  return {"float32"};
#endif
}

}  // namespace storyteller
#endif
