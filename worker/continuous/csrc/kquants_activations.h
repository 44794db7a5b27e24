// The K-quant kernels' activations: a step's rows of x rounded to 8 bits per group of 32, and
// what the kernels need of each group beside its bytes. Part of kquants.h, which includes it after
// the constants it reads (GROUP), as it includes kquants_avx2.h after the Group.
#pragma once
#ifdef STORYTELLER_KQUANTS

namespace storyteller {
namespace kquants {

// The step's rows of x rounded to 8 bits per group of 32, with what the kernel needs per group.
//
// For the K-quants (row_step) a group's step is its row's, max|x| / 127 over the whole row, halved
// e times (e <= SHIFTS): the smallest such step that holds the group's largest |x| within 127, so
// q = round(x 127 / max 2^e). The kernel then shifts a group's integer sums left by SHIFTS - e,
// where they all count in one unit, the row's step / 2^SHIFTS, and meets them with one float
// multiply-add a group (the weights' scale) instead of a multiply for the activations' scale beside
// it; the unit multiplies each output once, at the end. What it costs against a float step per
// group (bench.activation_grouping, docs/serving.md): +0.0005 of KL divergence on SmolLM2-135M's
// Q4_K_M, where llama.cpp's float step per 256 costs +0.0021. For Q5_0 and Q5_1 a group's step is
// its own, max|x| / 127 (dx), its shift 0 and the unit 1: the halved step there cost more than the
// bar allows (docs/serving.md).
// The AMX path (kquants_amx.h) meets a step TILE_ROWS rows at a time, and only a step of
// TILE_MIN_ROWS rows or more (tiles_pay); for those Activations pads the rows for it.
constexpr int64_t TILE_ROWS = 16;
constexpr int64_t TILE_MIN_ROWS = 2 * TILE_ROWS;

constexpr int SHIFTS = 13;  // the most halvings: a shifted sum stays under 2^31 (|sum| <= 32 x 31 x 127)

struct Activations {
  int64_t rows = 0, K = 0, G = 0;
  aligned_vector<int8_t> q;        // [rows, K]
  aligned_vector<int32_t> shift;   // [rows, G] SHIFTS - e
  aligned_vector<float> dx;        // [rows, G] a group's own step (Q5_0, Q5_1)
  aligned_vector<float> nsum;      // [rows, G] the minimum's factor in the unit: -(sum(q) << shift), or -dx sum(q)
  aligned_vector<int32_t> sums;    // [rows, 2 G] sum(q) over each half group (weights 0-15, 16-31)
  aligned_vector<float> unit;      // [rows] max|x| / 127 / 2^SHIFTS: what a shifted sum's 1 is worth

  // An output of row r as the kernel sums it (in the row's unit) as a product: the only rounding
  // after the sums.
  Floats in_units(int64_t r, Floats acc) const { return mul(acc, splatf(unit[r])); }

  template <typename T>
  void fill(const T* x, int64_t rows_, int64_t K_, bool row_step_) {
    rows = rows_, K = K_, G = K_ / GROUP, row_step = row_step_;
    q.resize(rows * K);
    // Rows up to a multiple of TILE_ROWS are kept, zero, where the AMX path may take the step. Only
    // those are cleared: the step's own rows are all written below, and a step of a few rows should
    // not clear 16 rows' worth a product (at one row that was 3.7 MB of stores a step of the 1.7B file).
    const int64_t padded = rows >= TILE_MIN_ROWS ? (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS : rows;
    shift.resize(padded * G);
    dx.resize(padded * G);
    nsum.resize(padded * G);
    sums.resize(padded * 2 * G);
    unit.resize(padded);
    std::fill(shift.begin() + rows * G, shift.end(), 0);
    std::fill(dx.begin() + rows * G, dx.end(), 0.f);
    std::fill(nsum.begin() + rows * G, nsum.end(), 0.f);
    std::fill(sums.begin() + rows * 2 * G, sums.end(), 0);
    std::fill(unit.begin() + rows, unit.end(), 0.f);
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row(x + r * K, r);
    });
  }

 private:
  // How many times (e) the row's step can be halved and still hold a group whose largest |x| is
  // `largest` (inv: 127 / the row's largest); the group is then rounded with inv 2^e (exact).
  static inline int halvings(float largest, float inv) {
    const float at_row_step = largest * inv;  // <= 127
    int e = 0;
    while (e < SHIFTS && at_row_step * static_cast<float>(2 << e) <= 127.f) ++e;
    return e;
  }
#ifdef __AVX512F__
  // The same for 16 groups at once (their largest |x| in `largest`): the count of k in 1..SHIFTS
  // with at_row_step 2^k <= 127, which is the loop's e, since the products grow with k. Exact.
  static inline __m512i halvings16(__m512 largest, float inv) {
    const __m512 at_row_step = _mm512_mul_ps(largest, _mm512_set1_ps(inv));
    __m512i e = _mm512_setzero_si512();
    for (int k = 1; k <= SHIFTS; ++k) {
      const __mmask16 holds = _mm512_cmp_ps_mask(_mm512_mul_ps(at_row_step, _mm512_set1_ps(static_cast<float>(1 << k))),
                                                 _mm512_set1_ps(127.f), _CMP_LE_OQ);
      e = _mm512_mask_add_epi32(e, holds, e, _mm512_set1_epi32(1));
    }
    return e;
  }
#endif

