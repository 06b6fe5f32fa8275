// CUDA kernels of fsdpcheck::compare and fsdpcheck::fingerprint.
//
// Two phases, as in apex's multi-tensor reductions, for determinism: the chunk kernel writes one
// Partial per chunk (NOTE: [chunks] in elementwise.h), the finishing kernel combines each tensor's
// chunks in a fixed order. No floating-point atomics anywhere. Per-element rules come from
// fsdpcheck/elementwise.h, the same code the CPU's fsdpcheck::_reference op runs in every CI.
#include <c10/cuda/CUDAException.h>

#include "cuda/launch.h"

namespace fsdpcheck::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Elements each thread loads before it processes them, so that several loads are in flight.
constexpr int kUnroll = 4;
// Caps registers at 65536 / (256 * 2) = 128 per thread, so two blocks share an SM.
constexpr int kMinBlocksPerSM = 2;

__device__ __forceinline__ void shfl_down(Partial& x, int offset) {
  constexpr unsigned kMask = 0xFFFFFFFFu;
  Partial y;
  y.mismatched = __shfl_down_sync(kMask, static_cast<long long>(x.mismatched), offset);
  y.nan_a = __shfl_down_sync(kMask, static_cast<long long>(x.nan_a), offset);
  y.nan_e = __shfl_down_sync(kMask, static_cast<long long>(x.nan_e), offset);
  y.inf_a = __shfl_down_sync(kMask, static_cast<long long>(x.inf_a), offset);
  y.inf_e = __shfl_down_sync(kMask, static_cast<long long>(x.inf_e), offset);
  y.zeros = __shfl_down_sync(kMask, static_cast<long long>(x.zeros), offset);
  y.fp_a = __shfl_down_sync(kMask, static_cast<unsigned long long>(x.fp_a), offset);
  y.fp_e = __shfl_down_sync(kMask, static_cast<unsigned long long>(x.fp_e), offset);
  y.max_abs = __shfl_down_sync(kMask, x.max_abs, offset);
  y.max_abs_idx = __shfl_down_sync(kMask, static_cast<long long>(x.max_abs_idx), offset);
  y.max_rel = __shfl_down_sync(kMask, x.max_rel, offset);
  y.max_rel_idx = __shfl_down_sync(kMask, static_cast<long long>(x.max_rel_idx), offset);
  y.sum = __shfl_down_sync(kMask, x.sum, offset);
  y.sumsq = __shfl_down_sync(kMask, x.sumsq, offset);
  partial_combine(x, y);
}

// Block-wide combination in a fixed tree order (deterministic float sums). The result is valid
// in thread 0.
__device__ void block_reduce(Partial& x) {
  __shared__ Partial warp_results[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) shfl_down(x, offset);
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  if (warp == 0) {
    if (lane < kWarps) {
      x = warp_results[lane];
    } else {
      partial_init(x);
    }
    for (int offset = 16; offset > 0; offset /= 2) shfl_down(x, offset);
  }
}

__device__ int find_tensor(const int64_t* first_chunk, int n, int64_t chunk) {
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

__device__ void load_plan(const int64_t* rec, TensorPlan& p) {
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
__device__ void process_vectorized(const TensorPlan& p, int64_t l0, int64_t l1, const Options& o,
                                   Partial& acc) {
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
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t kk = k + u * kThreads;
      if (kk < count) {
        xa[u] = a[first + kk];
        if (kHasE) xe[u] = e[first + kk];
      }
    }
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t kk = k + u * kThreads;
      if (kk < count) {
        const int64_t g0 = p.gbase + (first + kk) * kV * gs;
        uint64_t key = hash_key(static_cast<uint64_t>(g0));
#pragma unroll
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

__device__ __forceinline__ bool aligned(const char* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % kVecBytes == 0;
}

// Elements [l0, l1) of a same-dtype input. Each thread visits its elements in increasing global
// index order (take_max's tie rule does not need it, but the equal-bits path stays cheap).
template <DType D, bool kHasE>
__device__ void process_same(const TensorPlan& p, const ChunkStart& start, int64_t l0,
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
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t l = base + u * kThreads;
        if (l < l1) {
          va[u] = a[l * sa];
          ve[u] = kHasE ? e[l * se] : B{0};
        }
      }
      const int64_t g0 = p.gbase + base * gs;
      uint64_t key = hash_key(static_cast<uint64_t>(g0));
#pragma unroll
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
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
    chunk_kernel(const int64_t* __restrict__ meta, int n, Options o, Partial* __restrict__ partials) {
  __shared__ TensorPlan plan;
  __shared__ ChunkStart start;  // NOTE: [chunk-relative indexing]: one per block, not per thread
  __shared__ int64_t chunk_in_tensor;
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

__global__ void __launch_bounds__(kThreads)
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

}  // namespace

void launch_compare(const LaunchArgs& args, cudaStream_t stream) {
  if (args.total_chunks > 0) {
    const dim3 grid(static_cast<unsigned>(args.total_chunks));
    if (args.has_expected && args.options.fingerprints) {
      chunk_kernel<true, true><<<grid, kThreads, 0, stream>>>(args.meta, args.n, args.options, args.partials);
    } else if (args.has_expected) {
      chunk_kernel<true, false><<<grid, kThreads, 0, stream>>>(args.meta, args.n, args.options, args.partials);
    } else {
      chunk_kernel<false, true><<<grid, kThreads, 0, stream>>>(args.meta, args.n, args.options, args.partials);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (args.n > 0) {
    finish_kernel<<<args.n, kThreads, 0, stream>>>(args.meta, args.partials, args.rows, args.fingerprints);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace fsdpcheck::cuda
