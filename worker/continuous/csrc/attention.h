// Decode attention straight from the paged KV cache, for the CPU.
//
// torch's way gathers every row's blocks into a contiguous copy, then runs two batched matmuls
// over it: the whole context is read from memory, written, and read again. At 64 rows that copy
// was the largest cost after the matrix products. Here each (row, KV head) reads its keys and
// values once, in place, through the block table, for the query heads that share them.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>

#include "rowwise.h"
#include "attention_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <utility>
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
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)  // exact, as the scalar conversion is
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Calls f(T(), C()) with T the step's element type and C the cache's: the step's own, or float16 /
// bfloat16 beside float32. A float32 model (a CPU without bf16 arithmetic computes a quantized
// file's model in float32) then keeps its keys and values in half the bytes, as llama.cpp keeps
// them in float16: twice the tokens in a cache of the same size, half the bytes read a step.
template <typename F>
void with_cache_type(at::ScalarType x, at::ScalarType cache, const char* who, const F& f) {
  TORCH_CHECK(cache == x || (x == at::kFloat && (cache == at::kHalf || cache == at::kBFloat16)), who,
              ": the cache must have the step's dtype, or float16 / bfloat16 beside float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x, "with_cache_type", [&] {
    if (cache == x) return f(scalar_t(), scalar_t());
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (cache == at::kHalf) return f(scalar_t(), c10::Half());
      return f(scalar_t(), c10::BFloat16());
    }
  });
}

// A prompt's consecutive rows (one request, positions p, p + 1, ...) that share one pass over its
// blocks: each block's keys and values are turned to floats once for all of them, not once a row.
constexpr int64_t QUERY_TILE = 16;

// Scratch space of one thread, kept between calls (a step calls this once a layer).
struct DecodeBuffers {
  aligned_vector<float> query, acc, scores, total, block_f;
};

// The steps of one row's attention, each a function of its own (rowwise.h), so that a row computes
// the same whether it comes alone (a decode) or in a tile of a prompt's rows: scores of a block of
// keys for the row's query heads, the softmax over its `length` scores, the weighted values of a
// block added up. The blocks come in order, so every row's sums run in one order.
template <int64_t DIM>
STORYTELLER_ROW static void block_scores(const float* query, const float* keys, int64_t n, int64_t group,
                                         int64_t dim_at_run_time, float* scores, int64_t stride) {
  const int64_t dim = DIM > 0 ? DIM : dim_at_run_time;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = query + g * dim;
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = keys + t * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * kt[d];
      scores[g * stride + t] = s;
    }
  }
}

STORYTELLER_ROW static void softmax(float* scores, int64_t length, int64_t group, int64_t stride, float* total) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * stride;
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
}

template <int64_t DIM>
STORYTELLER_ROW static void block_values(const float* weights, const float* values, int64_t n, int64_t group,
                                         int64_t dim_at_run_time, float* acc, int64_t stride) {
  const int64_t dim = DIM > 0 ? DIM : dim_at_run_time;
  for (int64_t g = 0; g < group; ++g) {
    float* ag = acc + g * dim;
    const float* wg = weights + g * stride;
    for (int64_t t = 0; t < n; ++t) {
      const float w = wg[t];
      const float* vt = values + t * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += w * vt[d];
    }
  }
}

// A row's block of keys or values that holds position `start`: where the cache keeps it (an offset
// in elements, the same in the keys' and the values' caches), and its bytes in use.
template <typename T>
static inline std::pair<int64_t, int64_t> block_at(const int64_t* table, int64_t start, int64_t longest, int64_t kv,
                                                   int64_t blocks, int64_t block_size, int64_t dim) {
  return {(kv * blocks + table[start / block_size]) * block_size * dim,
          std::min(block_size, longest - start) * dim * static_cast<int64_t>(sizeof(T))};
}

// The blocks a row reads next are asked for ahead (_mm_prefetch): the next one toward L1, the one
// this far on toward L2, and a thread's next item's first ones toward L2 (NextBlocks). A row's blocks lie
// anywhere in the pool, where the hardware's prefetcher, which follows addresses in order, cannot
// guess them. (Until 2026-12-05 a helper asked for the next block, and GCC compiled its loop to
// nothing: no prefetch instruction in attend_tile's code, the cache read at 7-9 GB/s. Written where
// the loops run, these are kept, and read it at 15-21 GB/s: docs/serving.md, "The Zen 4 again".
// Check with objdump after moving them.)
constexpr int64_t BLOCKS_AHEAD = 8;

