// CPU implementation of fsdpcheck::compare and fsdpcheck::fingerprint.
//
// The per-element rules come from fsdpcheck/elementwise.h. This file only organises the work so
// that the common case is fast: a correct load is a copy, so blocks whose raw bits are equal take a
// vectorised path that hashes once and does no float64 comparison; only blocks with a differing
// element run the scalar reference comparison.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "fsdpcheck/elementwise.h"
#include "fsdpcheck/plan.h"
#include "fsdpcheck/scalar.h"

// NOTE: [SIMD dispatch] The hot loops are compiled three times (AVX-512, AVX2, baseline) and the
// loader picks one at run time (GCC ifuncs: target_clones for loops written once, and target
// multiversioning for the hash, whose vector width differs per level). Never -march=native: the
// wheel must run on any x86-64. Elsewhere the loops are compiled once for the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDPCHECK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define FSDPCHECK_MULTIVERSION 1
#else
#define FSDPCHECK_CLONES
#define FSDPCHECK_MULTIVERSION 0
#endif
#define FSDPCHECK_INLINE inline __attribute__((always_inline))

namespace fsdpcheck {
namespace simd {

// Elements per block of the vectorised path. Small enough to stay in L1 while it is read by the
// equality test, the hash and the statistics loops, large enough to amortise the calls.
constexpr int kBlock = 512;

// The loops below read elements with load_as from byte pointers: the elements of a CPU tensor
// may sit at any address (see load_as), and such loads vectorise to unaligned vector loads.
template <typename B>
FSDPCHECK_INLINE int count_neq_body(const char* a, const char* b, int m) {
  int c = 0;
  for (int j = 0; j < m; ++j) {
    c += load_as<B>(a + j * sizeof(B)) != load_as<B>(b + j * sizeof(B));
  }
  return c;
}

// Fingerprint v1 of m elements whose keys are key, key + step, ... The high and low halves are
// summed separately (the high half only mod 2**32, as it is shifted by 32) so the loop vectorises
// on 32-bit lanes. The baseline and the tails of the vector form below.
template <typename B>
FSDPCHECK_INLINE uint64_t hash_body(const char* v, int m, uint64_t key, uint64_t step) {
  uint32_t hi = 0;
  uint64_t lo = 0;
  for (int j = 0; j < m; ++j) {
    const uint32_t kl = static_cast<uint32_t>(key);
    const uint32_t kh = static_cast<uint32_t>(key >> 32);
    const B b = load_as<B>(v + j * sizeof(B));
    if constexpr (sizeof(B) == 8) {
      const uint32_t vl = static_cast<uint32_t>(b);
      const uint32_t vh = static_cast<uint32_t>(b >> 32);
      hi += fmix32(fmix32(kh ^ vh) ^ vl);
      lo += fmix32(fmix32(kl ^ vl) ^ vh);
    } else {
      const uint32_t x = b;
      hi += fmix32(kh ^ x);
      lo += fmix32(kl ^ x);
    }
    key += step;
  }
  return (static_cast<uint64_t>(hi) << 32) + lo;
}

#if FSDPCHECK_MULTIVERSION
// NOTE: [paired lanes] A 64-bit lane holding key(i) is the pair (kl, kh) of 32-bit lanes, and
// Fingerprint v1's h(i) is exactly fmix32 applied to both halves of (key(i) XOR (v, v)) (8-byte
// elements: XOR (lo, hi), fmix, XOR (hi, lo), fmix). So one fmix32 over a vector of 32-bit lanes
// hashes W/8 elements whole, h lands in its 64-bit lane as hi << 32 | lo, and the fingerprint is a
// plain 64-bit lane sum: no key halves to split out, no separate high and low sums. The element
// bits reach both halves by one shuffle per W/8 elements (zeros in the upper bytes). W is the
// vector width in bytes of the level the function is compiled for (64: AVX-512, 32: AVX2).
template <int W>
struct Lanes {
  typedef uint64_t u64 __attribute__((vector_size(W)));
  typedef uint32_t u32 __attribute__((vector_size(W)));
};

// out = the (v, v) pairs of elements [G * W/8, (G + 1) * W/8) of the W bytes at v.
template <int W, typename B, int G, size_t... T>
FSDPCHECK_INLINE void pair_elements(typename Lanes<W>::u32& out, const char* v,
                                    std::index_sequence<T...>) {
  constexpr int kPerHalf = 4 / static_cast<int>(sizeof(B));  // B lanes per 32-bit half
  constexpr int kLine = W / static_cast<int>(sizeof(B));      // B lanes per vector
  constexpr int kGroup = W / 8;                               // elements per vector of pairs
  typedef B Line __attribute__((vector_size(W), aligned(1), may_alias));
  typedef B LineValue __attribute__((vector_size(W)));
  const LineValue raw = *reinterpret_cast<const Line*>(v);
  const LineValue zero = {};
  // Lane T of the result: the low B lane of each 32-bit half takes the element of its 64-bit
  // lane; the other B lanes take zero (index kLine: lane 0 of `zero`).
  // (A cast between vector types of one size reinterprets the bits.)
  out = (typename Lanes<W>::u32)__builtin_shufflevector(
      raw, zero, (T % kPerHalf == 0 ? G * kGroup + static_cast<int>(T / kPerHalf) / 2 : kLine)...);
}

template <int W, typename B, size_t... G>
FSDPCHECK_INLINE void hash_line(const char* v, typename Lanes<W>::u64& keys,
                                const typename Lanes<W>::u64& inc, typename Lanes<W>::u64& acc,
                                std::index_sequence<G...>) {
  using U32 = typename Lanes<W>::u32;
  using U64 = typename Lanes<W>::u64;
  (
      [&] {
        U32 x;
        pair_elements<W, B, static_cast<int>(G)>(x, v, std::make_index_sequence<W / sizeof(B)>());
        // NOTE: [narrow first round] fmix32 starts with x ^= x >> 16, x = key ^ element. An
        // element of 1 or 2 bytes has no bit at 16 or above, so (key ^ element) >> 16 is
        // key >> 16 and the first round is key ^ (key >> 16) ^ element: one shift and one
        // three-way XOR (vpternlogd) instead of XOR, shift, XOR. The same bits (Fingerprint v1).
        if constexpr (sizeof(B) < 4) {
          const U32 k = (U32)keys;
          x ^= k ^ (k >> 16);
          x *= 0x85EBCA6BU;
          x ^= x >> 13;
          x *= 0xC2B2AE35U;
          x ^= x >> 16;
        } else {
          x ^= (U32)keys;
          fmix32_lanes(x);
        }
        acc += (U64)x;
        keys += inc;
      }(),
      ...);
}

// NOTE: [hash prefetch] The vector hash spends about a cycle per element on its multiplies and
// shifts, and at that pace the hardware prefetcher on an Intel Xeon (Sapphire Rapids, AVX-512)
// stopped keeping ahead: bf16 hashed at 5.8 GB/s per core from L2 and at 2.0 GB/s from memory
// (a 32 MiB tensor), while a plain sum streamed 14 GB/s. Asking for the line 4 KiB ahead of
// the one being hashed makes the hash compute-bound again: 6.1 GB/s per core from memory,
// 6.6-6.7 GB/s on two cores (3.4 before). A prefetch never faults, so reading past the end
// of a block is harmless.
constexpr int kPrefetchAhead = 4096;

template <int W, typename B>
FSDPCHECK_INLINE uint64_t hash_lanes(const char* v, int m, uint64_t key, uint64_t step) {
  using U32 = typename Lanes<W>::u32;
  using U64 = typename Lanes<W>::u64;
  constexpr int kGroup = W / 8;
  constexpr int kLine = W / static_cast<int>(sizeof(B));
  U64 keys;
  for (int t = 0; t < kGroup; ++t) keys[t] = key + static_cast<uint64_t>(t) * step;
  U64 inc = {};
  inc += static_cast<uint64_t>(kGroup) * step;
  U64 acc = {};
  int j = 0;
  for (; j + kLine <= m; j += kLine) {
    __builtin_prefetch(v + j * static_cast<int>(sizeof(B)) + kPrefetchAhead);
    if constexpr (sizeof(B) == 8) {
      typedef uint64_t Line __attribute__((vector_size(W), aligned(1), may_alias));
      const U64 w = *reinterpret_cast<const Line*>(v + j * 8);
      U32 x = (U32)(keys ^ w);
      fmix32_lanes(x);
      x ^= (U32)((w >> 32) | (w << 32));
      fmix32_lanes(x);
      acc += (U64)x;
      keys += inc;
    } else {
      hash_line<W, B>(v + j * sizeof(B), keys, inc, acc,
                      std::make_index_sequence<kLine / kGroup>());
    }
  }
  uint64_t h = 0;
  for (int t = 0; t < kGroup; ++t) h += acc[t];
  return h + hash_body<B>(v + j * sizeof(B), m - j, key + static_cast<uint64_t>(j) * step, step);
}
#endif

struct BlockStats {
  int64_t nan = 0;
  int64_t inf = 0;
  int64_t zeros = 0;
  double sum = 0.0;
  double sumsq = 0.0;
};

template <DType D>
FSDPCHECK_INLINE BlockStats stats_body(const char* v, int m, bool with_stats) {
  using T = Traits<D>;
  using B = typename T::Bits;
  BlockStats s;
  if constexpr (!T::kInteger) {
    int nan = 0, inf = 0;
    for (int j = 0; j < m; ++j) {
      const B b = load_as<B>(v + j * sizeof(B));
      nan += T::is_nan(b);
      inf += T::is_inf(b);
    }
    s.nan = nan;
    s.inf = inf;
  }
  if (with_stats) {
    int zeros = 0;
    double sum = 0.0, sumsq = 0.0;
#pragma omp simd reduction(+ : zeros, sum, sumsq)
    for (int j = 0; j < m; ++j) {
      const double x = T::to_f64(load_as<B>(v + j * sizeof(B)));
      zeros += x == 0.0;
      sum += x;
      sumsq += x * x;
    }
    s.zeros = zeros;
    s.sum = sum;
    s.sumsq = sumsq;
  }
  return s;
}

// Non-template entry points: target_clones applies to plain functions; the always_inline bodies
// above are compiled inside each clone with that clone's instruction set. The templates
// count_neq<B>, hash<B> and stats<D> name them for the callers. Pointers are to bytes (elements
// at any address, see load_as).
template <typename B>
int count_neq(const char* a, const char* b, int m);
template <typename B>
uint64_t hash(const char* v, int m, uint64_t key, uint64_t step);

#define FSDPCHECK_DEF_COUNT_NEQ(B, NAME)                                \
  FSDPCHECK_CLONES int NAME(const char* a, const char* b, int m) {      \
    return count_neq_body<B>(a, b, m);                                  \
  }                                                                     \
  template <>                                                           \
  int count_neq<B>(const char* a, const char* b, int m) {               \
    return NAME(a, b, m);                                               \
  }
FSDPCHECK_DEF_COUNT_NEQ(uint8_t, count_neq_u8)
FSDPCHECK_DEF_COUNT_NEQ(uint16_t, count_neq_u16)
FSDPCHECK_DEF_COUNT_NEQ(uint32_t, count_neq_u32)
FSDPCHECK_DEF_COUNT_NEQ(uint64_t, count_neq_u64)
#undef FSDPCHECK_DEF_COUNT_NEQ

#if FSDPCHECK_MULTIVERSION
#define FSDPCHECK_DEF_HASH_VERSIONS(B, NAME)                                                   \
  __attribute__((target("arch=x86-64-v4"))) uint64_t NAME(const char* v, int m, uint64_t key,  \
                                                           uint64_t step) {                    \
    return hash_lanes<64, B>(v, m, key, step);                                                 \
  }                                                                                            \
  __attribute__((target("arch=x86-64-v3"))) uint64_t NAME(const char* v, int m, uint64_t key,  \
                                                           uint64_t step) {                    \
    return hash_lanes<32, B>(v, m, key, step);                                                 \
  }                                                                                            \
  __attribute__((target("default"))) uint64_t NAME(const char* v, int m, uint64_t key,         \
                                                   uint64_t step) {                            \
    return hash_body<B>(v, m, key, step);                                                      \
  }
#else
#define FSDPCHECK_DEF_HASH_VERSIONS(B, NAME)                              \
  uint64_t NAME(const char* v, int m, uint64_t key, uint64_t step) {      \
    return hash_body<B>(v, m, key, step);                                 \
  }
#endif
#define FSDPCHECK_DEF_HASH(B, NAME)                                        \
  FSDPCHECK_DEF_HASH_VERSIONS(B, NAME)                                     \
  template <>                                                              \
  uint64_t hash<B>(const char* v, int m, uint64_t key, uint64_t step) {    \
    return NAME(v, m, key, step);                                          \
  }
FSDPCHECK_DEF_HASH(uint8_t, hash_u8)
FSDPCHECK_DEF_HASH(uint16_t, hash_u16)
FSDPCHECK_DEF_HASH(uint32_t, hash_u32)
FSDPCHECK_DEF_HASH(uint64_t, hash_u64)
#undef FSDPCHECK_DEF_HASH
#undef FSDPCHECK_DEF_HASH_VERSIONS

template <DType D>
BlockStats stats(const char* v, int m, bool with_stats);

#define FSDPCHECK_DEF_STATS(D, NAME)                                            \
  FSDPCHECK_CLONES BlockStats NAME(const char* v, int m, bool with_stats) {     \
    return stats_body<D>(v, m, with_stats);                                     \
  }                                                                             \
  template <>                                                                   \
  BlockStats stats<D>(const char* v, int m, bool with_stats) {                  \
    return NAME(v, m, with_stats);                                              \
  }
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) FSDPCHECK_DEF_STATS(DType::k##E, stats_##E)
FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X
#undef FSDPCHECK_DEF_STATS

std::string level() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
  return "x86-64";
#else
  return "baseline";
#endif
}

}  // namespace simd

