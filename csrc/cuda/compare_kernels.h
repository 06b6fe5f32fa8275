// The CUDA kernels of fsdpcheck::compare and fsdpcheck::fingerprint, and their launch.
//
// Two phases, as in apex's multi-tensor reductions, for determinism: the chunk kernels write one
// Partial per chunk (NOTE: [chunks] in elementwise.h), the finishing kernel combines each tensor's
// chunks in a fixed order. No floating-point atomics anywhere. Per-element rules come from
// fsdpcheck/elementwise.h, the same code the CPU's fsdpcheck::_reference op runs.
//
// Two chunk kernels (NOTE: [launches] in launch.h): the vector kernel, for what real checkpoints
// hold (contiguous, aligned, one dtype on both sides), and the general kernel for every other
// layout (strided, boxes of several dims, mixed dtypes, misaligned views).
//
// NOTE: [two compilers] This header is compiled twice: by nvcc in compare_kernels.cu, and by the
// C++ compiler in csrc/emulator/compare_emulated.cpp, where csrc/emulator/cuda_shim.h runs each
// block's threads as host threads (fsdpcheck::_emulated, in every CI). The includer defines what
// differs, so that the code below is the same text for both:
//   FSDPCHECK_DEVICE / FSDPCHECK_DEVICE_INLINE   __device__ (__forceinline__) functions
//   FSDPCHECK_GLOBAL(threads[, min_blocks])      a __global__ kernel and its launch bounds
//   FSDPCHECK_SHARED(T, name)                    a __shared__ variable of the running block
//   FSDPCHECK_UNROLL / FSDPCHECK_NO_UNROLL       #pragma unroll / #pragma unroll 1
//   FSDPCHECK_LOAD_VEC(words, ptr)               a 16-byte load (uint32_t[4]) from global memory
//   FSDPCHECK_LAUNCH(kernel, grid, block, stream, args...)   kernel<<<grid, block, 0, stream>>>
// and threadIdx, blockIdx, __syncthreads, __syncthreads_or and __shfl_down_sync.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda/launch.h"
#include "fsdpcheck/elementwise.h"

namespace fsdpcheck::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
// block_reduce: whole warps only, and one warp can combine the results of every warp.
static_assert(kThreads % kWarpSize == 0 && kWarps <= kWarpSize,
              "a block is whole warps, at most 32 of them");
// Elements each thread of the general kernel loads before it processes them.
constexpr int kUnroll = 2;

// ---------------------------------------------------------------------------------------------
// Block-wide reductions.
// ---------------------------------------------------------------------------------------------

// v from the lane `offset` above (every lane of the warp takes part).
template <typename T>
FSDPCHECK_DEVICE_INLINE T shfl_down(T v, int offset) {
  constexpr unsigned kMask = 0xFFFFFFFFu;
  return __shfl_down_sync(kMask, v, offset);
}

// Block-wide combination of T (T::shfl_combine(x, offset): x combined with the T of the lane
// `offset` above; T::identity()) in a fixed tree order (deterministic float sums). The result is
// valid in thread 0. Every thread of the block must call it. Ends with a barrier, so that the
// next call cannot overwrite warp_results while warp 0 still reads them.
template <typename T>
FSDPCHECK_DEVICE void block_reduce(T& x) {
  using WarpResults = T[kWarps];
  FSDPCHECK_SHARED(WarpResults, warp_results);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) T::shfl_combine(x, offset);
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? warp_results[lane] : T::identity();
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) T::shfl_combine(x, offset);
  }
  __syncthreads();
}

