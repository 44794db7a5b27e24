// Vectors of 16 lanes for csrc/kquants.h: one AVX-512 register or two AVX2 ones, so that the
// K-quant kernel is written once and built for either (--kernel-isa). Each operation does the same
// to every lane on both instruction sets, so the two builds write the same bits.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define STORYTELLER_KQUANTS 1
#define STORYTELLER_KQUANTS_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STORYTELLER_KQUANTS 1
#endif

#ifdef STORYTELLER_KQUANTS
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace storyteller {
namespace kquants {

// 16 int32 (or 64 byte) lanes and 16 float lanes.
#ifdef STORYTELLER_KQUANTS_VNNI
struct Ints { __m512i v; };
struct Floats { __m512 v; };
static inline Ints load(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
static inline Ints bytes(int b) { return {_mm512_set1_epi8(static_cast<char>(b))}; }
static inline Ints splat(int32_t v) { return {_mm512_set1_epi32(v)}; }
static inline Ints operator&(Ints a, Ints b) { return {_mm512_and_si512(a.v, b.v)}; }
static inline Ints operator|(Ints a, Ints b) { return {_mm512_or_si512(a.v, b.v)}; }
// Each int32 lane shifted left by *n bits (n read straight from memory into every lane).
static inline Ints shifted(Ints a, const int32_t* n) { return {_mm512_sllv_epi32(a.v, _mm512_set1_epi32(*n))}; }
// Each 16-bit lane shifted by n (left if n > 0): with a byte mask after it, a shift of every byte.
template <int N>
static inline Ints shift(Ints a) {
  if constexpr (N > 0) return {_mm512_slli_epi16(a.v, N)};
  else if constexpr (N < 0) return {_mm512_srli_epi16(a.v, -N)};
  else return a;
}
// The four (signed) bytes at x in every int32 lane. (Broadcast through a general register: a float broadcast
// straight from memory, which the compiler folds into the load port, measured 1.2x slower at 64
// rows.)
static inline Ints broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof(four));
  return {_mm512_set1_epi32(four)};
}
// Product N (of 0..LAST) of an integer sum: sum + the sums of four products of u's bytes (unsigned,
// at most LARGEST) with x4's (signed), per int32 lane. vpdpbusd adds each at once; the run it
// would be pending in on AVX2 (see there) is empty here.
struct Pending {};
template <int LARGEST, int N, int LAST>
static inline void add_product(Ints& sum, Pending&, Ints u, Ints x4) { sum = {_mm512_dpbusd_epi32(sum.v, u.v, x4.v)}; }
// The same with x's four bytes broadcast by vpdpbusd's own memory operand ({1to16}), where they
// feed this one product: no broadcast of their own, which GCC emits for the intrinsic and which
// is a vector instruction more (on Zen 4, one of the ~39 a K-quant group took at one row; without
// them the one-row pass ran 1.07x faster from L2, docs/serving.md).
template <int LARGEST, int N, int LAST>
static inline void add_product_at(Ints& sum, Pending&, Ints u, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum.v) : "v"(u.v), "m"(*reinterpret_cast<const int32_t*>(x)));
}
static inline Floats to_floats(Ints a) { return {_mm512_cvtepi32_ps(a.v)}; }
static inline Floats splatf(float v) { return {_mm512_set1_ps(v)}; }
static inline Floats zerof() { return {_mm512_setzero_ps()}; }
static inline Floats mul(Floats a, Floats b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline Floats fma(Floats a, Floats b, Floats c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline Floats halves16(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline Floats ubytes16(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
static inline Floats sbytes16(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
static inline void store(Floats a, float* p) { _mm512_storeu_ps(p, a.v); }
// The value as it is, out of the compiler's algebra: -ffast-math may otherwise fold a multiply
// that made it into the next one (d sc dx as d (sc dx)) in one caller and not in another.
static inline void pin(Floats& a) { asm volatile("" : "+v"(a.v)); }
static inline Floats loadf(const float* p) { return {_mm512_load_ps(p)}; }
static inline void store_ints(Ints a, uint8_t* p) { _mm512_store_si512(p, a.v); }
#else
struct Ints { __m256i a, b; };
struct Floats { __m256 a, b; };
static inline Ints load(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
static inline Ints bytes(int b) { const __m256i v = _mm256_set1_epi8(static_cast<char>(b)); return {v, v}; }
static inline Ints splat(int32_t v) { const __m256i s = _mm256_set1_epi32(v); return {s, s}; }
static inline Ints operator&(Ints x, Ints y) { return {_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)}; }
static inline Ints operator|(Ints x, Ints y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
static inline Ints shifted(Ints x, const int32_t* n) {
  const __m256i by = _mm256_set1_epi32(*n);
  return {_mm256_sllv_epi32(x.a, by), _mm256_sllv_epi32(x.b, by)};
}
template <int N>
static inline Ints shift(Ints x) {
  if constexpr (N > 0) return {_mm256_slli_epi16(x.a, N), _mm256_slli_epi16(x.b, N)};
  else if constexpr (N < 0) return {_mm256_srli_epi16(x.a, -N), _mm256_srli_epi16(x.b, -N)};
  else return x;
}
static inline Ints broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof(four));
  const __m256i v = _mm256_set1_epi32(four);
  return {v, v};
}
// Product N (of 0..LAST) of an integer sum: sum + the sums of four products of u's bytes (unsigned,
// at most LARGEST) with x4's (signed), per int32 lane. vpmaddubsw's products come as int16 sums of
// two, which vpmaddwd widens to int32; a run of products is added in int16 first (vpaddw) and
// widened once: as many as cannot overflow int16 (|x| <= 127), so the sums stay exact. For 4-bit
// weights that is one vpmaddwd per 8 vpmaddubsw instead of one each, both on the vector
// multipliers, where vpaddw has more units to run on.
struct Pending { __m256i a, b; };
template <int LARGEST, int N, int LAST>
static inline void add_product(Ints& sum, Pending& run, Ints u, Ints x4) {
  constexpr int RUN = 32767 / (2 * LARGEST * 127);
  static_assert(RUN >= 1, "a pair of products must fit int16");
  const __m256i a = _mm256_maddubs_epi16(u.a, x4.a), b = _mm256_maddubs_epi16(u.b, x4.b);
  if constexpr (N % RUN == 0) run = {a, b};
  else run = {_mm256_add_epi16(run.a, a), _mm256_add_epi16(run.b, b)};
  if constexpr (N % RUN == RUN - 1 || N == LAST) {
    const __m256i ones = _mm256_set1_epi16(1);
    sum = {_mm256_add_epi32(sum.a, _mm256_madd_epi16(run.a, ones)), _mm256_add_epi32(sum.b, _mm256_madd_epi16(run.b, ones))};
  }
}
// Here the run is also added to at once: left free, GCC computes a pass's products first and adds
// them after, storing each to the stack and reading it back (one row from L2 on a Zen 3: 1.06x
// faster so, 1.02-1.04x at 2 and 4 rows). In kquants.h's pairs of panels the same pin cost 0.85x:
// there the weights' registers crowd the runs out, and kquants_avx2.h's pair_rows_avx2 takes the
// passes of many rows, written for it.
template <int LARGEST, int N, int LAST>
static inline void add_product_at(Ints& sum, Pending& run, Ints u, const int8_t* x) {
  add_product<LARGEST, N, LAST>(sum, run, u, broadcast4(x));
  asm volatile("" : "+x"(run.a), "+x"(run.b));
}
static inline Floats to_floats(Ints x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline Floats splatf(float v) { const __m256 s = _mm256_set1_ps(v); return {s, s}; }
static inline Floats zerof() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline Floats mul(Floats x, Floats y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline Floats fma(Floats x, Floats y, Floats z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
static inline Floats halves16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
static inline Floats ubytes16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
}
static inline Floats sbytes16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
static inline void store(Floats x, float* p) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline void pin(Floats& x) { asm volatile("" : "+v"(x.a), "+v"(x.b)); }
static inline Floats loadf(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
static inline void store_ints(Ints x, uint8_t* p) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(p), x.a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(p + 32), x.b);
}
#endif

}  // namespace kquants
}  // namespace storyteller
#endif
