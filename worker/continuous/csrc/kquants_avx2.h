// The K-quant products of a step of many rows on AVX2 without AVX-512: up to 32 rows 8 rows a
// vector, where kquants.h holds 16 features a vector; beyond, kquants.h's pairs of panels, their
// passes after the first written for AVX2's registers (pair_rows_avx2). The same bits as kquants.h's
// kernel, which this file is part of (included there after the Group a panel is made ready into,
// as kquants_amx.h is).
//
// Why another layout: kquants.h's vectors hold 16 features (two AVX2 registers each) and meet a
// row's 4 bytes of x broadcast, so a pass over two panels holds 2 rows (their int16 runs, int32
// sums and float accumulators already want more than AVX2's 16 registers), and up to 32 rows it
// takes the panels' nibbles apart again every 2 rows. Here each panel is made ready once, and a
// vector holds 8 rows' 4 bytes of x, loaded as they lie (`Columns` lays them out once a step),
// meeting one feature's 4 bytes of weights broadcast straight from the Group made ready (a load,
// no vector work). A pass of 8 rows x F features keeps, per feature, one int16 run and one float
// accumulator (Q5, Q6: and an int32 sum): 12 registers at F = 6 (Q4) or 4.
//
// Why the same bits: an output's integer sums are exact whichever way they are added (a run of
// products in int16 is as long as cannot overflow, as in lanes.h), and the float operations on
// them are GroupSums::end's, per output and group in the same order on the same values: each sum
// shifted by its row's shift times scale_f (Q5_0, Q5_1: times scale_f dx_r), then the minimum's
// fma of M and the row's factor, and the row's unit multiplies the output at the end.
// tests/test_kquants.py compares the bits at every step size.
#pragma once
#if defined(STORYTELLER_KQUANTS) && !defined(STORYTELLER_KQUANTS_VNNI)
#define STORYTELLER_KQUANTS_COLUMNS 1
#include <atomic>

namespace storyteller {
namespace kquants {

constexpr int64_t COLUMN_ROWS = 8;  // rows a vector
// Whether a step of `rows` rows takes this kernel: from a block of 8 rows up to 32 (where
// kquants.h met pairs of panels straight from their bytes until 2026-12-06; its DIRECT_ROWS is
// lower since, for AVX-512, and this range was measured against that).
// On a 2-core Zen 1 it made the 1.7B file's products 1.09-1.11x faster at 8-15 rows and its steps
// 1.16-1.18x at 16-32; beyond, within the noise (1.02x, Q6_K alone 0.94-0.97x; docs/serving.md).
constexpr int64_t COLUMN_MAX_ROWS = 32;
inline bool columns_pay(int64_t rows) { return rows >= COLUMN_ROWS && rows <= COLUMN_MAX_ROWS; }
// Off for A/B benchmarks and the tests that compare the two kernels' bits (kquant_columns).
static inline std::atomic<bool>& columns_enabled() {
  static std::atomic<bool> on{true};
  return on;
}

// The step's rounded activations as this kernel reads them: per block of 8 rows and group, the
// group's 8 pieces of 4 bytes in the order of a Group's vectors (weights 0, 16, 4, 20, 8, 24, 12,
// 28 and the 3 after each), each piece's 8 rows side by side (32 bytes), and the 8 rows' shifts,
// minimums' factors and sums over each half group (Activations has them row by row).
struct Columns {
  int64_t blocks = 0, G = 0;
  aligned_vector<int32_t> x;      // [blocks][G][8 pieces][8 rows], 4 bytes each
  aligned_vector<int32_t> shift;  // [blocks][G][8 rows]
  aligned_vector<float> dx, nsum; // [blocks][G][8 rows]
  aligned_vector<int32_t> half;   // [blocks][G][2 halves][8 rows]