namespace {

// NOTE: [denormals] torch.set_flush_denormal(True) turns on flush-to-zero / denormals-are-zero for
// the calling thread, which would make distinct subnormal values compare equal. Every thread that
// runs our comparisons clears those modes and restores them afterwards.
class FpEnvGuard {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FpEnvGuard() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }  // FTZ (15), DAZ (6)
  ~FpEnvGuard() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  FpEnvGuard() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t cleared = saved_ & ~(uint64_t{1} << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(cleared));
  }
  ~FpEnvGuard() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

// Elements [j0, j0 + m) of a run starting at src (stride in elements), as contiguous bytes: in
// place when contiguous (at any alignment: every loop reads with load_as), else gathered into buf.
template <typename B>
FSDPCHECK_INLINE const char* block(B* buf, const char* src, int64_t stride, int64_t j0, int m) {
  const int64_t step = stride * static_cast<int64_t>(sizeof(B));
  const char* p = src + j0 * step;
  if (stride == 1) return p;
  for (int j = 0; j < m; ++j) buf[j] = load_as<B>(p + j * step);
  return reinterpret_cast<const char*>(buf);
}

// A block's NaN and Inf counts of each side and the statistics of `actual`, added to acc.
FSDPCHECK_INLINE void add_block(Partial& acc, const simd::BlockStats& a, const simd::BlockStats& e) {
  acc.nan_a += a.nan;
  acc.nan_e += e.nan;
  acc.inf_a += a.inf;
  acc.inf_e += e.inf;
  acc.zeros += a.zeros;
  acc.sum += a.sum;
  acc.sumsq += a.sumsq;
}

