// The boundary between the host code (compare_cuda.cpp, compiled by the C++ compiler with ATen)
// and the kernels (compare_kernels.cu, compiled by nvcc with nothing but this project's headers).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fsdpcheck/elementwise.h"

namespace fsdpcheck::cuda {

// NOTE: [device metadata] One int64 buffer describes a whole call:
//   words [0, n]         first chunk of each tensor (prefix sums; word n = total chunks)
//   words [n+1, 2n]      word offset of each tensor's record
//   records              kRecordHeader words, then size, stride_a, stride_e, gstride (ndim each)
// It is built on the host, copied once (pinned, async, on the current stream), and each block
// loads its tensor's record into shared memory.
constexpr int kRecordHeader = 5;  // a, e, numel, gbase, dtype_a | dtype_e << 8 | ndim << 16

struct LaunchArgs {
  const int64_t* meta;     // device
  int n;                   // tensors
  int64_t total_chunks;
  Options options;
  bool has_expected;
  Partial* partials;       // device, total_chunks rows (unused when total_chunks == 0)
  Partial* rows;           // device, n rows, or nullptr
  int64_t* fingerprints;   // device, n words, or nullptr
};

// Launches the chunk kernel and the finishing kernel on `stream`; checks each launch.
void launch_compare(const LaunchArgs& args, cudaStream_t stream);

}  // namespace fsdpcheck::cuda