// A thread's next item's first blocks (keys and values), asked for toward L2 one as each block of
// this item is met. Asked for all at once when the item was claimed (32 KB at the 1.7B shape), they
// stalled the thread until the memory took them: on a Zen 4, 74% of the samples in decode's own code
// fell right after those prefetches. One at a time, this item's work goes on meanwhile (64-row steps
// 1.02-1.04x: docs/serving.md, "The Zen 4 again: where a 64-row step goes"). Only a hint: no bits change.
struct NextBlocks {
  const char *k = nullptr, *v = nullptr;  // the caches
  int64_t at[BLOCKS_AHEAD] = {}, bytes[BLOCKS_AHEAD] = {};  // each block's offset in the caches, its bytes
  int n = 0, fetched = 0;
  inline void fetch_one() {
    if (fetched == n) return;
    for (int64_t line = 0; line < bytes[fetched]; line += 64) {
      _mm_prefetch(k + at[fetched] + line, _MM_HINT_T1);
      _mm_prefetch(v + at[fetched] + line, _MM_HINT_T1);
    }
    ++fetched;
  }
};

// The first position a row attends to: with a sliding window of `window` positions (0: none) the
// row at position p = length - 1 sees p - window + 1 .. p, its own included.
static inline int64_t window_start(int64_t length, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, length - window) : 0;
}

// `rows` rows of one request at consecutive positions (lengths[0], lengths[0] + 1, ...) and one KV
// head: the query heads that share it, block by block through the request's table. A row's scores
// are kept from its own first position on (window_start), so that they start on a 64-byte line
// whatever the tile's other rows see; blocks wholly before the tile's first row's window are never
// read (a sliding-window layer may have freed them: their table entries mean nothing).
template <typename T, typename C, int64_t DIM>
static void attend_tile(const T* q, int64_t q_stride, const C* k, const C* v, const int64_t* table,
                        const int64_t* lengths, int64_t rows, T* out, int64_t out_stride, int64_t group,
                        int64_t kv, int64_t blocks, int64_t block_size, int64_t dim_at_run_time, float scale,
                        int64_t window, DecodeBuffers& buf, NextBlocks& next) {
  const int64_t dim = DIM > 0 ? DIM : dim_at_run_time, width = group * dim;
#ifdef STORYTELLER_ATTENTION_AVX512
  constexpr bool VECTOR = DIM > 0 && DIM % 32 == 0 && !std::is_same_v<C, double>;  // attention_avx512.h's steps
#else
  constexpr bool VECTOR = false;
#endif
  // A row's scores: group x stride floats, the stride a whole number of 64-byte lines, so that every
  // row's scores start on one (rowwise.h: where a buffer starts can change a vectorised sum).
  const int64_t longest = lengths[rows - 1];
  int64_t widest = 0;
  for (int64_t r = 0; r < rows; ++r) widest = std::max(widest, lengths[r] - window_start(lengths[r], window));
  const int64_t stride = (widest + 15) / 16 * 16;
  buf.query.resize(rows * width);
  buf.acc.assign(rows * width, 0.f);
  buf.total.resize(rows * group);
  buf.scores.resize(rows * group * stride);
  if constexpr (!VECTOR) buf.block_f.resize(block_size * dim);  // the vector steps read the cache itself
  for (int64_t r = 0; r < rows; ++r) {
    to_float(q + r * q_stride, buf.query.data() + r * width, width);
    for (int64_t i = 0; i < width; ++i) buf.query[r * width + i] *= scale;
  }
  // Each block of keys (then values), in order, once for every row of the tile (turned to floats
  // first, or read as it is by the vector steps); each row takes the part of it inside its window:
  // positions [from, from + n), `from` absolute. (Lengths grow along the tile, and so do the
  // windows' starts: the first row's starts first.)
  const int64_t first = window_start(lengths[0], window) / block_size * block_size;
  const auto blockwise = [&](const C* cache, const auto& each_row) {
    for (int64_t start = first; start < longest; start += block_size) {
      if (start + block_size < longest) {  // the next block, toward L1
        const auto [at, bytes] = block_at<C>(table, start + block_size, longest, kv, blocks, block_size, dim);
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(cache + at) + line, _MM_HINT_T0);
      }
      if (start + BLOCKS_AHEAD * block_size < longest) {  // and one further on, toward L2
        const auto [at, bytes] = block_at<C>(table, start + BLOCKS_AHEAD * block_size, longest, kv, blocks, block_size, dim);
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(cache + at) + line, _MM_HINT_T1);
      }
      next.fetch_one();
      const auto [at, bytes] = block_at<C>(table, start, longest, kv, blocks, block_size, dim);
      const auto block = [&] {  // the vector steps read the cache's own elements; the others, floats
        if constexpr (VECTOR) return cache + at;
        else return to_float(cache + at, buf.block_f.data(), bytes / static_cast<int64_t>(sizeof(C))), buf.block_f.data();
      }();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t from = std::max(start, window_start(lengths[r], window));
        const int64_t to = std::min(start + block_size, lengths[r]);
        if (from < to) each_row(r, block + (from % block_size) * dim, from, to - from);
      }
    }
  };
  const auto scores_of = [&](int64_t r) { return buf.scores.data() + r * group * stride; };
  blockwise(k, [&](int64_t r, const auto* keys, int64_t from, int64_t n) {
    float* scores = scores_of(r) + from - window_start(lengths[r], window);
#ifdef STORYTELLER_ATTENTION_AVX512
    if constexpr (VECTOR) attention_avx512::block_scores<C, DIM>(buf.query.data() + r * width, keys, n, group, scores, stride);
#endif
    if constexpr (!VECTOR) block_scores<DIM>(buf.query.data() + r * width, keys, n, group, dim, scores, stride);
  });
  for (int64_t r = 0; r < rows; ++r)
    softmax(scores_of(r), lengths[r] - window_start(lengths[r], window), group, stride, buf.total.data() + r * group);
  blockwise(v, [&](int64_t r, const auto* values, int64_t from, int64_t n) {
    const float* weights = scores_of(r) + from - window_start(lengths[r], window);
#ifdef STORYTELLER_ATTENTION_AVX512
    if constexpr (VECTOR) attention_avx512::block_values<C, DIM>(weights, values, n, group, buf.acc.data() + r * width, stride);
#endif
    if constexpr (!VECTOR) block_values<DIM>(weights, values, n, group, dim, buf.acc.data() + r * width, stride);
  });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.f / buf.total[r * group + g];
      for (int64_t d = 0; d < dim; ++d)
        out[r * out_stride + g * dim + d] = static_cast<T>(buf.acc[r * width + g * dim + d] * inv);
    }
}

