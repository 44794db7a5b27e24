// The K-quant products of a step of many rows on AMX tiles (Intel's Sapphire Rapids and later),
// writing the same bits as the VNNI kernel in kquants.h, which this file is part of (included
// there after the Group a panel is made ready into).
//
// Why it can be the same bits: a group's integer sum u . q is exact whichever instruction adds
// it, and the float work on it is per output and group, in order. So the tiles take only the
// integer sums, 16 rows x 16 features x 32 weights in one tdpbssd (signed bytes both: u is at
// most 31), and each row's sums then meet exactly GroupSums::end's float operations, in the same
// order, on the same values (the zero point's integer start is added to the exact sum instead of
// before it: the same integer). Which rows a step has, or whether it takes this path at all,
// changes nothing in any output's bits (tests/test_kquants.py compares them at every size).
//
// What it gains, and why not more (docs/serving.md, "AMX tiles"): the products of 16 rows take
// one instruction instead of 128 vpdpbusd, but every group's sums must leave the tile (a store
// of 1 KB) and meet their scales on the vector ports, 4 float operations a row as on VNNI; on
// the Xeon measured, tile instructions and vector work hardly overlap, so a product of many rows
// is 1.1-1.3x the VNNI kernel's speed, not the 3x the instruction counts promise. Q6_K, whose
// two sums a group (a scale per 16 weights) double the stores, measured 0.86-0.92x and keeps the
// VNNI kernel.
//
// The layout fits as it is: a Group made ready holds the 8 vectors u[v] whose byte 4 f + b is
// feature f's weight k(v, b) = 4 (v / 2) + b (v even) or 16 + 4 (v / 2) + b (v odd), which is
// tdpbssd's second operand (4 bytes of K a feature, 16 features a row) with v as the row of K / 4.
// The first operand, 16 rows of x, must then meet its bytes in that order: each group's 8 pieces
// of 4 bytes as 0, 4, 1, 5, 2, 6, 3, 7 (`arrange`).
#pragma once