// The Partial of elementwise.h, as block_reduce wants it. Field by field (partial_combine's
// rules), so that only one field of the other lane is in registers at a time.
struct FullResult {
  Partial p;
  FSDPCHECK_DEVICE_INLINE static void shfl_combine(FullResult& x, int offset) {
    Partial& p = x.p;
    p.mismatched += shfl_down(p.mismatched, offset);
    p.nan_a += shfl_down(p.nan_a, offset);
    p.nan_e += shfl_down(p.nan_e, offset);
    p.inf_a += shfl_down(p.inf_a, offset);
    p.inf_e += shfl_down(p.inf_e, offset);
    p.zeros += shfl_down(p.zeros, offset);
    p.fp_a += shfl_down(p.fp_a, offset);
    p.fp_e += shfl_down(p.fp_e, offset);
    const double abs = shfl_down(p.max_abs, offset);
    take_max(p.max_abs, p.max_abs_idx, abs, shfl_down(p.max_abs_idx, offset));
    const double rel = shfl_down(p.max_rel, offset);
    take_max(p.max_rel, p.max_rel_idx, rel, shfl_down(p.max_rel_idx, offset));
    p.sum += shfl_down(p.sum, offset);
    p.sumsq += shfl_down(p.sumsq, offset);
  }
  FSDPCHECK_DEVICE_INLINE static FullResult identity() {
    FullResult r;
    partial_init(r.p);
    return r;
  }
};

// ---------------------------------------------------------------------------------------------
// Items (NOTE: [launches] in launch.h).
// ---------------------------------------------------------------------------------------------

