// The metadata buffer of a launch (NOTE: [device metadata] in launch.h). Host code without CUDA or
// torch: the CUDA implementation and the emulator pack the same words.
#include "cuda/launch.h"

namespace fsdpcheck::cuda {

std::vector<int64_t> pack_metadata(const std::vector<TensorPlan>& plans) {
  const int64_t n = static_cast<int64_t>(plans.size());
  std::vector<int64_t> meta(static_cast<size_t>(2 * n + 1), 0);
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
  return meta;
}

}  // namespace fsdpcheck::cuda
