// The metadata buffer and launches of a call (NOTE: [device metadata], NOTE: [launches] in
// launch.h). Host code without CUDA or torch: the CUDA implementation and the emulator pack the
// same words.
#include "cuda/launch.h"

#include <algorithm>
#include <map>

namespace fsdpcheck::cuda {

namespace {
constexpr uintptr_t kVectorBytes = 16;
bool vector_aligned(const char* ptr) { return reinterpret_cast<uintptr_t>(ptr) % kVectorBytes == 0; }
}  // namespace

bool vector_readable(const TensorPlan& p) {
  if (p.numel == 0 || p.ndim != 1 || p.stride_a[0] != 1 || !vector_aligned(p.a)) return false;
  if (p.e == nullptr) return true;
  return p.dtype_e == p.dtype_a && p.stride_e[0] == 1 && vector_aligned(p.e);
}

LaunchPlan plan_launches(const std::vector<TensorPlan>& plans, int64_t vector_blocks,
                         int64_t general_blocks) {
  const int64_t n = static_cast<int64_t>(plans.size());
  LaunchPlan out;
  std::vector<int64_t>& meta = out.meta;
  meta.assign(static_cast<size_t>(2 * n + 1), 0);
  for (int64_t t = 0; t < n; ++t) {
    meta[t + 1] = meta[t] + plan_chunks(plans[t]);
  }
  for (int64_t t = 0; t < n; ++t) {
    const TensorPlan& p = plans[t];
    meta[n + 1 + t] = static_cast<int64_t>(meta.size());
    meta.push_back(reinterpret_cast<int64_t>(p.a));
    meta.push_back(reinterpret_cast<int64_t>(p.e));
    meta.push_back(p.numel);
    meta.push_back(p.gbase);
    meta.push_back(static_cast<int64_t>(p.dtype_a) | (static_cast<int64_t>(p.dtype_e) << 8) |
                   (static_cast<int64_t>(p.ndim) << 16));
    for (const int64_t* field : {p.size, p.stride_a, p.stride_e, p.gstride}) {
      meta.insert(meta.end(), field, field + p.ndim);
    }
  }
  // Tensors by launch, in input order within each (empty tensors have no chunk: no launch reads
  // them, and the finishing kernel gives them the empty result).
  std::map<int32_t, std::vector<int64_t>> groups;
  for (int64_t t = 0; t < n; ++t) {
    if (plans[t].numel == 0) continue;
    const TensorPlan& p = plans[t];
    groups[vector_readable(p) ? static_cast<int32_t>(p.dtype_a) : kGeneralLaunch].push_back(t);
  }
  for (const auto& [dtype, tensors] : groups) {
    Launch l{};
    l.dtype = dtype;
    l.n_items = static_cast<int32_t>(tensors.size());
    l.items = static_cast<int64_t>(meta.size());
    int64_t local = 0;
    for (const int64_t t : tensors) {
      const TensorPlan& p = plans[t];
      const Item item{reinterpret_cast<int64_t>(p.a), reinterpret_cast<int64_t>(p.e), p.numel,
                      p.gbase, p.gstride[0], meta[t], local, t};
      const auto* words = reinterpret_cast<const int64_t*>(&item);
      meta.insert(meta.end(), words, words + kItemWords);
      local += plan_chunks(p);
    }
    l.chunks = local;
    const int64_t cap = std::max<int64_t>(1, dtype == kGeneralLaunch ? general_blocks : vector_blocks);
    l.grid = static_cast<uint32_t>(std::min(local, cap));
    out.launches.push_back(l);
  }
  return out;
}

}  // namespace fsdpcheck::cuda
