// fsdpcheck::_emulated: the rows the CUDA kernels compute, run on the CPU by the emulator
// (NOTE: [emulator] in cuda_shim.h). The same host steps as the CUDA implementation
// (compare_cuda.cpp): plans, the launch checks, the metadata buffer, both kernels; host memory
// stands in for device memory.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <vector>

#include "emulator/emulator.h"
#include "fsdpcheck/plan.h"

namespace fsdpcheck::cuda {
namespace {

at::Tensor emulated_cpu(at::TensorList actual, at::TensorList expected,
                        at::IntArrayRef box_shapes, at::IntArrayRef box_offsets, double rtol,
                        double atol, bool equal_nan, bool fingerprints, bool stats, bool single) {
  check_tolerances(rtol, atol);
  const std::vector<TensorPlan> plans =
      make_plans("_emulated", actual, single ? nullptr : &expected, box_shapes, box_offsets);
  // NOTE: [emulated grids] Grids of at most 2 blocks: every launch of more than 2 chunks has
  // blocks that take several chunks, of one tensor or across tensors.
  const LaunchPlan launch = plan_launch("_emulated", plans, 2, 2);
  const std::vector<int64_t>& meta = launch.meta;
  const int64_t n = static_cast<int64_t>(plans.size());
  std::vector<Partial> partials(static_cast<size_t>(std::max<int64_t>(meta[n], 1)));
  std::vector<int64_t> fps(plans.size(), 0);
  at::Tensor rows = at::empty({n, kPartialWords}, at::kLong);
  LaunchArgs args;
  args.meta = meta.data();
  args.n = static_cast<int>(n);
  args.total_chunks = meta[n];
  // Single-tensor mode is what fsdpcheck::fingerprint launches: the fingerprint alone.
  args.options = single ? Options{CompareParams{0.0, 0.0, true}, true, false, false}
                        : Options{CompareParams{rtol, atol, equal_nan}, fingerprints, stats};
  args.has_expected = !single;
  args.partials = partials.data();
  args.rows = reinterpret_cast<Partial*>(rows.mutable_data_ptr<int64_t>());
  // Single-tensor mode is the path of fsdpcheck::fingerprint, whose output is the fingerprints
  // alone: both outputs are written here, and must agree.
  args.fingerprints = single ? fps.data() : nullptr;
  args.launches = launch.launches.data();
  args.n_launches = static_cast<int>(launch.launches.size());
  try {
    emulate_compare(args);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdpcheck._emulated: ", e.what());
  }
  for (int64_t t = 0; single && t < n; ++t) {
    TORCH_CHECK(static_cast<uint64_t>(fps[t]) == args.rows[t].fp_a, "fsdpcheck._emulated: the "
                "finishing kernel wrote two fingerprints for tensor ", t);
  }
  return rows;
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpcheck, CPU, m) { m.impl("_emulated", &emulated_cpu); }

}  // namespace fsdpcheck::cuda
