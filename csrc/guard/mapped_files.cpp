// Files mapped for reading that may be truncated while they are read.
//
// NOTE: [mapped-file guard] A page of a mapped file that lies past the file's end after a
// truncation raises SIGBUS when touched, which kills the process: a checkpoint rewritten while
// `fsdpcheck compare` reads it would end it with no output. The offline readers hand mapped
// pages to the kernels (no copy: see NOTE: [mapped files] in fsdpcheck/sources/rawio.py), so
// every mapping they make is made here and registered. A SIGBUS whose address lies in a
// registered mapping maps zero pages over the rest of that mapping (MAP_FIXED, anonymous),
// records the mapping's id and returns: the read finishes on zeros instead of killing the
// process. The Python side asks for recorded faults after every batch a kernel read
// (`_guard_faults`) and turns one into an error naming the file ("changed while it was read");
// the zeros are never reported as values. Any other SIGBUS goes to the handler that was there
// before (re-installed, then re-raised), so crashes elsewhere still crash as they would.
//
// The handler is async-signal-safe: it reads a fixed table with atomics, calls mmap (a plain
// system call) and writes to a fixed ring. Mappings are registered and removed outside it.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <mutex>
#include <vector>

namespace fsdpcheck {
namespace {

constexpr int kSlots = 4096;      // mappings alive at once (readers keep a few dozen)
constexpr int64_t kRing = 1024;   // faults remembered between two checks

struct Slot {
  std::atomic<uintptr_t> start{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<int64_t> id{0};
  std::atomic<bool> used{false};
};

Slot g_slots[kSlots];
std::atomic<int64_t> g_faults{0};       // faults handled so far
std::atomic<int64_t> g_ring[kRing];     // the id of the mapping of fault i at i % kRing
uintptr_t g_page = 4096;
struct sigaction g_previous;
std::mutex g_install;

std::atomic<bool> g_forwarded{false};

void restore_and_reraise(int sig, siginfo_t* info) {
  // Not ours: put back whatever handled SIGBUS before and let it see the signal. A handler that
  // re-installs this one and raises again on its way out (faulthandler does) brings it back
  // here: the second time the default action ends the process, as it would have without us.
  if (g_forwarded.exchange(true)) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  sigaction(SIGBUS, &g_previous, nullptr);
  if (info == nullptr || info->si_code <= 0) {
    raise(sig);  // sent by a process: deliver it again, now to the previous handler
  }
  // A fault: returning re-runs the faulting access, which faults again into that handler.
}

void on_sigbus(int sig, siginfo_t* info, void* /*context*/) {
  const int saved = errno;
  if (info != nullptr && info->si_code > 0) {
    const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
    for (auto& s : g_slots) {
      const uintptr_t start = s.start.load(std::memory_order_acquire);
      if (start == 0 || addr < start) continue;
      const uintptr_t end = s.end.load(std::memory_order_acquire);
      if (addr >= end) continue;
      const uintptr_t page = addr & ~(g_page - 1);
      void* got = mmap(reinterpret_cast<void*>(page), end - page, PROT_READ,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (got == MAP_FAILED) break;
      const int64_t n = g_faults.fetch_add(1, std::memory_order_acq_rel);
      g_ring[n % kRing].store(s.id.load(std::memory_order_relaxed), std::memory_order_release);
      errno = saved;
      return;
    }
  }
  restore_and_reraise(sig, info);
  errno = saved;
}

// Installs the handler, or installs it again if something replaced it (e.g. a later
// faulthandler.enable()): the one found becomes the one faults elsewhere go to.
void install() {
  std::lock_guard<std::mutex> lock(g_install);
  struct sigaction now;
  if (sigaction(SIGBUS, nullptr, &now) != 0) return;
  if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return;
  g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction mine = {};
  mine.sa_sigaction = on_sigbus;
  mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&mine.sa_mask);
  struct sigaction previous;
  if (sigaction(SIGBUS, &mine, &previous) == 0) g_previous = previous;
}

int acquire_slot() {
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (g_slots[i].used.compare_exchange_strong(expected, true)) return i;
  }
  return -1;
}

// The whole file [0, length) mapped read-only, registered under `id`; an empty tensor when it
// cannot be mapped (the caller reads by byte range instead).
at::Tensor map_file(int64_t fd, int64_t length, int64_t id) {
  auto none = at::empty({0}, at::TensorOptions().dtype(at::kByte));
  if (length <= 0) return none;
  install();
  const int slot = acquire_slot();
  if (slot < 0) return none;
  void* base = mmap(nullptr, static_cast<size_t>(length), PROT_READ, MAP_PRIVATE,
                    static_cast<int>(fd), 0);
  if (base == MAP_FAILED) {
    g_slots[slot].used.store(false);
    return none;
  }
  const auto start = reinterpret_cast<uintptr_t>(base);
  const uintptr_t end = (start + static_cast<uintptr_t>(length) + g_page - 1) & ~(g_page - 1);
  Slot& s = g_slots[slot];
  s.id.store(id, std::memory_order_relaxed);
  s.end.store(end, std::memory_order_release);
  s.start.store(start, std::memory_order_release);
  const auto bytes = static_cast<size_t>(length);
  auto release = [slot, bytes](void* p) {
    // Unregistered before unmapped: a fault can no longer be attributed to a range that is
    // about to hold something else.
    g_slots[slot].start.store(0, std::memory_order_release);
    munmap(p, bytes);
    g_slots[slot].used.store(false, std::memory_order_release);
  };
  return at::from_blob(base, {length}, release, at::TensorOptions().dtype(at::kByte));
}

// [count, id of each fault after `since`] (ids of faults older than the ring are lost: the
// caller then treats all its mappings as damaged).
std::vector<int64_t> guard_faults(int64_t since) {
  const int64_t total = g_faults.load(std::memory_order_acquire);
  std::vector<int64_t> out{total};
  for (int64_t i = std::max(since, total - kRing); i < total; ++i) {
    out.push_back(g_ring[i % kRing].load(std::memory_order_acquire));
  }
  return out;
}

}  // namespace
}  // namespace fsdpcheck

TORCH_LIBRARY_FRAGMENT(fsdpcheck, m) {
  // See NOTE: [mapped-file guard]. Testing and reading aids of the offline readers, CPU only.
  m.def("_map_file(int fd, int length, int id) -> Tensor", &fsdpcheck::map_file);
  m.def("_guard_faults(int since) -> int[]", &fsdpcheck::guard_faults);
}
