// src/api/split_heuristic.cpp
// \brief The split-count model of split_heuristic.h.
#include "api/split_heuristic.h"

#include <algorithm>

namespace flashkit::api {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int choose_num_splits(const SplitShape& shape) {
  if (shape.ctas <= 0 || shape.key_blocks <= 1 || shape.sm_count <= 0 || shape.max_splits <= 1) {
    return 1;
  }
  const int64_t slots = static_cast<int64_t>(shape.sm_count) * std::max(1, shape.ctas_per_sm);
  if (shape.ctas >= slots) return 1;
  const int64_t limit = std::min<int64_t>(shape.max_splits, shape.key_blocks);
  int best = 1;
  int64_t best_time = INT64_MAX;
  int64_t previous_blocks = -1;
  for (int64_t s = 1; s <= limit; ++s) {
    const int64_t blocks_per_split = ceil_div(shape.key_blocks, s);
    if (blocks_per_split == previous_blocks) continue;
    previous_blocks = blocks_per_split;
    const int64_t waves = ceil_div(shape.ctas * s, slots);
    const int64_t time = waves * (blocks_per_split + kCtaOverheadBlocks);
    if (time < best_time) {
      best_time = time;
      best = static_cast<int>(s);
    }
  }
  return best;
}

bool one_cta_per_sm(int64_t ctas, int num_splits, int sm_count) {
  return ctas > 0 && num_splits > 0 && ctas * num_splits <= sm_count;
}

int decode_ctas_per_sm(const SplitShape& shape, int64_t shared_sm_cta_bytes, int64_t smem_per_sm) {
  if (shared_sm_cta_bytes <= 0 || 2 * shared_sm_cta_bytes > smem_per_sm) return 1;
  SplitShape split = shape;
  split.ctas_per_sm = 2;
  const int splits = choose_num_splits(split);
  return splits > 1 && ceil_div(shape.key_blocks, splits) >= kSharedSmMinKeyBlocks ? 2 : 1;
}

}  // namespace flashkit::api