// The last item whose first local chunk is <= c.
FSDPCHECK_DEVICE int find_item(const Item* items, int n, int64_t c) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (items[mid].local <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The local chunks of this block: [begin, end).
FSDPCHECK_DEVICE_INLINE void block_chunks(int64_t chunks, unsigned grid, int64_t& begin,
                                          int64_t& end) {
  begin = static_cast<int64_t>(blockIdx.x) * chunks / grid;
  end = (static_cast<int64_t>(blockIdx.x) + 1) * chunks / grid;
}

// ---------------------------------------------------------------------------------------------
// The vector kernel.
// ---------------------------------------------------------------------------------------------

// NOTE: [bit-equal fast path] A correct load is a copy, so nearly every 16-byte vector of actual
// is bit for bit the vector of expected, and holds no NaN or infinity. Such a vector is settled
// with word operations: XOR of the two sides' words (any difference), and the special-value test
// below on actual's words; then every element counts as a match with difference 0, NaN/Inf
// counts do not move, and one hash per element serves both fingerprints. Only a vector that
// fails either test goes element by element through accumulate_element (tolerance, maxima with
// their global index, NaN/Inf classes), into the thread's Tally (NOTE: [tally]).

constexpr int kVecBytes = 16;
constexpr int kVecWords = kVecBytes / 4;
struct alignas(kVecBytes) Vec {
  uint32_t w[kVecWords];
};
// The vector at p, with one 16-byte load from global memory (nvcc: the read-only path, LDG.128;
// the address arrives as an integer, from which it would emit generic loads otherwise).
FSDPCHECK_DEVICE_INLINE Vec load_vec(const Vec* p) {
  Vec v;
  FSDPCHECK_LOAD_VEC(v.w, p);
  return v;
}

// Vectors each thread of the vector kernel loads before it processes them: with 32 warps per SM,
// 2 x 32 B in flight per thread of a pair (64 KiB per SM).
constexpr int kVecUnroll = 2;

// Non-zero iff an element of the vector is NaN or infinite (NOTE: [special words] in
// elementwise.h): the words' masked sums ORed, then one test.
template <DType D>
FSDPCHECK_DEVICE_INLINE uint32_t special_bits(const Vec& v) {
  using S = SpecialWords<D>;
  constexpr bool kWide = sizeof(typename Traits<D>::Bits) == 8;
  uint32_t s = 0;
  FSDPCHECK_UNROLL
  for (int i = kWide ? 1 : 0; i < kVecWords; i += kWide ? 2 : 1) s |= (v.w[i] & S::kMask) + S::kAdd;
  return s & S::kTop;
}

// The raw bits of element j of a vector (little-endian lanes, as on every CUDA device and on the
// hosts the emulator runs on).
template <typename B>
FSDPCHECK_DEVICE_INLINE B vec_element(const Vec& v, int j) {
  if constexpr (sizeof(B) == 8) {
    return static_cast<B>(v.w[2 * j]) | (static_cast<B>(v.w[2 * j + 1]) << 32);
  } else {
    constexpr int kPerWord = 4 / static_cast<int>(sizeof(B));
    return static_cast<B>(v.w[j / kPerWord] >> (8 * sizeof(B) * (j % kPerWord)));
  }
}

// What a thread accumulates on the fast path of one chunk: the common fingerprint (NOTE:
// [bit-equal fast path]: the same on both sides), the chunk-relative offset of its first
// fast-path element (difference 0 there: the maxima's smallest index of a 0 difference) and, with
// kStats, the statistics of actual. Also what block_reduce combines when no thread of the block
// left the fast path.
template <bool kStats>
struct Fast {
  uint64_t fp;
  int32_t first;  // kChunk: none
  uint32_t zeros;
  FSDPCHECK_DEVICE_INLINE static Fast identity() { return Fast{0, kChunk, 0}; }
  FSDPCHECK_DEVICE_INLINE static void shfl_combine(Fast& x, int offset) {
    x.fp += shfl_down(x.fp, offset);
    const int32_t first = shfl_down(x.first, offset);
    x.first = x.first < first ? x.first : first;
  }
  FSDPCHECK_DEVICE_INLINE void add(double) {}
};
template <>
struct Fast<true> {
  uint64_t fp;
  int32_t first;
  uint32_t zeros;
  double sum;
  double sumsq;
  FSDPCHECK_DEVICE_INLINE static Fast identity() { return Fast{0, kChunk, 0, 0.0, 0.0}; }
  FSDPCHECK_DEVICE_INLINE static void shfl_combine(Fast& x, int offset) {
    x.fp += shfl_down(x.fp, offset);
    const int32_t first = shfl_down(x.first, offset);
    x.first = x.first < first ? x.first : first;
    x.zeros += shfl_down(x.zeros, offset);
    x.sum = add_rn(x.sum, shfl_down(x.sum, offset));
    x.sumsq = add_rn(x.sumsq, shfl_down(x.sumsq, offset));
  }
  // The same arithmetic as accumulate_stats.
  FSDPCHECK_DEVICE_INLINE void add(double f) {
    zeros += f == 0.0;
    sum = add_rn(sum, f);
    sumsq = add_rn(sumsq, mul_rn(f, f));
  }
};

// The Partial of a chunk from a thread's fast-path result (the element at chunk-relative offset
// x.first has global index g0 + x.first * gstride).
template <bool kHasE, bool kStats>
FSDPCHECK_DEVICE_INLINE void fold_fast(Partial& p, const Fast<kStats>& x, int64_t g0,
                                       int64_t gstride) {
  p.fp_a += x.fp;
  if (kHasE) {
    p.fp_e += x.fp;
    if (x.first < kChunk) {
      const int64_t g = g0 + static_cast<int64_t>(x.first) * gstride;
      take_max(p.max_abs, p.max_abs_idx, 0.0, g);
      take_max(p.max_rel, p.max_rel_idx, 0.0, g);
    }
  }
  if constexpr (kStats) {
    p.zeros += x.zeros;
    p.sum = add_rn(p.sum, x.sum);
    p.sumsq = add_rn(p.sumsq, x.sumsq);
  }
}

// The calling thread's Tally (NOTE: [tally]) for the per-element path, in shared memory: it is
// touched only off the fast path, so it takes no registers there. Declared once, outside the
// kernel templates, so that every kernel has the one array.
FSDPCHECK_DEVICE_INLINE Tally& thread_tally() {
  using Tallies = Tally[kThreads];
  FSDPCHECK_SHARED(Tallies, tallies);
  return tallies[threadIdx.x];
}

// Elements [l, l + n) of an item, one at a time through accumulate_element (the per-element
// path; the reads go to global memory again: the vector kernel has just loaded those lines).
template <DType D, bool kHasE>
FSDPCHECK_DEVICE void elements(Tally& t, const Item& m, int64_t l, int n, const Options& o) {
  using B = typename Traits<D>::Bits;
  const B* a = reinterpret_cast<const B*>(m.a);
  const B* e = reinterpret_cast<const B*>(m.e);
  FSDPCHECK_NO_UNROLL
  for (int j = 0; j < n; ++j) {
    const int64_t g = m.gbase + (l + j) * m.gstride;
    accumulate_element<D, kHasE>(t, a[l + j], kHasE ? e[l + j] : B{0}, g,
                                 hash_key(static_cast<uint64_t>(g)), o);
  }
}

// One vector on the fast path: its fingerprint (when asked) and statistics.
template <DType D, bool kFingerprints, bool kStats>
FSDPCHECK_DEVICE_INLINE void fast_vector(Fast<kStats>& x, const Vec& v, uint64_t key,
                                         uint64_t step) {
  using B = typename Traits<D>::Bits;
  constexpr int kV = kVecBytes / static_cast<int>(sizeof(B));
  FSDPCHECK_UNROLL
  for (int j = 0; j < kV; ++j) {
    const B b = vec_element<B>(v, j);
    if (kFingerprints) {
      x.fp += hash_bits(key, b, sizeof(B));
      key += step;
    }
    if (kStats) x.add(Traits<D>::to_f64(b));
  }
}

// Non-zero iff the vectors of the two sides differ in a bit or actual's holds a NaN or an
// infinity (NOTE: [bit-equal fast path]).
template <DType D>
FSDPCHECK_DEVICE_INLINE uint32_t leaves_fast_path(const Vec& a, const Vec& e) {
  uint32_t d = special_bits<D>(a);
  FSDPCHECK_UNROLL
  for (int i = 0; i < kVecWords; ++i) d |= a.w[i] ^ e.w[i];
  return d;
}

// NOTE: [segments] A thread takes the vectors of a chunk in segments of at most 32 (one bit each
// of `slow`), and only after a segment sends the vectors that left the fast path through the
// per-element path: the fast loop's registers (the loaded vectors, the key) are free then, which
// is what lets both fit in 64 registers without spilling.
constexpr int kSegment = 32;

// The chunks of a launch of tensors of dtype D that are contiguous and 16-byte aligned (on both
// sides: kHasE). Single-tensor mode (!kHasE) is the fingerprint alone: no counts, no statistics.
template <DType D, bool kHasE, bool kFingerprints, bool kStats>
FSDPCHECK_GLOBAL(kThreads, kVectorBlocksPerSM)
    vector_kernel(const Item* __restrict__ items, int n_items, int64_t chunks, unsigned grid,
                  Options o, Partial* __restrict__ partials) {
  static_assert(kHasE || (kFingerprints && !kStats), "single-tensor mode is a fingerprint");
  using B = typename Traits<D>::Bits;
  constexpr int kV = kVecBytes / static_cast<int>(sizeof(B));
  static_assert(kChunk % (kV * kThreads) == 0, "a chunk is whole vectors, the same per thread");
  Tally& mine = thread_tally();
  o.fingerprints = kFingerprints;  // compile-time constants from here on
  o.stats = kStats;
  o.counts = kHasE;

  int64_t c, end;
  block_chunks(chunks, grid, c, end);
  if (c >= end) return;
  int it = find_item(items, n_items, c);
  for (; c < end; ++c) {
    while (it + 1 < n_items && items[it + 1].local <= c) ++it;
    const Item& m = items[it];
    const int64_t l0 = (c - m.local) * kChunk;
    const int64_t n = m.numel - l0 < kChunk ? m.numel - l0 : kChunk;
    const int count = static_cast<int>(n / kV);  // whole vectors in the chunk
    const Vec* a = reinterpret_cast<const Vec*>(m.a) + l0 / kV;
    const Vec* e = kHasE ? reinterpret_cast<const Vec*>(m.e) + l0 / kV : nullptr;
    // Keys: element j of vector k has key(g0 + (k * kV + j) * gstride), g0 = gbase + l0 * gstride.
    const uint64_t step = static_cast<uint64_t>(m.gstride) * kKeyMul;
    uint64_t key = kFingerprints ? hash_key(static_cast<uint64_t>(
                                       m.gbase + (l0 + threadIdx.x * kV) * m.gstride))
                                 : 0;
    Fast<kStats> x = Fast<kStats>::identity();
    bool dirty = false;  // mine holds something of this chunk
    for (int seg = threadIdx.x; seg < count; seg += kSegment * kThreads) {
      const int seg_end = seg + kSegment * kThreads < count ? seg + kSegment * kThreads : count;
      uint32_t slow = 0;  // bit i: vector seg + i * kThreads left the fast path
      int k = seg;
      // Whole rounds of kVecUnroll vectors, then one vector at a time.
      for (; k + (kVecUnroll - 1) * kThreads < seg_end; k += kVecUnroll * kThreads) {
        Vec va[kVecUnroll];
        Vec ve[kVecUnroll];
        FSDPCHECK_UNROLL
        for (int u = 0; u < kVecUnroll; ++u) {
          va[u] = load_vec(a + k + u * kThreads);
          if (kHasE) ve[u] = load_vec(e + k + u * kThreads);
        }
        FSDPCHECK_UNROLL
        for (int u = 0; u < kVecUnroll; ++u) {
          if (kHasE) {
            if (leaves_fast_path<D>(va[u], ve[u]) != 0) {
              slow |= 1u << ((k - seg) / kThreads + u);
            } else {
              const int32_t off = (k + u * kThreads) * kV;
              x.first = x.first < off ? x.first : off;
              fast_vector<D, kFingerprints, kStats>(x, va[u], key, step);
            }
          } else {
            fast_vector<D, kFingerprints, kStats>(x, va[u], key, step);
          }
          if (kFingerprints) key += static_cast<uint64_t>(kThreads * kV) * step;
        }
      }
      for (; k < seg_end; k += kThreads) {
        const Vec va = load_vec(a + k);
        if (kHasE) {
          if (leaves_fast_path<D>(va, load_vec(e + k)) != 0) {
            slow |= 1u << ((k - seg) / kThreads);
          } else {
            const int32_t off = k * kV;
            x.first = x.first < off ? x.first : off;
            fast_vector<D, kFingerprints, kStats>(x, va, key, step);
          }
        } else {
          fast_vector<D, kFingerprints, kStats>(x, va, key, step);
        }
        if (kFingerprints) key += static_cast<uint64_t>(kThreads * kV) * step;
      }
      if (kHasE && slow != 0) {
        if (!dirty) tally_init(mine);
        dirty = true;
        FSDPCHECK_NO_UNROLL
        for (int i = 0; slow != 0; ++i, slow >>= 1) {
          if (slow & 1u) elements<D, true>(mine, m, l0 + (seg + i * kThreads) * kV, kV, o);
        }
      }
    }
    // The tail: fewer than kV elements at the end of the tensor, one per thread.
    const int tail = static_cast<int>(n - static_cast<int64_t>(count) * kV);
    if (static_cast<int>(threadIdx.x) < tail) {
      if (!dirty) tally_init(mine);
      dirty = true;
      elements<D, kHasE>(mine, m, l0 + static_cast<int64_t>(count) * kV + threadIdx.x, 1, o);
    }
    const int64_t g0 = m.gbase + l0 * m.gstride;
    Partial* out = partials + m.chunk + (c - m.local);
    // Every thread on the fast path (the common case): reduce only what it accumulated.
    if (!__syncthreads_or(dirty)) {
      block_reduce(x);
      if (threadIdx.x == 0) {
        Partial p;
        partial_init(p);
        fold_fast<kHasE, kStats>(p, x, g0, m.gstride);
        *out = p;
      }
      continue;
    }
    FullResult r = FullResult::identity();
    fold_fast<kHasE, kStats>(r.p, x, g0, m.gstride);
    if (dirty) partial_add(r.p, mine);
    block_reduce(r);
    if (threadIdx.x == 0) *out = r.p;
  }
}

// ---------------------------------------------------------------------------------------------
// The general kernel: every other layout, element by element.
// ---------------------------------------------------------------------------------------------

FSDPCHECK_DEVICE void load_plan(const int64_t* rec, TensorPlan& p) {
  p.a = reinterpret_cast<const char*>(rec[0]);
  p.e = reinterpret_cast<const char*>(rec[1]);
  p.numel = rec[2];
  p.gbase = rec[3];
  p.dtype_a = static_cast<DType>(rec[4] & 0xFF);
  p.dtype_e = static_cast<DType>((rec[4] >> 8) & 0xFF);
  p.ndim = static_cast<int32_t>((rec[4] >> 16) & 0xFF);
  const int64_t* dims = rec + kRecordHeader;
  for (int d = 0; d < p.ndim; ++d) {
    p.size[d] = dims[d];
    p.stride_a[d] = dims[p.ndim + d];
    p.stride_e[d] = dims[2 * p.ndim + d];
    p.gstride[d] = dims[3 * p.ndim + d];
  }
}

// Elements [l0, l1) of a same-dtype input. Each thread visits its elements in increasing global
// index order.
template <DType D, bool kHasE>
FSDPCHECK_DEVICE void process_same(const TensorPlan& p, const ChunkStart& start, int64_t l0,
                                   int64_t l1, const Options& o, Partial& acc) {
  using B = typename Traits<D>::Bits;
  const B* a = reinterpret_cast<const B*>(p.a);
  const B* e = reinterpret_cast<const B*>(p.e);
  if (p.ndim == 1) {
    // Strided 1-D: no index arithmetic beyond a multiply-add; the hash key steps by a constant.
    const int64_t sa = p.stride_a[0];
    const int64_t se = p.stride_e[0];
    const int64_t gs = p.gstride[0];
    const uint64_t key_step = static_cast<uint64_t>(kThreads) * static_cast<uint64_t>(gs) * kKeyMul;
    for (int64_t base = l0 + threadIdx.x; base < l1; base += kUnroll * kThreads) {
      B va[kUnroll];
      B ve[kUnroll];
      FSDPCHECK_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t l = base + u * kThreads;
        if (l < l1) {
          va[u] = a[l * sa];
          ve[u] = kHasE ? e[l * se] : B{0};
        }
      }
      const int64_t g0 = p.gbase + base * gs;
      uint64_t key = hash_key(static_cast<uint64_t>(g0));
      FSDPCHECK_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t l = base + u * kThreads;
        if (l < l1) {
          accumulate_element<D, kHasE>(acc, va[u], ve[u], g0 + u * kThreads * gs, key, o);
        }
        key += key_step;
      }
    }
    return;
  }
  for (int64_t l = l0 + threadIdx.x; l < l1; l += kThreads) {
    const Location loc = locate_in_chunk(p, start, l - l0);
    const B ba = a[loc.off_a];
    const B be = kHasE ? e[loc.off_e] : B{0};
    accumulate_element<D, kHasE>(acc, ba, be, loc.g, hash_key(static_cast<uint64_t>(loc.g)), o);
  }
}

