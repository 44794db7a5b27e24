// A row's attention steps (attention.h) written for AVX-512, for head sizes that are a multiple of
// 32: keys and values read straight from the cache in its own element type, converted in
// registers, and a block's scores made 16 positions at a time. (Other head sizes, and the AVX2
// build, keep attention.h's portable steps.)
//
// Why: the portable steps turn each block into floats in a buffer first, then score one position
// at a time, each a dot product ending in a horizontal sum. At the 1.7B shape (32 KV heads of 64,
// one query head each) that buffer's stores were most of attention's time even with the cache hot,
// and attention a fifth of a 64-row step (docs/serving.md, "Attention in registers").
//
// The numbers, one path for every row whatever shares its step or tile: a score is the sum over
// the head's vectors of 16 elements, in order, of fma(q, k) into 16 lanes (element d in lane
// d % 16), then those lanes added in one fixed tree (lane i with i + 8, then i + 4, i + 2, i + 1):
// the same operations for every position, whichever of the 16 slots it took. Values are added
// position after position, in order, into 16-lane accumulators. Every cache type is widened to
// float exactly, so a float16 or bfloat16 cache gives the bits of a float32 one holding its values.
#pragma once

#if defined(__AVX512F__)
#define STORYTELLER_ATTENTION_AVX512 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "rowwise.h"

namespace storyteller {
namespace attention_avx512 {

// 32 elements at p as two vectors of 16 floats (rowwise.h's exact conversions).
template <typename C>
static inline void load32(const C* p, __m512& a, __m512& b) {
  a = load16(p), b = load16(p + 16);
}

// 16 vectors' lanes each added up, vector i's sum into lane 4 (i % 4) + i / 4 (rowwise.h's tree).
static inline __m512 sum_lanes(const __m512 (&a)[16]) {
  return reduce_lanes(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

// Scores of n positions of keys (`keys`: position t's DIM elements at t * DIM) for `group` query
// heads (`query`: DIM floats a head, scaled), into scores[g * stride + t].
template <typename C, int64_t DIM>
STORYTELLER_ROW static void block_scores(const float* query, const C* keys, int64_t n, int64_t group, float* scores,
                                         int64_t stride) {
  constexpr int CHUNKS = DIM / 32;
  for (int64_t g = 0; g < group; ++g) {
    __m512 q[2 * CHUNKS];
    for (int c = 0; c < 2 * CHUNKS; ++c) q[c] = _mm512_loadu_ps(query + g * DIM + 16 * c);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - t0);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const int64_t t = 4 * (i % 4) + i / 4;  // the position whose sum lands in lane t
        acc[i] = _mm512_setzero_ps();
        if (t >= m) continue;
        const C* k = keys + (t0 + t) * DIM;
        __m512 lo, hi;
        load32(k, lo, hi);
        acc[i] = _mm512_fmadd_ps(q[1], hi, _mm512_mul_ps(q[0], lo));
        for (int c = 1; c < CHUNKS; ++c) {
          load32(k + 32 * c, lo, hi);
          acc[i] = _mm512_fmadd_ps(q[2 * c + 1], hi, _mm512_fmadd_ps(q[2 * c], lo, acc[i]));
        }
      }
      _mm512_mask_storeu_ps(scores + g * stride + t0, static_cast<__mmask16>((1u << m) - 1), sum_lanes(acc));
    }
  }
}

// The weighted values of n positions (`values` as keys above) added to acc (DIM floats a head),
// position after position; weights[g * stride + t].
template <typename C, int64_t DIM>
STORYTELLER_ROW static void block_values(const float* weights, const C* values, int64_t n, int64_t group, float* acc,
                                         int64_t stride) {
  constexpr int CHUNKS = DIM / 32;
  for (int64_t g = 0; g < group; ++g) {
    __m512 a[2 * CHUNKS];
    for (int c = 0; c < 2 * CHUNKS; ++c) a[c] = _mm512_loadu_ps(acc + g * DIM + 16 * c);
    const float* w = weights + g * stride;
    for (int64_t t = 0; t < n; ++t) {
      const __m512 wt = _mm512_set1_ps(w[t]);
      for (int c = 0; c < CHUNKS; ++c) {
        __m512 lo, hi;
        load32(values + t * DIM + 32 * c, lo, hi);
        a[2 * c] = _mm512_fmadd_ps(wt, lo, a[2 * c]);
        a[2 * c + 1] = _mm512_fmadd_ps(wt, hi, a[2 * c + 1]);
      }
    }
    for (int c = 0; c < 2 * CHUNKS; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * c, a[c]);
  }
}

}  // namespace attention_avx512
}  // namespace storyteller
#endif
