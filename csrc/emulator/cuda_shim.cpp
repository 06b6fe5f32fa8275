// The emulator's threads, barriers and warp exchange (NOTE: [emulator] in cuda_shim.h).
#include "emulator/cuda_shim.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace fsdpcheck::emu {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// Thrown in a thread of a failed block to leave the kernel; the failure itself is in Block::error.
struct Aborted {};

struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;          // guarded by m
  int vote = 0;             // guarded by m: the OR of the predicates of this round's arrivals
  int result = 0;           // guarded by m: the OR of the last completed round
  uint64_t generation = 0;  // guarded by m: completed rounds
};

// NOTE: [warp barrier] A barrier over the 32 lanes of a warp, met 70 times per warp per
// block_reduce: without a lock (an atomic count and generation, waiters sleep on the generation),
// the wake-ups after each round do not queue on a mutex (about half the time of a
// mutex-and-condition-variable barrier per block, measured).
struct WarpBarrier {
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
};

struct Warp {
  WarpBarrier barrier;
  std::atomic<int> live{kWarpSize};  // lanes that have not returned
  // NOTE: [warp exchange] Lane i writes slot[parity][i], all 32 lanes meet at the barrier, then
  // each reads the slot of lane i + delta. Consecutive shuffles alternate between the two rows,
  // so a lane writes a row again only after the next barrier, which every lane reaches after
  // reading that row: one barrier per shuffle.
  unsigned long long slot[2][kWarpSize] = {};
};

struct Block {
  unsigned index = 0;
  Barrier sync;  // __syncthreads
  int live = 0;  // guarded by sync.m: threads that have not returned
  std::vector<Warp> warps;
  alignas(64) std::byte shared[kSharedBytes];
  // Failure: the first error wins; `aborted` wakes every waiting thread.
  std::atomic<bool> aborted{false};
  std::mutex error_m;
  std::string error;
  // For the watchdog only (relaxed: they must not order the threads, or ThreadSanitizer would
  // miss the races the barriers are there to prevent): threads running, threads waiting at a
  // barrier that has not completed, barriers completed.
  std::atomic<int> running{0};
  std::atomic<int> blocked{0};
  std::atomic<uint64_t> progress{0};
};

thread_local Block* t_block = nullptr;
thread_local int t_parity = 0;

void fail(Block& b, const std::string& what) {
  {
    const std::lock_guard<std::mutex> lk(b.error_m);
    if (b.error.empty()) b.error = what;
  }
  b.aborted.store(true);
  // Take each barrier's lock before notifying, so that no waiter misses the wake-up between
  // testing its condition and sleeping.
  auto wake = [](Barrier& bar) {
    { const std::lock_guard<std::mutex> lk(bar.m); }
    bar.cv.notify_all();
  };
  wake(b.sync);
  for (Warp& w : b.warps) {
    w.barrier.generation.fetch_add(1, std::memory_order_release);
    w.barrier.generation.notify_all();
  }
}

// Under bar.m: the round is complete; `waiters` threads wait in it.
void complete(Block& b, Barrier& bar, int waiters) {
  bar.arrived = 0;
  bar.result = bar.vote;
  bar.vote = 0;
  ++bar.generation;
  b.blocked.fetch_sub(waiters, std::memory_order_relaxed);
  b.progress.fetch_add(1, std::memory_order_relaxed);
  bar.cv.notify_all();
}

// __syncthreads(_or): arrives at the block's barrier and waits for every thread that has not
// returned; returns whether any of them arrived with a non-zero predicate. A round cannot
// complete again before every waiter of this one has read its result (they must arrive first).
int block_arrive_and_wait(Block& b, int predicate) {
  Barrier& bar = b.sync;
  std::unique_lock<std::mutex> lk(bar.m);
  if (b.aborted.load(std::memory_order_relaxed)) throw Aborted{};
  bar.vote |= predicate != 0 ? 1 : 0;
  if (++bar.arrived >= b.live) {
    complete(b, bar, bar.arrived - 1);
    return bar.result;
  }
  b.blocked.fetch_add(1, std::memory_order_relaxed);
  const uint64_t round = bar.generation;
  bar.cv.wait(lk, [&] {
    return bar.generation != round || b.aborted.load(std::memory_order_relaxed);
  });
  if (bar.generation == round) throw Aborted{};
  return bar.result;
}