// q: rows of `heads * dim`, `q_stride` elements apart (the queries may sit inside a fused QKV
// row); out: [rows, heads, dim]. The cache: [kv_heads, blocks, block_size, dim], of q's type or C. `window` > 0: each
// row attends to its last `window` positions only (a sliding-window layer), 0: to all of them.
// DIM > 0 fixes the head size at compile time (the inner loops then unroll into a few vector
// instructions); DIM == 0 takes it at run time.
template <typename T, typename C, int64_t DIM>
void decode(const T* q, int64_t q_stride, const C* k, const C* v, const int64_t* tables,
            const int64_t* lengths, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
            int64_t blocks, int64_t block_size, int64_t dim_at_run_time, int64_t width, float scale,
            int64_t window) {
  const int64_t dim = DIM > 0 ? DIM : dim_at_run_time;
  const int64_t group = heads / kv_heads;
  // Tiles: runs of rows with the same blocks at consecutive positions (a prompt chunk's), the rest alone.
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first row, rows)
  for (int64_t r = 0; r < rows;) {
    int64_t n = 1;
    while (r + n < rows && n < QUERY_TILE && lengths[r + n] == lengths[r] + n &&
           std::equal(tables + r * width, tables + (r + 1) * width, tables + (r + n) * width))
      ++n;
    tiles.emplace_back(r, n);
    r += n;
  }
  // Items taken one at a time by whichever thread is free (a prompt's tile costs many decodes):
  // which thread computes an item does not change its bits. Each thread claims its next item as it
  // starts one, and asks for that item's first keys and values meanwhile (toward L2, NextBlocks).
  const int64_t items = static_cast<int64_t>(tiles.size()) * kv_heads;
  take_turns(items, std::min<int64_t>(items, at::get_num_threads()), [&](int64_t item, int64_t following) {
    thread_local DecodeBuffers buf;
    NextBlocks next{reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v)};
    if (following >= 0) {
      const auto [next_row, next_n] = tiles[following / kv_heads];
      const int64_t longest = lengths[next_row + next_n - 1], next_kv = following % kv_heads;
      const int64_t first = window_start(lengths[next_row], window) / block_size * block_size;
      for (int64_t start = first; start < std::min(longest, first + BLOCKS_AHEAD * block_size); start += block_size) {
        const auto [at, bytes] = block_at<C>(tables + next_row * width, start, longest, next_kv, blocks, block_size, dim);
        next.at[next.n] = at * static_cast<int64_t>(sizeof(C)), next.bytes[next.n++] = bytes;
      }
    }
    const auto [row, n] = tiles[item / kv_heads];
    const int64_t kv = item % kv_heads;
    attend_tile<T, C, DIM>(q + row * q_stride + kv * group * dim, q_stride, k, v, tables + row * width, lengths + row,
                        n, out + (row * heads + kv * group) * dim, heads * dim, group, kv, blocks, block_size,
                        dim, scale, window, buf, next);
    while (next.fetched < next.n) next.fetch_one();  // an item of fewer blocks than the next one's first
  }, /*ahead=*/true);
}

// Picks the instance for the head size: 64 (SmolLM2) and 128 (most Llamas) unrolled.
template <typename T, typename C = T>
auto decode_for(int64_t dim) {
  return dim == 64 ? decode<T, C, 64> : dim == 128 ? decode<T, C, 128> : decode<T, C, 0>;
}

}  // namespace storyteller
