// src/cuda/sm90/warpgroup.cuh
// \brief Warp-specialization primitives of sm_90a: register reallocation between warpgroups,
// named barriers, and the proxy fence between ordinary shared-memory stores and the async proxy.
#pragma once

#include <cstdint>

namespace flashkit::sm90 {

constexpr int kWarpgroupThreads = 128;

// Hands registers back (producer warpgroups) or claims them (consumer warpgroups). Every thread of
// the warpgroup executes it; it takes effect only in a kernel launched with a register cap
// (__launch_bounds__(threads, 1)), and each role must be one branch of a single if/else.
template <int kRegisters>
__device__ __forceinline__ void warpgroup_release_registers() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void warpgroup_claim_registers() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Hardware barrier ids (0 is __syncthreads). A kernel names its own in an enum class whose values
// start at kFirstNamedBarrier.
constexpr uint32_t kFirstNamedBarrier = 1;

// Blocks until `threads` threads (a multiple of 32) have reached barrier `id`.
template <typename Id>
__device__ __forceinline__ void named_barrier_sync(Id id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}

// Counts this thread's arrival at barrier `id` without waiting (the matching side calls sync).
template <typename Id>
__device__ __forceinline__ void named_barrier_arrive(Id id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}

// Orders this thread's ordinary shared-memory stores before later reads of that memory by the
// tensor cores (wgmma) or the copy engine (TMA): issue it, then the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace flashkit::sm90