  void fill(const Activations& a) {  // the step's whole blocks of 8 rows
    blocks = a.rows / COLUMN_ROWS, G = a.G;
    x.resize(blocks * G * 8 * COLUMN_ROWS);  // every element written below
    shift.resize(blocks * G * COLUMN_ROWS);
    dx.resize(blocks * G * COLUMN_ROWS);
    nsum.resize(blocks * G * COLUMN_ROWS);
    half.resize(blocks * G * 2 * COLUMN_ROWS);
    for (int64_t row = 0; row < blocks * COLUMN_ROWS; ++row) {
      const int64_t b = row / COLUMN_ROWS, r = row % COLUMN_ROWS;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = (b * G + g) * COLUMN_ROWS + r;
        const int8_t* q = a.q.data() + row * a.K + g * GROUP;
        for (int v = 0; v < 8; ++v) std::memcpy(&x[(b * G + g) * 8 * COLUMN_ROWS + v * COLUMN_ROWS + r], q + 4 * (v / 2) + 16 * (v % 2), 4);
        shift[at] = a.shift[row * G + g];
        dx[at] = a.dx[row * G + g];
        nsum[at] = a.nsum[row * G + g];
        half[(b * G + g) * 2 * COLUMN_ROWS + r] = a.sums[(row * G + g) * 2];
        half[(b * G + g) * 2 * COLUMN_ROWS + COLUMN_ROWS + r] = a.sums[(row * G + g) * 2 + 1];
      }
    }
  }
};

static inline __m256i feature4(const uint8_t* u) {  // a feature's 4 bytes in every int32 lane
  int32_t four;
  std::memcpy(&four, u, sizeof(four));
  return _mm256_set1_epi32(four);
}

// Block b's 8 rows against features f0..f0 + F of a panel's groups made ready: acc[f] holds
// feature f0 + f's 8 rows. Per group: the integer sum of each part (Q6_K: weights 0-15, then
// 16-31; else all 32), from the zero point's start, into acc with its scale, then the minimum.
template <int T, int F>
static inline void column_tile(const Columns& c, int64_t b, const Group* groups, int f0, __m256* acc) {
  using Fmt = Format<T>;
  constexpr int RUN = 32767 / (2 * ((1 << Fmt::bits) - 1) * 127);  // products an int16 run holds
  constexpr int PARTS = Fmt::halves ? 2 : 1, PIECES = 8 / PARTS;   // part h: vectors h, h + PARTS, ...
  constexpr int SHIFT = Fmt::zero == 32 ? 5 : 4;                   // zero = 1 << SHIFT where it is not 0
  const __m256i ones = _mm256_set1_epi16(1);
  for (int f = 0; f < F; ++f) acc[f] = _mm256_setzero_ps();
  const int64_t at = b * c.G;
  const int32_t* x = c.x.data() + at * 8 * COLUMN_ROWS;
  const int32_t* shift = c.shift.data() + at * COLUMN_ROWS;
  const float *dx = c.dx.data() + at * COLUMN_ROWS, *nsum = c.nsum.data() + at * COLUMN_ROWS;
  const int32_t* half = c.half.data() + at * 2 * COLUMN_ROWS;
  for (int64_t g = 0; g < c.G; ++g, x += 8 * COLUMN_ROWS, shift += COLUMN_ROWS, dx += COLUMN_ROWS, nsum += COLUMN_ROWS, half += 2 * COLUMN_ROWS) {
    const Group& group = groups[g];
    const __m256i by = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift));
    auto part = [&](auto h_, const float* scale) __attribute__((always_inline)) {
      constexpr int h = decltype(h_)::value;
      __m256i sum[F];
      if constexpr (Fmt::zero != 0) {  // -zero sum(q) over the part's weights
        const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(half)),
                      hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(half + COLUMN_ROWS));
        const __m256i s = PARTS == 2 ? (h == 0 ? lo : hi) : _mm256_add_epi32(lo, hi);
        const __m256i start = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, SHIFT));
        for (int f = 0; f < F; ++f) sum[f] = start;
      } else {
        for (int f = 0; f < F; ++f) sum[f] = _mm256_setzero_si256();
      }
      for (int i = 0; i < PIECES; i += RUN) {
        __m256i run[F];
        for (int j = i; j < i + RUN && j < PIECES; ++j) {
          const int v = h + PARTS * j;
          const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + v * COLUMN_ROWS));
          for (int f = 0; f < F; ++f) {
            const __m256i p = _mm256_maddubs_epi16(feature4(group.u[v] + 4 * (f0 + f)), xv);
            run[f] = j == i ? p : _mm256_add_epi16(run[f], p);
          }
        }
        for (int f = 0; f < F; ++f) sum[f] = _mm256_add_epi32(sum[f], _mm256_madd_epi16(run[f], ones));
      }
      for (int f = 0; f < F; ++f) {
        if constexpr (Fmt::row_step)
          acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sllv_epi32(sum[f], by)), _mm256_set1_ps(scale[f0 + f]), acc[f]);
        else
          acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[f]), _mm256_mul_ps(_mm256_set1_ps(scale[f0 + f]), _mm256_load_ps(dx)), acc[f]);
      }
    };
    part(std::integral_constant<int, 0>(), group.scale);
    if constexpr (PARTS == 2) part(std::integral_constant<int, 1>(), group.scale2);
    if constexpr (Fmt::minimum) {
      const __m256 n = _mm256_load_ps(nsum);
      for (int f = 0; f < F; ++f) acc[f] = _mm256_fmadd_ps(_mm256_set1_ps(group.minimum[f0 + f]), n, acc[f]);
    }
  }
}

