// python/csrc/dropout_rng.cpp
// \brief torch generator -> rng_state -> flashkit::DropoutSpec (see dropout_rng.h).
#include "dropout_rng.h"

#include <algorithm>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#ifdef FLASHKIT_TORCH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace flashkit::torch_glue {
namespace {

#ifdef FLASHKIT_TORCH_CUDA
// A call draws ceil(max_seqlen_k / 32) Philox counters (one per 32 keys); torch's CUDA generator
// advances its offset in multiples of 4.
uint64_t counters_of_call(int64_t max_seqlen_k) {
  const uint64_t counters = static_cast<uint64_t>(std::max<int64_t>(max_seqlen_k, 1) + 31) / 32;
  return (counters + 3) / 4 * 4;
}

at::Tensor draw_cuda(const at::Tensor& q, uint64_t counters,
                     const std::optional<at::Generator>& generator) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      generator, at::cuda::detail::getDefaultCUDAGenerator(q.device().index()));
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(counters);
  }
  const at::TensorOptions int64_on_device = q.options().dtype(at::kLong);
  if (!philox.captured_) {
    const int64_t key[2] = {static_cast<int64_t>(philox.seed_.val),
                            static_cast<int64_t>(philox.offset_.val)};
    return at::tensor(at::IntArrayRef(key, 2), at::TensorOptions(at::kLong))
        .to(q.device(), /*non_blocking=*/true);
  }
  // Capturing a CUDA graph: the seed and the base offset are device memory that each replay
  // updates, and this call's own share of the offset is fixed at capture. Both reads are captured.
  const at::Tensor seed = at::from_blob(philox.seed_.ptr, {1}, int64_on_device);
  const at::Tensor offset = at::from_blob(philox.offset_.ptr, {1}, int64_on_device);
  return at::cat({seed, offset + static_cast<int64_t>(philox.offset_intragraph_)});
}
#endif

// A fresh seed per call and offset 0: a call's counters never overlap each other.
at::Tensor draw_cpu(const std::optional<at::Generator>& generator) {
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      generator, at::detail::getDefaultCPUGenerator());
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    seed = gen->random64();
  }
  return at::tensor({static_cast<int64_t>(seed), int64_t{0}}, at::TensorOptions(at::kLong));
}

}  // namespace

at::Tensor draw_rng_state(const at::Tensor& q, int64_t max_seqlen_k,
                          const std::optional<at::Generator>& generator) {
#ifdef FLASHKIT_TORCH_CUDA
  if (q.is_cuda()) return draw_cuda(q, counters_of_call(max_seqlen_k), generator);
#endif
  if (q.is_cpu()) return draw_cpu(generator);
  // No CUDA in this extension: flashkit refuses the call with its own message; the key is unused.
  return at::zeros({2}, q.options().dtype(at::kLong));
}

DropoutSpec dropout_spec(const char* fn, double p, const std::optional<at::Tensor>& rng_state,
                         const at::Tensor& q) {
  DropoutSpec spec;
  spec.p = static_cast<float>(p);
  if (!(p > 0.0)) return spec;  // no mask (0), or a p that flashkit refuses by name
  TORCH_CHECK(rng_state.has_value() && rng_state->defined(), fn, ": dropout_p is ", p,
              " but rng_state is None; pass the rng_state that the forward returned");
  const at::Tensor& key = *rng_state;
  TORCH_CHECK(key.scalar_type() == at::kLong && key.dim() == 1 && key.size(0) == 2 &&
                  key.is_contiguous(),
              fn, ": rng_state has dtype ", key.scalar_type(), " and shape ", key.sizes(),
              "; expected the contiguous int64 [2] (seed, offset) that the forward returned");
  TORCH_CHECK(key.device() == q.device(), fn, ": rng_state is on ", key.device(), " but q is on ",
              q.device(), "; pass the rng_state that the forward returned");
  if (key.is_cpu()) {
    spec.seed = static_cast<uint64_t>(key.data_ptr<int64_t>()[0]);
    spec.offset = static_cast<uint64_t>(key.data_ptr<int64_t>()[1]);
  } else {
    spec.rng_state = key.data_ptr<int64_t>();
  }
  return spec;
}

}  // namespace flashkit::torch_glue