// A run: n elements along the innermost coalesced dim, global indices g, g + gstep, ...
struct Run {
  int64_t n;
  int64_t g;
  int64_t gstep;
};

template <DType D>
void run_pair_same(const char* a, int64_t sa, const char* e, int64_t se, const Run& run,
                   const Options& o, Partial& acc) {
  using B = typename Traits<D>::Bits;
  alignas(64) B ba[simd::kBlock];
  alignas(64) B be[simd::kBlock];
  const uint64_t kstep = static_cast<uint64_t>(run.gstep) * kKeyMul;
  for (int64_t j0 = 0; j0 < run.n; j0 += simd::kBlock) {
    const int m = static_cast<int>(std::min<int64_t>(simd::kBlock, run.n - j0));
    const char* pa = block(ba, a, sa, j0, m);
    const char* pe = block(be, e, se, j0, m);
    const int64_t g0 = run.g + j0 * run.gstep;
    const uint64_t key = hash_key(static_cast<uint64_t>(g0));
    if (simd::count_neq<B>(pa, pe, m) == 0) {
      // Bit-equal block: one hash serves both sides; nothing can mismatch except NaN when
      // equal_nan is off; every non-NaN element has difference 0.
      if (o.fingerprints) {
        const uint64_t h = simd::hash<B>(pa, m, key, kstep);
        acc.fp_a += h;
        acc.fp_e += h;
      }
      const simd::BlockStats s = simd::stats<D>(pa, m, o.stats);
      add_block(acc, s, s);
      if (!o.cmp.equal_nan) acc.mismatched += s.nan;
      // Elements arrive in increasing global index, so only the first difference can matter.
      if (acc.max_abs_idx < 0 && s.nan < m) {
        int j = 0;
        while (Traits<D>::is_nan(load_as<B>(pa + j * sizeof(B)))) ++j;
        take_max(acc.max_abs, acc.max_abs_idx, 0.0, g0 + j * run.gstep);
        take_max(acc.max_rel, acc.max_rel_idx, 0.0, g0 + j * run.gstep);
      }
      continue;
    }
    if (o.fingerprints) {
      acc.fp_a += simd::hash<B>(pa, m, key, kstep);
      acc.fp_e += simd::hash<B>(pe, m, key, kstep);
    }
    const simd::BlockStats s_a = simd::stats<D>(pa, m, o.stats);
    const simd::BlockStats s_e = simd::stats<D>(pe, m, false);
    add_block(acc, s_a, s_e);
    for (int j = 0; j < m; ++j) {
      const ElementResult r = compare_values(decode<D>(load_as<B>(pa + j * sizeof(B))),
                                             decode<D>(load_as<B>(pe + j * sizeof(B))), o.cmp);
      acc.mismatched += r.mismatch;
      if (r.has_diff) {
        take_max(acc.max_abs, acc.max_abs_idx, r.abs_diff, g0 + j * run.gstep);
        take_max(acc.max_rel, acc.max_rel_idx, r.rel_diff, g0 + j * run.gstep);
      }
    }
  }
}

