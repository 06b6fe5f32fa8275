// The fsdpcheck::* operator schemas and the tiny Python module that loads them.
//
// Implementations live in cpu/ and cuda/ and register themselves with TORCH_LIBRARY_IMPL, so this
// file knows nothing about which backends were compiled.
#include <Python.h>
#include <torch/library.h>

#include <string>

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
}

namespace {

PyObject* build_info(PyObject*, PyObject*) {
  std::string info = fsdpcheck::backends_summary();
  info += "torch\t" FSDPCHECK_TORCH_VERSION "\n";
  return PyUnicode_FromStringAndSize(info.data(), static_cast<Py_ssize_t>(info.size()));
}

PyMethodDef kMethods[] = {
    {"build_info", build_info, METH_NOARGS,
     "Tab-separated lines: each compiled backend and its details, and the torch built against."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "fsdpcheck's compiled operators.", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kModule); }