template <bool kHasE, bool kFingerprints>
FSDPCHECK_GLOBAL(kThreads, kGeneralBlocksPerSM)
    general_kernel(const int64_t* __restrict__ meta, int n, const Item* __restrict__ items,
                   int n_items, int64_t chunks, unsigned grid, Options o,
                   Partial* __restrict__ partials) {
  FSDPCHECK_SHARED(TensorPlan, plan);
  FSDPCHECK_SHARED(ChunkStart, start);  // NOTE: [chunk-relative indexing]: one per chunk
  o.fingerprints = kFingerprints;  // a compile-time constant from here on
  o.counts = kHasE;
  int64_t c, end;
  block_chunks(chunks, grid, c, end);
  if (c >= end) return;
  int it = find_item(items, n_items, c);
  int loaded = -1;  // the item whose record is in `plan` (the same value in every thread)
  for (; c < end; ++c) {
    while (it + 1 < n_items && items[it + 1].local <= c) ++it;
    const int64_t chunk_in_tensor = c - items[it].local;
    if (threadIdx.x == 0) {
      if (loaded != it) load_plan(meta + meta[n + 1 + items[it].tensor], plan);
      start = chunk_start(plan, chunk_in_tensor * kChunk);
    }
    loaded = it;
    __syncthreads();
    const int64_t l0 = chunk_in_tensor * kChunk;
    const int64_t l1 = l0 + kChunk < plan.numel ? l0 + kChunk : plan.numel;
    FullResult acc = FullResult::identity();
    if (kHasE && plan.dtype_a != plan.dtype_e) {
      for (int64_t l = l0 + threadIdx.x; l < l1; l += kThreads) {
        accumulate_mixed(acc.p, plan, locate_in_chunk(plan, start, l - l0), o);
      }
    } else {
      visit_dtype(plan.dtype_a, [&](auto tag) {
        process_same<decltype(tag)::value, kHasE>(plan, start, l0, l1, o, acc.p);
      });
    }
    block_reduce(acc);  // ends with a barrier: `plan` and `start` are free for the next chunk
    if (threadIdx.x == 0) partials[items[it].chunk + chunk_in_tensor] = acc.p;
  }
}

