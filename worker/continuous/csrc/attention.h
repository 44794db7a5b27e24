// Decode attention straight from the paged KV cache, for the CPU.
//
// torch's way gathers every row's blocks into a contiguous copy, then runs two batched matmuls
// over it: the whole context is read from memory, written, and read again. At 64 rows that copy
// was the largest cost after the matrix products. Here each (row, KV head) reads its keys and
// values once, in place, through the block table, for the query heads that share them.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "rowwise.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace storyteller {

// Elements as float32, in loops the compiler vectorizes (bf16 is the top half of a float).
static inline void to_float(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
static inline void to_float(const double* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
static inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}
static inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Scratch space of one thread, kept between calls (a step calls this once a layer).
struct DecodeBuffers {
  aligned_vector<float> query, acc, scores, total, block_f;
};

// One (row, KV head): the query heads that share the KV head, over the row's `length` tokens,
// block by block in order (the same sums whatever else the step holds: rowwise.h).
template <typename T, int64_t DIM>
STORYTELLER_ROW static void decode_item(const T* q_row, const T* k, const T* v, const int64_t* table,
                                        int64_t length, T* out_row, int64_t group, int64_t kv, int64_t blocks,
                                        int64_t block_size, int64_t dim_at_run_time, float scale,
                                        DecodeBuffers& buf) {
  const int64_t dim = DIM > 0 ? DIM : dim_at_run_time;
  auto &query = buf.query, &acc = buf.acc, &scores = buf.scores, &total = buf.total, &block_f = buf.block_f;
  query.resize(group * dim);
  acc.resize(group * dim);
  total.resize(group);
  block_f.resize(block_size * dim);
  to_float(q_row, query.data(), group * dim);
  for (int64_t i = 0; i < group * dim; ++i) query[i] *= scale;
  scores.resize(group * length);
  // Scores, a block at a time: one conversion of the block's keys serves every query head.
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t n = std::min(block_size, length - start);
    const int64_t block = table[start / block_size];
    to_float(k + (kv * blocks + block) * block_size * dim, block_f.data(), n * dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query.data() + g * dim;
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = block_f.data() + t * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qg[d] * kt[d];
        scores[g * length + start + t] = s;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * length;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < length; ++t) top = std::max(top, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < length; ++t) {
      sg[t] = std::exp(sg[t] - top);
      sum += sg[t];
    }
    total[g] = sum;
  }
  std::fill(acc.begin(), acc.end(), 0.f);
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t n = std::min(block_size, length - start);
    const int64_t block = table[start / block_size];
    to_float(v + (kv * blocks + block) * block_size * dim, block_f.data(), n * dim);
    for (int64_t g = 0; g < group; ++g) {
      float* ag = acc.data() + g * dim;
      const float* sg = scores.data() + g * length + start;
      for (int64_t t = 0; t < n; ++t) {
        const float w = sg[t];
        const float* vt = block_f.data() + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] += w * vt[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / total[g];
    for (int64_t d = 0; d < dim; ++d) out_row[g * dim + d] = static_cast<T>(acc[g * dim + d] * inv);
  }
}

// q: rows of `heads * dim`, `q_stride` elements apart (the queries may sit inside a fused QKV
// row); out: [rows, heads, dim]. The cache: [kv_heads, blocks, block_size, dim].
// DIM > 0 fixes the head size at compile time (the inner loops then unroll into a few vector
// instructions); DIM == 0 takes it at run time.
template <typename T, int64_t DIM>
void decode(const T* q, int64_t q_stride, const T* k, const T* v, const int64_t* tables,
            const int64_t* lengths, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
            int64_t blocks, int64_t block_size, int64_t dim_at_run_time, int64_t width, float scale) {
  const int64_t dim = DIM > 0 ? DIM : dim_at_run_time;
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local DecodeBuffers buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kv = item % kv_heads;
      decode_item<T, DIM>(q + row * q_stride + kv * group * dim, k, v, tables + row * width, lengths[row],
                          out + (row * heads + kv * group) * dim, group, kv, blocks, block_size, dim, scale, buf);
    }
  });
}

// Picks the instance for the head size: 64 (SmolLM2) and 128 (most Llamas) unrolled.
template <typename T>
auto decode_for(int64_t dim) {
  return dim == 64 ? decode<T, 64> : dim == 128 ? decode<T, 128> : decode<T, 0>;
}

}  // namespace storyteller
