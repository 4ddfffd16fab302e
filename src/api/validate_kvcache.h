// src/api/validate_kvcache.h
// \brief From MhaFwdKvcacheParams to a KvcacheProblem: every check, every default, no side effects.
//
// Like validate_fwd, it reads only the views' metadata and never calls the CUDA runtime, so bad
// input fails before a device is touched. The contents of cache_seqlens, cache_leftpad,
// cache_batch_idx and block_table are read only for CPU views (the reference indexes with them);
// on CUDA they live on the device, and check_kvcache_contents runs on host copies of them only when
// the caller asks (FLASHKIT_CHECK_KVCACHE=1, see mha_fwd_kvcache.cpp).
#pragma once

#include <cstdint>

#include "common/kvcache_problem.h"
#include "flashkit/kvcache_params.h"

namespace flashkit::api {

constexpr int kMaxKvcacheSplits = 128;

// Throws flashkit::Error("mha_fwd_kvcache: ...") naming the argument, its value and what is
// supported. Defaults resolved as in mha_fwd (scale, causal folded into the window, window sides
// >= cache_capacity unbounded, causal off for one query row without ALiBi). problem.num_splits is
// left at 1 and the workspace empty: the dispatcher sets them.
KvcacheProblem validate_mha_fwd_kvcache(const MhaFwdKvcacheParams& params);

// The index arrays of `problem`, as host memory (null where the problem has none).
struct KvcacheIndexArrays {
  const int* cache_seqlens = nullptr;
  const int* cache_leftpad = nullptr;
  const int* cache_batch_idx = nullptr;
  const int* block_table = nullptr;  // with problem.block_table_batch_stride
};

// The promises listed in kvcache_params.h, checked on host copies of the index arrays: lengths and
// left pads in range, the append inside the capacity, batch indices in range (and distinct when
// appending), the block-table entries each sequence uses in [0, num_blocks).
void check_kvcache_contents(const KvcacheProblem& problem, const KvcacheIndexArrays& arrays);

}  // namespace flashkit::api
