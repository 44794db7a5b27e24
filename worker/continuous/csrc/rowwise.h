// What keeps a row's numbers its own in the kernels' vectorised loops, whatever else the step holds
// (docs/serving.md, "Same request, same text"; tests/test_invariance.py checks the bits).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <new>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace storyteller {

// Each row's work is a function of its own, never inlined into the loop over rows: inlined, the
// compiler specialised that loop (a row that came first in a parallel region was normed with other
// roundings than the same row later: seen in float32 here), and a row's bits then depended on
// where in the step it sat. One compiled body per row is one numeric path.
#define STORYTELLER_ROW __attribute__((noinline))

// Buffers on 64-byte boundaries. The compiler may peel a vectorised loop's first elements off to
// align its pointers, and then a reduction's order depends on where its buffer happens to start:
// a thread's buffers start wherever malloc put them, so one row's sums could differ by which
// thread ran it. Aligned, every row's loops split the same way (tests/test_invariance.py).
template <typename T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <typename U>
  Aligned(const Aligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned<U>&) const { return false; }
};
template <typename T>
using aligned_vector = std::vector<T, Aligned<T>>;

// The weight bytes the next product will read first, where the caller knows the order (the
// decoder's layers): a thread with no piece left of this product fetches them toward the cache while
// the others finish theirs (take_turns), instead of idling at the region's end. Only a hint: the
// bytes a product computes with are its own arguments, so no bits change.
struct Upcoming {
  std::atomic<const uint8_t*> at{nullptr};
  std::atomic<int64_t> bytes{0};
  std::atomic<bool> enabled{true};
};
inline Upcoming& upcoming() {
  static Upcoming u;
  return u;
}
inline void expect(const uint8_t* at, int64_t bytes) {
  upcoming().at.store(at, std::memory_order_relaxed);
  upcoming().bytes.store(at ? bytes : 0, std::memory_order_relaxed);
}
// Whether threads fetch ahead, after turning it on or off if `enable` is given (A/Bs and tests).
inline bool fetch_ahead(c10::optional<bool> enable) {
  if (enable) upcoming().enabled.store(*enable);
  return upcoming().enabled.load();
}
constexpr int64_t UPCOMING_MAX = 2 << 20;  // bytes fetched ahead at most: a core's L2 (2 MiB on Sapphire Rapids)

// Called by a thread that found no item left while `working` threads still run theirs: the
// upcoming bytes, a page at a time, until they are done (the lines land in this core's cache, or
// are on their way: the next product's first reads find them on chip).
static inline void fetch_upcoming(const std::atomic<int64_t>& working, std::atomic<int64_t>& fetched) {
  Upcoming& u = upcoming();
  if (!u.enabled.load(std::memory_order_relaxed)) return;
  const uint8_t* at = u.at.load(std::memory_order_relaxed);
  const int64_t bytes = std::min(u.bytes.load(std::memory_order_relaxed), UPCOMING_MAX);
  for (int64_t off = fetched.fetch_add(4096); off < bytes && working.load(std::memory_order_relaxed) > 0;
       off = fetched.fetch_add(4096))
    for (int64_t line = off; line < std::min(bytes, off + 4096); line += 64)
      __builtin_prefetch(at + line, 0, 2);  // to read, into L2 (x86's prefetcht1)
}

// Items 0..n run by `threads` threads, each taking the next item whenever it is free (an atomic
// counter): which thread runs an item does not change its bits. A thread left with nothing to do
// fetches the upcoming bytes while the others finish. With `ahead`, a thread claims the item it
// runs next as it starts one, and an f that takes f(i, following) is told it (-1: none), so that it
// can fetch that item's bytes toward its cache meanwhile (kquants.h, attention.h). A claimed item
// waits for its thread, so the threads may end up to an item further apart.
template <typename F>
static void take_turns(int64_t n, int64_t threads, const F& f, bool ahead = false) {
  std::atomic<int64_t> next{0}, working{threads}, fetched{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n;) {
      const int64_t following = ahead ? next++ : -1;
      if constexpr (std::is_invocable_v<F, int64_t, int64_t>) f(i, following < n ? following : -1);
      else f(i);
      i = ahead ? following : next++;
    }
    if (--working > 0) fetch_upcoming(working, fetched);
  });
}

// Indices [begin, end) split among the threads in pieces that each takes, one at a time, when it is
// free: on a small machine the API, Redis and the clients share the worker's cores, and a thread
// the system preempts then holds up only its piece, not a fixed half of the step (with a split
// fixed in advance, every step lasts as long as its slowest thread). Each index still runs on one
// thread, with the same code whichever it is, so no bits change. A thread gets `grain` indices at
// least, as with at::parallel_for (a parallel region costs ~10 us), and a piece a multiple of it.
// With `ahead`, an f that takes f(begin, end, after) is also told where its thread's next piece
// begins (-1: none; take_turns' ahead).
constexpr int64_t PIECES_PER_THREAD = 8;
template <typename F>
static void in_pieces(int64_t begin, int64_t end, int64_t grain, const F& f, bool ahead = false) {
  auto run = [&](int64_t b, int64_t e, int64_t after) {
    if constexpr (std::is_invocable_v<F, int64_t, int64_t, int64_t>) f(b, e, after);
    else f(b, e);
  };
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) return run(begin, end, -1);
  const int64_t per = threads * PIECES_PER_THREAD * grain, piece = grain * ((n + per - 1) / per);
  take_turns((n + piece - 1) / piece, threads, [&](int64_t i, int64_t following) {
    run(begin + i * piece, std::min(end, begin + (i + 1) * piece), following < 0 ? -1 : begin + following * piece);
  }, ahead);
}

