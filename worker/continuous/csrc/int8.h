// Quantized products in integers, as llama.cpp does with the same blocks: with AVX-512 VNNI
// (Intel since Cascade Lake, AMD since Zen 4) or, slower, with AVX2 alone.
//
// quantized.h turns each group of weights into floats; here the step's activations are rounded to
// 8 bits instead, per group of 32 with a scale of their own (dx = max|x| / 127), once per step, and
// the integer products of a group are summed into int32 lanes of four bytes each: `vpdpbusd` does
// 64 bytes in one instruction; AVX2 multiplies bytes into pairs of int16 (`vpmaddubsw`) and sums
// those into int32 (`vpmaddwd`). A group's integer sum is then scaled by d * dx, in float:
//   y[r, n] = sum_g d[n, g] dx[r, g] (qw[n, g, :] . qx[r, g, :])  +  sum_g m[n, g] s[r, g]
// Q4_1 (weights 0..15, unsigned): s[r, g] = dx sum(qx), the sum of the group's rounded x (as
// llama.cpp's Q8_1 and panels.h: the product is then exactly the weights' against the rounded x).
// Q8_0 (weights -128..127, signed; no m): both instructions want one unsigned side, so the
// activations are stored as qx + 128. VNNI starts each int32 lane at -128 times the sum of its four
// weights; AVX2 takes qx back and moves the weights' signs onto it (|w| * sign(w) qx: no int16 pair
// can overflow, as 255 * 128 * 2 would).
// The rounding of x is the one difference from the float kernel: about 0.4% of each group's
// largest activation, as in llama.cpp.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>

#include "rowwise.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define STORYTELLER_INT8 1
#define STORYTELLER_INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STORYTELLER_INT8 1
#endif

