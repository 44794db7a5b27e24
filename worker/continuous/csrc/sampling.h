// Sampling a token per row from softmax(logits / temperature), for rows without top-k or top-p.
//
// The same draw as worker/sampling.py's torch path (one uniform number u per row from the row's
// own generator, then the first token whose cumulative probability passes u), without its
// [rows, vocab] temporaries: at 64 rows of SmolLM2's 49,152 logits, the division, softmax,
// cumulative sum and search took ~20 ms a step there, a third of the step. Here each row is two
// passes over its logits: the largest, then exp((l - max) / T) into a buffer with sums per block of
// 256; the draw finds its block from the block sums, then its token inside the block.
#pragma once

#include <torch/types.h>
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
    // A block a grammar masks whole (all -inf) is 0 without exp: the vectorised exp takes a slow
    // path for -inf lanes, and a constrained row is nearly all -inf (64 rows: 7 ms -> ~1 ms). The
    // same numbers: exp(-inf) is 0, and the sum of a block of zeros is 0.
    bool masked = true;
    for (int64_t i = begin; i < end && masked; ++i)
      masked = static_cast<float>(logits[i]) == -std::numeric_limits<float>::infinity();
    if (masked) {
      std::fill(buf.begin() + begin, buf.begin() + end, 0.f);
      block_sums[b] = 0.f;
      continue;
    }
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

// A grammar's masks, in place: -inf on each token its row's bitmask does not allow (llguidance's
// layout: token t is allowed where bit t % 32 of word t / 32 is set; tokens past the words are not).
// logits: [rows, vocab] float32 or bfloat16, contiguous; mask: [rows, words] int32. The same as
// llguidance.torch.apply_token_bitmask_inplace, without its torch.compile (seconds at a worker's
// first constrained step) or its [rows, vocab] temporaries.
static void mask_rows(torch::Tensor logits, const torch::Tensor& mask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && mask.dim() == 2 && mask.is_contiguous() &&
                  mask.scalar_type() == torch::kInt32 && mask.size(0) == logits.size(0),
              "mask_rows: contiguous logits [rows, vocab] and an int32 mask [rows, words]");
  const int64_t rows = logits.size(0), V = logits.size(1), words = mask.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, logits.scalar_type(), "mask_rows", [&] {
    scalar_t* l = logits.data_ptr<scalar_t>();
    const uint32_t* m = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
    const scalar_t masked = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = l + r * V;
        const uint32_t* bits = m + r * words;
        // Word by word: a grammar allows few tokens, so most words are 0 (32 tokens masked at once).
        for (int64_t w = 0; w * 32 < V; ++w) {
          const int64_t first = w * 32, last = std::min(V, first + 32);
          const uint32_t word = w < words ? bits[w] : 0u;
          if (word == 0xFFFFFFFFu) continue;
          if (word == 0u) {
            std::fill(row + first, row + last, masked);
            continue;
          }
          for (int64_t t = first; t < last; ++t)
            if (!((word >> (t - first)) & 1u)) row[t] = masked;
        }
      }
    });
  });
}

}  // namespace storyteller