// Arrives at the barrier of the calling thread's warp and waits for the other 31 lanes.
void warp_arrive_and_wait(Block& b, Warp& w) {
  if (b.aborted.load(std::memory_order_relaxed)) throw Aborted{};
  if (w.live.load(std::memory_order_relaxed) != kWarpSize) {
    fail(b, "a lane of warp " + std::to_string(threadIdx.x / kWarpSize) +
                " has returned, yet __shfl_down_sync names every lane (a full mask)");
    throw Aborted{};
  }
  WarpBarrier& bar = w.barrier;
  const int round = bar.generation.load(std::memory_order_acquire);
  if (bar.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == kWarpSize) {
    // The last lane: every lane's writes before it arrived are visible to it (the chain of
    // acq_rel additions) and, through the generation, to every lane it releases.
    bar.arrived.store(0, std::memory_order_relaxed);
    b.blocked.fetch_sub(kWarpSize - 1, std::memory_order_relaxed);
    b.progress.fetch_add(1, std::memory_order_relaxed);
    bar.generation.fetch_add(1, std::memory_order_release);
    bar.generation.notify_all();
    return;
  }
  b.blocked.fetch_add(1, std::memory_order_relaxed);
  while (bar.generation.load(std::memory_order_acquire) == round) {
    bar.generation.wait(round, std::memory_order_acquire);
  }
  if (b.aborted.load(std::memory_order_relaxed)) throw Aborted{};
}

// The calling thread has left the kernel.
void thread_exit(Block& b, unsigned tid) {
  {
    const std::lock_guard<std::mutex> lk(b.sync.m);
    --b.live;
    // Threads that have returned no longer count at __syncthreads.
    if (b.sync.arrived > 0 && b.sync.arrived >= b.live) complete(b, b.sync, b.sync.arrived);
  }
  Warp& w = b.warps[tid / kWarpSize];
  w.live.fetch_sub(1, std::memory_order_relaxed);
  if (w.barrier.arrived.load(std::memory_order_relaxed) > 0 && !b.aborted.load()) {
    fail(b, "thread " + std::to_string(tid) + " returned while other lanes of warp " +
                std::to_string(tid / kWarpSize) +
                " wait in __shfl_down_sync with a full mask (a shuffle not every lane reaches)");
  }
  b.running.fetch_sub(1, std::memory_order_relaxed);
}

// Who waits where, for a deadlock report (only once the block is stuck).
std::string describe_waits(Block& b) {
  std::string out;
  {
    const std::lock_guard<std::mutex> lk(b.sync.m);
    out = std::to_string(b.sync.arrived) + " of " + std::to_string(b.live) +
          " live threads wait in __syncthreads";
  }
  for (size_t i = 0; i < b.warps.size(); ++i) {
    const int arrived = b.warps[i].barrier.arrived.load(std::memory_order_relaxed);
    if (arrived > 0) {
      out += "; " + std::to_string(arrived) + " lanes of warp " + std::to_string(i) +
             " wait in __shfl_down_sync";
    }
  }
  return out;
}

std::mutex& slots_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

std::byte* block_shared_memory() {
  if (t_block == nullptr) throw std::logic_error("__shared__ memory used outside a kernel");
  return t_block->shared;
}

SharedSlot::SharedSlot(size_t size, size_t align) {
  static size_t next = 0;
  const std::lock_guard<std::mutex> lk(slots_mutex());
  offset_ = (next + align - 1) / align * align;
  if (offset_ + size > kSharedBytes) {
    throw std::length_error("the emulated kernels' __shared__ variables exceed " +
                            std::to_string(kSharedBytes) + " bytes");
  }
  next = offset_ + size;
}

unsigned long long shfl_down_bits(unsigned mask, unsigned long long value, unsigned delta,
                                  int width) {
  Block& b = *t_block;
  if (mask != kFullMask || width != kWarpSize) {
    fail(b, "__shfl_down_sync with mask " + std::to_string(mask) + " and width " +
                std::to_string(width) + " is not emulated (only a full warp)");
    throw Aborted{};
  }
  const unsigned lane = threadIdx.x % kWarpSize;
  Warp& w = b.warps[threadIdx.x / kWarpSize];
  unsigned long long(&row)[kWarpSize] = w.slot[t_parity];
  t_parity ^= 1;
  row[lane] = value;
  warp_arrive_and_wait(b, w);
  const unsigned src = lane + delta;
  return src < kWarpSize ? row[src] : value;
}

