// What keeps a row's numbers its own in the kernels' vectorised loops, whatever else the step holds
// (docs/serving.md, "Same request, same text"; tests/test_invariance.py checks the bits).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

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

}  // namespace storyteller
