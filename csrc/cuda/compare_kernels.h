// The CUDA kernels of fsdpcheck::compare and fsdpcheck::fingerprint, and their launch.
//
// Two phases, as in apex's multi-tensor reductions, for determinism: the chunk kernel writes one
// Partial per chunk (NOTE: [chunks] in elementwise.h), the finishing kernel combines each tensor's
// chunks in a fixed order. No floating-point atomics anywhere. Per-element rules come from
// fsdpcheck/elementwise.h, the same code the CPU's fsdpcheck::_reference op runs.
//
// NOTE: [two compilers] This header is compiled twice: by nvcc in compare_kernels.cu, and by the
// C++ compiler in csrc/emulator/compare_emulated.cpp, where csrc/emulator/cuda_shim.h runs each
// block's threads as host threads (fsdpcheck::_emulated, in every CI). The includer defines what
// differs, so that the code below is the same text for both:
//   FSDPCHECK_DEVICE / FSDPCHECK_DEVICE_INLINE   __device__ (__forceinline__) functions
//   FSDPCHECK_GLOBAL(threads[, min_blocks])      a __global__ kernel and its launch bounds
//   FSDPCHECK_SHARED(T, name)                    a __shared__ variable of the running block
//   FSDPCHECK_UNROLL                             #pragma unroll
//   FSDPCHECK_LAUNCH(kernel, grid, block, stream, args...)   kernel<<<grid, block, 0, stream>>>
// and threadIdx, blockIdx, __syncthreads and __shfl_down_sync.
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
// Elements each thread loads before it processes them, so that several loads are in flight.
constexpr int kUnroll = 4;
// Caps registers at 65536 / (256 * 2) = 128 per thread, so two blocks share an SM.
constexpr int kMinBlocksPerSM = 2;

// x combined with the Partial of the lane `offset` above (every lane of the warp takes part).
FSDPCHECK_DEVICE_INLINE void shfl_down(Partial& x, int offset) {
  constexpr unsigned kMask = 0xFFFFFFFFu;
  unsigned long long w[kPartialWords];
  memcpy(w, &x, sizeof(x));
  FSDPCHECK_UNROLL
  for (int i = 0; i < kPartialWords; ++i) w[i] = __shfl_down_sync(kMask, w[i], offset);
  Partial y;
  memcpy(&y, w, sizeof(y));
  partial_combine(x, y);
}

// Block-wide combination in a fixed tree order (deterministic float sums). The result is valid
// in thread 0. Every thread of the block must call it. Ends with a barrier, so that a second call
// in the same kernel cannot overwrite warp_results while warp 0 still reads them.
using WarpResults = Partial[kWarps];
FSDPCHECK_DEVICE void block_reduce(Partial& x) {
  FSDPCHECK_SHARED(WarpResults, warp_results);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) shfl_down(x, offset);
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  if (warp == 0) {
    if (lane < kWarps) {
      x = warp_results[lane];
    } else {
      partial_init(x);
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) shfl_down(x, offset);
  }
  __syncthreads();
}

FSDPCHECK_DEVICE int find_tensor(const int64_t* first_chunk, int n, int64_t chunk) {
  int lo = 0, hi = n - 1;  // the last t with first_chunk[t] <= chunk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_chunk[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

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

// NOTE: [vector loads] Narrow dtypes need many bytes in flight per thread to reach memory
// bandwidth, so contiguous 16-byte-aligned inputs are read 16 bytes at a time (8 bf16, 4 fp32).
// Each element of a vector then goes through the same accumulate_element as every other path.
constexpr int kVecBytes = 16;
constexpr int kVecUnroll = 2;

template <DType D, bool kHasE>
FSDPCHECK_DEVICE void process_vectorized(const TensorPlan& p, int64_t l0, int64_t l1,
                                         const Options& o, Partial& acc) {
  using B = typename Traits<D>::Bits;
  constexpr int kV = kVecBytes / static_cast<int>(sizeof(B));
  struct alignas(kVecBytes) Vec {
    B v[kV];
  };
  static_assert(kChunk % kV == 0, "chunks must start on a vector boundary");
  const Vec* a = reinterpret_cast<const Vec*>(p.a);
  const Vec* e = reinterpret_cast<const Vec*>(p.e);
  const int64_t gs = p.gstride[0];
  const uint64_t key_step = static_cast<uint64_t>(gs) * kKeyMul;
  const int64_t first = l0 / kV;            // first vector of the chunk
  const int64_t count = (l1 - l0) / kV;     // whole vectors in the chunk
  for (int64_t k = threadIdx.x; k < count; k += kVecUnroll * kThreads) {
    Vec xa[kVecUnroll];
    Vec xe[kVecUnroll];
    FSDPCHECK_UNROLL
    for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t kk = k + u * kThreads;
      if (kk < count) {
        xa[u] = a[first + kk];
        if (kHasE) xe[u] = e[first + kk];
      }
    }
    FSDPCHECK_UNROLL
    for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t kk = k + u * kThreads;
      if (kk < count) {
        const int64_t g0 = p.gbase + (first + kk) * kV * gs;
        uint64_t key = hash_key(static_cast<uint64_t>(g0));
        FSDPCHECK_UNROLL
        for (int j = 0; j < kV; ++j) {
          accumulate_element<D, kHasE>(acc, xa[u].v[j], kHasE ? xe[u].v[j] : B{0}, g0 + j * gs,
                                       key, o);
          key += key_step;
        }
      }
    }
  }
  // The tail (fewer than kV elements at the end of the tensor), one element per thread.
  const B* as = reinterpret_cast<const B*>(p.a);
  const B* es = reinterpret_cast<const B*>(p.e);
  for (int64_t l = l0 + count * kV + threadIdx.x; l < l1; l += kThreads) {
    const int64_t g = p.gbase + l * gs;
    accumulate_element<D, kHasE>(acc, as[l], kHasE ? es[l] : B{0}, g,
                                 hash_key(static_cast<uint64_t>(g)), o);
  }
}

