// Products with the blocks of llama.cpp's K-quant files (Q4_K, Q5_K, Q6_K, and the Q5_0 and Q5_1
// a Q4_K_M or Q5_K_M file puts where rows are no multiple of 256) against 8-bit activations, 16
// output features a vector, on AVX-512 VNNI or on AVX2.
//
// Every type is read as unsigned integers u of 4, 5 or 6 bits with a scale per 32 (Q6_K: per 16)
// weights, w = S u - M, where S and M come from the file's bytes exactly:
//   Q4_K, Q5_K: S = d sc, M = dmin m (d, dmin float16 per 256 weights; sc, m 6-bit per 32)
//   Q6_K:       S = d sc (sc a signed byte per 16), M = 32 S (u = q + 32)
//   Q5_0:       S = d, M = 16 d               Q5_1: S = d, M = -m (float16 per 32)
// d sc is exact in float32 (11 + 6 bits), so these are the file's weights bit for bit.
//
// The step's activations are rounded to 8 bits per group of 32: for Q4_K, Q5_K and Q6_K with a
// step that is the row's (max|x| over the row / 127) halved e times, the smallest that holds the
// group; for Q5_0 and Q5_1 with the group's own, dx = max|x| / 127 (Activations below; llama.cpp
// rounds a K-quant's activations with a float step per 256, which costs more in KL divergence:
// bench.activation_grouping). Then, per group and output feature,
//   K-quants:    sum_i w_i x^_i = unit (S ((u . q) << shift) - M (sum(q) << shift)),  shift = SHIFTS - e
//   Q5_0, Q5_1:  sum_i w_i x^_i = dx (S (u . q) - M sum(q))
// with unit = the row's step / 2^SHIFTS. u . q is an integer sum of 32 bytes: vpdpbusd on AVX-512
// VNNI, vpmaddubsw and vpmaddwd on AVX2 (a pair of products is at most 2 * 63 * 127, inside
// int16); the zero points of Q6_K and Q5_0 are integers and start that sum (-32 sum(q), per 16 for
// Q6_K), so they cost nothing per weight. A K-quant's group then costs one float multiply-add for
// its scale (Q6_K: two), where a float step per group costs a multiply more (Q5_0, Q5_1), and one
// for M sum(q) (Q4_K, Q5_K, Q5_1; its factor counted once a step); unit multiplies each output
// once. With the rounded activations the product is exact but for float32's rounding of these few
// terms.
//
// Why one row's result cannot depend on the others: each output is made by one thread, group
// after group in order, with the same instructions whatever the number of rows beside it (a tile
// of rows or of two panels only unrolls loops; its integer sums are exact), and the rounding of x is per row (rowwise.h). No timing
// picks a path.
//
// The weights, as worker/continuous/kquants.py packs them: per panel of 16 output features and
// per superblock of 256 weights (Q5_0, Q5_1: per group), a header of 16 float16 d (and 16 dmin),
// then per group of 32: 4 blocks of 64 bytes of nibbles (byte b of feature f in block j: the low
// 4 bits of weight 4j + b in its low nibble, of weight 16 + 4j + b in its high one: block j's two
// halves are its "vectors" 2j and 2j + 1), then the higher bits: Q5, 64 bytes whose bit v is bit 4
// of vector v's weight in that byte; Q6, 2 x 64 bytes with two bits of each of vectors 0-3 and
// 4-7 (bits 2t, 2t + 1: vector 4k + t); then the scales: 16 sc and 16 m (bytes), or Q6_K's 16 + 16
// signed sc (weights 0-15, 16-31), or Q5_0's 16 d, or Q5_1's 16 d and 16 -m (float16). The same
// bytes per weight as the file, give or take a header's alignment.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>

#include "lanes.h"
#include "rowwise.h"

