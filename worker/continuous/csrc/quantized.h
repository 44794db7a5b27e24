// Matrix products with the GGUF's own quantized weights, for steps of a few rows.
//
// A step of one or a few tokens is bound by how fast the weights stream from memory, so fewer
// bytes per weight is the whole game. torch's int4 CPU kernel does this well with AVX-512, but
// measured here on an AVX2-only CPU it took 12 ms for a product that float32 does in 0.2 ms. This
// kernel reads Q4_1's weights (0..15) as the file packs them, two to a byte (the low nibbles of a
// group's 16 bytes are its weights 0-15, the high nibbles 16-31), and Q8_0's (-128..127) a byte
// each, with a float scale and minimum per 32 weights, w = d * q + m, and turns each group into
// floats once for every row of the step:
//   y[r, n] = sum_g d[n, g] * (q[n, g, :] . x[r, g, :])  +  sum_g m[n, g] * sum(x[r, g, :])
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <vector>

namespace storyteller {

constexpr int64_t QGROUP = 32;
constexpr int64_t QROWS = 8;  // rows of x done together: each group's floats serve them all

#ifdef __AVX2__
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

static inline __m256 eight_floats(__m128i bytes, bool is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// A group's 32 weights as four vectors of eight floats.
template <int Kind>
static inline void group_floats(const uint8_t* q, __m256* w) {
  if (Kind == 2) {  // Q4_1, 16 bytes of nibbles
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    w[0] = eight_floats(low, false);
    w[1] = eight_floats(_mm_srli_si128(low, 8), false);
    w[2] = eight_floats(high, false);
    w[3] = eight_floats(_mm_srli_si128(high, 8), false);
  } else {  // a byte per weight: 1 signed (Q8_0), 0 unsigned
    for (int j = 0; j < 4; ++j)
      w[j] = eight_floats(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j)), Kind == 1);
  }
}
#endif

// Weight j of a group, in the scalar fallback.
template <int Kind>
static inline float weight_at(const uint8_t* q, int64_t j) {
  if (Kind == 2) return static_cast<float>(j < 16 ? q[j] & 0x0F : q[j - 16] >> 4);
  return Kind == 1 ? static_cast<float>(static_cast<int8_t>(q[j])) : static_cast<float>(q[j]);
}

// x: [rows, K] float32 (rows <= QROWS); q: [N, K * bytes per weight]; d, m: [N, K / 32] (m may
// be null); xsum: [rows, K / 32] each group's sum of x (used with m); y: [rows, N].
// Kind: 0 unsigned bytes, 1 signed bytes (Q8_0), 2 nibbles (Q4_1).
template <int Kind>
static void qgemm_block(const float* x, int64_t rows, int64_t K, const uint8_t* q, const float* d,
                        const float* m, const float* xsum, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / QGROUP, group_bytes = Kind == 2 ? QGROUP / 2 : QGROUP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * groups * group_bytes;
    const float* dn = d + n * groups;
    float out[QROWS];
#ifdef __AVX2__
    __m256 acc[QROWS];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 w[4];
      group_floats<Kind>(qn + g * group_bytes, w);
      const __m256 scale = _mm256_set1_ps(dn[g]);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xg = x + r * K + g * QGROUP;
        __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
        p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), p);
        p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), p);
        p = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), p);
        acc[r] = _mm256_fmadd_ps(p, scale, acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) out[r] = hsum(acc[r]);
#else
    for (int64_t r = 0; r < rows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t i = 0; i < QGROUP; ++i)
          s += weight_at<Kind>(qn + g * group_bytes, i) * x[r * K + g * QGROUP + i];
        total += s * dn[g];
      }
      out[r] = total;
    }
#endif
    if (m) {
      const float* mn = m + n * groups;
      for (int64_t r = 0; r < rows; ++r) {
        float s = 0.f;
        for (int64_t g = 0; g < groups; ++g) s += mn[g] * xsum[r * groups + g];
        out[r] += s;
      }
    }
    for (int64_t r = 0; r < rows; ++r) y[r * N + n] = out[r];
  }
}

// x: [rows, K] of any float type; q: [N, K] uint8 (a byte per weight), [N, K / 2] uint8 (Q4_1's
// nibbles) or [N, K] int8 (Q8_0); d, m: [N, K / 32] float32, m undefined for Q8_0.
// Returns [rows, N] in x's type.
static torch::Tensor quantized_linear(const torch::Tensor& x_in, const torch::Tensor& q,
                                      const torch::Tensor& d, const c10::optional<torch::Tensor>& m) {
  const bool nibbles = q.scalar_type() == torch::kUInt8 && q.size(1) * 2 == x_in.size(-1);
  TORCH_CHECK(q.dim() == 2 && (nibbles || x_in.size(-1) == q.size(1)) && x_in.size(-1) % QGROUP == 0,
              "quantized_linear: x [rows, K] and q [N, K] or [N, K / 2], K a multiple of 32");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const int64_t rows = x.size(0), K = x.size(1), N = q.size(0), groups = K / QGROUP;
  auto y = torch::empty({rows, N}, x.options());
  std::vector<float> xsum(rows * groups, 0.f);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < rows * groups; ++i)
    for (int64_t j = 0; j < QGROUP; ++j) xsum[i] += xp[i * QGROUP + j];
  const auto run = nibbles ? qgemm_block<2> : q.scalar_type() == torch::kInt8 ? qgemm_block<1> : qgemm_block<0>;
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* mp = m ? m->data_ptr<float>() : nullptr;
  // Each thread takes whole output features, so every weight is read from memory once a step.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < rows; r0 += QROWS) {
      const int64_t r = std::min(QROWS, rows - r0);
      run(xp + r0 * K, r, K, qp, d.data_ptr<float>(), mp, xsum.data() + r0 * groups,
          y.data_ptr<float>() + r0 * N, N, n0, n1);
    }
  });
  return y.to(x_in.scalar_type());
}

}  // namespace storyteller
