// Just enough of CUDA's execution model to run csrc/cuda/compare_kernels.h on the CPU, unchanged.
//
// NOTE: [emulator] Each CUDA thread of a block is a host thread (a pool of blockDim threads,
// reused for every block of a launch); blocks run in turn. threadIdx and blockIdx are
// thread-local; __shared__ variables live in one buffer per running block; __syncthreads is a
// barrier over the block's threads that have not returned; __shfl_down_sync goes through a
// per-warp exchange and a barrier over the warp's 32 lanes. So ThreadSanitizer sees exactly the
// ordering the kernels ask for: a missing __syncthreads is a data race on shared memory, and
// nothing else orders the threads of a block (no lock is shared between warps). A shuffle that
// not every lane of its warp reaches, or barriers that wait on each other, stop the launch with
// an error naming the block, instead of hanging. It is slow (a host thread per CUDA thread, a
// context switch per barrier): meant for a few chunks per call, in tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>

namespace fsdpcheck::emu {

struct Uint3 {
  unsigned x = 0, y = 0, z = 0;
};

// Bytes of shared memory per block (CUDA's static limit).
constexpr size_t kSharedBytes = 48 * 1024;

// The shared memory of the block the calling thread runs in.
std::byte* block_shared_memory();

// The place of one __shared__ declaration in every block's shared memory, handed out once.
class SharedSlot {
 public:
  SharedSlot(size_t size, size_t align);
  template <typename T>
  T& get() const {
    return *reinterpret_cast<T*>(block_shared_memory() + offset_);
  }

 private:
  size_t offset_;
};

// The bits of `value` from the lane `delta` above (its own when that lane is past the warp).
unsigned long long shfl_down_bits(unsigned mask, unsigned long long value, unsigned delta,
                                  int width);

// A device: blocks of `threads_per_block` threads, run one after another.
class Device {
 public:
  explicit Device(unsigned threads_per_block);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // kernel<<<grid, block>>>(args...): the arguments are copied once, as a launch copies them.
  template <typename... P, typename... A>
  void launch(void (*kernel)(P...), unsigned grid, unsigned block, const A&... args) {
    check_block_size(block);
    const std::tuple<std::decay_t<P>...> params(args...);
    for (unsigned b = 0; b < grid; ++b) run_block(b, [&] { std::apply(kernel, params); });
  }

 private:
  struct Impl;
  void check_block_size(unsigned block) const;
  // Runs body on every thread of block b; raises std::runtime_error if the block failed.
  void run_block(unsigned b, const std::function<void()>& body);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdpcheck::emu

// CUDA's names, for the emulated kernels.
inline thread_local fsdpcheck::emu::Uint3 threadIdx;
inline thread_local fsdpcheck::emu::Uint3 blockIdx;

void __syncthreads();
// __syncthreads, and whether `predicate` was non-zero in any thread of the block.
int __syncthreads_or(int predicate);

template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "a 1- to 8-byte value");
  unsigned long long bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = fsdpcheck::emu::shfl_down_bits(mask, bits, delta, width);
  std::memcpy(&var, &bits, sizeof(T));
  return var;
}

// The macros of NOTE: [two compilers] (compare_kernels.h).
#define FSDPCHECK_DEVICE inline
#define FSDPCHECK_DEVICE_INLINE inline
#define FSDPCHECK_GLOBAL(...) void
#define FSDPCHECK_SHARED(T, name)                                                      \
  static const ::fsdpcheck::emu::SharedSlot name##_slot(sizeof(T), alignof(T));       \
  std::type_identity_t<T>& name = name##_slot.get<std::type_identity_t<T>>()
#define FSDPCHECK_UNROLL
#define FSDPCHECK_LOAD_VEC(words, ptr) std::memcpy((words), (ptr), 16)
#define FSDPCHECK_NO_UNROLL
#define FSDPCHECK_LAUNCH(kernel, grid, block, stream, ...) (stream)->launch(kernel, grid, block, __VA_ARGS__)