#ifdef STORYTELLER_KQUANTS
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace storyteller {
namespace kquants {

constexpr int64_t GROUP = 32;
constexpr int64_t LANES = 16;  // output features per panel
constexpr int64_t MIN_WORK = 1 << 19;  // multiply-adds per thread's share at least: a parallel region costs ~10 us

// The types, by the codes kquants.py packs them under.
enum Type : int { Q4_K = 0, Q5_K = 1, Q6_K = 2, Q5_0 = 3, Q5_1 = 4 };

template <int T>
struct Format {
  static constexpr int bits = T == Q4_K ? 4 : T == Q6_K ? 6 : 5;
  static constexpr int64_t super = T == Q5_0 || T == Q5_1 ? 1 : 8;  // groups per header
  static constexpr int64_t header = T == Q6_K ? 32 : T == Q4_K || T == Q5_K ? 64 : 0;
  static constexpr int64_t high = bits == 4 ? 0 : bits == 5 ? 64 : 128;
  static constexpr int64_t scales = T == Q5_1 ? 64 : 32;
  static constexpr int64_t group = 256 + high + scales;
  static constexpr bool minimum = T == Q4_K || T == Q5_K || T == Q5_1;  // M is a float per group
  static constexpr int zero = T == Q6_K ? 32 : T == Q5_0 ? 16 : 0;     // M is zero * S, an integer
  static constexpr bool halves = T == Q6_K;                             // a scale per 16 weights
  // Whether the activations' step is the row's halved per group (the K-quants, whose blocks are of
  // 256, as llama.cpp's Q8_K rounding is), or a float step per group (Q5_0, Q5_1, which llama.cpp
  // meets with Q8_0's and Q8_1's per 32): see Activations.
  static constexpr bool row_step = super > 1;
  static constexpr int64_t bytes(int64_t G) { return G / super * header + G * group; }  // a panel's
};

#ifdef STORYTELLER_KQUANTS_VNNI
constexpr int ROWS = 8;  // rows per pass over a panel: an accumulator and an integer sum each
constexpr int PAIR_ROWS = 4;  // rows per pass over two panels: 8 accumulators, 8 (Q6_K: 16) integer sums
constexpr bool FETCH_UNPACKED = true;  // whether a pair that is unpacked fetches the next (linear)
#else
constexpr bool FETCH_UNPACKED = false;
constexpr int ROWS = 4;  // AVX2 has 16 registers, and each of these takes two
constexpr int PAIR_ROWS = 2;
#endif
// The most rows of a pass whose products broadcast x themselves (GroupSums::add_at; on AVX2, which
// has no such instruction, add_product_at broadcasts as add_product's callers do).
constexpr int BROADCAST_IN_PRODUCT = 4;

}  // namespace kquants
}  // namespace storyteller
#include "kquants_activations.h"  // the step's x rounded to 8 bits (Activations)
namespace storyteller {
namespace kquants {

// Vector v's (0-7) weights' bits above the nibble, moved to bits 4 and up of each byte.
template <int T, int V>
static inline Ints high_bits(const uint8_t* h) {
  if constexpr (Format<T>::bits == 5) return shift<4 - V>(load(h)) & bytes(0x10);
  else return shift<4 - 2 * (V % 4)>(load(h + 64 * (V / 4))) & bytes(0x30);
}

// Up to this many rows a pair of panels is met straight from its bytes, each pass taking its nibbles
// apart again; beyond, the first pass stores them apart as it goes and the others read them (A/Bs
// on the 1.7B file's layers, docs/serving.md: a pass of its own storing them cost 1.12x at 24 rows
// and 1.05x at 32; stored by the first pass, the products of every layer ran 1.01x faster than
// straight from the bytes at 20 rows, 1.03x at 24, and 1.02-1.06x faster than the pass of its own
// at 33-128 rows, 1.00x at 512, on a Zen 4).
constexpr int64_t DIRECT_ROWS = 20;
constexpr int64_t AHEAD = 8;  // groups ahead whose weights are prefetched (~2-3 KB)
// A pass of a few rows asks for its weights further ahead where that pays, which depends on the CPU
// (docs/serving.md, "A lone row's prefetches, by CPU"). On an Intel Xeon (AVX-512 VNNI, AMX), a lone
// row: every line of a group 4 groups on (into L1) 1.10-1.15x against none (4-8 on, the same;
// half the lines 1.06x; 16 on nothing), and every line LONE_FAR_INTEL (12) on toward L2 as well
// (first 32, 1.04-1.06x more; then, against 32 on, with the weights in huge pages: 12 on 1.05x and
// 1.06x, 16 on 1.04x, 8 on 1.00x, 6 on 0.97x, 12 alone without the 4 into L1 0.99x);
// 2-4 rows: 32 on toward L2 beside their 8 on, 1.06-1.12x (6 and 8 rows: 0.96-1.01x, so not there).
// On a Zen 4 a lone row with none ran 1.06x faster than with 8 on in minutes when memory was fast
// (there its ~65 instructions a group hold the pass, and 5 prefetches are 5 more), the same when it
// was slow. On a Zen 3 (AVX2 alone) a lone row over every layer of the 1.7B file ran 1.12x faster
// with them (0.97-1.16, 8 rounds), 2 and 4 rows the same either way. So on by default but on a
// Zen 4 (AMD family 19h with AVX-512; unmeasured on Zen 1 and 2); `kquant_few_rows_fetch` turns it
// (no bits change).
//
// A Zen 5 (AMD, AVX-512 on full 512-bit units, family 1Ah) wants the far fetches alone, and nearer:
// there the pass computes from cache at ~2.3x the rate it reads memory (75-78 against 33 GB/s on
// one core, whose plain reduction reads 41), so the reads alone hold it, and lines asked into L1
// as well only crowd them. Every layer's products of the 1.7B file at one row, against LONE_AHEAD
// and FEW_FAR (the same bits; A/Bs of builds in one process, medians of 6-8 rounds): nothing ahead
// 0.92x; only toward L2, 32 on 1.05-1.10x, 24 on 1.15x, 16 on 1.13-1.14x, 12 on 1.12x, 8 on
// 1.08x, 64 on 1.08x. 2 and 4 rows, the L2 fetches alone 20 on: 1.04x and 1.05x. So there every
// pass of up to R_FEW rows asks for the lines FAR_ALONE groups on toward L2, and nothing into L1.
constexpr int64_t LONE_AHEAD = 4;
constexpr int64_t FEW_FAR = 32;
constexpr int64_t LONE_FAR_INTEL = 12;
constexpr int64_t FAR_ALONE = 20;
constexpr int R_FEW = 4;  // the most rows a pass asks FEW_FAR (FAR_ALONE) on for
struct FewRowsFetch {
  std::atomic<bool> enabled{!amd_avx512() || !__builtin_cpu_is("amdfam19h")};  // off on a Zen 4
  // An AMD CPU with AVX-512 after the Zen 4 (GCC 12 does not name family 1Ah).
  const bool far_alone = amd_avx512() && !__builtin_cpu_is("amdfam19h");
  const bool intel = __builtin_cpu_is("intel");  // (amd_avx512 has run __builtin_cpu_init)
  static bool amd_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f");
  }
};
static inline FewRowsFetch& few_rows_fetch() {
  static FewRowsFetch f;
  return f;
}

// One group of a panel made ready for the products: its 8 vectors of weights as bytes u (vector
// 2j: weights 4j.., 2j + 1: 16 + 4j.., 4 bytes a feature), its scales as floats.
struct Group {
  alignas(64) uint8_t u[8][64];
  alignas(64) float scale[LANES], scale2[LANES], minimum[LANES];
};

// Block J of a group (w: the group's bytes) as the bytes u of its two vectors, 2J and 2J + 1.
template <int T, int J>
static inline void block_u(const uint8_t* w, Ints& lo, Ints& hi) {
  const Ints raw = load(w + 64 * J);
  lo = raw & bytes(0x0F), hi = shift<-4>(raw) & bytes(0x0F);
  if constexpr (Format<T>::bits > 4) {
    lo = lo | high_bits<T, 2 * J>(w + 256);
    hi = hi | high_bits<T, 2 * J + 1>(w + 256);
  }
}

// A group's scales S (and Q6_K's second S, of weights 16-31) and minimums M as floats; d and dmin
// are its superblock's.
template <int T>
static inline void group_scales(const uint8_t* w, Floats d, Floats dmin, Floats& scale, Floats& scale2, Floats& minimum) {
  const uint8_t* sc = w + 256 + Format<T>::high;
  scale2 = zerof(), minimum = zerof();
  if constexpr (T == Q4_K || T == Q5_K) {
    scale = mul(d, ubytes16(sc));
    minimum = mul(dmin, ubytes16(sc + 16));
  } else if constexpr (T == Q6_K) {
    scale = mul(d, sbytes16(sc));
    scale2 = mul(d, sbytes16(sc + 16));
  } else {
    scale = halves16(sc);
    if (T == Q5_1) minimum = halves16(sc + 32);
  }
  pin(scale), pin(scale2), pin(minimum);  // as a Group made ready holds them: every path multiplies these values
}

// The weights stream through once (a few rows a step): ask for those N groups ahead, every line,
// into L1 (or toward L2: TO_L2).
template <int T, int64_t N = AHEAD, bool TO_L2 = false>
static inline void prefetch_ahead(const uint8_t* w) {
  for (int64_t line = 0; N && line < Format<T>::group; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + N * Format<T>::group + line), TO_L2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

// Walks a panel's G groups (w: the panel's bytes), calling visit(g, the group's bytes, d, dmin),
// d and dmin from the header of the group's superblock; asking for the weights N groups on as it
// goes (0: for none), and FAR groups on toward L2 (0: none).
template <int T, int64_t N = AHEAD, int64_t FAR = 0, typename Visit>
static inline void each_group(const uint8_t* w, int64_t G, const Visit& visit) {
  using F = Format<T>;
  Floats d = zerof(), dmin = zerof();
  for (int64_t g = 0; g < G; ++g) {
    if (F::header && g % F::super == 0) {
      d = halves16(w);
      if (F::minimum) dmin = halves16(w + 32);
      w += F::header;
    }
    if constexpr (N > 0) prefetch_ahead<T, N>(w);
    if constexpr (FAR > 0) prefetch_ahead<T, FAR, /*TO_L2=*/true>(w);
    visit(g, w, d, dmin);
    w += F::group;
  }
}

// A panel's G groups (w: the panel's bytes) made ready, into out[0..G].
template <int T>
static void unpack(const uint8_t* w, int64_t G, Group* out) {
  each_group<T>(w, G, [&](int64_t g, const uint8_t* group, Floats d, Floats dmin) {
    Group& o = out[g];
    Floats scale, scale2, minimum;
    group_scales<T>(group, d, dmin, scale, scale2, minimum);
    store(scale, o.scale);
    store(scale2, o.scale2);
    store(minimum, o.minimum);
    Ints lo, hi;
    block_u<T, 0>(group, lo, hi), store_ints(lo, o.u[0]), store_ints(hi, o.u[1]);
    block_u<T, 1>(group, lo, hi), store_ints(lo, o.u[2]), store_ints(hi, o.u[3]);
    block_u<T, 2>(group, lo, hi), store_ints(lo, o.u[4]), store_ints(hi, o.u[5]);
    block_u<T, 3>(group, lo, hi), store_ints(lo, o.u[6]), store_ints(hi, o.u[7]);
  });
}

// R rows' integer sums over one group, then into acc: begin (the zero points' start), a block
// at a time (its two vectors' bytes lo, hi), end (the scales). Whether the bytes and scales come
// from a Group made ready or straight from the panel, each row meets the same integers and the
// same float operations in the same order: the same bits. A sum takes 8 products a group (Q6_K:
// two sums of 4, one per half): block j's are products 2 j (lo) and 2 j + 1 (hi) (Q6_K: j of
// each), added as lanes.h's add_product does on each instruction set, exact integers either way.
template <int T, int R>
struct GroupSums {
  using F = Format<T>;
  static constexpr int LARGEST = (1 << F::bits) - 1;  // of the bytes u
  static constexpr int LAST = F::halves ? 3 : 7;  // the last product of a sum
  const Activations& a;
  int64_t at;  // rows r0.. of group g: (r0 * G + g)
  const int8_t* x;
  Ints lo_sum[R], hi_sum[R];
  Pending lo_run[R], hi_run[R];

  GroupSums(const Activations& a_, int64_t r0, int64_t g) : a(a_), at(r0 * a_.G + g), x(a_.q.data() + r0 * a_.K + g * GROUP) {
    for (int r = 0; r < R; ++r) {
      const int32_t* s = a.sums.data() + (at + r * a.G) * 2;
      lo_sum[r] = splat(F::halves ? -F::zero * s[0] : -F::zero * (s[0] + s[1]));
      hi_sum[r] = splat(F::halves ? -F::zero * s[1] : 0);
    }
  }
  template <int N>
  static inline void add(Ints& sum, Pending& run, Ints u, Ints x4) { add_product<LARGEST, N, LAST>(sum, run, u, x4); }
  // Each of x's broadcasts feeds one product here. Up to BROADCAST_IN_PRODUCT rows, the product reads it
  // itself (add_product_at); more rows' sums crowd the registers, and there the asm cost copies
  // (from L2, on a Zen 4: 1.07x faster at one row, 1.04x at 2 and 4, 0.99x at 6, 0.92x at 8).
  template <int N>
  static inline void add_at(Ints& sum, Pending& run, Ints u, const int8_t* x4) {
    if constexpr (R <= BROADCAST_IN_PRODUCT) add_product_at<LARGEST, N, LAST>(sum, run, u, x4);
    else add_product<LARGEST, N, LAST>(sum, run, u, broadcast4(x4));
  }
  template <int J>
  inline void block(Ints lo, Ints hi) {
    for (int r = 0; r < R; ++r) {
      add_at<F::halves ? J : 2 * J>(lo_sum[r], lo_run[r], lo, x + r * a.K + 4 * J);
      if constexpr (F::halves) add_at<J>(hi_sum[r], hi_run[r], hi, x + r * a.K + 16 + 4 * J);
      else add_at<2 * J + 1>(lo_sum[r], lo_run[r], hi, x + r * a.K + 16 + 4 * J);
    }
  }
  // The same for this panel's block (lo, hi) and the next panel's (its sums: `next`), each
  // broadcast of x serving both.
  template <int J>
  inline void pair_block(Ints lo, Ints hi, GroupSums& next, Ints next_lo, Ints next_hi) {
    for (int r = 0; r < R; ++r) {
      const Ints x_lo = broadcast4(x + r * a.K + 4 * J), x_hi = broadcast4(x + r * a.K + 16 + 4 * J);
      add<F::halves ? J : 2 * J>(lo_sum[r], lo_run[r], lo, x_lo);
      add<F::halves ? J : 2 * J>(next.lo_sum[r], next.lo_run[r], next_lo, x_lo);
      if constexpr (F::halves) {
        add<J>(hi_sum[r], hi_run[r], hi, x_hi);
        add<J>(next.hi_sum[r], next.hi_run[r], next_hi, x_hi);
      } else {
        add<2 * J + 1>(lo_sum[r], lo_run[r], hi, x_hi);
        add<2 * J + 1>(next.lo_sum[r], next.lo_run[r], next_hi, x_hi);
      }
    }
  }
  // The sums in the row's unit (shifted; or times the group's own step), times the weights'
  // scales; the minimum's term.
  inline void end(Floats scale, Floats scale2, Floats minimum, Floats* acc) const {
    for (int r = 0; r < R; ++r) {
      if constexpr (F::row_step) {
        const int32_t* by = a.shift.data() + at + r * a.G;
        acc[r] = fma(to_floats(shifted(lo_sum[r], by)), scale, acc[r]);
        if (F::halves) acc[r] = fma(to_floats(shifted(hi_sum[r], by)), scale2, acc[r]);
      } else {
        acc[r] = fma(to_floats(lo_sum[r]), mul(scale, splatf(a.dx[at + r * a.G])), acc[r]);
      }
      if (F::minimum) acc[r] = fma(minimum, splatf(a.nsum[at + r * a.G]), acc[r]);
    }
  }
};

// Rows r0..r0 + R of x against a panel, added to acc, straight from its bytes, in registers: a step
// of a few rows, whose weights stream by once (storing each group's bytes and reading them back cost more than the products at
// one row: a store of 64 bytes takes two cycles on Zen 4).
//
// Two rows and more ask for the weights AHEAD groups on (unmeasured at 2 and 3: at 4 rows a pass
// without them ran 0.84x on a Zen 4, and 4 ahead instead of 8 0.97-0.99x on a Xeon), and up to R_FEW
// rows FEW_FAR on too where few_rows_fetch() says (12 instead of 32 on a Xeon: 1.00x at 2 rows, 0.96x
// at 4). A lone row asks LONE_AHEAD and FEW_FAR on where it says (LONE_FAR_INTEL on an Intel CPU),
// and for nothing otherwise; on a Zen 5, up to R_FEW rows ask FAR_ALONE on alone (above).
template <int T, int R>
static inline void rows_direct(const Activations& a, int64_t r0, const uint8_t* w, Floats* acc) {
  const auto visit = [&](int64_t g, const uint8_t* group, Floats d, Floats dmin) {
    GroupSums<T, R> sums(a, r0, g);
    Ints lo, hi;
    block_u<T, 0>(group, lo, hi), sums.template block<0>(lo, hi);
    block_u<T, 1>(group, lo, hi), sums.template block<1>(lo, hi);
    block_u<T, 2>(group, lo, hi), sums.template block<2>(lo, hi);
    block_u<T, 3>(group, lo, hi), sums.template block<3>(lo, hi);
    Floats scale, scale2, minimum;
    group_scales<T>(group, d, dmin, scale, scale2, minimum);
    sums.end(scale, scale2, minimum, acc);
  };
  const FewRowsFetch& fetch = few_rows_fetch();
  if (R > R_FEW || !fetch.enabled.load(std::memory_order_relaxed))
    each_group<T, R == 1 ? 0 : AHEAD>(w, a.G, visit);
  else if (fetch.far_alone)
    each_group<T, 0, FAR_ALONE>(w, a.G, visit);
  else if (R == 1 && fetch.intel)
    each_group<T, LONE_AHEAD, LONE_FAR_INTEL>(w, a.G, visit);
  else
    each_group<T, R == 1 ? LONE_AHEAD : AHEAD, FEW_FAR>(w, a.G, visit);
}

// Rows r0..r0 + R of x against one panel, into out [R, 16] floats.
template <int T, int R>
static void panel_rows(const Activations& a, int64_t r0, const uint8_t* w, float* out) {
  Floats acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zerof();
  rows_direct<T, R>(a, r0, w, acc);
  for (int r = 0; r < R; ++r) store(a.in_units(r0 + r, acc[r]), out + r * LANES);
}

template <int T, size_t... R>
static constexpr auto row_tiles(std::index_sequence<R...>) {
  return std::array<void (*)(const Activations&, int64_t, const uint8_t*, float*), sizeof...(R)>{
      panel_rows<T, static_cast<int>(R) + 1>...};
}

// A pass's share of the bytes its thread's next pair of panels will read (docs/serving.md, "The
// Zen 4 again"): fetched toward L2 a line or so a group, while the pass computes, so that the next
// pair's first pass (or its unpacking) reads from cache instead of waiting on memory. Only a hint:
// no bits change.
struct Slice {
  const uint8_t* at = nullptr;
  int64_t lines = 0, per = 0;  // lines in all, a group
  Slice(const uint8_t* at_, int64_t lines_, int64_t G) : at(at_), lines(lines_), per((lines_ + G - 1) / G) {}
  // Pass `pass`'s share of the `lines` lines from `at` spread over `passes` passes (none where pass < 0).
  static Slice share(const uint8_t* at, int64_t lines, int64_t pass, int64_t passes, int64_t G) {
    const int64_t from = pass < 0 ? 0 : pass * lines / passes, to = pass < 0 ? 0 : (pass + 1) * lines / passes;
    return Slice(at + 64 * from, to - from, G);
  }
  inline void fetch(int64_t g) const {
    if (g * per < lines)
      for (int64_t line = g * per; line < (g + 1) * per; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(at + 64 * line), _MM_HINT_T1);
  }
};

// Rows r0..r0 + R of x against two panels made ready (a step of many rows), into out and next_out
// [R, 16] each: every broadcast of x feeds the products of both, half the broadcasts per product
// of a single panel's tile (which share the vector units with vpdpbusd).
template <int T, int R>
static void pair_rows(const Activations& a, int64_t r0, const Group* groups, const Group* next, float* out,
                      float* next_out, const Slice& slice) {
  Floats acc[R], next_acc[R];
  for (int r = 0; r < R; ++r) acc[r] = next_acc[r] = zerof();
  for (int64_t g = 0; g < a.G; ++g, ++groups, ++next) {
    slice.fetch(g);
    GroupSums<T, R> sums(a, r0, g), next_sums(sums);
    auto block = [&](auto j) {  // j: a block's index as a type (std::integral_constant), for pair_block<j>
      sums.template pair_block<j>(load(groups->u[2 * j]), load(groups->u[2 * j + 1]), next_sums,
                                  load(next->u[2 * j]), load(next->u[2 * j + 1]));
    };
    block(std::integral_constant<int, 0>()), block(std::integral_constant<int, 1>());
    block(std::integral_constant<int, 2>()), block(std::integral_constant<int, 3>());
    sums.end(loadf(groups->scale), loadf(groups->scale2), loadf(groups->minimum), acc);
    next_sums.end(loadf(next->scale), loadf(next->scale2), loadf(next->minimum), next_acc);
  }
  for (int r = 0; r < R; ++r) store(a.in_units(r0 + r, acc[r]), out + r * LANES), store(a.in_units(r0 + r, next_acc[r]), next_out + r * LANES);
}

// Rows r0..r0 + R of x against two panels straight from their bytes (w, w + panel): every
// broadcast of x feeds both panels' products, and no group is stored and read back. With KEEP, the
// first pass of a step of many rows: each group is also stored made ready (kept[g], and the second
// panel's kept[G + g], as unpack would) for the passes after it, its stores under the products'
// time instead of in a pass of their own before them.
template <int T, int R, bool KEEP = false>
static void pair_direct(const Activations& a, int64_t r0, const uint8_t* w, const uint8_t* w2, float* out,
                        float* next_out, const Slice& slice, Group* kept = nullptr) {
  using F = Format<T>;
  Floats acc[R], next_acc[R];
  for (int r = 0; r < R; ++r) acc[r] = next_acc[r] = zerof();
  Floats d = zerof(), dmin = zerof(), d2 = zerof(), dmin2 = zerof();
  for (int64_t g = 0; g < a.G; ++g) {
    slice.fetch(g);
    if (F::header && g % F::super == 0) {
      d = halves16(w), d2 = halves16(w2);
      if (F::minimum) dmin = halves16(w + 32), dmin2 = halves16(w2 + 32);
      w += F::header, w2 += F::header;
    }
    if (r0 == 0) prefetch_ahead<T>(w), prefetch_ahead<T>(w2);  // the later passes find them in L2
    GroupSums<T, R> sums(a, r0, g), next_sums(sums);
    auto block = [&](auto j) {  // j: a block's index as a type (std::integral_constant)
      constexpr int J = decltype(j)::value;
      Ints lo, hi, lo2, hi2;
      block_u<T, J>(w, lo, hi), block_u<T, J>(w2, lo2, hi2);
      if constexpr (KEEP) {
        store_ints(lo, kept[g].u[2 * J]), store_ints(hi, kept[g].u[2 * J + 1]);
        store_ints(lo2, kept[a.G + g].u[2 * J]), store_ints(hi2, kept[a.G + g].u[2 * J + 1]);
      }
      sums.template pair_block<J>(lo, hi, next_sums, lo2, hi2);
    };
    block(std::integral_constant<int, 0>()), block(std::integral_constant<int, 1>());
    block(std::integral_constant<int, 2>()), block(std::integral_constant<int, 3>());
    Floats scale, scale2, minimum;
    const auto keep = [&](int64_t at) {  // kept[at] only where KEEP: kept is null otherwise
      if constexpr (KEEP) store(scale, kept[at].scale), store(scale2, kept[at].scale2), store(minimum, kept[at].minimum);
    };
    group_scales<T>(w, d, dmin, scale, scale2, minimum);
    keep(g);
    sums.end(scale, scale2, minimum, acc);
    group_scales<T>(w2, d2, dmin2, scale, scale2, minimum);
    keep(a.G + g);
    next_sums.end(scale, scale2, minimum, next_acc);
    w += F::group, w2 += F::group;
  }
  for (int r = 0; r < R; ++r) store(a.in_units(r0 + r, acc[r]), out + r * LANES), store(a.in_units(r0 + r, next_acc[r]), next_out + r * LANES);
}

template <int T, size_t... R>
static constexpr auto pair_direct_tiles(std::index_sequence<R...>) {
  return std::array<void (*)(const Activations&, int64_t, const uint8_t*, const uint8_t*, float*, float*, const Slice&, Group*), sizeof...(R)>{
      pair_direct<T, static_cast<int>(R) + 1>...};
}

template <int T, size_t... R>
static constexpr auto pair_tiles(std::index_sequence<R...>) {
  return std::array<void (*)(const Activations&, int64_t, const Group*, const Group*, float*, float*, const Slice&), sizeof...(R)>{
      pair_rows<T, static_cast<int>(R) + 1>...};
}

}  // namespace kquants
}  // namespace storyteller
#include "kquants_amx.h"
#include "kquants_avx2.h"
namespace storyteller {
namespace kquants {

// One weight of a step of a few rows: its panels (bytes each), its outputs' first column in y, and
// its type's passes of 1..ROWS rows (row_tiles). A product is one part; a stack of weights of
// different types side by side (a layer's q, k and v, weights.fuse) is one part each.
struct Part {
  using Rows = void (*)(const Activations&, int64_t, const uint8_t*, float*);
  const uint8_t* w;
  int64_t panels, panel_bytes, column;
  const Rows* by_rows;
  template <int T>
  static Part of(const uint8_t* w, int64_t N, int64_t column, int64_t G) {
    static constexpr auto by_rows = row_tiles<T>(std::make_index_sequence<ROWS>());
    return {w, N / LANES, Format<T>::bytes(G), column, by_rows.data()};
  }
};

// y's rows (`stride` apart) = the step's rounded x (a, up to ROWS rows) times each part's weight,
// every panel of every part straight from its bytes, the threads taking them in pieces in one
// parallel region: a stack of parts costs one region and one ramp of the reads, not one a part
// (on a Xeon, a lone row's q/k/v of Q4_K and Q6_K read 19 GB/s as two products where q/k/v all of
// Q4_K read 23; in one region, steps of 1-4 rows 1.00-1.04x faster: docs/serving.md, "The Xeon at
// night"). Each panel's outputs are made as a product of its part alone makes them.
#ifdef STORYTELLER_KQUANTS_AMX
static_assert(TILE_MIN_ROWS > ROWS, "a step of up to ROWS rows takes few_rows, never the tiles");
#endif
#ifdef STORYTELLER_KQUANTS_COLUMNS
static_assert(COLUMN_ROWS > ROWS, "a step of up to ROWS rows takes few_rows, never the columns");
#endif
template <typename X>
static void few_rows(const Activations& a, const Part* parts, int64_t n_parts, X* y, int64_t stride) {
  TORCH_INTERNAL_ASSERT(a.rows <= ROWS, "few_rows: a step of up to ROWS rows");
  int64_t panels = 0;
  for (int64_t i = 0; i < n_parts; ++i) panels += parts[i].panels;
  const int64_t grain = std::max<int64_t>(1, MIN_WORK / (LANES * a.K * a.rows));
  in_pieces(0, panels, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float out[ROWS * LANES];
    const Part* part = parts;
    int64_t first = 0;  // the index of part's first panel
    for (int64_t p = begin; p < end; ++p) {
      while (p >= first + part->panels) first += (part++)->panels;
      part->by_rows[a.rows - 1](a, 0, part->w + (p - first) * part->panel_bytes, out);
      for (int64_t r = 0; r < a.rows; ++r) store16(out + r * LANES, y + r * stride + part->column + (p - first) * LANES);
    }
  });
}

#ifdef STORYTELLER_KQUANTS_AMX
constexpr int64_t FETCH_TILE_ROWS = 128;  // the most rows whose tile passes fetch the next panel
// A step the tiles pay for (kquants_amx.h's tiles_pay) on them: each panel made ready once, as the
// VNNI kernel does beyond DIRECT_ROWS, then met 16 rows at a time.
template <int T, typename X>
static void tile_linear(const Activations& a, const uint8_t* w, X* y, int64_t N) {
  TORCH_INTERNAL_ASSERT(a.rows >= TILE_MIN_ROWS, "tile_linear: Activations pads rows for the tiles only from TILE_MIN_ROWS on");
  thread_local aligned_vector<int8_t> arranged;
  arrange(a, arranged);
  const int8_t* xt = arranged.data();
  const int64_t panel_bytes = Format<T>::bytes(a.G), panels = N / LANES;
  const int64_t grain = std::max<int64_t>(1, MIN_WORK / (LANES * a.K * a.rows));
  // The next panel fetched during a panel's tile passes (below): products of every layer of the 1.7B
  // file on a Xeon, 1.04x at 24 rows, 1.06x at 64 and 128, 64-row steps 1.05x; 0.96x at 512 (a
  // prompt chunk's 32 passes, compute-bound), so not there.
  const bool fetch = a.rows <= FETCH_TILE_ROWS && fetch_ahead(c10::nullopt);
  in_pieces(0, panels, grain, [&](int64_t begin, int64_t end, int64_t after) {
    configure();  // a thread's tiles may have served another kernel (oneDNN's) since
    alignas(64) float out[TILE_ROWS * LANES];
    thread_local aligned_vector<Group> ready;
    ready.resize(a.G);
    for (int64_t p = begin; p < end; ++p) {
      unpack<T>(w + p * panel_bytes, a.G, ready.data());
      // The panel this thread unpacks next, fetched toward L2 in slices over this one's tile passes
      // (as linear's pairs are), so that its unpacking reads from cache instead of memory.
      const int64_t following = !fetch ? -1 : p + 1 < end ? p + 1 : after;
      const int64_t lines = following < 0 ? 0 : (panel_bytes + 63) / 64, passes = (a.rows + TILE_ROWS - 1) / TILE_ROWS;
      const uint8_t* fetched = following < 0 ? nullptr : w + following * panel_bytes;
      for (int64_t r0 = 0; r0 < a.rows; r0 += TILE_ROWS) {
        const int64_t n = std::min<int64_t>(TILE_ROWS, a.rows - r0);
        tile_rows<T>(a, xt, r0, n, ready.data(), out, Slice::share(fetched, lines, r0 / TILE_ROWS, passes, a.G));
        for (int64_t r = 0; r < n; ++r) store16(out + r * LANES, y + (r0 + r) * N + p * LANES);
      }
    }
    _tile_release();
  }, /*ahead=*/fetch);
}
#endif

// y [rows, N] = x [rows, K] times the packed weight, threads splitting the panels (each output made
// by one thread). A step of a few rows meets a panel ROWS rows at a time, straight from its bytes;
// a step of more meets two panels at a time, PAIR_ROWS rows a pass, straight from their bytes up to
// DIRECT_ROWS rows; beyond, the first pass stores them made ready for the others; there, on a CPU
// with AMX tiles, every type but Q6_K takes them instead (kquants_amx.h). On AVX2 a step of 8 to
// COLUMN_MAX_ROWS rows takes the kernel of 8 rows a vector instead, and a larger step's passes of
// two rows after the first take pair_rows_avx2 (kquants_avx2.h). The same bits on every path.
template <int T, typename X>
static void linear(const X* x, int64_t rows, int64_t K, const uint8_t* w, X* y, int64_t N) {
  thread_local Activations kept;  // the caller's thread quantizes; its buffers outlive the call
  Activations& a = kept;          // (named, so the threads below read the caller's, not their own)
  a.fill(x, rows, K, Format<T>::row_step);
  static constexpr auto by_rows = row_tiles<T>(std::make_index_sequence<ROWS>());
#ifdef STORYTELLER_KQUANTS_AMX
  if constexpr (!Format<T>::halves)
    if (tiles_pay(rows) && tiles().enabled) return tile_linear<T>(a, w, y, N);
#endif
#ifdef STORYTELLER_KQUANTS_COLUMNS
  if (columns_pay(rows) && columns_enabled()) return column_linear<T>(a, w, y, N, by_rows);
#endif
  const int64_t panel_bytes = Format<T>::bytes(a.G), panels = N / LANES;
  static constexpr auto by_pair = pair_tiles<T>(std::make_index_sequence<PAIR_ROWS>());
  static constexpr auto by_direct = pair_direct_tiles<T>(std::make_index_sequence<PAIR_ROWS>());
  auto write = [&](const float* out, int64_t r0, int64_t n, int64_t p) {
    for (int64_t r = 0; r < n; ++r) store16(out + r * LANES, y + (r0 + r) * N + p * LANES);  // rowwise.h
  };
  if (rows <= ROWS) {
    const Part part = Part::of<T>(w, N, 0, a.G);
    return few_rows(a, &part, 1, y, N);
  }
  const int64_t grain = std::max<int64_t>(1, MIN_WORK / (2 * LANES * K * rows));
  const bool direct = rows <= DIRECT_ROWS, fetch = (direct || FETCH_UNPACKED) && fetch_ahead(c10::nullopt);
  in_pieces(0, (panels + 1) / 2, grain, [&](int64_t begin, int64_t end, int64_t after) {
    alignas(64) float out[2][ROWS * LANES];  // ROWS >= PAIR_ROWS: the odd panel's tiles fit too
    thread_local aligned_vector<Group> ready;
    ready.resize(2 * a.G);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t p = 2 * pair;
      if (p + 1 == panels) {  // an odd panel out: alone, ROWS rows at a time, straight from its bytes
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
          const int64_t n = std::min<int64_t>(ROWS, rows - r0);
          by_rows[n - 1](a, r0, w + p * panel_bytes, out[0]);
          write(out[0], r0, n, p);
        }
        continue;
      }
      const uint8_t *first = w + p * panel_bytes, *second = first + panel_bytes;
      // The pair this thread meets next (the next of its piece, or its next piece's first), fetched
      // in slices over this pair's passes after the first, which reads the pair's own bytes (and,
      // beyond DIRECT_ROWS, stores them made ready for the others). (Not on AVX2 beyond
      // DIRECT_ROWS: 0.95x there, measured on a Zen 4 running the AVX2 build; again 0.98x, 0.93-1.03,
      // at 64 rows once the first pass kept the pair.)
      const int64_t following = !fetch ? -1 : pair + 1 < end ? pair + 1 : after;
      const int64_t lines = following < 0 ? 0 : (std::min<int64_t>(2, panels - 2 * following) * panel_bytes + 63) / 64;
      const uint8_t* fetched = following < 0 ? nullptr : w + 2 * following * panel_bytes;
      const int64_t skipped = 1, passes = (rows + PAIR_ROWS - 1) / PAIR_ROWS - skipped;  // the first reads the bytes
      for (int64_t r0 = 0; r0 < rows; r0 += PAIR_ROWS) {
        const int64_t n = std::min<int64_t>(PAIR_ROWS, rows - r0);
        const Slice slice = Slice::share(fetched, lines, r0 / PAIR_ROWS - skipped, passes, a.G);
        if (direct) by_direct[n - 1](a, r0, first, second, out[0], out[1], slice, nullptr);
        else if (r0 == 0) pair_direct<T, PAIR_ROWS, /*KEEP=*/true>(a, 0, first, second, out[0], out[1], slice, ready.data());
#ifdef STORYTELLER_KQUANTS_COLUMNS
        else if (n == 2) pair_rows_avx2<T>(a, r0, ready.data(), ready.data() + a.G, out[0], out[1], slice);
#endif
        else by_pair[n - 1](a, r0, ready.data(), ready.data() + a.G, out[0], out[1], slice);
        write(out[0], r0, n, p);
        write(out[1], r0, n, p + 1);
      }
    }
  }, /*ahead=*/fetch);
}

