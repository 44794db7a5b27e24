// What the rest of the kernels call of the K-quant products (kquants.h), built in a translation
// unit of their own, kquants.cpp: the compiler takes it and kernels.cpp on two cores at once (a
// build of the kernels on a 2-core Zen 4: 46-54 s as one unit, 37-46 s as these two).
// Only kquants.cpp includes kquants.h, so its switches (tiles(), few_rows_fetch(), columns_enabled())
// are one each in the library.
#pragma once

#include <torch/types.h>

#include <vector>

#include "lanes.h"  // STORYTELLER_KQUANTS: whether this CPU's build has them

#ifdef STORYTELLER_KQUANTS
namespace storyteller {

// x: [rows, K] float32 or bfloat16; w: [N / 16, panel bytes] uint8 packed by kquants.py for `type`
// (kquants::Type). Returns [rows, N] in x's type.
torch::Tensor kquant_linear(const torch::Tensor& x_in, const torch::Tensor& w, int64_t type);

// A stack's parts side by side: [rows, sum of N] = x times each ws[i] (packed for types[i]), as
// kquant_linear makes each part's outputs. A step of a few rows runs every part in one parallel region.
torch::Tensor kquant_stack(const torch::Tensor& x_in, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types);
// The most rows of a step kquant_stack runs in one parallel region (more: a product a part).
int64_t kquant_stack_rows();

// Rows `ids` of the weight w ([N / 16, panel bytes], packed for `type`, K inputs) as float32
// [len(ids), K]: a tied head's panels looked up as the embedding table.
torch::Tensor kquant_rows(const torch::Tensor& w, int64_t type, int64_t K, const torch::Tensor& ids_in);

// Whether a K-quant step of many rows takes the AMX tiles (kquants_amx.h), after turning them on
// or off if `enable` is given (on only where this CPU and process have them); given `rows`, whether
// a step of that many rows takes them now. The bits are the same either way: the switch is for
// tests and A/B benchmarks.
bool kquant_tiles(c10::optional<bool> enable, c10::optional<int64_t> rows);

// Whether a K-quant pass of 1-4 rows asks for its weights further ahead (FewRowsFetch), after
// turning it on or off if `enable` is given. Prefetches only, the same bits: for tests and A/Bs.
bool kquant_few_rows_fetch(c10::optional<bool> enable);

// Whether a K-quant step of many rows takes the AVX2 kernel of 8 rows a vector (kquants_avx2.h),
// after turning it on or off if `enable` is given; given `rows`, whether a step of that many rows
// takes it now. Same bits either way: the switch is for tests and A/B benchmarks.
bool kquant_columns(c10::optional<bool> enable, c10::optional<int64_t> rows);

}  // namespace storyteller
#endif
