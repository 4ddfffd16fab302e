// src/api/dispatch_support.h
// \brief What every entry point's dispatch shares: the FLASHKIT_DEBUG switch, the rebuild hint for a
// kernel a build left out, and the guard that makes the tensors' device current for one call.
#pragma once

#include <cstdlib>
#include <string>

#include "build_config.h"

#ifdef FLASHKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#endif

#include "flashkit/error.h"
#include "flashkit/tensor.h"

namespace flashkit::api {

// FLASHKIT_DEBUG=1 in the environment prints the backend and kernel configuration each call runs
// on, to stderr: the first thing to check when a shape is slower than expected.
inline bool debug_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("FLASHKIT_DEBUG");
    return value != nullptr && value[0] != '\0' && value[0] != '0';
  }();
  return enabled;
}

// The short dtype names the build options use (FLASHKIT_DTYPES).
inline const char* build_dtype_name(DType dtype) {
  return dtype == DType::kBFloat16 ? "bf16" : "fp16";
}

// A CMake list with `item` appended to the space-separated `built` list, e.g. "64;128;96".
inline std::string list_with(const char* built, const std::string& item) {
  std::string list = built;
  for (char& c : list) {
    if (c == ' ') c = ';';
  }
  return (list.empty() ? "" : list + ";") + item;
}

#ifdef FLASHKIT_WITH_CUDA

// The error for a call whose `kernel` ("forward", "backward", "decode") this build left out, with
// the CMake flags of a build that has it: the head-dim family added to FLASHKIT_HEAD_DIMS unless
// some dtype has that family (`family_built`), the dtype added to FLASHKIT_DTYPES unless some
// family has that dtype (`dtype_built`).
[[noreturn]] inline void throw_kernel_not_built(const char* fn, const char* kernel, DType dtype,
                                                int head_dim, int family, bool family_built,
                                                bool dtype_built) {
  std::string flags;
  if (!family_built) {
    flags += "-DFLASHKIT_HEAD_DIMS=\"" +
             list_with(FLASHKIT_BUILT_HEAD_DIMS, std::to_string(family)) + "\"";
  }
  if (!dtype_built) {
    if (!flags.empty()) flags += " ";
    flags +=
        "-DFLASHKIT_DTYPES=\"" + list_with(FLASHKIT_BUILT_DTYPES, build_dtype_name(dtype)) + "\"";
  }
  throw Error(std::string(fn) + ": this build of flashkit does not include the CUDA " + kernel +
              " kernel for " + build_dtype_name(dtype) + " head dim " + std::to_string(head_dim) +
              " (family " + std::to_string(family) + "); rebuild with " + flags +
              " (built: head dims " + FLASHKIT_BUILT_HEAD_DIMS + ", dtypes " +
              FLASHKIT_BUILT_DTYPES + ")");
}

// The sm80 kernels need compute capability 8.0 or newer; `device` must be current.
inline void check_sm80_or_newer(const char* fn, int device) {
  const int arch = cuda::current_device_arch();
  if (arch < 80) {
    throw Error(std::string(fn) + ": cuda:" + std::to_string(device) + " has compute capability " +
                std::to_string(arch / 10) + "." + std::to_string(arch % 10) +
                "; the flashkit CUDA kernels need 8.0 or newer (Ampere, Ada, Hopper)");
  }
}

// Makes `device` current for the lifetime of the guard and restores the caller's device after, so
// that a call on cuda:1 leaves a caller working on cuda:0 where it was.
class CurrentDeviceGuard {
 public:
  explicit CurrentDeviceGuard(int device) {
    cuda::check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) cuda::check(cudaSetDevice(device), "cudaSetDevice");
  }
  // Restoring cannot fail for a device that was current a moment ago; a destructor must not throw,
  // so the code is not checked.
  ~CurrentDeviceGuard() { cudaSetDevice(previous_); }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

#endif  // FLASHKIT_WITH_CUDA

}  // namespace flashkit::api
