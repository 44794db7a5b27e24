// The step's one matrix product on AVX-512 VNNI CPUs: the file's Q4_1 and Q8_0 weights against
// the step's activations rounded to 8 bits, for every number of rows, one row's bits the same
// whatever the step holds (tests/test_invariance.py).
//
// int8.h lays a weight row's groups along a vector's lanes, so each row of x pays for a convert,
// two multiplies and a horizontal sum per 128 weights: cheap at a few rows, twice the dense bf16
// product's time at 64. Here the lanes hold 16 output features instead ("a panel"), the way GEMM
// micro-kernels lay out B: four bytes of x broadcast to all lanes meet four weights of each
// feature in one `vpdpbusd`, a group's 32 weights sum into int32 without leaving the register, and
// only then is the group scaled, once per (row, group, panel): 8 (Q4_1) or 8 (Q8_0) integer
// multiply-adds per 3-4 float operations, instead of 2 per 5.
//
//   y[r, n] = sum_g d[n, g] dx[r, g] (qw[n, g, :] . qx[r, g, :])  +  sum_g m[n, g] s[r, g]
// Q4_1 (weights 0..15): the unsigned side of vpdpbusd; s[r, g] = dx sum(qx), the sum of the group's
// rounded x, as llama.cpp's Q8_1 has it: then the whole product is the weights' against the rounded
// x, and its error sum w (x^ - x). With the exact sum of x the error was sum d q (x^ - x), the
// weights measured from their minimum rather than from zero: for Q4_1 of bell-shaped weights about
// 5 times the variance (the packaged SmolLM2's KL divergence from float32: 0.0156 -> see
// docs/serving.md, "K-quant kernels").
// Q8_0 (weights -128..127): stored as w + 128 (unsigned), so each group's integer sum starts at
// -128 times the sum of the row's rounded group (c[r, g]), an integer known once per step.
//
// Why one row's result cannot depend on the others: each y[r, n] is computed by one thread, group
// after group in order, with the same instructions whatever the number of rows beside it (the
// row tile only unrolls a loop over rows); the rounding of x is per row. No timing picks a path.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>

#include "rowwise.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define STORYTELLER_PANELS 1
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace storyteller {
namespace panels {

constexpr int64_t GROUP = 32;
constexpr int64_t LANES = PANEL;  // output features per panel: one int32 lane each (rowwise.h)
constexpr int64_t ROWS = PANEL_ROWS;  // rows of x per pass over a panel: two accumulators each, 16 registers

// One group of one panel, as weights.py packs it: the weights, then 16 float16 scales (Q4_1: and
// 16 float16 minimums). Q4_1: 4 x 64 bytes, byte b of lane f in block j holding weights 4j + b
// (low nibble) and 16 + 4j + b (high) of feature f's group; Q8_0: 8 x 64 bytes, weight 4j + b
// (+ 128). The same bytes per weight as the file (20 per Q4_1 group, 34 per Q8_0 group).
template <bool Nibbles>
struct Format {
  static constexpr int64_t blocks = Nibbles ? 4 : 8;  // 64-byte loads of weights per group
  static constexpr int64_t q_bytes = 64 * blocks;
  static constexpr int64_t bytes = q_bytes + (Nibbles ? 64 : 32);
};

// The step's rows of x rounded to 8 bits per group of 32, as llama.cpp rounds them:
// q = round(x * 127 / max|x|), dx = max|x| / 127.
struct Activations {
  int64_t rows = 0, K = 0, G = 0;
  std::vector<int8_t> q;   // [rows, K]
  std::vector<float> dx;   // [rows, G]
  std::vector<float> s;    // [rows, G] dx times the sum of the group's q (Q4_1's minimums)
  std::vector<int32_t> c;  // [rows, G] -128 times the sum of the group's q (Q8_0's + 128)

  template <typename T>
  void fill(const T* x, int64_t rows_, int64_t K_) {
    rows = rows_, K = K_, G = K_ / GROUP;
    q.resize(rows * K);
    dx.resize(rows * G);
    s.resize(rows * G);
    c.resize(rows * G);
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < G; ++g) group(x + r * K + g * GROUP, r * G + g, q.data() + r * K + g * GROUP);
    });
  }

 private:
  template <typename T>
  void group(const T* x, int64_t at, int8_t* out) {
    int32_t half0, half1;
    dx[at] = round_group32(x, out, half0, half1) / 127.f;  // rowwise.h
    const int32_t sum = half0 + half1;
    s[at] = dx[at] * static_cast<float>(sum);
    c[at] = -128 * sum;
  }
};

static inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// Rows r0..r0 + R of x against one panel (w: its G groups), into out [R, 16] floats.
template <bool Nibbles, int R>
static void panel_rows(const Activations& a, int64_t r0, const uint8_t* w, float* out) {
  using F = Format<Nibbles>;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g, w += F::bytes) {
    const int8_t* x = a.q.data() + r0 * a.K + g * GROUP;
    const int64_t at = r0 * a.G + g;
    __m512i isum[R];
    if (Nibbles) {
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(w + 64 * j);
        const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        for (int r = 0; r < R; ++r) {
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, broadcast4(x + r * a.K + 4 * j));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, broadcast4(x + r * a.K + 16 + 4 * j));
        }
      }
    } else {
      for (int r = 0; r < R; ++r) isum[r] = _mm512_set1_epi32(a.c[at + r * a.G]);
      for (int j = 0; j < 8; ++j) {
        const __m512i raw = _mm512_loadu_si512(w + 64 * j);
        for (int r = 0; r < R; ++r) isum[r] = _mm512_dpbusd_epi32(isum[r], raw, broadcast4(x + r * a.K + 4 * j));
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + F::q_bytes)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, _mm512_set1_ps(a.dx[at + r * a.G])), acc[r]);
    if (Nibbles) {
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + F::q_bytes + 32)));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[at + r * a.G]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * LANES, acc[r]);
}

template <bool Nibbles, size_t... R>
static constexpr auto row_tiles(std::index_sequence<R...>) {
  return std::array<void (*)(const Activations&, int64_t, const uint8_t*, float*), sizeof...(R)>{
      panel_rows<Nibbles, static_cast<int>(R) + 1>...};
}

template <bool Nibbles, typename T>
static void linear(const T* x, int64_t rows, int64_t K, const uint8_t* w, T* y, int64_t N) {
  thread_local Activations kept;  // the caller's thread quantizes; its buffers outlive the call
  Activations& a = kept;          // (named, so the threads below read the caller's, not their own)
  a.fill(x, rows, K);
  const int64_t panel_bytes = a.G * Format<Nibbles>::bytes;
  static constexpr auto by_rows = row_tiles<Nibbles>(std::make_index_sequence<ROWS>());
  over_panels(rows, K, N, y, [&](int64_t p, int64_t r0, int64_t n, float* out) {
    by_rows[n - 1](a, r0, w + p * panel_bytes, out);
  });
}

}  // namespace panels

// x: [rows, K] float32 or bfloat16; w: [N / 16, K / 32 * (320 Q4_1, 544 Q8_0)] uint8, packed by
// worker/continuous/weights.py (panel_packed). Returns [rows, N] in x's type.
static torch::Tensor panel_linear(const torch::Tensor& x_in, const torch::Tensor& w, bool nibbles) {
  const int64_t per_group = nibbles ? panels::Format<true>::bytes : panels::Format<false>::bytes;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
              x_in.dim() == 2 && x_in.size(1) % panels::GROUP == 0 &&
              w.size(1) == x_in.size(1) / panels::GROUP * per_group,
              "panel_linear: x [rows, K]; w [N / 16, K / 32 * (320 for Q4_1, 544 for Q8_0)] uint8");
  const torch::Tensor x = x_in.scalar_type() == torch::kBFloat16 ? x_in.contiguous() : x_in.to(torch::kFloat32).contiguous();
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0) * panels::LANES;
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y.to(x_in.scalar_type());
  const auto run = [&](auto* xs, auto* ys) {
    (nibbles ? panels::linear<true, std::remove_pointer_t<decltype(xs)>>
             : panels::linear<false, std::remove_pointer_t<decltype(xs)>>)(xs, rows, K, w.data_ptr<uint8_t>(), ys, N);
  };
  if (x.scalar_type() == torch::kBFloat16) run(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  else run(x.data_ptr<float>(), y.data_ptr<float>());
  return y.to(x_in.scalar_type());
}

}  // namespace storyteller
#endif
