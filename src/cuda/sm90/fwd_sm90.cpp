// src/cuda/sm90/fwd_sm90.cpp
// \brief Which problems the sm90 forward kernels cover (see fwd_sm90.h). Plain C++: the dispatcher
// asks before choosing a path.
#include "cuda/sm90/fwd_sm90.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/sm90/fwd_tile_config_sm90.h"
#include "cuda/sm90/tma_layout.h"
#include "flashkit/error.h"

namespace flashkit::sm90 {

std::string fwd_unsupported_reason(const FwdProblem& p) {
  if (fwd_head_dim_family(p.head_dim) < 0) {
    return "head dim " + std::to_string(p.head_dim) + " is above 256";
  }
  if (p.attn_probs != nullptr) return "return_softmax (attn_probs) is written by the sm80 path";
  // The copy engine reads q, k and v, and the epilogue stores out the same way.
  const bool varlen = p.is_varlen();
  const TmaTensorLayout tensors[] = {
      {"q", p.q, p.q_tensor_rows(), p.heads_q, p.batch, p.q_row_stride, p.q_head_stride,
       p.q_batch_stride},
      {"k", p.k, p.k_tensor_rows(), p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride,
       p.k_batch_stride},
      {"v", p.v, p.k_tensor_rows(), p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride,
       p.v_batch_stride},
      {"out", p.out, p.q_tensor_rows(), p.heads_q, p.batch, p.out_row_stride,
       p.out_head_stride, p.out_batch_stride},
  };
  for (const TmaTensorLayout& t : tensors) {
    if (std::string why = tma_layout_problem(t, varlen); !why.empty()) return why;
  }
  return "";
}

PackGqa pack_gqa_from_env() {
  const char* value = std::getenv("FLASHKIT_SM90_PACK_GQA");
  if (value == nullptr || *value == '\0') return PackGqa::kAuto;
  if (std::strcmp(value, "0") == 0) return PackGqa::kNever;
  if (std::strcmp(value, "1") == 0) return PackGqa::kWherever;
  throw Error(std::string("FLASHKIT_SM90_PACK_GQA='") + value +
              "'; it must be 0 (one query head per tile), 1 (a kv head's query heads packed into its tiles "
              "wherever the sm90 forward can) or unset (where that pays)");
}

int fwd_pack_gqa_group(const FwdProblem& p, int block_m, int block_n, int sm_count, bool can_split,
                       PackGqa mode) {
  if (mode == PackGqa::kNever || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return 1;
  const int group = p.heads_q / p.heads_kv;
  if (group < 2 || group > 64) return 1;
  if (p.dropout_p > 0.0f || p.alibi_slopes != nullptr || p.seqlen_q <= 0) return 1;
  if (static_cast<int64_t>(p.seqlen_q) * group > INT32_MAX - block_m) return 1;  // seqlen_q: the maximum if varlen
  if (mode == PackGqa::kWherever) return group;
  auto tiles = [](int64_t tokens, int tokens_per_tile) { return (tokens + tokens_per_tile - 1) / tokens_per_tile; };
  if (static_cast<int64_t>(p.batch) * p.heads_q * tiles(p.seqlen_q, block_m) <= sm_count) {
    // Within one wave the busiest CTA sets the time (fwd_sm90.h): its split's key blocks, each
    // costing more with more consumers busy, and the split's fixed cost.
    auto busiest_cta_cost = [&](int g) {
      const int tokens_per_consumer = fwd_tokens_per_consumer(g);
      const int64_t tokens = std::min<int64_t>(p.seqlen_q, fwd_tokens_per_tile(block_m, g));
      const int64_t consumers = (tokens + tokens_per_consumer - 1) / tokens_per_consumer;
      const int64_t key_blocks = (static_cast<int64_t>(p.seqlen_k) + block_n - 1) / block_n;
      const int splits = can_split ? fwd_split_count(p, block_m, block_n, g, sm_count, 0) : 1;
      const double block_cost = 1.0 + kFwdConsumerBlockCost * static_cast<double>(consumers - 1);
      return static_cast<double>((key_blocks + splits - 1) / splits) * block_cost +
             (splits > 1 ? kFwdSplitCostBlocks : 0.0);
    };
    return busiest_cta_cost(group) < busiest_cta_cost(1) ? group : 1;
  }
  // The rows in use per row run: s_q x G rows on G times fewer (packed) tiles, against s_q.
  const double packed = static_cast<double>(p.seqlen_q) * group /
                        static_cast<double>(tiles(p.seqlen_q, fwd_tokens_per_tile(block_m, group)) * block_m);
  const double unpacked = static_cast<double>(p.seqlen_q) / static_cast<double>(tiles(p.seqlen_q, block_m) * block_m);
  return packed > 1.01 * unpacked || (p.is_varlen() && packed >= unpacked) ? group : 1;
}

int forced_splits_from_env() {
  const char* value = std::getenv("FLASHKIT_SM90_SPLITS");
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  if (*end != '\0' || n < 0 || n > kFwdMaxSplits) {
    throw Error(std::string("FLASHKIT_SM90_SPLITS='") + value + "'; it must be 0 or unset (automatic) or 1 .. " +
                std::to_string(kFwdMaxSplits) + " (that many key splits wherever the sm90 forward can split)");
  }
  return static_cast<int>(n);
}

int fwd_split_count(const FwdProblem& p, int block_m, int block_n, int pack_group, int sm_count, int forced) {
  if (p.dropout_p > 0.0f || p.window_left >= 0 || p.seqlen_k <= 0 || p.seqlen_q <= 0) return 1;
  const int64_t key_blocks = (static_cast<int64_t>(p.seqlen_k) + block_n - 1) / block_n;  // the maximum if varlen
  if (forced > 0) return static_cast<int>(std::min<int64_t>({forced, key_blocks, kFwdMaxSplits}));
  const int tokens_per_tile = fwd_tokens_per_tile(block_m, pack_group);
  const int64_t tiles = static_cast<int64_t>(p.batch) * (p.heads_q / pack_group) *
                        ((p.seqlen_q + tokens_per_tile - 1) / tokens_per_tile);
  if (2 * tiles > sm_count) return 1;
  const int64_t splits = std::min<int64_t>({sm_count / tiles, key_blocks / kFwdMinBlocksPerSplit, kFwdMaxSplits});
  return static_cast<int>(std::max<int64_t>(1, splits));
}

FwdPlan plan_fwd(const FwdProblem& p, int sm_count, bool can_split, PackGqa pack_mode, int forced_splits) {
  const FwdTileConfig tile = fwd_tile_config(fwd_head_dim_family(p.head_dim), p.dropout_p > 0.0f);
  FwdPlan plan;
  plan.pack_group = fwd_pack_gqa_group(p, tile.block_m, tile.block_n, sm_count, can_split, pack_mode);
  if (can_split) {
    plan.num_splits = fwd_split_count(p, tile.block_m, tile.block_n, plan.pack_group, sm_count, forced_splits);
  }
  return plan;
}

}  // namespace flashkit::sm90
