// The CUDA kernels (compare_kernels.h) compiled by nvcc, and their launch on a CUDA stream.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#define FSDPCHECK_DEVICE __device__
#define FSDPCHECK_DEVICE_INLINE __device__ __forceinline__
#define FSDPCHECK_GLOBAL(...) __global__ void __launch_bounds__(__VA_ARGS__)
#define FSDPCHECK_SHARED(T, name) __shared__ T name
#define FSDPCHECK_UNROLL _Pragma("unroll")
#define FSDPCHECK_LOAD_VEC(words, ptr)                                  \
  do {                                                                  \
    const uint4 v_ = __ldg(reinterpret_cast<const uint4*>(ptr));        \
    (words)[0] = v_.x;                                                  \
    (words)[1] = v_.y;                                                  \
    (words)[2] = v_.z;                                                  \
    (words)[3] = v_.w;                                                  \
  } while (0)
#define FSDPCHECK_NO_UNROLL _Pragma("unroll 1")
#define FSDPCHECK_LAUNCH(kernel, grid, block, stream, ...)  \
  do {                                                      \
    kernel<<<grid, block, 0, stream>>>(__VA_ARGS__);        \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                         \
  } while (0)

#include "cuda/compare_kernels.h"

namespace fsdpcheck::cuda {

void launch_compare(const LaunchArgs& args, cudaStream_t stream) { launch_kernels(args, stream); }

}  // namespace fsdpcheck::cuda