template <DType D>
void run_single(const char* a, int64_t sa, const Run& run, const Options& o, Partial& acc) {
  using B = typename Traits<D>::Bits;
  alignas(64) B ba[simd::kBlock];
  const uint64_t kstep = static_cast<uint64_t>(run.gstep) * kKeyMul;
  for (int64_t j0 = 0; j0 < run.n; j0 += simd::kBlock) {
    const int m = static_cast<int>(std::min<int64_t>(simd::kBlock, run.n - j0));
    const char* pa = block(ba, a, sa, j0, m);
    if (o.fingerprints) {
      acc.fp_a += simd::hash<B>(pa, m, hash_key(static_cast<uint64_t>(run.g + j0 * run.gstep)),
                                kstep);
    }
    if (!o.counts && !o.stats) continue;  // a fingerprint only
    add_block(acc, simd::stats<D>(pa, m, o.stats), simd::BlockStats{});
  }
}

// Calls fn(offset_a, offset_e, run) for each innermost-dim run of local elements [l0, l1), in
// order. Offsets are in elements.
template <typename Fn>
void for_each_run(const TensorPlan& p, int64_t l0, int64_t l1, Fn&& fn) {
  const int last = p.ndim - 1;
  int64_t idx[kMaxDims];
  int64_t rem = l0;
  for (int d = last; d >= 0; --d) {
    idx[d] = rem % p.size[d];
    rem /= p.size[d];
  }
  for (int64_t l = l0; l < l1;) {
    int64_t oa = 0, oe = 0, g = p.gbase;
    for (int d = 0; d <= last; ++d) {
      oa += idx[d] * p.stride_a[d];
      oe += idx[d] * p.stride_e[d];
      g += idx[d] * p.gstride[d];
    }
    const int64_t n = std::min(p.size[last] - idx[last], l1 - l);
    fn(oa, oe, Run{n, g, p.gstride[last]});
    l += n;
    idx[last] += n;
    for (int d = last; d > 0 && idx[d] == p.size[d]; --d) {
      idx[d] = 0;
      ++idx[d - 1];
    }
  }
}