// Two rows against two panels made ready (kquants.h's pair_rows<T, 2>, the passes of a step of more
// than COLUMN_MAX_ROWS rows after its first), written for AVX2's 16 registers: a sum's products are
// taken vector by vector (Q6_K: its first half's four, then its second's), each added to its int16
// run at once (pinned, as lanes.h's add_product_at does), so that the 8 runs of a vector (2 rows x
// 2 panels x 2 registers), its 4 registers of weights and a broadcast of x stay in registers. Left
// to itself GCC computed a group's 64 products first and added them after, through the stack
// (pair_rows<T, 2>'s loop read or wrote the stack ~150 times a group). The integer sums are exact
// in any order, and each output's float operations are GroupSums::end's in its order (a half's
// scale, then the second's; then the minimum): the same bits. On a Zen 3, every layer of the 1.7B
// file at 64 rows: 1.29x (1.17-1.32, 5 rounds).
template <int T>
static void pair_rows_avx2(const Activations& a, int64_t r0, const Group* first, const Group* second, float* out,
                           float* next_out, const Slice& slice) {
  using F = Format<T>;
  constexpr int LARGEST = (1 << F::bits) - 1, RUN = 32767 / (2 * LARGEST * 127);  // as lanes.h's add_product
  constexpr int PARTS = F::halves ? 2 : 1, PER = 8 / PARTS;  // sums a group, products a sum
  alignas(32) float acc[2][2][LANES] = {};  // [row][panel][feature]
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < a.G; ++g) {
    slice.fetch(g);
    const int64_t at0 = r0 * a.G + g, at1 = at0 + a.G;
    const int8_t *x0 = a.q.data() + r0 * a.K + g * GROUP, *x1 = x0 + a.K;
    const uint8_t *w0 = first[g].u[0], *w1 = second[g].u[0];
    auto part = [&](auto h_) __attribute__((always_inline)) {  // a sum's products: vectors h, h + PARTS, ...
      constexpr int h = decltype(h_)::value;
      // Runs and sums by [row][panel][register], named: GCC keeps these in registers, arrays not.
      __m256i r000, r001, r010, r011, r100, r101, r110, r111;
      const int32_t *s0 = a.sums.data() + at0 * 2, *s1 = a.sums.data() + at1 * 2;
      const __m256i start0 = _mm256_set1_epi32(PARTS == 2 ? -F::zero * s0[h] : -F::zero * (s0[0] + s0[1]));
      const __m256i start1 = _mm256_set1_epi32(PARTS == 2 ? -F::zero * s1[h] : -F::zero * (s1[0] + s1[1]));
      __m256i s000 = start0, s001 = start0, s010 = start0, s011 = start0;
      __m256i s100 = start1, s101 = start1, s110 = start1, s111 = start1;
      auto product = [&](auto n_) __attribute__((always_inline)) {
        constexpr int n = decltype(n_)::value, v = h + PARTS * n, off = 4 * (v / 2) + 16 * (v % 2);
        auto add = [&](__m256i& run, __m256i& sum, __m256i u, __m256i x4) __attribute__((always_inline)) {
          const __m256i p = _mm256_maddubs_epi16(u, x4);
          run = n % RUN == 0 ? p : _mm256_add_epi16(run, p);
          asm volatile("" : "+x"(run));  // added now
          if constexpr (n % RUN == RUN - 1 || n == PER - 1) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(run, ones));
        };
        const __m256i u00 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w0 + 64 * v));
        const __m256i u01 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w0 + 64 * v + 32));
        const __m256i u10 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w1 + 64 * v));
        const __m256i u11 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w1 + 64 * v + 32));
        const __m256i a4 = broadcast4(x0 + off).a;
        add(r000, s000, u00, a4), add(r001, s001, u01, a4), add(r010, s010, u10, a4), add(r011, s011, u11, a4);
        const __m256i b4 = broadcast4(x1 + off).a;
        add(r100, s100, u00, b4), add(r101, s101, u01, b4), add(r110, s110, u10, b4), add(r111, s111, u11, b4);
      };
      [&]<size_t... N>(std::index_sequence<N...>) __attribute__((always_inline)) {
        (product(std::integral_constant<int, N>()), ...);
      }(std::make_index_sequence<PER>());
      // GroupSums::end's first float operation (and Q6_K's second), per output.
      auto end = [&](float* to, __m256i sum, const float* scale, int64_t at) __attribute__((always_inline)) {
        const __m256 s = _mm256_load_ps(scale);
        __m256 v = _mm256_load_ps(to);
        if constexpr (F::row_step) v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sllv_epi32(sum, _mm256_set1_epi32(a.shift[at]))), s, v);
        else v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s, _mm256_set1_ps(a.dx[at])), v);
        _mm256_store_ps(to, v);
      };
      const float *sc0 = h == 0 ? first[g].scale : first[g].scale2, *sc1 = h == 0 ? second[g].scale : second[g].scale2;
      end(acc[0][0], s000, sc0, at0), end(acc[0][0] + 8, s001, sc0 + 8, at0);
      end(acc[0][1], s010, sc1, at0), end(acc[0][1] + 8, s011, sc1 + 8, at0);
      end(acc[1][0], s100, sc0, at1), end(acc[1][0] + 8, s101, sc0 + 8, at1);
      end(acc[1][1], s110, sc1, at1), end(acc[1][1] + 8, s111, sc1 + 8, at1);
    };
    part(std::integral_constant<int, 0>());
    if constexpr (PARTS == 2) part(std::integral_constant<int, 1>());
    if constexpr (F::minimum)  // then the minimum's
      for (int r = 0; r < 2; ++r)
        for (int k = 0; k < LANES; k += 8) {
          const __m256 factor = _mm256_set1_ps(a.nsum[r == 0 ? at0 : at1]);
          _mm256_store_ps(acc[r][0] + k, _mm256_fmadd_ps(_mm256_load_ps(first[g].minimum + k), factor, _mm256_load_ps(acc[r][0] + k)));
          _mm256_store_ps(acc[r][1] + k, _mm256_fmadd_ps(_mm256_load_ps(second[g].minimum + k), factor, _mm256_load_ps(acc[r][1] + k)));
        }
  }
  for (int r = 0; r < 2; ++r)
    store(a.in_units(r0 + r, loadf(acc[r][0])), out + r * LANES), store(a.in_units(r0 + r, loadf(acc[r][1])), next_out + r * LANES);
}