#ifdef STORYTELLER_INT8
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace storyteller {
namespace int8 {

constexpr int64_t GROUP = 32;
#ifdef STORYTELLER_INT8_VNNI
constexpr int64_t ROWS = 8;       // rows of x against each loaded chunk of weights: an accumulator each
using Vec = __m512;               // 16 int32 lanes: a whole chunk
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int64_t ROWS = 4;       // AVX2 has 16 registers: 4 accumulators and a chunk's weights
using Vec = __m256;               // 8 int32 lanes: half a chunk
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline float vsum(Vec v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#endif
constexpr int64_t TILE = 16;      // output features a thread takes against every row before the next
constexpr int64_t PREFETCH = 4;   // features ahead whose weights are asked for while one is done

// A chunk is what one 64-byte load of weights holds: 4 groups of Q4_1 nibbles, 2 groups of Q8_0.
// The activations of a row are laid out chunk by chunk to match, with each group's scale and
// "s" repeated over the group's int32 lanes (4 lanes a group for Q4_1, 8 for Q8_0).
template <bool Nibbles>
struct Layout {
  static constexpr int64_t groups = Nibbles ? 4 : 2;        // groups per chunk
  static constexpr int64_t lanes = 16 / groups;              // int32 lanes per group
  static constexpr int64_t x_bytes = Nibbles ? 128 : 64;     // activation bytes per chunk (Q4_1: lows then highs)
  static constexpr int64_t w_bytes = Nibbles ? 16 : 32;      // weight bytes per group
};

// Rows of x, rounded to 8 bits in chunk layout: qx [chunks, rows, x_bytes], dx and s [chunks, rows,
// 16] (s is read for Q4_1 only).
template <bool Nibbles>
struct Activations {
  int64_t rows, chunks;
  std::vector<int8_t> qx;
  std::vector<float> dx, s;

  template <typename T>
  Activations(const T* x, int64_t rows_, int64_t K) : rows(rows_) {
    using L = Layout<Nibbles>;
    const int64_t G = K / GROUP;
    chunks = (G + L::groups - 1) / L::groups;
    qx.assign(rows * chunks * L::x_bytes, 0);
    dx.assign(rows * chunks * 16, 0.f);
    if (Nibbles) s.assign(rows * chunks * 16, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        float xg[GROUP], amax = 0.f;
        int32_t sum = 0;  // of the rounded values
        for (int64_t i = 0; i < GROUP; ++i) {
          xg[i] = static_cast<float>(x[r * K + g * GROUP + i]);
          amax = std::max(amax, std::fabs(xg[i]));
        }
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const int64_t c = g / L::groups, in_chunk = g % L::groups;
        int8_t* q = qx.data() + (c * rows + r) * L::x_bytes;
        for (int64_t i = 0; i < GROUP; ++i) {
          const int v = static_cast<int>(std::nearbyint(xg[i] * inv));
          sum += v;
          if (Nibbles)  // byte j of a group's 16 holds weights j (low nibble) and 16 + j (high)
            q[(i < 16 ? 0 : 64) + in_chunk * 16 + (i % 16)] = static_cast<int8_t>(v);
          else  // stored as qx + 128, read as unsigned
            q[in_chunk * GROUP + i] = static_cast<int8_t>(static_cast<uint8_t>(v + 128));
        }
        const int64_t lane = (c * rows + r) * 16 + in_chunk * L::lanes;
        for (int64_t j = 0; j < L::lanes; ++j) {
          dx[lane + j] = d;
          if (Nibbles) s[lane + j] = d * static_cast<float>(sum) / L::lanes;  // summed back over the group's lanes (exact: /4)
        }
      }
    }
  }
};

// The weights as this kernel streams them, one contiguous run per output feature, chunk by chunk:
// Q4_1: 16 t bytes of nibbles, t scales d, t minimums m (float16, as in the file), for the t <= 4
// groups of the chunk (t = 4 but in a row's last chunk); Q8_0: 32 t bytes, t scales. Exactly the
// file's bytes (20 per Q4_1 group, 34 per Q8_0 group), reordered so one load takes a chunk.
template <bool Nibbles>
static inline int64_t chunk_bytes(int64_t t) { return t * (Nibbles ? 16 + 4 : 32 + 2); }

// One chunk of an output feature's weights (t groups at p) against `Rows` rows of activations
// (chunk c of rows r0...), added to acc (the d terms) and extra (Q4_1's m terms). Full chunks
// (t = groups) take plain loads; only a row's last chunk needs masks.
#ifdef STORYTELLER_INT8_VNNI
template <bool Nibbles, int Rows, bool Full>
static inline void chunk(const Activations<Nibbles>& a, int64_t r0, int64_t c, const uint8_t* p, int64_t t,
                         __m512* acc, __m512* extra) {
  using L = Layout<Nibbles>;
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  // Lane i of the 16 takes its group's scale: group i / lanes of the chunk.
  const __m512i spread = Nibbles ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  if (Full) t = L::groups;
  const int64_t q_bytes = t * L::w_bytes;
  const __m512i raw = Full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ULL << q_bytes) - 1, p);
  // t scales (and, for Q4_1, t minimums after them), float16 -> float32
  const __m128i halves = Full && Nibbles ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + q_bytes))
      : _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << (Nibbles ? 2 * t : t)) - 1), p + q_bytes);
  const __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(halves));
  const __m512 dw = _mm512_permutexvar_ps(spread, dm);
  const int64_t at = c * a.rows + r0;  // the activations are laid out chunk-major
  const float* dx = a.dx.data() + at * 16;
  if (Nibbles) {
    const __m512 mw = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(static_cast<int>(t))), dm);
    const __m512i lo = _mm512_and_si512(raw, low_mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_mask);
    const int8_t* q = a.qx.data() + at * L::x_bytes;
    const float* s = a.s.data() + at * 16;
    for (int r = 0; r < Rows; ++r) {
      __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q + r * L::x_bytes));
      isum = _mm512_dpbusd_epi32(isum, hi, _mm512_loadu_si512(q + r * L::x_bytes + 64));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_loadu_ps(dx + r * 16)), acc[r]);
      extra[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(s + r * 16), extra[r]);
    }
  } else {
    // The activations are qx + 128: start each lane at -128 times its four weights' sum.
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), raw);
    const __m512i base = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
    const int8_t* q = a.qx.data() + at * L::x_bytes;
    for (int r = 0; r < Rows; ++r) {
      const __m512i isum = _mm512_dpbusd_epi32(base, _mm512_loadu_si512(q + r * L::x_bytes), raw);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_loadu_ps(dx + r * 16)), acc[r]);
    }
  }
}
#else
// The same with AVX2, a half chunk (32 bytes: 8 int32 lanes) at a time. Q4_1's m terms go straight
// into acc (extra stays zero: no registers to spare). A row's last chunk is copied, zero-padded, to
// a whole one first: AVX2 has no masked byte loads, and reading past it could leave the weights.
template <bool Nibbles, int Rows, bool Full>
static inline void chunk(const Activations<Nibbles>& a, int64_t r0, int64_t c, const uint8_t* p, int64_t t,
                         __m256* acc, __m256*) {
  using L = Layout<Nibbles>;
  alignas(32) uint8_t whole[64 + 16];
  if (!Full) {
    std::memset(whole, 0, sizeof(whole));
    std::memcpy(whole, p, t * L::w_bytes);                                  // the bytes (or nibbles)
    std::memcpy(whole + 64, p + t * L::w_bytes, 2 * t);                     // t scales
    if (Nibbles) std::memcpy(whole + 64 + 2 * L::groups, p + t * L::w_bytes + 2 * t, 2 * t);  // t minimums
    p = whole;
  }
  // A whole chunk's scales (and Q4_1's minimums after them), float16 -> float32
  int32_t two_scales;  // Q8_0's chunk has two groups
  std::memcpy(&two_scales, p + 64, sizeof(two_scales));
  const __m256 dm = Nibbles ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64)))
                            : _mm256_cvtph_ps(_mm_cvtsi32_si128(two_scales));
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t at = c * a.rows + r0;  // the activations are laid out chunk-major
  const float* dx = a.dx.data() + at * 16;
  const int8_t* q = a.qx.data() + at * L::x_bytes;
  for (int h = 0; h < 2; ++h) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    if (Nibbles) {  // groups 2h (lanes 0-3) and 2h + 1 (lanes 4-7)
      const __m256i pick = _mm256_setr_epi32(2 * h, 2 * h, 2 * h, 2 * h, 2 * h + 1, 2 * h + 1, 2 * h + 1, 2 * h + 1);
      const __m256 dw = _mm256_permutevar8x32_ps(dm, pick);
      const __m256 mw = _mm256_permutevar8x32_ps(dm, _mm256_add_epi32(pick, _mm256_set1_epi32(4)));
      const __m256i low_mask = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(raw, low_mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_mask);
      const float* s = a.s.data() + at * 16 + 8 * h;
      for (int r = 0; r < Rows; ++r) {
        const int8_t* x = q + r * L::x_bytes + 32 * h;  // lows, then highs 64 bytes on
        const __m256i pairs = _mm256_add_epi16(  // at most 2 * 2 * 15 * 127: no overflow
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64))));
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_loadu_ps(dx + r * 16 + 8 * h)), acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(s + r * 16), acc[r]);
      }
    } else {  // group h, all 8 lanes
      const __m256 dw = _mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(h));
      const __m256i magnitude = _mm256_sign_epi8(raw, raw);  // |w| as unsigned: -128 -> 128
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int r = 0; r < Rows; ++r) {
        const __m256i x = _mm256_xor_si256(  // qx + 128 -> qx
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * L::x_bytes + 32 * h)), flip);
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, raw));
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_loadu_ps(dx + r * 16 + 8 * h)), acc[r]);
      }
    }
  }
}
#endif

