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
//   items                per launch, one Item (kItemWords words) per tensor it reads
// It is built on the host, copied once (pinned, async, on the current stream). The general
// kernel loads a tensor's record into shared memory; the vector kernels need only its Item.
constexpr int kRecordHeader = 5;  // a, e, numel, gbase, dtype_a | dtype_e << 8 | ndim << 16

// NOTE: [launches] The tensors of a call are split between launches (Launch below), each tensor
// read by exactly one: those the vector kernels can read (one dim after coalescing, contiguous,
// 16-byte aligned on every side, one dtype on both sides) in one launch per dtype, the others in
// one launch of the general kernel. A launch numbers the chunks of its tensors 0, 1, ... in item
// order ("local" chunks); block b of a grid of G blocks takes the local chunks
// [b * C / G, (b + 1) * C / G): a contiguous run, so it finds its first item once (a binary search)
// and steps to the next item as its chunks cross into it. Each chunk still writes its own
// Partial (at its global chunk number), so nothing depends on the grid: G is a choice of the host
// (enough blocks to fill the device once) and the results are the same for any G.
struct Item {
  int64_t a;        // actual's data
  int64_t e;        // expected's data (0: single-tensor mode)
  int64_t numel;
  int64_t gbase;    // global index of element 0
  int64_t gstride;  // global stride of the one dim (vector kernels)
  int64_t chunk;    // global number of the tensor's first chunk: where its partials go
  int64_t local;    // launch-local number of its first chunk
  int64_t tensor;   // the tensor's index (its record, for the general kernel)
};
constexpr int kItemWords = 8;
static_assert(sizeof(Item) == kItemWords * 8, "an Item is kItemWords int64 words");

constexpr int32_t kGeneralLaunch = -1;

// NOTE: [occupancy] The vector kernels are the hot ones: 4 blocks of 256 threads per SM is 32
// warps per SM, which caps them at 65536 / 1024 = 64 registers per thread (they must fit without
// spilling: bench/sass_report.py checks it). The general kernel keeps 2 blocks (128 registers):
// it carries the whole per-element path for every layout and dtype. A grid is at most what is
// resident at once.
constexpr int kVectorBlocksPerSM = 4;
constexpr int kGeneralBlocksPerSM = 2;

struct Launch {
  int32_t dtype;    // the DType of a vector launch, or kGeneralLaunch
  int32_t n_items;
  int64_t items;    // word offset of its first Item in the metadata
  int64_t chunks;   // its local chunks
  uint32_t grid;    // blocks
};

struct LaunchPlan {
  std::vector<int64_t> meta;
  std::vector<Launch> launches;
};

// Whether the vector kernels can read this input (NOTE: [launches]).
bool vector_readable(const TensorPlan& p);

// The metadata buffer and launches of `plans` (NOTE: [device metadata], NOTE: [launches]); its
// word plans.size() is the number of chunks. Grids are at most `vector_blocks` blocks for the
// vector kernels and `general_blocks` for the general kernel (at least one each).
LaunchPlan plan_launches(const std::vector<TensorPlan>& plans, int64_t vector_blocks,
                         int64_t general_blocks);

struct LaunchArgs {
  const int64_t* meta;     // device
  int n;                   // tensors
  int64_t total_chunks;
  Options options;
  bool has_expected;
  Partial* partials;       // device, total_chunks rows (unused when total_chunks == 0)
  Partial* rows;           // device, n rows, or nullptr
  int64_t* fingerprints;   // device, n words, or nullptr
  const Launch* launches;  // host
  int n_launches;
};

// Launches the chunk kernels and the finishing kernel on `stream`; checks each launch.
void launch_compare(const LaunchArgs& args, CUstream_st* stream);

}  // namespace fsdpcheck::cuda
