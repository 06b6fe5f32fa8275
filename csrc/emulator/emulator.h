// The CUDA kernels run on the CPU by the emulator (NOTE: [emulator] in cuda_shim.h). Free of torch
// and CUDA headers.
#pragma once

#include "cuda/launch.h"

namespace fsdpcheck::cuda {

// Runs the chunk and finishing kernels of compare_kernels.h on host memory: every pointer in
// args (the metadata and what it points to) is a host pointer. Raises std::runtime_error naming
// the block when a kernel breaks the rules of its barriers or shuffles.
void emulate_compare(const LaunchArgs& args);

}  // namespace fsdpcheck::cuda