FSDPCHECK_GLOBAL(kThreads)
    finish_kernel(const int64_t* __restrict__ meta, const Partial* __restrict__ partials,
                  Partial* __restrict__ rows, int64_t* __restrict__ fingerprints) {
  const int t = blockIdx.x;
  FullResult acc = FullResult::identity();
  for (int64_t c = meta[t] + threadIdx.x; c < meta[t + 1]; c += kThreads) {
    partial_combine(acc.p, partials[c]);
  }
  block_reduce(acc);
  if (threadIdx.x == 0) {
    if (rows != nullptr) rows[t] = acc.p;
    if (fingerprints != nullptr) fingerprints[t] = static_cast<int64_t>(acc.p.fp_a);
  }
}

// The vector kernel of dtype D for the call's mode. Single-tensor mode reads raw bits only, so
// one kernel per element size serves every dtype of that size.
template <DType D, typename Stream>
void launch_vector(const LaunchArgs& args, const Launch& l, Stream stream) {
  const Item* items = reinterpret_cast<const Item*>(args.meta + l.items);
  const Options& o = args.options;
#define FSDPCHECK_VECTOR(DT, E, F, S)                                                          \
  do {                                                                                         \
    const auto kernel = &vector_kernel<DT, E, F, S>;                                           \
    FSDPCHECK_LAUNCH(kernel, l.grid, kThreads, stream, items, l.n_items, l.chunks, l.grid, o,  \
                     args.partials);                                                           \
  } while (0)
  if (!args.has_expected) {
    constexpr int kSize = sizeof(typename Traits<D>::Bits);
    constexpr DType kRaw = kSize == 1   ? DType::kUInt8
                           : kSize == 2 ? DType::kInt16
                           : kSize == 4 ? DType::kInt32
                                        : DType::kInt64;
    if constexpr (D == kRaw) FSDPCHECK_VECTOR(kRaw, false, true, false);
  } else if (o.fingerprints && o.stats) {
    FSDPCHECK_VECTOR(D, true, true, true);
  } else if (o.fingerprints) {
    FSDPCHECK_VECTOR(D, true, true, false);
  } else if (o.stats) {
    FSDPCHECK_VECTOR(D, true, false, true);
  } else {
    FSDPCHECK_VECTOR(D, true, false, false);
  }
#undef FSDPCHECK_VECTOR
}