// y[r0..r0 + Rows, n0..n1); w: [N, G groups] in the layout above. Rows is a template argument so
// that the loops over rows unroll and the accumulators stay in registers.
template <bool Nibbles, int Rows, typename T>
static void rows_block(const Activations<Nibbles>& a, int64_t r0, const uint8_t* w, int64_t G,
                       T* y, int64_t N, int64_t n0, int64_t n1) {
  using L = Layout<Nibbles>;
  const int64_t row_bytes = G * chunk_bytes<Nibbles>(1), full = G / L::groups, tail = G % L::groups;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* p = w + n * row_bytes;
    // The weights are read once, in order: ask for the features PREFETCH ahead while this one is done.
    if (n + PREFETCH < N)
      for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH * row_bytes + off), _MM_HINT_T0);
    Vec acc[Rows], extra[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = extra[r] = vzero();
    for (int64_t c = 0; c < full; ++c, p += chunk_bytes<Nibbles>(L::groups))
      chunk<Nibbles, Rows, true>(a, r0, c, p, L::groups, acc, extra);
    if (tail) chunk<Nibbles, Rows, false>(a, r0, full, p, tail, acc, extra);
    for (int r = 0; r < Rows; ++r) y[(r0 + r) * N + n] = static_cast<T>(vsum(acc[r]) + vsum(extra[r]));
  }
}