template <typename X>
static void dispatch(int64_t type, const X* x, int64_t rows, int64_t K, const uint8_t* w, X* y, int64_t N) {
  switch (type) {
    case Q4_K: return linear<Q4_K>(x, rows, K, w, y, N);
    case Q5_K: return linear<Q5_K>(x, rows, K, w, y, N);
    case Q6_K: return linear<Q6_K>(x, rows, K, w, y, N);
    case Q5_0: return linear<Q5_0>(x, rows, K, w, y, N);
    case Q5_1: return linear<Q5_1>(x, rows, K, w, y, N);
    default: TORCH_CHECK(false, "kquant_linear: unknown type code ", type);
  }
}

static inline int64_t panel_bytes(int64_t type, int64_t G) {
  switch (type) {
    case Q4_K: return Format<Q4_K>::bytes(G);
    case Q5_K: return Format<Q5_K>::bytes(G);
    case Q6_K: return Format<Q6_K>::bytes(G);
    case Q5_0: return Format<Q5_0>::bytes(G);
    case Q5_1: return Format<Q5_1>::bytes(G);
    default: return -1;
  }
}

// Whether a type's activations are rounded with the row's step (Format::row_step), by its code.
static inline bool row_step(int64_t type) { return type != Q5_0 && type != Q5_1; }

