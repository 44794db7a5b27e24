// Decode attention straight from the paged KV cache, for the CPU.
//
// The torch version gathers every row's blocks into a contiguous copy, then runs two batched
// matmuls over it: the whole context is read from memory, written, and read again. At 64 rows
// that copy was the largest cost after the matrix products. Here each (row, KV head) reads its
// keys and values once, in place, through the block table, for the query heads that share them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

// A row of the cache as float32, in a loop the compiler vectorizes (bf16 is the top half of a float).
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

// DIM > 0 fixes the head size at compile time (the inner loops then unroll into a few vector
// instructions); DIM == 0 takes it at run time.
template <typename T, int64_t DIM>
static void decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lengths,
                   T* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t blocks,
                   int64_t block_size, int64_t dim_at_run_time, int64_t width, float scale) {
  const int64_t dim = DIM > 0 ? DIM : dim_at_run_time;
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), acc(group * dim), scores, buffer(dim);
    float* row_f = buffer.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kv = item % kv_heads, length = lengths[row];
      const T* q_row = q + (row * heads + kv * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) query[i] = static_cast<float>(q_row[i]) * scale;
      scores.assign(group * length, 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const int64_t block = tables[row * width + t / block_size];
        to_float(k + ((kv * blocks + block) * block_size + t % block_size) * dim, row_f, dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * row_f[d];
          scores[g * length + t] = s;
        }
      }
      std::vector<float> total(group);
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
      for (int64_t t = 0; t < length; ++t) {
        const int64_t block = tables[row * width + t / block_size];
        to_float(v + ((kv * blocks + block) * block_size + t % block_size) * dim, row_f, dim);
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * length + t];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += w * row_f[d];
        }
      }
      T* out_row = out + (row * heads + kv * group) * dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) out_row[g * dim + d] = static_cast<T>(acc[g * dim + d] / total[g]);
    }
  });
}

// q: [rows, heads, dim]; k_cache, v_cache: [kv_heads, blocks, block_size, dim];
// tables: [rows, width] int64 block ids; lengths: [rows] int64 tokens each row attends to.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lengths.is_contiguous(), "paged_decode: contiguous tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and the cache must share a dtype");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_decode", [&] {
    auto run = q.size(2) == 64 ? decode<scalar_t, 64> : q.size(2) == 128 ? decode<scalar_t, 128>
                                                                          : decode<scalar_t, 0>;
    run(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
        q.size(0), q.size(1), k_cache.size(0), k_cache.size(1), k_cache.size(2), q.size(2),
        tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU)");
}
