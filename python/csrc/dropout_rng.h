// python/csrc/dropout_rng.h
// \brief Dropout's Philox key from torch's generators: drawn by the forward operators, returned to
// Python as the rng_state tensor that the backward operators take back.
//
// rng_state is int64 [2] = {seed, offset} on the tensors' device. On CUDA it is drawn from the CUDA
// generator's Philox state and the kernels read it from device memory (DropoutSpec::rng_state), so
// that a forward captured in a CUDA graph draws a fresh mask at each replay as torch's own dropout
// does, and a backward captured with it regenerates the same mask. On the CPU it comes from the CPU
// generator and the reference reads it on the host.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "flashkit/params.h"

namespace flashkit::torch_glue {

// Draws the key of one forward call that reads keys 0 .. max_seqlen_k - 1 (its Philox counters:
// DropoutSpec's comment), advancing `generator` (torch's default for q's device when absent).
at::Tensor draw_rng_state(const at::Tensor& q, int64_t max_seqlen_k,
                          const std::optional<at::Generator>& generator);

// The DropoutSpec of probability p whose key is `rng_state` (what draw_rng_state returned; not read
// when p is 0). Raises unless rng_state is int64 [2] on q's device.
DropoutSpec dropout_spec(const char* fn, double p, const std::optional<at::Tensor>& rng_state,
                         const at::Tensor& q);

}  // namespace flashkit::torch_glue