static inline Part part_of(int64_t type, const uint8_t* w, int64_t N, int64_t column, int64_t G) {
  switch (type) {
    case Q4_K: return Part::of<Q4_K>(w, N, column, G);
    case Q5_K: return Part::of<Q5_K>(w, N, column, G);
    case Q6_K: return Part::of<Q6_K>(w, N, column, G);
    case Q5_0: return Part::of<Q5_0>(w, N, column, G);
    case Q5_1: return Part::of<Q5_1>(w, N, column, G);
    default: TORCH_CHECK(false, "kquant_stack: unknown type code ", type);
  }
}

// A stack's step of up to ROWS rows, every part's activations rounded alike (row_step): x rounded
// once, then few_rows over all the parts, into y [rows, N] (N: the parts' outputs together).
template <typename X>
static void stack_rows(const X* x, int64_t rows, int64_t K, bool row_step, const std::vector<Part>& parts, X* y, int64_t N) {
  thread_local Activations kept;  // as linear's: the caller's thread quantizes, the threads read it
  Activations& a = kept;
  a.fill(x, rows, K, row_step);
  few_rows(a, parts.data(), static_cast<int64_t>(parts.size()), y, N);
}

// Output features ids of the packed weight as float32 rows [n, K] (an embedding lookup in a tied
// head's panels): w = S u - M, each value the product S u (exact: at most 24 bits) less M, rounded
// once, which is gguf's dequantization bit for bit.
template <int T>
static void feature_rows(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
  const int64_t G = K / GROUP, panel_bytes = Format<T>::bytes(G);
  aligned_vector<Group> groups(G);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t f = ids[i] % LANES;
    unpack<T>(w + ids[i] / LANES * panel_bytes, G, groups.data());
    for (int64_t g = 0; g < G; ++g) {
      const Group& group = groups[g];
      for (int64_t k = 0; k < GROUP; ++k) {  // weight k of the group: vector 2 (k % 16 / 4) + k / 16, byte k % 4
        const float u = group.u[2 * (k % 16 / 4) + k / 16][4 * f + k % 4];
        const float scale = Format<T>::halves && k >= 16 ? group.scale2[f] : group.scale[f];
        const float minimum = Format<T>::minimum ? group.minimum[f] : Format<T>::zero * scale;
        out[i * K + g * GROUP + k] = scale * u - minimum;
      }
    }
  }
}

}  // namespace kquants
}  // namespace storyteller
#endif
