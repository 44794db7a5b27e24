// Sampling a token per row from softmax(logits / temperature), for rows without top-k or top-p.
//
// The same draw as worker/sampling.py's torch path (one uniform number u per row from the row's
// own generator, then the first token whose cumulative probability passes u), without its
// [rows, vocab] temporaries: at 64 rows of SmolLM2's 49,152 logits, the division, softmax,
// cumulative sum and search took ~20 ms a step there, a third of the step. Here each row is two
// passes over its logits: the largest, then exp((l - max) / T) into a buffer with sums per block of
// 256; the draw finds its block from the block sums, then its token inside the block.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "rowwise.h"

namespace storyteller {

constexpr int64_t SAMPLE_BLOCK = 256;

template <typename T>
STORYTELLER_ROW static int64_t sample_row(const T* logits, int64_t V, float temperature, float u, aligned_vector<float>& buf,
                          aligned_vector<float>& block_sums) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) top = std::max(top, static_cast<float>(logits[i]));
  const float inv = 1.f / temperature;
  const int64_t blocks = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  buf.resize(V);
  block_sums.resize(blocks);
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * SAMPLE_BLOCK, end = std::min(V, begin + SAMPLE_BLOCK);
    float sum = 0.f;
    for (int64_t i = begin; i < end; ++i) {
      buf[i] = std::exp((static_cast<float>(logits[i]) - top) * inv);
      sum += buf[i];
    }
    block_sums[b] = sum;
    total += sum;
  }
  const float target = u * total;
  float seen = 0.f;
  int64_t last = 0;  // the last token with any probability: where rounding leaves the draw past the end
  for (int64_t b = 0; b < blocks; ++b) {
    if (block_sums[b] <= 0.f) continue;
    const int64_t begin = b * SAMPLE_BLOCK, end = std::min(V, begin + SAMPLE_BLOCK);
    if (seen + block_sums[b] > target) {
      for (int64_t i = begin; i < end; ++i) {
        seen += buf[i];
        if (buf[i] > 0.f) last = i;
        if (seen > target) return i;
      }
      return last;
    }
    seen += block_sums[b];
    for (int64_t i = end - 1; i >= begin; --i)
      if (buf[i] > 0.f) { last = i; break; }
  }
  return last;
}

// logits: [rows, vocab] float32 or bfloat16; temperature, uniform: [rows] float32 (temperature > 0,
// uniform in [0, 1)). Returns [rows] int64 token ids.
static torch::Tensor sample_rows(const torch::Tensor& logits_in, const torch::Tensor& temperature,
                                 const torch::Tensor& uniform) {
  const torch::Tensor logits = logits_in.scalar_type() == torch::kBFloat16 ? logits_in.contiguous()
                                                                            : logits_in.to(torch::kFloat32).contiguous();
  const torch::Tensor temp = temperature.to(torch::kFloat32).contiguous(), u = uniform.to(torch::kFloat32).contiguous();
  TORCH_CHECK(logits.dim() == 2 && temp.numel() == logits.size(0) && u.numel() == logits.size(0),
              "sample_rows: logits [rows, vocab], temperature and uniform [rows]");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto out = torch::empty({rows}, torch::kInt64);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, logits.scalar_type(), "sample_rows", [&] {
    const scalar_t* l = logits.data_ptr<scalar_t>();
    int64_t* picks = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      aligned_vector<float> buf, block_sums;
      for (int64_t r = begin; r < end; ++r)
        picks[r] = sample_row(l + r * V, V, temp.data_ptr<float>()[r], u.data_ptr<float>()[r], buf, block_sums);
    });
  });
  return out;
}

}  // namespace storyteller
