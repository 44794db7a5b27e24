// The step's one matrix product for dense weights (a local Hugging Face model), any number of rows,
// one row's bits the same whatever the step holds: panels.h's layout with float weights.
//
// oneDNN's and torch's products pick their blocking, and so their order of summation, by the
// shape: a row's sums change with the number of rows beside it. Here every output is summed over
// k in order, in one lane of one register, by the same instructions at any number of rows:
// float32 weights with a multiply-add per k (AVX-512F), bfloat16 ones with `vdpbf16ps`, two k at a
// time (AVX512_BF16: Zen 4, Sapphire Rapids and later). 16 output features to a panel, the rows of
// x broadcast, 8 rows per pass over a panel's weights. On AVX2 alone a panel is two registers of 8
// lanes, 4 rows a pass (16 registers), and bfloat16 is widened to float32 (exactly) and met with
// float32's multiply-adds, k then k + 1: its own bits, not vdpbf16ps's, and its own build key.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>

#include "rowwise.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define STORYTELLER_DENSE_PANELS 1
#include <immintrin.h>

#include <array>
#include <cstring>
#include <type_traits>
#include <utility>

namespace storyteller {
namespace dense_panels {

constexpr int64_t LANES = PANEL;  // rowwise.h
constexpr int64_t ROWS = PANEL_ROWS;

#if defined(__AVX512F__)

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

#else  // AVX2: a panel's 16 features as two registers of 8

#define STORYTELLER_DENSE_BF16 1
constexpr int PASS = 4;  // rows a pass: 8 accumulators, the weights of k (and k + 1), the broadcast x

// A bfloat16 is the top half of a float32: 8 lanes of pairs (k, k + 1) as the two floats each.
static inline void widen_pairs(const c10::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// Rows 0..R (R <= PASS) of x against weights [K][16] (float32) or [K / 2][16][2] (bfloat16): out [R][16].
template <int R, typename T>
static void pass(const T* x, int64_t K, const T* w, float* out) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = 0; k < K; ++k) {
      const __m256 w_lo = _mm256_loadu_ps(w + k * LANES), w_hi = _mm256_loadu_ps(w + k * LANES + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xk = _mm256_set1_ps(x[r * K + k]);
        lo[r] = _mm256_fmadd_ps(w_lo, xk, lo[r]);
        hi[r] = _mm256_fmadd_ps(w_hi, xk, hi[r]);
      }
    }
  } else {
    for (int64_t k = 0; k < K; k += 2) {
      __m256 lo_k, lo_k1, hi_k, hi_k1;
      widen_pairs(w + k * LANES, lo_k, lo_k1);
      widen_pairs(w + k * LANES + 16, hi_k, hi_k1);
      for (int r = 0; r < R; ++r) {
        const __m256 xk = _mm256_set1_ps(static_cast<float>(x[r * K + k]));
        const __m256 xk1 = _mm256_set1_ps(static_cast<float>(x[r * K + k + 1]));
        lo[r] = _mm256_fmadd_ps(lo_k1, xk1, _mm256_fmadd_ps(lo_k, xk, lo[r]));
        hi[r] = _mm256_fmadd_ps(hi_k1, xk1, _mm256_fmadd_ps(hi_k, xk, hi[r]));
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * LANES, lo[r]), _mm256_storeu_ps(out + r * LANES + 8, hi[r]);
}

// R rows (up to ROWS) as passes of PASS: each row meets the same code in any pass.
template <int R, typename T>
static void rows_avx2(const T* x, int64_t K, const T* w, float* out) {
  if constexpr (R > PASS) {
    pass<PASS>(x, K, w, out);
    rows_avx2<R - PASS>(x + PASS * K, K, w, out + PASS * LANES);
  } else {
    pass<R>(x, K, w, out);
  }
}
template <int R>
static void rows_f32(const float* x, int64_t K, const float* w, float* out) { rows_avx2<R>(x, K, w, out); }
template <int R>
static void rows_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, float* out) { rows_avx2<R>(x, K, w, out); }

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
// AVX512_BF16 or only AVX2), packed by worker/continuous/linear.py (pack_dense_panels). Returns [rows, N].
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
    TORCH_CHECK(false, "dense_panel_linear: float32, or bfloat16 on a CPU with AVX512_BF16 or without AVX-512");
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