// y [rows, N] = x times the packed weight for a step that columns_pay: threads take
// panels in pieces (each output made by one thread); each panel is made ready once, then met 8
// rows and F features a pass. The rows past the last whole 8 (fewer than 8) take kquants.h's
// tiles of a few rows, straight from the panel's bytes (tile: its row_tiles), rather than a
// block padded with rows of zeros: at 17 rows a block of 8 would cost more than the 1 row.
template <int T, typename X, typename Tile>
static void column_linear(const Activations& a, const uint8_t* w, X* y, int64_t N, const Tile& tile) {
  constexpr int WIDE = Format<T>::bits == 4 ? 6 : 4;  // features a pass: 3 registers a feature beyond 4 bits
  thread_local Columns kept;
  Columns& c = kept;
  c.fill(a);
  const int64_t panel_bytes = Format<T>::bytes(a.G), panels = N / LANES;
  const int64_t grain = std::max<int64_t>(1, MIN_WORK / (LANES * a.K * a.rows));
  in_pieces(0, panels, grain, [&](int64_t begin, int64_t end) {
    thread_local aligned_vector<Group> ready;
    ready.resize(a.G);
    alignas(32) float out[LANES][COLUMN_ROWS];     // [feature][row], as the accumulators hold them
    alignas(64) float rows_out[COLUMN_ROWS][LANES];  // [row][feature], as y holds them
    for (int64_t p = begin; p < end; ++p) {
      unpack<T>(w + p * panel_bytes, a.G, ready.data());
      for (int64_t b = 0; b < c.blocks; ++b) {
        __m256 acc[WIDE];
        int f0 = 0;
        const __m256 unit = _mm256_loadu_ps(a.unit.data() + b * COLUMN_ROWS);  // the 8 rows' (Activations::in_units)
        for (; f0 + WIDE <= LANES; f0 += WIDE) {
          column_tile<T, WIDE>(c, b, ready.data(), f0, acc);
          for (int f = 0; f < WIDE; ++f) _mm256_store_ps(out[f0 + f], _mm256_mul_ps(acc[f], unit));
        }
        if (f0 < LANES) {  // 6 + 6 + 4
          static_assert(LANES % WIDE == 0 || LANES % WIDE == 4, "the last pass takes 4 features");
          column_tile<T, 4>(c, b, ready.data(), f0, acc);
          for (int f = 0; f < 4; ++f) _mm256_store_ps(out[f0 + f], _mm256_mul_ps(acc[f], unit));
        }
        for (int64_t r = 0; r < COLUMN_ROWS; ++r) {
          for (int f = 0; f < LANES; ++f) rows_out[r][f] = out[f][r];
          store16(rows_out[r], y + (b * COLUMN_ROWS + r) * N + p * LANES);
        }
      }
      for (int64_t r0 = c.blocks * COLUMN_ROWS; r0 < a.rows; r0 += ROWS) {
        const int64_t n = std::min<int64_t>(ROWS, a.rows - r0);
        tile[n - 1](a, r0, w + p * panel_bytes, rows_out[0]);
        for (int64_t r = 0; r < n; ++r) store16(rows_out[0] + r * LANES, y + (r0 + r) * N + p * LANES);
      }
    }
  });
}

}  // namespace kquants
}  // namespace storyteller
#endif