// rows_block for 1..ROWS rows, indexed by rows - 1.
template <bool Nibbles, typename T, size_t... R>
static constexpr auto row_blocks(std::index_sequence<R...>) {
  return std::array<void (*)(const Activations<Nibbles>&, int64_t, const uint8_t*, int64_t, T*, int64_t, int64_t,
                             int64_t), sizeof...(R)>{rows_block<Nibbles, static_cast<int>(R) + 1, T>...};
}

template <bool Nibbles, typename T>
static void linear(const T* x, int64_t rows, int64_t K, const uint8_t* w, T* y, int64_t N) {
  const Activations<Nibbles> a(x, rows, K);
  const int64_t G = K / GROUP;
  // Threads split the output features, so each weight is read once a step; within a thread a tile
  // of features meets every row of x before the next tile is loaded.
  in_pieces(0, N, TILE, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += TILE) {
      const int64_t n1 = std::min(end, n0 + TILE);
      for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
        static constexpr auto by_rows = row_blocks<Nibbles, T>(std::make_index_sequence<ROWS>());
        by_rows[std::min(ROWS, rows - r0) - 1](a, r0, w, G, y, N, n0, n1);
      }
    }
  });
}

}  // namespace int8

// x: [rows, K] float32 or bfloat16; w: [N, bytes] uint8, a Q4_1 (nibbles) or Q8_0 matrix in the
// layout above (worker/continuous/weights.py packs it). Returns [rows, N] in x's type.
static torch::Tensor int8_linear(const torch::Tensor& x_in, const torch::Tensor& w, bool nibbles) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
              x_in.size(-1) % int8::GROUP == 0 &&
              w.size(1) == x_in.size(-1) / int8::GROUP * (nibbles ? int8::chunk_bytes<true>(1) : int8::chunk_bytes<false>(1)),
              "int8_linear: x [rows, K]; w [N, K / 32 * (20 for Q4_1, 34 for Q8_0)] uint8");
  const torch::Tensor x = x_in.scalar_type() == torch::kBFloat16 ? x_in.contiguous() : x_in.to(torch::kFloat32).contiguous();
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({rows, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "int8_linear", [&] {
    const auto run = nibbles ? int8::linear<true, scalar_t> : int8::linear<false, scalar_t>;
    run(x.data_ptr<scalar_t>(), rows, K, w.data_ptr<uint8_t>(), y.data_ptr<scalar_t>(), N);
  });
  return y.to(x_in.scalar_type());
}

}  // namespace storyteller
#endif