void process_chunk(const TensorPlan& p, int64_t c, const Options& o, Partial& out) {
  partial_init(out);
  const int64_t l0 = c * kChunk;
  const int64_t l1 = std::min(l0 + kChunk, p.numel);
  const int last = p.ndim - 1;
  const int64_t sa = p.stride_a[last];
  const int64_t se = p.stride_e[last];
  if (p.e != nullptr && p.dtype_a != p.dtype_e) {
    // Mixed dtypes are rare (a dtype change is itself a finding): the scalar path.
    for (int64_t l = l0; l < l1; ++l) accumulate_mixed(out, p, locate(p, l), o);
    return;
  }
  visit_dtype(p.dtype_a, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using B = typename Traits<D>::Bits;
    constexpr int64_t kSize = sizeof(B);
    if (p.e == nullptr) {
      for_each_run(p, l0, l1, [&](int64_t oa, int64_t, const Run& run) {
        run_single<D>(p.a + oa * kSize, sa, run, o, out);
      });
    } else {
      for_each_run(p, l0, l1, [&](int64_t oa, int64_t oe, const Run& run) {
        run_pair_same<D>(p.a + oa * kSize, sa, p.e + oe * kSize, se, run, o, out);
      });
    }
  });
}

// NOTE: [worker pool] The chunk workers of a call run on threads of this pool, not on torch's
// OpenMP pool: libgomp's idle workers spin (GOMP_SPINCOUNT, 300000 pause loops by default) after
// every parallel region, and on a 2-core machine that spinning took the core the offline
// commands' reader thread needed: an offline fingerprint of 1.3 GB of bf16 on an AMD EPYC (2
// cores) spent ~0.1 s more CPU and ran ~30% longer than with OMP_WAIT_POLICY=PASSIVE (2.8-3x
// `cat` against ~2x, measured side by side). These threads sleep on a condition variable between
// calls. One call at a time uses the pool; a call that finds it busy (another thread of the
// process inside a kernel) runs on its own thread. After fork() the child, which has none of
// the pool's threads, starts its own.
class WorkerPool {
 public:
  // Runs body(i) for i in [0, n): i = 0 on the calling thread, the others on pool threads; waits
  // for all, then rethrows the first exception any of them raised. n <= 1 or a busy pool: every
  // i on the calling thread, in order.
  static void run(int n, const std::function<void(int)>& body) {
    WorkerPool& pool = instance();
    std::unique_lock<std::mutex> busy(pool.busy_, std::try_to_lock);
    if (n <= 1 || !busy.owns_lock()) {
      for (int i = 0; i < n; ++i) body(i);
      return;
    }
    pool.grow(n - 1);
    {
      const std::lock_guard<std::mutex> lk(pool.m_);
      pool.body_ = &body;
      pool.wanted_ = n - 1;
      pool.taken_ = 0;
      pool.done_ = 0;
      pool.error_ = nullptr;
      ++pool.round_;
    }
    pool.start_.notify_all();
    std::exception_ptr mine;
    try {
      body(0);
    } catch (...) {
      mine = std::current_exception();
    }
    std::unique_lock<std::mutex> lk(pool.m_);
    pool.finished_.wait(lk, [&] { return pool.done_ == pool.wanted_; });
    pool.body_ = nullptr;
    if (mine) std::rethrow_exception(mine);
    if (pool.error_) std::rethrow_exception(pool.error_);
  }

