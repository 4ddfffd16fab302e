// src/cuda/sm90/fwd_launch_sm90.cuh
// \brief Host side of the sm90 forward kernel: tensor maps, grid, shared memory, launch. Included
// only by the generated per-(dtype, family) instance files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/sm90/fwd_kernel_sm90.cuh"
#include "cuda/sm90/fwd_sm90.h"
#include "cuda/sm90/fwd_tile_config_sm90.h"
#include "cuda/sm90/tensor_map.h"
#include "cuda/sm90/tile_counter_slots.h"
#include "flashkit/error.h"

namespace flashkit::sm90 {
#ifdef FLASHKIT_SM90_FWD_TRACE
inline namespace traced {  // the traced build's own symbols, beside the library's untraced ones
#endif

// The dynamic tile scheduler's counters of this instance (tile_counter_slots.h): zero when the module
// loads, and every launch leaves its counter zero.
static __device__ unsigned fwd_tile_counters[kTileCounterSlots];

template <DType kDType> struct ElementOf;
template <> struct ElementOf<DType::kBFloat16> { using type = __nv_bfloat16; };
template <> struct ElementOf<DType::kFloat16> { using type = __half; };

// Launches fwd_kernel<Traits, kPipelined> on the problem: tensor maps, tile order, grid, shared
// memory. The query heads packed as plan.pack_group says; with Traits::kSplitKeys the keys split
// plan.num_splits ways (into plan.split_lse and split_out).
template <typename Traits, bool kPipelined>
void launch_fwd(const FwdProblem& problem, const FwdPlan& plan, cudaStream_t stream) {
  const int group = plan.pack_group;
  const int row_heads = problem.heads_q / group;  // the (batch, head) pairs' heads: kv heads when packed
  const int tokens_per_tile = fwd_tokens_per_tile(Traits::kBlockM, group);
  const int64_t num_m_blocks = (problem.seqlen_q + tokens_per_tile - 1) / tokens_per_tile;
  const int num_splits = Traits::kSplitKeys ? plan.num_splits : 1;
  const int64_t num_blocks = num_m_blocks * problem.batch * row_heads * num_splits;
  if (num_blocks == 0) return;
  if (num_blocks > INT32_MAX) {
    throw Error("mha_fwd: the sm90 forward's tiles, batch * heads_q / " + std::to_string(group) +
                " * ceil(seqlen_q / " + std::to_string(tokens_per_tile) + ") * " + std::to_string(num_splits) +
                " split(s) = " + std::to_string(num_blocks) +
                ", exceed the 2^31 - 1 one launch can run");
  }

  const bool varlen = problem.is_varlen();
  FwdParams params;
  params.problem = problem;
  params.rows.group = group;
  params.rows.tokens_per_consumer = fwd_tokens_per_consumer(group);
  params.rows.reciprocal = fwd_pack_reciprocal(group);
  params.num_splits = num_splits;
  params.blocks_per_split = 0;
  params.split_lse = nullptr;
  params.split_out = nullptr;
  if constexpr (Traits::kSplitKeys) {
    const int64_t key_blocks = (problem.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    params.blocks_per_split = static_cast<int>((key_blocks + num_splits - 1) / num_splits);
    params.split_lse = plan.split_lse;
    params.split_out = plan.split_out;
  }
  params.tile_counter = nullptr;
  // Q and O move in boxes of one consumer's tokens (TileRows).
  params.q_map = grouped_rows_tensor_map(problem, problem.q, problem.q_tensor_rows(), problem.heads_q, group,
                                         problem.q_row_stride, problem.q_head_stride, problem.q_batch_stride,
                                         params.rows.tokens_per_consumer, "q");
  params.k_map = input_tensor_map(problem, problem.k, problem.k_tensor_rows(),
                                  problem.heads_kv, problem.k_row_stride, problem.k_head_stride,
                                  problem.k_batch_stride, Traits::kBlockN, "k");
  params.v_map = input_tensor_map(problem, problem.v, problem.k_tensor_rows(),
                                  problem.heads_kv, problem.v_row_stride, problem.v_head_stride,
                                  problem.v_batch_stride, Traits::kBlockN, "v");
  if constexpr (Traits::kStageOutput) {
    params.o_map = grouped_rows_tensor_map(problem, problem.out, problem.q_tensor_rows(), problem.heads_q, group,
                                           problem.out_row_stride, problem.out_head_stride,
                                           problem.out_batch_stride, params.rows.tokens_per_consumer, "out");
  }

  // Tile order (TileOrder in fwd_kernel_sm90.cuh). Under a causal or sliding-window mask the tiles
  // of one (batch, head) pair cost different numbers of key blocks; with the pairs one after another
  // (1 pair per group) the heavy tiles of the last pairs started late and set the end. Groups of
  // about kPairsPerGroup pairs hand the heaviest tiles out first and end every group on light ones:
  // H200, bf16, 2026-11-23, causal +1% (d64 2k) to +11% (d256 2k) over the old order in the same
  // run (bench/NOTES.md). Without a window every tile costs the same and the grouping only spreads
  // the CTAs in flight over more pairs (-2% to -4% at d128/d256 8k in that run), so one pair per
  // group stays. FLASHKIT_SM90_TILE_GROUP=<pairs per group> overrides both (measurement switch).
  constexpr int kPairsPerGroup = 8;
  const int64_t batch_heads = static_cast<int64_t>(problem.batch) * row_heads;
  const bool uneven_tiles = problem.window_left >= 0 || problem.window_right >= 0;
  const char* group_env = std::getenv("FLASHKIT_SM90_TILE_GROUP");
  const int64_t pairs_per_group = group_env != nullptr ? std::max(1, std::atoi(group_env))
                                  : uneven_tiles      ? kPairsPerGroup
                                                      : 1;
#ifdef FLASHKIT_SM90_FWD_TRACE
  params.trace = fwd_trace_buffer;
#endif
  params.tile_groups = static_cast<int>(std::max<int64_t>(1, batch_heads / pairs_per_group));

  // Grid. Where every tile costs the same (no window, fixed lengths), one CTA per SM walks the tiles
  // in a static round robin (persistent): the next tile's Q, K and V load under the previous tile's
  // last products and epilogue instead of behind a CTA launch. H200, bf16, 2026-11-23: +1% to +3%
  // over one CTA per tile in all nine unmasked cells of the grid (bench/NOTES.md). Under a mask, or
  // with sequences of different lengths, the tiles differ and a static walk leaves SMs idle at the
  // end (the static round robin ran causal cells 3-28% slower; a static snake over every pair's
  // heaviest tiles first, balanced in a model, 1-13% slower: K and V of all pairs in flight at once,
  // by count past L2). There one CTA per SM takes the tiles from a counter in TileOrder (dynamic),
  // which balances as the hardware does with one CTA per tile, without a CTA start per tile. A
  // launch being captured into a CUDA graph runs one CTA per tile instead: a replay may run beside
  // launches on the capturing stream, which would share its counter. FLASHKIT_SM90_GRID=persistent
  // (static), =dynamic or =tile forces one (measurement switch; dynamic, outside a capture).
  const char* grid = std::getenv("FLASHKIT_SM90_GRID");
  const std::string forced = grid != nullptr ? grid : "";
  const bool uniform = !uneven_tiles && !varlen;
  int device = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  bool dynamic = forced.empty() ? !uniform : forced == "dynamic";
  if (dynamic) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cuda::check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    const int slot = capture == cudaStreamCaptureStatusNone ? tile_counter_slot(device, stream) : -1;
    if (slot >= 0) {
      unsigned* counters = nullptr;
      cuda::check(cudaGetSymbolAddress(reinterpret_cast<void**>(&counters), fwd_tile_counters),
                  "cudaGetSymbolAddress(fwd_tile_counters)");
      params.tile_counter = counters + slot;
    }
    dynamic = slot >= 0;
  }
  const bool persistent = dynamic || (forced.empty() ? uniform : forced == "persistent");
  int64_t ctas = num_blocks;
  if (persistent) {
    int sm_count = 0;
    cuda::check(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
                "cudaDeviceGetAttribute(multiprocessor count)");
    ctas = std::min<int64_t>(num_blocks, sm_count);
  }

  auto kernel = fwd_kernel<Traits, kPipelined>;
  cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   Traits::kSmemBytes),
              "cudaFuncSetAttribute(sm90 fwd_kernel, max dynamic shared memory)");
  kernel<<<static_cast<unsigned>(ctas), Traits::kThreads, Traits::kSmemBytes, stream>>>(
      params, static_cast<int>(num_blocks));
  cuda::check_last_launch("sm90 fwd_kernel");
}