#ifdef __AVX512F__
// 16 values as floats (bf16 is a float's top half: exact).
static inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m512 load16(const c10::Half* x) {  // vcvtph2ps: exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// 16 vectors' lanes each reduced by op (an add, a max), vector i's into lane 4 (i % 4) + i / 4 of
// the result, in one tree for all: lanes (l, l + 8), then (l, l + 4), (l, l + 2), (l, l + 1).
template <typename Op>
static inline __m512 reduce_lanes(const __m512 (&a)[16], const Op& op) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // quarters 0 + 2 and 1 + 3 of a vector: its lanes l and l + 8
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // then l and l + 4: four lanes left of each of four vectors
    c[i] = op(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // l and l + 2, within each quarter
    d[i] = op(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  return op(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));  // l and l + 1
}

// max|x| over each of 16 groups of 32 activations (x: the first group's), group i's in lane i:
// a maximum is exact, whichever order takes it (group_max32's bits).
template <typename T>
static inline __m512 group_maxima32x16(const T* x) {
  __m512 m[16];
  for (int i = 0; i < 16; ++i) {  // vector i of the tree lands in lane 4 (i % 4) + i / 4: give it that group
    const T* g = x + 32 * (4 * (i % 4) + i / 4);
    m[i] = _mm512_max_ps(_mm512_abs_ps(load16(g)), _mm512_abs_ps(load16(g + 16)));
  }
  return reduce_lanes(m, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

// max|x| over a group of 32 activations.
template <typename T>
static inline float group_max32(const T* x) {
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(load16(x)), _mm512_abs_ps(load16(x + 16))));
}

// A group of 32 activations rounded to 8 bits as the integer kernels take them (panels.h,
// kquants.h): q = round(x inv) to nearest, ties to even (cvtps2dq in the default rounding mode, as
// std::nearbyint in int8.h and in kquants.h's scalar loop), into out; half0 and half1 get the sums
// of q over values 0-15 and 16-31.
template <typename T>
static inline void round32(const T* x, float inv, int8_t* out, int32_t& half0, int32_t& half1) {
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x), _mm512_set1_ps(inv)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + 16), _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(qb));
  half0 = _mm512_reduce_add_epi32(qa), half1 = _mm512_reduce_add_epi32(qb);
}

// The same with inv = 127 / max|x| (panels.h: a float step per group). Returns max|x|.
template <typename T>
static inline float round_group32(const T* x, int8_t* out, int32_t& half0, int32_t& half1) {
  const float amax = group_max32(x);
  round32(x, amax > 0.f ? 127.f / amax : 0.f, out, half0, half1);
  return amax;
}

// 16 products stored in the output's type. bf16: rounded to nearest, ties to even, as c10::BFloat16
// rounds (in integers, so that CPUs without AVX512_BF16's vcvtneps2bf16 give the same bits; a
// product is never NaN here).
static inline void store16(__m512 v, float* to) { _mm512_storeu_ps(to, v); }
static inline void store16(__m512 v, c10::BFloat16* to) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif
// 16 products from `from` stored in the output's type (bf16: c10's rounding, the same bits as above).
template <typename T>
static inline void store16(const float* from, T* to) {
#ifdef __AVX512F__
  store16(_mm512_loadu_ps(from), to);
#else
  for (int i = 0; i < 16; ++i) to[i] = static_cast<T>(from[i]);
#endif
}

// The panel kernels' product (panels.h, dense_panels.h): y [rows, N] = x [rows, K] times a weight
// laid out in panels of PANEL output features. Threads split the panels, so each output is made
// by one thread; within a panel, rows go PANEL_ROWS at a time through `tile(panel, first row,
// rows, out)`, which writes rows x PANEL floats to out. Which thread or tile a row lands in does
// not change its bits: the tile's code for a row is the same at any number of rows beside it.
constexpr int64_t PANEL = 16;       // output features per panel: one lane each
constexpr int64_t PANEL_ROWS = 8;   // rows of x per pass over a panel's weights (an accumulator each)
constexpr int64_t PANEL_MIN_WORK = 1 << 19;  // multiply-adds per thread's share at least: a parallel region costs ~10 us

template <typename T, typename Tile>
static void over_panels(int64_t rows, int64_t K, int64_t N, T* y, const Tile& tile) {
  const int64_t grain = std::max<int64_t>(1, PANEL_MIN_WORK / (PANEL * K * rows));
  in_pieces(0, N / PANEL, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float out[PANEL_ROWS * PANEL];
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < rows; r0 += PANEL_ROWS) {
        const int64_t n = std::min(PANEL_ROWS, rows - r0);
        tile(p, r0, n, out);
        for (int64_t r = 0; r < n; ++r) store16(out + r * PANEL, y + (r0 + r) * N + p * PANEL);
      }
  });
}

}  // namespace storyteller