 private:
  static WorkerPool& instance() {
    static std::mutex m;
    static WorkerPool* current = nullptr;
    const std::lock_guard<std::mutex> lk(m);
    // Never destroyed: its threads wait until the process ends, and nothing runs at exit.
    if (current == nullptr || current->pid_ != getpid()) current = new WorkerPool();
    return *current;
  }

  // At least `count` pool threads (called with busy_ held).
  void grow(int count) {
    while (static_cast<int>(threads_.size()) < count) {
      threads_.emplace_back([this] { loop(); });
      threads_.back().detach();
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* body;
      int index;
      {
        std::unique_lock<std::mutex> lk(m_);
        start_.wait(lk, [&] { return round_ != seen && taken_ < wanted_; });
        seen = round_;
        index = 1 + taken_++;
        body = body_;
      }
      std::exception_ptr error;
      try {
        (*body)(index);
      } catch (...) {
        error = std::current_exception();
      }
      const std::lock_guard<std::mutex> lk(m_);
      if (error && !error_) error_ = error;
      if (++done_ == wanted_) finished_.notify_all();
    }
  }

  pid_t pid_ = getpid();
  std::mutex busy_;  // held by the call using the pool
  std::mutex m_;
  std::condition_variable start_;
  std::condition_variable finished_;
  std::vector<std::thread> threads_;                 // guarded by busy_
  const std::function<void(int)>* body_ = nullptr;  // guarded by m_
  uint64_t round_ = 0;                               // guarded by m_
  int wanted_ = 0;                                   // guarded by m_
  int taken_ = 0;                                    // guarded by m_
  int done_ = 0;                                     // guarded by m_
  std::exception_ptr error_;                         // guarded by m_
};