template <DType kDType, int kHeadDimFamily>
void run_fwd(const FwdProblem& problem, const FwdPlan& plan, void* stream_ptr) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDimFamily);
  constexpr FwdTileConfig kDropoutTile = fwd_tile_config(kHeadDimFamily, true);
  static_assert(kTile.block_m > 0 && kDropoutTile.block_m > 0,
                "no sm90 tile configuration for this head-dim family");
  using Element = typename ElementOf<kDType>::type;
  using Traits =
      FwdKernelTraits<Element, kHeadDimFamily, kTile.block_m, kTile.block_n, kTile.stages, false>;
  using DropoutTraits = FwdKernelTraits<Element, kHeadDimFamily, kDropoutTile.block_m,
                                        kDropoutTile.block_n, kDropoutTile.stages, true>;
  // Problems with a left window edge (fwd_takes_sliding_window_instance).
  using WindowTraits =
      FwdKernelTraits<Element, kHeadDimFamily, kTile.block_m, kTile.block_n, kTile.stages, false,
                      fwd_sliding_window_instance(kHeadDimFamily)>;
  // Split keys (fwd_split_count: never with dropout or a left window edge).
  using SplitTraits =
      FwdKernelTraits<Element, kHeadDimFamily, kTile.block_m, kTile.block_n, kTile.stages, false, false, true>;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);

  // Dropout has its own instance (the p = 0 ones stay untouched by its code), pipelined only: the
  // serial schedule (FLASHKIT_SM90_SCHEDULE=serial) is a measurement switch of the p = 0 kernel.
  const char* schedule = std::getenv("FLASHKIT_SM90_SCHEDULE");
  const bool serial = schedule != nullptr && std::string(schedule) == "serial";
  if (problem.dropout_p > 0.0f) {
    launch_fwd<DropoutTraits, true>(problem, plan, stream);
  } else if (plan.num_splits > 1) {
    launch_fwd<SplitTraits, true>(problem, plan, stream);
  } else if (serial) {
    launch_fwd<Traits, false>(problem, plan, stream);
  } else if (fwd_takes_sliding_window_instance(kHeadDimFamily, problem.window_left, problem.dropout_p)) {
    launch_fwd<WindowTraits, true>(problem, plan, stream);
  } else {
    launch_fwd<Traits, true>(problem, plan, stream);
  }
}

#ifdef FLASHKIT_SM90_FWD_TRACE
}  // namespace traced
#endif
}  // namespace flashkit::sm90
