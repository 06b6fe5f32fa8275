// The CUDA kernels (compare_kernels.h), compiled by the C++ compiler for the emulator.
#include "emulator/cuda_shim.h"
// The shim first: it defines the macros and CUDA's names that the kernels use.
#include "cuda/compare_kernels.h"
#include "emulator/emulator.h"

#include <unistd.h>

#include <mutex>

namespace fsdpcheck::cuda {
namespace {

// NOTE: [emulator pool] Starting a block's 256 threads costs about as much as running a block
// (~30 ms here), so one device serves every launch of the process, one launch at a time. It is
// never destroyed (its threads wait until the process ends, and nothing runs at exit); a child
// process after fork(), which has none of its threads, starts its own.
struct Shared {
  std::mutex launch;
  emu::Device device{kThreads};
  pid_t pid = getpid();
};

Shared& shared_device() {
  static std::mutex m;
  static Shared* current = nullptr;
  const std::lock_guard<std::mutex> lk(m);
  if (current == nullptr || current->pid != getpid()) current = new Shared();
  return *current;
}

}  // namespace

void emulate_compare(const LaunchArgs& args) {
  Shared& d = shared_device();
  const std::lock_guard<std::mutex> lk(d.launch);
  launch_kernels(args, &d.device);
}

}  // namespace fsdpcheck::cuda