// Below this many elements a call runs on the calling thread (thread start-up would dominate).
constexpr int64_t kMinElementsPerThread = int64_t{1} << 20;

std::vector<Partial> run_plans(const std::vector<TensorPlan>& plans, const Options& o,
                               bool scalar = false) {
  const size_t n = plans.size();
  std::vector<int64_t> first_chunk(n + 1, 0);
  int64_t total_elements = 0;
  for (size_t t = 0; t < n; ++t) {
    first_chunk[t + 1] = first_chunk[t] + plan_chunks(plans[t]);
    total_elements += plans[t].numel;
  }
  const int64_t total_chunks = first_chunk[n];
  std::vector<Partial> parts(static_cast<size_t>(total_chunks));

  auto process = [&](int64_t c, size_t& t) {
    while (c >= first_chunk[t + 1]) ++t;
    Partial& part = parts[static_cast<size_t>(c)];
    if (scalar) {
      process_chunk_scalar(plans[t], c - first_chunk[t], o, part);
    } else {
      process_chunk(plans[t], c - first_chunk[t], o, part);
    }
  };
  const int64_t max_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t workers = std::min({max_threads, std::max<int64_t>(1, total_elements / kMinElementsPerThread),
                                    std::max<int64_t>(1, total_chunks)});
  if (workers == 1) {
    FpEnvGuard fp_env;
    size_t t = 0;
    for (int64_t c = 0; c < total_chunks; ++c) process(c, t);
  } else {
    // NOTE: [chunk workers] Each worker takes the next chunk from a shared counter, in order
    // (NOTE: [worker pool]): a worker slowed down (a reader thread of the offline commands on
    // the same core) takes fewer chunks instead of holding the others at the end. Each chunk
    // writes only its own partial and the second phase combines them in chunk order, so the
    // result does not depend on who took what.
    std::atomic<int64_t> next{0};
    WorkerPool::run(static_cast<int>(workers), [&](int) {
      FpEnvGuard fp_env;
      size_t t = 0;
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < total_chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        process(c, t);
      }
    });
  }

  // Second phase: combine each tensor's chunk partials in chunk order (fixed, so deterministic).
  std::vector<Partial> out(n);
  for (size_t t = 0; t < n; ++t) {
    partial_init(out[t]);
    for (int64_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) {
      partial_combine(out[t], parts[static_cast<size_t>(c)]);
    }
  }
  return out;
}

