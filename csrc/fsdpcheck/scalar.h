// The scalar path: every element of a chunk through the same header functions the CUDA kernels
// call (chunk_start, locate_in_chunk, accumulate_element, accumulate_mixed), one after another on
// one host thread. fsdpcheck::_reference runs it; the emulator's self-test compares against it.
// Host only, and free of torch, so that a plain C++ program can use it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fsdpcheck/elementwise.h"

namespace fsdpcheck {

inline void process_chunk_scalar(const TensorPlan& p, int64_t c, const Options& o, Partial& out) {
  partial_init(out);
  const int64_t l0 = c * kChunk;
  const int64_t l1 = std::min(l0 + kChunk, p.numel);
  const ChunkStart start = chunk_start(p, l0);
  if (p.e != nullptr && p.dtype_a != p.dtype_e) {
    for (int64_t l = l0; l < l1; ++l) accumulate_mixed(out, p, locate_in_chunk(p, start, l - l0), o);
    return;
  }
  visit_dtype(p.dtype_a, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using B = typename Traits<D>::Bits;
    constexpr int64_t kSize = sizeof(B);
    for (int64_t l = l0; l < l1; ++l) {
      const Location loc = locate_in_chunk(p, start, l - l0);
      const uint64_t key = hash_key(static_cast<uint64_t>(loc.g));
      const B ba = load_as<B>(p.a + loc.off_a * kSize);
      if (p.e == nullptr) {
        accumulate_element<D, false>(out, ba, B{0}, loc.g, key, o);
      } else {
        accumulate_element<D, true>(out, ba, load_as<B>(p.e + loc.off_e * kSize), loc.g, key, o);
      }
    }
  });
}

}  // namespace fsdpcheck
