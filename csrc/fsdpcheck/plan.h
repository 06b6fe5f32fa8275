// Host-side planning shared by the CPU and CUDA implementations: input validation, the mapping
// from a local tensor (sizes, strides, box) to coalesced index spaces, and the chunk split.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/launch.h"
#include "fsdpcheck/elementwise.h"

namespace fsdpcheck {

// Validates the inputs of an op (raising ValueError/TypeError naming the offending pair) and plans
// every input. `expected` may be null (single-tensor mode). Box shapes/offsets are the
// concatenation of one entry per dim of each tensor, or both empty for "every tensor is whole".
std::vector<TensorPlan> make_plans(const char* op, c10::ArrayRef<at::Tensor> actual,
                                   const c10::ArrayRef<at::Tensor>* expected,
                                   c10::IntArrayRef box_shapes, c10::IntArrayRef box_offsets);

// Raises ValueError unless rtol and atol are non-negative numbers.
void check_tolerances(double rtol, double atol);

// The metadata buffer and launches of one call of the CUDA kernels (NOTE: [device metadata] and
// NOTE: [launches] in cuda/launch.h; its word plans.size() is the number of chunks), with grids
// of at most vector_blocks / general_blocks blocks, after the checks that call needs: every non-empty input starts at a multiple of its element size (else ValueError naming
// it: the kernels read whole elements, and a misaligned one faults and takes the CUDA context down
// with it; torch's allocators never hand out such memory, but a view of a byte buffer, from
// DLPack or torch.frombuffer, can start anywhere), and the chunks fit one grid.
cuda::LaunchPlan plan_launch(const char* op, const std::vector<TensorPlan>& plans,
                             int64_t vector_blocks, int64_t general_blocks);

// The common device of all inputs; raises naming the first tensor that differs.
c10::Device common_device(const char* op, c10::ArrayRef<at::Tensor> actual,
                          const c10::ArrayRef<at::Tensor>* expected);

// Registry of compiled backends, for build_info(): each implementation adds itself at load time.
void register_backend(const std::string& name, const std::string& detail);
std::string backends_summary();

}  // namespace fsdpcheck
