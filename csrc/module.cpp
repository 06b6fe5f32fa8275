// The fsdpcheck::* operator schemas and the tiny Python module that loads them.
//
// Implementations live in cpu/ and cuda/ and register themselves with TORCH_LIBRARY_IMPL, so this
// file knows nothing about which backends were compiled.
#include <Python.h>
#include <torch/library.h>

#include <cstddef>
#include <string>
#include <utility>

#include "fsdpcheck/elementwise.h"
#include "fsdpcheck/plan.h"

TORCH_LIBRARY(fsdpcheck, m) {
  // One row of 14 int64 words per pair, the layout of fsdpcheck::Partial (elementwise.h): counts,
  // fingerprints (uint64 bits), maxima (float64 bits) with global linear indices, sums.
  m.def(
      "compare(Tensor[] actual, Tensor[] expected, int[] box_shapes, int[] box_offsets, "
      "float rtol, float atol, bool equal_nan, bool fingerprints, bool stats) -> Tensor");
  // Fingerprint v1 of each tensor at its box, as the int64 bits of a uint64.
  m.def("fingerprint(Tensor[] tensors, int[] box_shapes, int[] box_offsets) -> Tensor");
  // Testing aid (CPU only): the rows of compare computed element by element through the code path
  // of the CUDA kernels. single=True ignores `expected` (the path of fingerprint).
  m.def(
      "_reference(Tensor[] actual, Tensor[] expected, int[] box_shapes, int[] box_offsets, "
      "float rtol, float atol, bool equal_nan, bool fingerprints, bool stats, bool single) "
      "-> Tensor");
  // Testing aid (CPU only): the rows the CUDA kernels compute, run on the CPU by the emulator
  // (csrc/emulator): slow, for a few chunks per call.
  m.def(
      "_emulated(Tensor[] actual, Tensor[] expected, int[] box_shapes, int[] box_offsets, "
      "float rtol, float atol, bool equal_nan, bool fingerprints, bool stats, bool single) "
      "-> Tensor");
}

namespace {

// The word of each field in a compare row, from the struct itself: Python's ops.COLUMNS is
// tested against this line, so the two cannot drift apart.
std::string row_layout() {
  using fsdpcheck::Partial;
  const std::pair<const char*, size_t> fields[] = {
      {"mismatched", offsetof(Partial, mismatched)}, {"nan_actual", offsetof(Partial, nan_a)},
      {"nan_expected", offsetof(Partial, nan_e)},    {"inf_actual", offsetof(Partial, inf_a)},
      {"inf_expected", offsetof(Partial, inf_e)},    {"zeros", offsetof(Partial, zeros)},
      {"fingerprint_actual", offsetof(Partial, fp_a)},
      {"fingerprint_expected", offsetof(Partial, fp_e)},
      {"max_abs_diff", offsetof(Partial, max_abs)},  {"max_abs_index", offsetof(Partial, max_abs_idx)},
      {"max_rel_diff", offsetof(Partial, max_rel)},  {"max_rel_index", offsetof(Partial, max_rel_idx)},
      {"sum", offsetof(Partial, sum)},               {"sumsq", offsetof(Partial, sumsq)},
  };
  std::string out = "row\t";
  for (const auto& [name, offset] : fields) {
    out += std::string(name) + "=" + std::to_string(offset / sizeof(int64_t)) + " ";
  }
  out.back() = '\n';
  return out;
}

// One line per compiled dtype, from the table (dtypes.h): what Python's SUPPORTED_DTYPES and
// every per-dtype table in Python are held to.
std::string dtype_lines() {
  std::string out;
#define FSDPCHECK_X(E, CODE, NAME, BITS, SIZE, ST, KIND)                                    \
  out += std::string("dtype\t") + NAME + " code=" + std::to_string(CODE) +                \
         " size=" + std::to_string(SIZE) + " kind=" +                                      \
         fsdpcheck::dtype_kind_name(fsdpcheck::DTypeKind::k##KIND) + "\n";
  FSDPCHECK_DTYPES(FSDPCHECK_X)
#undef FSDPCHECK_X
  return out;
}

PyObject* build_info(PyObject*, PyObject*) {
  std::string info = fsdpcheck::backends_summary();
  info += "torch\t" FSDPCHECK_TORCH_VERSION "\n";
  info += row_layout();
  info += dtype_lines();
  return PyUnicode_FromStringAndSize(info.data(), static_cast<Py_ssize_t>(info.size()));
}

PyMethodDef kMethods[] = {
    {"build_info", build_info, METH_NOARGS,
     "Tab-separated lines: each compiled backend and its details, the torch built against, "
     "the word of each field of a compare row, and each compiled dtype (name, code, size, kind)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "fsdpcheck's compiled operators.", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kModule); }