#if defined(STORYTELLER_KQUANTS_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define STORYTELLER_KQUANTS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace storyteller {
namespace kquants {

// Whether a step of `rows` rows is faster on the tiles. They meet a step 16 rows at a time, so its
// rows are padded to a multiple of 16 (33 rows cost them 48 rows' work), and a row on them costs
// only ~5-15% less than on the VNNI kernel: the tiles pay from 32 rows where the padding is at most
// a sixteenth of the rows (32, 46-48, 61-64, ..., every step from 241). Measured on the 1.7B file's
// products, tiles against VNNI: 1.06-1.17x at 32 rows, 1.02 at 48, 1.09 at 64; 0.85 at 33, 0.89-0.95
// at 36-44, 0.92 at 56, 0.93 at 72 (docs/serving.md).
// (TILE_ROWS, the rows of x a tile holds, and TILE_MIN_ROWS are kquants.h's: Activations pads by them.)
inline bool tiles_pay(int64_t rows) {
  const int64_t padded = (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  return rows >= TILE_MIN_ROWS && (padded - rows) * TILE_ROWS <= rows;
}

// Whether this process may use the tiles: the CPU has them, and Linux gave it their state (an
// arch_prctl asked once; a kernel or VM that refuses leaves the VNNI kernel for every step).
// `enabled` is the switch tests and benchmarks turn (kquant_tiles in kquants.cpp).
struct Tiles {
  std::atomic<bool> enabled{available()};
  static bool available() {
    static const bool granted = [] {
      constexpr long REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
      return __builtin_cpu_supports("amx-int8") && syscall(SYS_arch_prctl, REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return granted;
  }
};
static inline Tiles& tiles() {
  static Tiles t;
  return t;
}

// ldtilecfg's 64 bytes: palette 1, then each tile's bytes a row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles, even groups' and odd groups' apart (so that neither waits on the other): x (0, 1),
// the weights (2, 3), the sums (4, 5). (The intrinsics take a tile's number as a literal: the
// code below writes these numbers.)
static inline void configure() {
  TileConfig c;
  for (int t : {0, 1}) c.colsb[t] = GROUP, c.rows[t] = TILE_ROWS;
  for (int t : {2, 3}) c.colsb[t] = 4 * LANES, c.rows[t] = GROUP / 4;
  for (int t : {4, 5}) c.colsb[t] = 4 * LANES, c.rows[t] = TILE_ROWS;
  // (Not _tile_loadconfig: GCC 12 does not count its builtin as reading the bytes and dropped
  // their stores, leaving stack garbage that ldtilecfg faults on.)
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// x's bytes as the tiles load them (see the top): per block of 16 rows and group, the 16 rows' 32
// bytes side by side (512 bytes: a tile's rows read from one stretch of lines, not each from a
// line of its own), each group's 8 pieces of 4 bytes in the order 0, 4, 1, 5, 2, 6, 3, 7. Rows
// past the step's (to a multiple of 16) are zero.
static void arrange(const Activations& a, aligned_vector<int8_t>& out) {
  const int64_t blocks = (a.rows + TILE_ROWS - 1) / TILE_ROWS, tile = TILE_ROWS * GROUP;
  out.resize(blocks * a.G * tile);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < blocks * TILE_ROWS; ++r) {
    int8_t* o = out.data() + (r / TILE_ROWS * a.G * TILE_ROWS + r % TILE_ROWS) * GROUP;
    for (int64_t g = 0; g < a.G; ++g, o += tile) {
      const __m256i v = r < a.rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + r * a.K + g * GROUP))
                                   : _mm256_setzero_si256();
      _mm256_store_si256(reinterpret_cast<__m256i*>(o), _mm256_permutevar8x32_epi32(v, order));
    }
  }
}

// Rows r0..r0 + n (n <= 16, r0 a multiple of 16) of x (xt: arranged) against one panel's groups
// made ready, into out [n, 16] floats: GroupSums::end's float operations on the tiles' exact
// integer sums. A tile's sums come tens of cycles after its instruction, so group g + 1's
// products are under way before group g's sums are stored and scaled.
template <int T>
static void tile_rows(const Activations& a, const int8_t* xt, int64_t r0, int64_t n, const Group* groups, float* out,
                      const Slice& slice) {
  using F = Format<T>;
  static_assert(!F::halves, "Q6_K keeps the VNNI kernel (see the top)");
  alignas(64) int32_t sums[2][TILE_ROWS][LANES];  // [group's parity][row][feature]
  __m512 acc[TILE_ROWS];
  for (int r = 0; r < TILE_ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* x = xt + r0 * a.G * GROUP;
  const int64_t G = a.G;
  auto products = [&](int64_t g, auto parity) __attribute__((always_inline)) {
    const int8_t* xg = x + g * TILE_ROWS * GROUP;
    if constexpr (decltype(parity)::value == 0) {
      _tile_loadd(0, xg, GROUP);
      _tile_loadd(2, groups[g].u[0], 64);
      _tile_zero(4);
      _tile_dpbssd(4, 0, 2);
    } else {
      _tile_loadd(1, xg, GROUP);
      _tile_loadd(3, groups[g].u[0], 64);
      _tile_zero(5);
      _tile_dpbssd(5, 1, 3);
    }
  };
  // Every one of the 16 rows (a step's last block reads the zero rows past its end that
  // Activations keeps), with the row a constant, so that the accumulators need no index.
  const int32_t* shift_at = a.shift.data() + r0 * G;
  const float *dx_at = a.dx.data() + r0 * G, *nsum_at = a.nsum.data() + r0 * G;
  const int32_t* half_at = a.sums.data() + r0 * G * 2;
  auto scales = [&](int64_t g, auto parity) __attribute__((always_inline)) {
    const auto& s = sums[decltype(parity)::value];
    if constexpr (decltype(parity)::value == 0) _tile_stored(4, s, 64);
    else _tile_stored(5, s, 64);
    slice.fetch(g);
    if (g + AHEAD < G) {  // the tiles' loads would wait on L2 otherwise
      for (int line = 0; line < 8; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(x + (g + AHEAD) * TILE_ROWS * GROUP) + 64 * line, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(groups[g + AHEAD].u[line]), _MM_HINT_T0);
      }
    }
    const Floats scale = loadf(groups[g].scale), minimum = loadf(groups[g].minimum);
    auto row = [&](auto rc) __attribute__((always_inline)) {
      constexpr int r = decltype(rc)::value;
      const int64_t at = r * G + g;
      const int32_t* half = half_at + at * 2;
      const __m512i sum = _mm512_add_epi32(_mm512_load_si512(s[r]), _mm512_set1_epi32(-F::zero * (half[0] + half[1])));
      if constexpr (F::row_step)  // GroupSums::end's
        acc[r] = fma(to_floats(shifted(Ints{sum}, shift_at + at)), scale, Floats{acc[r]}).v;
      else
        acc[r] = fma(to_floats(Ints{sum}), mul(scale, splatf(dx_at[at])), Floats{acc[r]}).v;
      if constexpr (F::minimum) acc[r] = fma(minimum, splatf(nsum_at[at]), Floats{acc[r]}).v;
    };
    [&]<size_t... R>(std::index_sequence<R...>) __attribute__((always_inline)) {
      (row(std::integral_constant<int, R>()), ...);
    }(std::make_index_sequence<TILE_ROWS>());
  };
  using Even = std::integral_constant<int, 0>;
  using Odd = std::integral_constant<int, 1>;
  products(0, Even());
  for (int64_t g = 0; g < G; g += 2) {
    if (g + 1 < G) products(g + 1, Odd());
    scales(g, Even());
    if (g + 1 == G) break;
    if (g + 2 < G) products(g + 2, Even());
    scales(g + 1, Odd());
  }
  for (int r = 0; r < n; ++r) _mm512_store_ps(out + r * LANES, a.in_units(r0 + r, Floats{acc[r]}).v);
}

}  // namespace kquants
}  // namespace storyteller
#endif
