// src/cuda/sm90/mbarrier.cuh
// \brief Shared-memory transaction barriers (mbarrier) and the stage/phase cursor of a ring of them.
//
// A ring of kStages buffers is guarded by two barriers per stage: `full` (the producer's copies have
// landed: completes when its arrivals are in and the expected transaction bytes were written) and
// `empty` (every consumer is done reading). An mbarrier's phase flips each time it completes; a
// waiter names the parity of the phase it waits to see completed. Walking the ring, the parity of a
// stage's barrier flips every kStages steps, which RingCursor tracks. The producer waits on `empty`
// with the opposite parity, so its first pass over a fresh ring does not block (a fresh barrier
// counts as having completed the phase before phase 0).
#pragma once

#include <cstdint>

namespace flashkit::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Initializes the barrier at shared address `bar` to expect `arrivals` arrivals per phase. One
// thread initializes; mbarrier_init_fence() + a CTA barrier publish it before first use.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

// Makes initialized barriers visible to the other threads and to the copy engine (async proxy).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival that also announces `bytes` of transactions (the bulk copies completing on `bar`).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

// Blocks until the phase with parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Whether the phase with parity `parity` of `bar` has completed, without blocking: a kernel tests
// early and waits (mbarrier_wait) later only if the test failed, so that the test's latency runs
// under other work.
__device__ __forceinline__ bool mbarrier_test(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Position in a ring of kStages barrier-guarded buffers: the stage index and the parity of the
// phase that step of the walk completes.
template <int kStages>
struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace flashkit::sm90
