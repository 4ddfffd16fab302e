// src/cuda/cuda_check.h
// \brief Turning CUDA runtime failures into flashkit::Error with the call and the reason.
#pragma once

namespace flashkit::cuda {

// Throws flashkit::Error("<what>: <cudaGetErrorString(code)>") when code != cudaSuccess.
// `code` is a cudaError_t passed as int so that plain C++ callers need no CUDA headers.
void check(int code, const char* what);

// Checks the launch just enqueued (cudaGetLastError).
void check_last_launch(const char* kernel_name);

// The current device's compute capability as 10 * major + minor, e.g. 90.
int current_device_arch();

}  // namespace flashkit::cuda
