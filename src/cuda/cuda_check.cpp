// src/cuda/cuda_check.cpp
#include "cuda/cuda_check.h"

#include <cuda_runtime.h>

#include <string>

#include "flashkit/error.h"

namespace flashkit::cuda {

void check(int code, const char* what) {
  if (code != cudaSuccess) {
    throw Error(std::string(what) + ": " + cudaGetErrorString(static_cast<cudaError_t>(code)));
  }
}

void check_last_launch(const char* kernel_name) {
  check(cudaGetLastError(), (std::string("launching ") + kernel_name).c_str());
}

int current_device_arch() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute(major)");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
        "cudaDeviceGetAttribute(minor)");
  return major * 10 + minor;
}

}  // namespace flashkit::cuda
