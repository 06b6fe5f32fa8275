#include "fsdpcheck/plan.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <sstream>
#include <utility>

#include "cuda/launch.h"

namespace fsdpcheck {
namespace {

bool to_dtype(at::ScalarType st, DType* out) {
  switch (st) {
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) \
  case at::ScalarType::ST:                               \
    *out = DType::k##E;                                  \
    return true;
    FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X
    default:
      return false;
  }
}

// "float64, float32, ...": the names of the table, for the error message.
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND) ", " NAME
constexpr const char* kSupportedNames = FSDPCHECK_DTYPES(FSDPCHECK_X) + 2;
#undef FSDPCHECK_X

DType checked_dtype(const char* op, const at::Tensor& t, const char* side, size_t i) {
  DType d;
  TORCH_CHECK_TYPE(to_dtype(t.scalar_type(), &d), "fsdpcheck.", op, ": ", side, "[", i,
                   "] has dtype ", t.scalar_type(), ", which is not supported (supported: ",
                   kSupportedNames, ")");
  return d;
}

void check_layout(const char* op, const at::Tensor& t, const char* side, size_t i) {
  TORCH_CHECK_VALUE(t.defined(), "fsdpcheck.", op, ": ", side, "[", i, "] is an undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "fsdpcheck.", op, ": ", side, "[", i,
                    "] has layout ", t.layout(), "; only strided (dense) tensors are supported");
}

// a * b with overflow detection (the product of non-negative int64s).
bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

c10::Device common_device(const char* op, c10::ArrayRef<at::Tensor> actual,
                          const c10::ArrayRef<at::Tensor>* expected) {
  TORCH_CHECK_VALUE(!actual.empty(), "fsdpcheck.", op, ": no tensors given");
  const c10::Device dev = actual[0].device();
  for (size_t i = 0; i < actual.size(); ++i) {
    TORCH_CHECK_VALUE(actual[i].device() == dev, "fsdpcheck.", op, ": actual[", i, "] is on ",
                      actual[i].device(), " but actual[0] is on ", dev,
                      "; one call handles one device (fsdpcheck.compare groups by device)");
    if (expected != nullptr) {
      TORCH_CHECK_VALUE((*expected)[i].device() == dev, "fsdpcheck.", op, ": expected[", i,
                        "] is on ", (*expected)[i].device(), " but actual[", i, "] is on ", dev,
                        "; move the pair to one device");
    }
  }
  return dev;
}

std::vector<TensorPlan> make_plans(const char* op, c10::ArrayRef<at::Tensor> actual,
                                   const c10::ArrayRef<at::Tensor>* expected,
                                   c10::IntArrayRef box_shapes, c10::IntArrayRef box_offsets) {
  const size_t n = actual.size();
  if (expected != nullptr) {
    TORCH_CHECK_VALUE(expected->size() == n, "fsdpcheck.", op, ": got ", n,
                      " actual tensors but ", expected->size(), " expected tensors");
  }
  TORCH_CHECK_VALUE(box_shapes.size() == box_offsets.size(), "fsdpcheck.", op,
                    ": box_shapes has ", box_shapes.size(), " entries but box_offsets has ",
                    box_offsets.size());
  size_t total_dims = 0;
  for (const at::Tensor& t : actual) total_dims += t.defined() ? t.dim() : 0;
  const bool whole = box_shapes.empty();
  TORCH_CHECK_VALUE(whole || box_shapes.size() == total_dims, "fsdpcheck.", op,
                    ": boxes describe ", box_shapes.size(), " dims in all but the tensors have ",
                    total_dims, " (one entry per dim of each tensor, concatenated)");

  std::vector<TensorPlan> plans(n);
  size_t cursor = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& a = actual[i];
    check_layout(op, a, "actual", i);
    TensorPlan& p = plans[i];
    p.dtype_a = checked_dtype(op, a, "actual", i);
    const at::Tensor* e = nullptr;
    if (expected != nullptr) {
      e = &(*expected)[i];
      check_layout(op, *e, "expected", i);
      p.dtype_e = checked_dtype(op, *e, "expected", i);
      TORCH_CHECK_VALUE(a.sizes() == e->sizes(), "fsdpcheck.", op, ": pair ", i,
                        " has shapes ", a.sizes(), " (actual) and ", e->sizes(), " (expected)");
      TORCH_CHECK_VALUE(a.device() == e->device(), "fsdpcheck.", op, ": pair ", i,
                        " is on ", a.device(), " (actual) and ", e->device(), " (expected)");
    } else {
      p.dtype_e = p.dtype_a;
    }

    const int64_t nd = a.dim();
    // Global shape, offsets and row-major global strides of this box.
    std::vector<int64_t> gshape(nd), goff(nd), gstr(nd);
    for (int64_t d = 0; d < nd; ++d) {
      gshape[d] = whole ? a.size(d) : box_shapes[cursor + d];
      goff[d] = whole ? 0 : box_offsets[cursor + d];
      TORCH_CHECK_VALUE(goff[d] >= 0 && gshape[d] >= 0 && goff[d] <= gshape[d] &&
                            a.size(d) <= gshape[d] - goff[d],
                        "fsdpcheck.", op, ": the box of tensor ", i, " (global shape ",
                        c10::IntArrayRef(gshape.data(), d + 1), ", offset ",
                        c10::IntArrayRef(goff.data(), d + 1), ") does not contain its local shape ",
                        a.sizes(), " in dim ", d);
    }
    cursor += whole ? 0 : nd;
    int64_t acc = 1;
    for (int64_t d = nd - 1; d >= 0; --d) {
      gstr[d] = acc;
      TORCH_CHECK_VALUE(!mul_overflows(acc, gshape[d], &acc), "fsdpcheck.", op,
                        ": the global shape of tensor ", i, " has more than 2**63 elements");
    }
    int64_t gbase = 0;
    for (int64_t d = 0; d < nd; ++d) {
      int64_t term;
      TORCH_CHECK_VALUE(!mul_overflows(goff[d], gstr[d], &term) &&
                            !__builtin_add_overflow(gbase, term, &gbase),
                        "fsdpcheck.", op, ": the box offset of tensor ", i, " overflows int64");
    }

    p.a = static_cast<const char*>(a.const_data_ptr());
    p.e = e != nullptr ? static_cast<const char*>(e->const_data_ptr()) : nullptr;
    p.numel = a.numel();
    p.gbase = gbase;
    if (p.numel == 0) {
      p.ndim = 1;
      continue;
    }

    // Coalesce: drop size-1 dims (their offset is already in gbase), then merge each dim into the
    // one outside it whenever the pair is one linear dim in all three index spaces.
    int k = 0;
    for (int64_t d = 0; d < nd; ++d) {
      const int64_t s = a.size(d);
      if (s == 1) continue;
      const int64_t sa = a.stride(d);
      const int64_t se = e != nullptr ? e->stride(d) : 0;
      if (k > 0 && p.gstride[k - 1] == s * gstr[d] && p.stride_a[k - 1] == s * sa &&
          p.stride_e[k - 1] == s * se) {
        p.size[k - 1] *= s;
        p.gstride[k - 1] = gstr[d];
        p.stride_a[k - 1] = sa;
        p.stride_e[k - 1] = se;
        continue;
      }
      TORCH_CHECK_VALUE(k < kMaxDims, "fsdpcheck.", op, ": tensor ", i, " (shape ", a.sizes(),
                        ", strides ", a.strides(), ") needs more than ", kMaxDims,
                        " dims after merging contiguous ones; pass a .contiguous() copy");
      p.size[k] = s;
      p.gstride[k] = gstr[d];
      p.stride_a[k] = sa;
      p.stride_e[k] = se;
      ++k;
    }
    if (k == 0) {  // a single element
      p.size[0] = 1;
      p.gstride[0] = 1;
      k = 1;
    }
    p.ndim = k;
  }
  return plans;
}

