// The boundary between the host code of the CUDA implementation (compare_cuda.cpp, compiled by the
// C++ compiler with ATen) and the kernels (compare_kernels.h, compiled by nvcc in
// compare_kernels.cu, and by the C++ compiler for the emulator in csrc/emulator). Free of CUDA
// and torch headers: the emulator and its self-test include it too.
#pragma once

#include <cstdint>
#include <vector>

#include "fsdpcheck/elementwise.h"

struct CUstream_st;  // cudaStream_t is a CUstream_st*

namespace fsdpcheck::cuda {

// NOTE: [device metadata] One int64 buffer describes a whole call:
//   words [0, n]         first chunk of each tensor (prefix sums; word n = total chunks)
//   words [n+1, 2n]      word offset of each tensor's record
//   records              kRecordHeader words, then size, stride_a, stride_e, gstride (ndim each)
// It is built on the host, copied once (pinned, async, on the current stream), and each block
// loads its tensor's record into shared memory.
constexpr int kRecordHeader = 5;  // a, e, numel, gbase, dtype_a | dtype_e << 8 | ndim << 16

// The metadata buffer of `plans` (NOTE: [device metadata]); its word n is the number of chunks.
std::vector<int64_t> pack_metadata(const std::vector<TensorPlan>& plans);

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
void launch_compare(const LaunchArgs& args, CUstream_st* stream);

}  // namespace fsdpcheck::cuda
