// CUDA implementation of fsdpcheck::compare and fsdpcheck::fingerprint: host side.
//
// Plans the inputs (shared with the CPU: fsdpcheck/plan.cpp), packs one metadata buffer
// (NOTE: [device metadata] in launch.h), copies it once and launches two kernels on the current
// stream of the inputs' device. Nothing here synchronises: the caller reads the result tensor.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda/launch.h"
#include "fsdpcheck/plan.h"

namespace fsdpcheck::cuda {
namespace {

struct Outputs {
  at::Tensor rows;          // [n, kPartialWords] or undefined
  at::Tensor fingerprints;  // [n] or undefined
};

Outputs run(const char* op, at::TensorList actual, const at::TensorList* expected,
            at::IntArrayRef box_shapes, at::IntArrayRef box_offsets, const Options& o,
            bool want_rows) {
  const c10::Device device = common_device(op, actual, expected);
  TORCH_CHECK_VALUE(device.is_cuda(), "fsdpcheck.", op, ": the CUDA implementation got tensors on ",
                    device);
  const std::vector<TensorPlan> plans = make_plans(op, actual, expected, box_shapes, box_offsets);
  const c10::cuda::OptionalCUDAGuard guard(device);
  // NOTE: [launches]: one grid fills the device once (every block resident), and each block
  // takes a contiguous run of chunks.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.index()));
  const LaunchPlan launch = plan_launch(op, plans, int64_t{sms} * kVectorBlocksPerSM,
                                        int64_t{sms} * kGeneralBlocksPerSM);
  const std::vector<int64_t>& meta = launch.meta;
  const int64_t n = static_cast<int64_t>(plans.size());
  const int64_t total_chunks = meta[n];

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor host = at::empty({static_cast<int64_t>(meta.size())}, long_opts.pinned_memory(true));
  std::memcpy(host.mutable_data_ptr<int64_t>(), meta.data(), meta.size() * sizeof(int64_t));
  // Pinned + non_blocking: an async copy on the current stream; the caching host allocator keeps
  // `host` alive until the copy has run.
  const at::Tensor dev_meta = host.to(device, /*non_blocking=*/true);
  const auto dev_opts = long_opts.device(device);
  const at::Tensor partials = at::empty({std::max<int64_t>(total_chunks, 1), kPartialWords}, dev_opts);
  Outputs out;
  if (want_rows) {
    out.rows = at::empty({n, kPartialWords}, dev_opts);
  } else {
    out.fingerprints = at::empty({n}, dev_opts);
  }
  LaunchArgs args;
  args.meta = dev_meta.const_data_ptr<int64_t>();
  args.n = static_cast<int>(n);
  args.total_chunks = total_chunks;
  args.options = o;
  args.has_expected = expected != nullptr;
  args.partials = reinterpret_cast<Partial*>(partials.mutable_data_ptr<int64_t>());
  args.rows = want_rows ? reinterpret_cast<Partial*>(out.rows.mutable_data_ptr<int64_t>()) : nullptr;
  args.fingerprints = want_rows ? nullptr : out.fingerprints.mutable_data_ptr<int64_t>();
  args.launches = launch.launches.data();
  args.n_launches = static_cast<int>(launch.launches.size());
  launch_compare(args, stream);
  return out;
}

at::Tensor compare_cuda(at::TensorList actual, at::TensorList expected,
                        at::IntArrayRef box_shapes, at::IntArrayRef box_offsets, double rtol,
                        double atol, bool equal_nan, bool fingerprints, bool stats) {
  check_tolerances(rtol, atol);
  const Options o{CompareParams{rtol, atol, equal_nan}, fingerprints, stats};
  return run("compare", actual, &expected, box_shapes, box_offsets, o, /*want_rows=*/true).rows;
}

at::Tensor fingerprint_cuda(at::TensorList tensors, at::IntArrayRef box_shapes,
                            at::IntArrayRef box_offsets) {
  const Options o{CompareParams{0.0, 0.0, true}, /*fingerprints=*/true, /*stats=*/false,
                  /*counts=*/false};
  return run("fingerprint", tensors, nullptr, box_shapes, box_offsets, o, /*want_rows=*/false)
      .fingerprints;
}

[[maybe_unused]] const bool kRegistered =
    (register_backend("cuda", "cuda=" FSDPCHECK_CUDA_VERSION "; archs=" FSDPCHECK_CUDA_ARCHS), true);

}  // namespace

TORCH_LIBRARY_IMPL(fsdpcheck, CUDA, m) {
  m.impl("compare", &compare_cuda);
  m.impl("fingerprint", &fingerprint_cuda);
}

}  // namespace fsdpcheck::cuda