struct Device::Impl {
  unsigned threads;
  Block block;
  std::vector<std::thread> pool;
  std::mutex m;
  std::condition_variable start_cv;
  std::condition_variable done_cv;
  uint64_t job_round = 0;                            // guarded by m
  const std::function<void()>* job = nullptr;         // guarded by m
  unsigned done = 0;                                 // guarded by m
  bool stop = false;                                 // guarded by m

  void worker(unsigned tid) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void()>* body;
      {
        std::unique_lock<std::mutex> lk(m);
        start_cv.wait(lk, [&] { return stop || job_round != seen; });
        if (stop) return;
        seen = job_round;
        body = job;
      }
      run_thread(tid, *body);
      {
        const std::lock_guard<std::mutex> lk(m);
        if (++done == threads) done_cv.notify_all();
      }
    }
  }

  void run_thread(unsigned tid, const std::function<void()>& body) {
    threadIdx = Uint3{tid, 0, 0};
    blockIdx = Uint3{block.index, 0, 0};
    t_block = &block;
    t_parity = 0;
    try {
      body();
    } catch (const Aborted&) {
    } catch (const std::exception& e) {
      fail(block, e.what());
    }
    thread_exit(block, tid);
    t_block = nullptr;
  }
};

Device::Device(unsigned threads_per_block) : impl_(std::make_unique<Impl>()) {
  if (threads_per_block == 0 || threads_per_block % kWarpSize != 0) {
    throw std::invalid_argument("the emulator runs blocks of whole warps");
  }
  impl_->threads = threads_per_block;
  impl_->block.warps = std::vector<Warp>(threads_per_block / kWarpSize);
  impl_->pool.reserve(threads_per_block);
  for (unsigned t = 0; t < threads_per_block; ++t) {
    impl_->pool.emplace_back([this, t] { impl_->worker(t); });
  }
}

Device::~Device() {
  {
    const std::lock_guard<std::mutex> lk(impl_->m);
    impl_->stop = true;
  }
  impl_->start_cv.notify_all();
  for (std::thread& t : impl_->pool) t.join();
}

void Device::check_block_size(unsigned block) const {
  if (block != impl_->threads) {
    throw std::invalid_argument("a launch of " + std::to_string(block) +
                                " threads per block on an emulator of " +
                                std::to_string(impl_->threads));
  }
}

void Device::run_block(unsigned b, const std::function<void()>& body) {
  Impl& d = *impl_;
  Block& blk = d.block;
  // A fresh block (the pool threads are all idle: the previous block has finished).
  blk.index = b;
  blk.live = static_cast<int>(d.threads);
  blk.sync.arrived = 0;
  blk.sync.vote = 0;
  for (Warp& w : blk.warps) {
    w.live.store(kWarpSize);
    w.barrier.arrived.store(0);
  }
  std::memset(blk.shared, 0, sizeof(blk.shared));
  blk.aborted.store(false);
  blk.error.clear();
  blk.running.store(static_cast<int>(d.threads));
  blk.blocked.store(0);
  std::unique_lock<std::mutex> lk(d.m);
  d.job = &body;
  d.done = 0;
  ++d.job_round;
  d.start_cv.notify_all();
  // NOTE: [watchdog] Every thread waiting at a barrier that has not completed, twice in a row
  // a second apart with no barrier completed in between, is a deadlock (barriers that wait on
  // each other): nothing else can release them.
  uint64_t last_progress = ~uint64_t{0};
  while (!d.done_cv.wait_for(lk, std::chrono::seconds(1), [&] { return d.done == d.threads; })) {
    const uint64_t progress = blk.progress.load(std::memory_order_relaxed);
    const bool stuck = blk.blocked.load(std::memory_order_relaxed) ==
                       blk.running.load(std::memory_order_relaxed);
    if (stuck && progress == last_progress) {
      fail(blk, "deadlock: " + describe_waits(blk));
    }
    last_progress = stuck ? progress : ~uint64_t{0};
  }
  d.job = nullptr;
  if (!blk.error.empty()) {
    throw std::runtime_error("emulated CUDA block " + std::to_string(b) + ": " + blk.error);
  }
}

}  // namespace fsdpcheck::emu

void __syncthreads() {
  fsdpcheck::emu::block_arrive_and_wait(*fsdpcheck::emu::t_block, 0);
}

int __syncthreads_or(int predicate) {
  return fsdpcheck::emu::block_arrive_and_wait(*fsdpcheck::emu::t_block, predicate);
}