void check_tolerances(double rtol, double atol) {
  TORCH_CHECK_VALUE(rtol >= 0.0 && atol >= 0.0, "fsdpcheck.compare: rtol and atol must be "
                    "non-negative numbers, got rtol=", rtol, ", atol=", atol);
}

cuda::LaunchPlan plan_launch(const char* op, const std::vector<TensorPlan>& plans,
                             int64_t vector_blocks, int64_t general_blocks) {
  for (size_t i = 0; i < plans.size(); ++i) {
    const TensorPlan& p = plans[i];
    if (p.numel == 0) continue;
    const std::pair<const char*, const char*> sides[] = {{"actual", p.a}, {"expected", p.e}};
    const DType dtypes[] = {p.dtype_a, p.dtype_e};
    for (int s = 0; s < 2; ++s) {
      const auto [side, ptr] = sides[s];
      if (ptr == nullptr) continue;
      const int size = dtype_size(dtypes[s]);
      TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(size) == 0,
                        "fsdpcheck.", op, ": ", side, "[", i, "] starts at address ",
                        static_cast<const void*>(ptr), ", not a multiple of its element size (",
                        size, " bytes), which the CUDA kernels cannot read; pass a copy "
                        "(tensor.clone())");
    }
  }
  cuda::LaunchPlan out = cuda::plan_launches(plans, vector_blocks, general_blocks);
  const int64_t total_chunks = out.meta[plans.size()];
  TORCH_CHECK_VALUE(total_chunks <= std::numeric_limits<int32_t>::max(), "fsdpcheck.", op,
                    ": ", total_chunks, " chunks exceed one launch; split the call");
  return out;
}

namespace {
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::pair<std::string, std::string>>& registry() {
  static std::vector<std::pair<std::string, std::string>> r;
  return r;
}
}  // namespace

void register_backend(const std::string& name, const std::string& detail) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().emplace_back(name, detail);
}

std::string backends_summary() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::ostringstream os;
  for (const auto& [name, detail] : registry()) os << name << '\t' << detail << '\n';
  return os.str();
}

}  // namespace fsdpcheck