at::Tensor rows_to_tensor(const std::vector<Partial>& rows) {
  at::Tensor out = at::empty({static_cast<int64_t>(rows.size()), kPartialWords}, at::kLong);
  if (!rows.empty()) std::memcpy(out.data_ptr(), rows.data(), rows.size() * sizeof(Partial));
  return out;
}

at::Tensor compare_cpu(at::TensorList actual, at::TensorList expected, at::IntArrayRef box_shapes,
                       at::IntArrayRef box_offsets, double rtol, double atol, bool equal_nan,
                       bool fingerprints, bool stats) {
  check_tolerances(rtol, atol);
  const std::vector<TensorPlan> plans =
      make_plans("compare", actual, &expected, box_shapes, box_offsets);
  const Options o{CompareParams{rtol, atol, equal_nan}, fingerprints, stats};
  return rows_to_tensor(run_plans(plans, o));
}

at::Tensor reference_cpu(at::TensorList actual, at::TensorList expected,
                         at::IntArrayRef box_shapes, at::IntArrayRef box_offsets, double rtol,
                         double atol, bool equal_nan, bool fingerprints, bool stats, bool single) {
  check_tolerances(rtol, atol);
  const std::vector<TensorPlan> plans = make_plans("_reference", actual, single ? nullptr : &expected,
                                                   box_shapes, box_offsets);
  const Options o{CompareParams{rtol, atol, equal_nan}, fingerprints, stats};
  return rows_to_tensor(run_plans(plans, o, /*scalar=*/true));
}

at::Tensor fingerprint_cpu(at::TensorList tensors, at::IntArrayRef box_shapes,
                           at::IntArrayRef box_offsets) {
  const std::vector<TensorPlan> plans =
      make_plans("fingerprint", tensors, nullptr, box_shapes, box_offsets);
  const Options o{CompareParams{0.0, 0.0, true}, true, false, /*counts=*/false};
  const std::vector<Partial> rows = run_plans(plans, o);
  at::Tensor out = at::empty({static_cast<int64_t>(rows.size())}, at::kLong);
  int64_t* dst = out.data_ptr<int64_t>();
  for (size_t t = 0; t < rows.size(); ++t) dst[t] = static_cast<int64_t>(rows[t].fp_a);
  return out;
}

[[maybe_unused]] const bool kRegistered = (register_backend("cpu", "simd=" + simd::level()), true);

}  // namespace

TORCH_LIBRARY_IMPL(fsdpcheck, CPU, m) {
  m.impl("compare", &compare_cpu);
  m.impl("fingerprint", &fingerprint_cpu);
  m.impl("_reference", &reference_cpu);
}

}  // namespace fsdpcheck
