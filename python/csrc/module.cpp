// python/csrc/module.cpp
// \brief The Python module flashkit._C. Importing it loads the library, whose static initialisers
// register the torch.ops.flashkit operators (ops.cpp); the module itself only answers what this
// build contains, so that callers can tell a left-out kernel from a bug.
#include <Python.h>

#include <string>

#include "flashkit/api.h"
#include "flashkit/tensor.h"

namespace {

using BuiltQuery = bool (*)(flashkit::DType, int);

// Parses (dtype: str, head_dim: int), dtype "float16" or "bfloat16", and asks `query`.
PyObject* ask_built(const char* fn, BuiltQuery query, PyObject* args) {
  const char* dtype = nullptr;
  int head_dim = 0;
  if (!PyArg_ParseTuple(args, "si", &dtype, &head_dim)) return nullptr;
  const std::string name = dtype;
  if (name != "float16" && name != "bfloat16") {
    PyErr_Format(PyExc_ValueError, "%s: dtype is '%s'; supported: float16, bfloat16", fn, dtype);
    return nullptr;
  }
  const flashkit::DType type =
      name == "float16" ? flashkit::DType::kFloat16 : flashkit::DType::kBFloat16;
  return PyBool_FromLong(query(type, head_dim));
}

PyObject* cuda_fwd_built(PyObject*, PyObject* args) {
  return ask_built("cuda_fwd_built", &flashkit::cuda_fwd_built, args);
}

PyObject* cuda_bwd_built(PyObject*, PyObject* args) {
  return ask_built("cuda_bwd_built", &flashkit::cuda_bwd_built, args);
}

PyObject* cuda_kvcache_built(PyObject*, PyObject* args) {
  return ask_built("cuda_kvcache_built", &flashkit::cuda_kvcache_built, args);
}

PyObject* cuda_nsa_built(PyObject*, PyObject* args) {
  return ask_built("cuda_nsa_built", &flashkit::cuda_nsa_built, args);
}

PyMethodDef methods[] = {
    {"cuda_fwd_built", cuda_fwd_built, METH_VARARGS,
     "Whether this build has the CUDA forward kernel for (dtype name, head dim)."},
    {"cuda_bwd_built", cuda_bwd_built, METH_VARARGS,
     "Whether this build has the CUDA backward kernel for (dtype name, head dim)."},
    {"cuda_kvcache_built", cuda_kvcache_built, METH_VARARGS,
     "Whether this build has the CUDA decode (KV-cache) kernel for (dtype name, head dim)."},
    {"cuda_nsa_built", cuda_nsa_built, METH_VARARGS,
     "Whether this build has the CUDA native-sparse-attention kernels for (dtype name, head dim)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                          "_C",
                          "flashkit's compiled part: the torch.ops.flashkit operators.",
                          -1,
                          methods,
                          nullptr,
                          nullptr,
                          nullptr,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module_def); }