  bool row_step = true;

  // Row r of x rounded, in vectors: 16 values a vector on AVX-512, 8 on AVX2 (the kernels are built
  // for no other instruction set: lanes.h). Both round as bench.activation_grouping states it in
  // Python, which tests/test_kquants.py holds the products to, and write the same bytes.
  template <typename T>
  STORYTELLER_ROW void row(const T* x, int64_t r) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>,
                  "kquant_linear hands the kernels float32 or bfloat16");
#ifdef __AVX512F__
    row16(x, r);
#else
    row8(x, r);
#endif
  }

#ifdef __AVX512F__
  // 16 values a vector (rowwise.h): a group's maximum, one float32 multiply a value and rounding to
  // nearest, ties to even. With the row's step, 16 groups' maxima and halvings are made at once (a
  // group's own horizontal maximum and its loop of halvings took most of the rounding's time).
  template <typename T>
  STORYTELLER_ROW void row16(const T* x, int64_t r) {
    int8_t* out = q.data() + r * K;
    int32_t half0, half1;
    if (!row_step) {
      for (int64_t g = 0; g < G; ++g) {
        const float amax = round_group32(x + g * GROUP, out + g * GROUP, half0, half1);
        keep(r, g, 0, amax, half0, half1);
      }
      return keep_unit(r, 0.f);
    }
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + i)));
    const float row_max = _mm512_reduce_max_ps(top);
    const float inv = row_max > 0.f ? 127.f / row_max : 0.f;
    int64_t g = 0;
    for (; g + 16 <= G; g += 16) {
      alignas(64) int32_t e[16];
      alignas(64) float by[16];
      const __m512i halved = halvings16(group_maxima32x16(x + g * GROUP), inv);
      _mm512_store_si512(e, halved);
      _mm512_store_ps(by, _mm512_scalef_ps(_mm512_set1_ps(inv), _mm512_cvtepi32_ps(halved)));  // inv 2^e, exact
      for (int i = 0; i < 16; ++i) {
        round32(x + (g + i) * GROUP, by[i], out + (g + i) * GROUP, half0, half1);
        keep(r, g + i, e[i], 0.f, half0, half1);
      }
    }
    for (; g < G; ++g) {
      const int e = halvings(group_max32(x + g * GROUP), inv);
      round32(x + g * GROUP, inv * static_cast<float>(1 << e), out + g * GROUP, half0, half1);  // ldexp's, exact
      keep(r, g, e, 0.f, half0, half1);
    }
    keep_unit(r, row_max);
  }
#endif

#ifndef __AVX512F__
  // The same on AVX2, 8 values a vector: the same maxima (exact in any order), float32 multiply and
  // rounding (cvtps2dq, to nearest, ties to even, as std::nearbyint), the same bytes. The scalar
  // loop it replaced took 3.4 ns a value on one thread of a Zen 3, 0.44 ms of a 64-row product of K
  // 2048 (4.3x).
  static inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
  static inline __m256 load8(const c10::BFloat16* x) {  // a float's top half: exact
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static inline __m256 abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  static inline float max8(__m256 v) {
    const __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 m2 = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
  }
  static inline int32_t sum8(__m256i v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i s2 = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
  }
  template <typename T>
  STORYTELLER_ROW void row8(const T* x, int64_t r) {
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < K && row_step; i += 8) top = _mm256_max_ps(top, abs8(load8(x + i)));
    const float row_max = max8(top), inv = row_max > 0.f ? 127.f / row_max : 0.f;
    int8_t* out = q.data() + r * K;
    for (int64_t g = 0; g < G; ++g) {
      const T* v = x + g * GROUP;
      const __m256 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
      const float amax = max8(_mm256_max_ps(_mm256_max_ps(abs8(v0), abs8(v1)), _mm256_max_ps(abs8(v2), abs8(v3))));
      const int e = row_step ? halvings(amax, inv) : 0;
      const __m256 by = _mm256_set1_ps(row_step ? std::ldexp(inv, e) : amax > 0.f ? 127.f / amax : 0.f);
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, by)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, by));
      const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, by)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, by));
      // |q| <= 127: the packs saturate nothing; they interleave 128-bit halves, which the permute undoes.
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * GROUP),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      keep(r, g, e, amax, sum8(_mm256_add_epi32(q0, q1)), sum8(_mm256_add_epi32(q2, q3)));
    }
    keep_unit(r, row_max);
  }
#endif

  // What the kernel needs of row r's group g besides its bytes q (e: its halvings of the row's
  // step; amax: its largest |x|, where its step is its own).
  void keep(int64_t r, int64_t g, int e, float amax, int32_t half0, int32_t half1) {
    const int64_t at = r * G + g;
    if (row_step) {
      shift[at] = SHIFTS - e;
      nsum[at] = -static_cast<float>((half0 + half1) * (1 << (SHIFTS - e)));
    } else {
      shift[at] = 0;
      dx[at] = amax / 127.f;
      nsum[at] = -(dx[at] * static_cast<float>(half0 + half1));
    }
    sums[at * 2] = half0;
    sums[at * 2 + 1] = half1;
  }
  void keep_unit(int64_t r, float row_max) { unit[r] = row_step ? std::ldexp(row_max / 127.f, -SHIFTS) : 1.f; }
};

}  // namespace kquants
}  // namespace storyteller
#endif
