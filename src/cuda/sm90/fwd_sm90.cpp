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

int fwd_pack_gqa_shift(const FwdProblem& p, int block_m, int block_n, int sm_count, bool can_split,
                       PackGqa mode) {
  if (mode == PackGqa::kNever || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return 0;
  const int group = p.heads_q / p.heads_kv;
  if (group < 2 || group > 64 || (group & (group - 1)) != 0) return 0;
  if (p.dropout_p > 0.0f || p.alibi_slopes != nullptr || p.seqlen_q <= 0) return 0;
  const int64_t packed_rows = static_cast<int64_t>(p.seqlen_q) * group;  // seqlen_q: the maximum if varlen
  if (packed_rows > INT32_MAX - block_m) return 0;
  int shift = 0;
  while ((1 << shift) < group) ++shift;
  if (mode == PackGqa::kWherever) return shift;
  auto tiles = [block_m](int64_t rows) { return (rows + block_m - 1) / block_m; };
  if (static_cast<int64_t>(p.batch) * p.heads_q * tiles(p.seqlen_q) <= sm_count) {
    const int64_t key_blocks = (static_cast<int64_t>(p.seqlen_k) + block_n - 1) / block_n;
    const bool splits = can_split && fwd_split_count(p, block_m, block_n, shift, sm_count, 0) > 1;
    return splits && key_blocks >= kFwdPackSplitMinKeyBlocks ? shift : 0;
  }
  if (p.is_varlen()) return shift;
  auto in_use = [&](int64_t rows) { return static_cast<double>(rows) / static_cast<double>(tiles(rows) * block_m); };
  return in_use(packed_rows) > 1.01 * in_use(p.seqlen_q) ? shift : 0;
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

int fwd_split_count(const FwdProblem& p, int block_m, int block_n, int pack_shift, int sm_count, int forced) {
  if (p.dropout_p > 0.0f || p.window_left >= 0 || p.seqlen_k <= 0 || p.seqlen_q <= 0) return 1;
  const int64_t key_blocks = (static_cast<int64_t>(p.seqlen_k) + block_n - 1) / block_n;  // the maximum if varlen
  if (forced > 0) return static_cast<int>(std::min<int64_t>({forced, key_blocks, kFwdMaxSplits}));
  const int64_t rows = static_cast<int64_t>(p.seqlen_q) << pack_shift;
  const int64_t tiles = static_cast<int64_t>(p.batch) * (p.heads_q >> pack_shift) * ((rows + block_m - 1) / block_m);
  if (2 * tiles > sm_count) return 1;
  const int64_t splits = std::min<int64_t>({sm_count / tiles, key_blocks / kFwdMinBlocksPerSplit, kFwdMaxSplits});
  return static_cast<int>(std::max<int64_t>(1, splits));
}

FwdPlan plan_fwd(const FwdProblem& p, int sm_count, bool can_split, PackGqa pack_mode, int forced_splits) {
  const FwdTileConfig tile = fwd_tile_config(fwd_head_dim_family(p.head_dim), p.dropout_p > 0.0f);
  FwdPlan plan;
  plan.pack_shift = fwd_pack_gqa_shift(p, tile.block_m, tile.block_n, sm_count, can_split, pack_mode);
  if (can_split) {
    plan.num_splits = fwd_split_count(p, tile.block_m, tile.block_n, plan.pack_shift, sm_count, forced_splits);
  }
  return plan;
}

}  // namespace flashkit::sm90