FSDPCHECK_DEVICE_INLINE bool aligned(const char* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % kVecBytes == 0;
}

// Elements [l0, l1) of a same-dtype input. Each thread visits its elements in increasing global
// index order (take_max's tie rule does not need it, but the equal-bits path stays cheap).
template <DType D, bool kHasE>
FSDPCHECK_DEVICE void process_same(const TensorPlan& p, const ChunkStart& start, int64_t l0,
                                   int64_t l1, const Options& o, Partial& acc) {
  using B = typename Traits<D>::Bits;
  const B* a = reinterpret_cast<const B*>(p.a);
  const B* e = reinterpret_cast<const B*>(p.e);
  if (p.ndim == 1 && p.stride_a[0] == 1 && aligned(p.a) &&
      (!kHasE || (p.stride_e[0] == 1 && aligned(p.e)))) {
    process_vectorized<D, kHasE>(p, l0, l1, o, acc);
    return;
  }
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
FSDPCHECK_GLOBAL(kThreads, kMinBlocksPerSM)
    chunk_kernel(const int64_t* __restrict__ meta, int n, Options o, Partial* __restrict__ partials) {
  FSDPCHECK_SHARED(TensorPlan, plan);
  FSDPCHECK_SHARED(ChunkStart, start);  // NOTE: [chunk-relative indexing]: one per block
  FSDPCHECK_SHARED(int64_t, chunk_in_tensor);
  const int64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) {
    const int t = find_tensor(meta, n, chunk);
    load_plan(meta + meta[n + 1 + t], plan);
    chunk_in_tensor = chunk - meta[t];
    start = chunk_start(plan, chunk_in_tensor * kChunk);
  }
  __syncthreads();
  o.fingerprints = kFingerprints;  // a compile-time constant from here on
  const int64_t l0 = chunk_in_tensor * kChunk;
  const int64_t l1 = l0 + kChunk < plan.numel ? l0 + kChunk : plan.numel;
  Partial acc;
  partial_init(acc);
  if (kHasE && plan.dtype_a != plan.dtype_e) {
    for (int64_t l = l0 + threadIdx.x; l < l1; l += kThreads) {
      accumulate_mixed(acc, plan, locate_in_chunk(plan, start, l - l0), o);
    }
  } else {
    visit_dtype(plan.dtype_a, [&](auto tag) {
      process_same<decltype(tag)::value, kHasE>(plan, start, l0, l1, o, acc);
    });
  }
  block_reduce(acc);
  if (threadIdx.x == 0) partials[chunk] = acc;
}

FSDPCHECK_GLOBAL(kThreads)
    finish_kernel(const int64_t* __restrict__ meta, const Partial* __restrict__ partials,
                  Partial* __restrict__ rows, int64_t* __restrict__ fingerprints) {
  const int t = blockIdx.x;
  Partial acc;
  partial_init(acc);
  for (int64_t c = meta[t] + threadIdx.x; c < meta[t + 1]; c += kThreads) {
    partial_combine(acc, partials[c]);
  }
  block_reduce(acc);
  if (threadIdx.x == 0) {
    if (rows != nullptr) rows[t] = acc;
    if (fingerprints != nullptr) fingerprints[t] = static_cast<int64_t>(acc.fp_a);
  }
}

// Both kernels of one call, in order, on `stream` (a cudaStream_t, or the emulator's device).
template <typename Stream>
void launch_kernels(const LaunchArgs& args, Stream stream) {
  if (args.total_chunks > 0) {
    const auto grid = static_cast<unsigned>(args.total_chunks);
    if (args.has_expected && args.options.fingerprints) {
      const auto kernel = &chunk_kernel<true, true>;
      FSDPCHECK_LAUNCH(kernel, grid, kThreads, stream, args.meta, args.n, args.options,
                       args.partials);
    } else if (args.has_expected) {
      const auto kernel = &chunk_kernel<true, false>;
      FSDPCHECK_LAUNCH(kernel, grid, kThreads, stream, args.meta, args.n, args.options,
                       args.partials);
    } else {
      const auto kernel = &chunk_kernel<false, true>;
      FSDPCHECK_LAUNCH(kernel, grid, kThreads, stream, args.meta, args.n, args.options,
                       args.partials);
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
