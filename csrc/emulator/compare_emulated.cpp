// The CUDA kernels (compare_kernels.h), compiled by the C++ compiler for the emulator.
#include "emulator/cuda_shim.h"
// The shim first: it defines the macros and CUDA's names that the kernels use.
#include "cuda/compare_kernels.h"
#include "emulator/emulator.h"

namespace fsdpcheck::cuda {

void emulate_compare(const LaunchArgs& args) {
  emu::Device device(kThreads);
  launch_kernels(args, &device);
}

}  // namespace fsdpcheck::cuda