// Every kernel of one call, in order, on `stream` (a cudaStream_t, or the emulator's device).
template <typename Stream>
void launch_kernels(const LaunchArgs& args, Stream stream) {
  for (int i = 0; i < args.n_launches; ++i) {
    const Launch& l = args.launches[i];
    if (l.dtype == kGeneralLaunch) {
      const Item* items = reinterpret_cast<const Item*>(args.meta + l.items);
#define FSDPCHECK_GENERAL(E, F)                                                                \
  do {                                                                                         \
    const auto kernel = &general_kernel<E, F>;                                                 \
    FSDPCHECK_LAUNCH(kernel, l.grid, kThreads, stream, args.meta, args.n, items, l.n_items,    \
                     l.chunks, l.grid, args.options, args.partials);                           \
  } while (0)
      if (args.has_expected && args.options.fingerprints) {
        FSDPCHECK_GENERAL(true, true);
      } else if (args.has_expected) {
        FSDPCHECK_GENERAL(true, false);
      } else {
        FSDPCHECK_GENERAL(false, true);
      }
#undef FSDPCHECK_GENERAL
      continue;
    }
    // Single-tensor launches go by element size (the raw-bits kernel of that size).
    DType d = static_cast<DType>(l.dtype);
    if (!args.has_expected) {
      const int size = dtype_size(d);
      d = size == 1 ? DType::kUInt8 : size == 2 ? DType::kInt16 : size == 4 ? DType::kInt32 : DType::kInt64;
    }
    // A host-side switch (visit_dtype is a host and device function: no host lambda in it).
    switch (d) {
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) \
  case DType::k##E:                                      \
    launch_vector<DType::k##E>(args, l, stream);         \
    break;
      FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X
    }
  }
  if (args.n > 0) {
    const auto kernel = &finish_kernel;
    FSDPCHECK_LAUNCH(kernel, static_cast<unsigned>(args.n), kThreads, stream, args.meta,
                     args.partials, args.rows, args.fingerprints);
  }
}

}  // namespace
}  // namespace fsdpcheck::cuda
