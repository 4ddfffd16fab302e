// tests/cpp/gpu_case_grids.h
// \brief The case grids both GPU suites run (forward: test_gpu_fwd.cpp, backward:
// test_gpu_bwd.cpp): the same shapes, masks and edge cases, each suite drawing its random parts
// from its own seed. A suite adds what is its own (the backward's no-query cases, its
// deterministic mode) around these.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.h"
#include "gpu_case_builders.h"

namespace flashkit::test {

// dtype x head dim x mask (8 kinds) on a medium GQA shape (6 query heads on 2 kv heads, batch 2),
// lengths rotating through s_q < s_k, s_q > s_k and s_q == s_k: 2 x dims x 8 cases.
inline std::vector<FwdCase> dtype_head_dim_mask_grid(const std::vector<int>& head_dims,
                                                     uint64_t seed) {
  const std::pair<int, int> lengths[] = {{113, 239}, {239, 113}, {203, 203}};
  std::vector<FwdCase> cases;
  Rng rng(seed);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (size_t di = 0; di < head_dims.size(); ++di) {
      for (size_t mi = 0; mi < kAllMasks.size(); ++mi) {
        const auto [sq, sk] = lengths[(di + mi) % 3];
        FwdCase c = fixed_case(dtype, head_dims[di], 6, 2, 2, sq, sk);
        apply_mask(c, kAllMasks[mi], rng);
        c.name = default_name(c, mask_name(kAllMasks[mi]));
        cases.push_back(c);
      }
    }
  }
  return cases;
}

// mask x {fixed, varlen} x heads x `draws` random draws of (lengths, head dim, dtype,
// softmax_scale): odd lengths 1 ... 1025 with s_q < s_k and s_q > s_k. Pairs with s_q * s_k >=
// 200k run batch 1 (fixed) or 2 (varlen) to keep the fp64 oracle cheap.
inline std::vector<FwdCase> shape_grid(const std::vector<int>& head_dims,
                                       const std::vector<std::pair<int, int>>& heads, int draws,
                                       uint64_t seed) {
  const std::vector<std::pair<int, int>> lengths = {
      {1, 1},     {1, 17},    {17, 1},   {3, 97},     {17, 113},   {113, 17},  {127, 203},
      {239, 113}, {113, 239}, {1, 1023}, {239, 1023}, {1023, 239}, {799, 339}, {1024, 1025}};
  const std::vector<float> scales = {0.0f, 0.0f, 0.05f, 0.2f};
  std::vector<FwdCase> cases;
  Rng rng(seed);
  for (MaskKind mask : kAllMasks) {
    for (bool varlen : {false, true}) {
      for (const auto& [hq, hkv] : heads) {
        for (int draw = 0; draw < draws; ++draw) {
          const DType dtype = rng.chance(0.5) ? DType::kBFloat16 : DType::kFloat16;
          const int d = rng.pick(head_dims);
          const auto [sq, sk] = rng.pick(lengths);
          const bool large = int64_t{sq} * sk >= 200000;
          FwdCase c = fixed_case(dtype, d, hq, hkv, large ? 1 : 2, sq, sk);
          if (varlen) fill_varlen(c, large ? 2 : 4, sq, sk, rng);
          c.softmax_scale = rng.pick(scales);
          apply_mask(c, mask, rng);
          c.name = default_name(c, mask_name(mask));
          cases.push_back(c);
        }
      }
    }
  }
  return cases;
}

// 2048 and 4224 tokens (the longest lengths of TESTING.md), with few heads.
inline std::vector<FwdCase> long_grid() {
  std::vector<FwdCase> cases;
  auto add = [&](FwdCase c, const std::string& mask) {
    c.name = default_name(c, mask);
    cases.push_back(c);
  };
  {
    FwdCase c = fixed_case(DType::kBFloat16, 128, 4, 1, 1, 2048, 2048);
    c.causal = true;
    add(c, "causal");
  }
  add(fixed_case(DType::kFloat16, 64, 2, 2, 1, 4224, 4224), "none");
  add(windowed(fixed_case(DType::kBFloat16, 64, 2, 1, 1, 4224, 4224), 1000, 37), "local");
  // Sliding windows narrower than a tile's rows: lower rows of a tile pass the window's left edge
  // a key block or more before its top rows do (the sm90 forward's consumers skip such blocks).
  {
    FwdCase c = fixed_case(DType::kBFloat16, 64, 4, 1, 1, 1999, 1999);
    c.causal = true;
    c.window_left = 128;
    add(c, "causalWindow128");
  }
  {
    FwdCase c = varlen_case(DType::kFloat16, 256, 2, 1, {1500, 333, 1201}, {1500, 800, 1201});
    c.causal = true;
    c.window_left = 200;
    add(c, "causalWindow200");
  }
  add(windowed(fixed_case(DType::kBFloat16, 64, 2, 2, 1, 1000, 1700), 300, 40), "window300x40");
  {
    FwdCase c = fixed_case(DType::kFloat16, 96, 2, 1, 1, 1025, 4224);
    c.alibi = AlibiKind::kPerHead;
    add(c, "alibi");
  }
  {
    FwdCase c = fixed_case(DType::kBFloat16, 256, 2, 2, 1, 2048, 1023);
    c.causal = true;
    c.softcap = 30.0f;
    c.q_scale = 10.0f;
    add(c, "causalSoftcap");
  }
  {
    FwdCase c = varlen_case(DType::kBFloat16, 128, 4, 2, {2048, 17, 1023, 0}, {4224, 2048, 0, 1});
    c.tail_q = 3;
    c.tail_k = 5;
    c.causal = true;
    add(c, "causal");
  }
  {
    FwdCase c = varlen_case(DType::kFloat16, 64, 2, 1, {4224, 1}, {4224, 4224});
    c.used_k = {3000, 4224};
    c.causal = true;
    c.alibi = AlibiKind::kPerBatchHead;
    add(c, "causalAlibi");
  }
  return cases;
}

// Varlen corner cases, each under several masks: zero-length query and key sequences, decoding
// shapes (max_seqlen_q == 1), seqused_k below the stored lengths (keys past it get zero dk / dv
// in the backward), a loose max_seqlen_q, one sequence followed by many unused tokens, every
// query sequence empty but one.
inline std::vector<FwdCase> varlen_edge_grid(uint64_t seed) {
  std::vector<FwdCase> cases;
  Rng rng(seed);
  auto add_masks = [&](const FwdCase& base, const std::string& what,
                       std::initializer_list<MaskKind> masks) {
    int i = 0;
    for (MaskKind m : masks) {
      FwdCase c = base;
      c.dtype = (i++ % 2 == 0) ? DType::kBFloat16 : DType::kFloat16;
      apply_mask(c, m, rng);
      c.name = what + "_" + short_dtype_name(c.dtype) + "_d" + std::to_string(c.head_dim) + "_" +
               mask_name(m);
      cases.push_back(c);
    }
  };
  {
    FwdCase c =
        varlen_case(DType::kBFloat16, 64, 6, 2, {0, 17, 1, 113, 5, 0}, {13, 0, 239, 64, 1, 0});
    c.tail_q = 5;
    c.tail_k = 7;
    add_masks(c, "zeroLengths",
              {MaskKind::kNone, MaskKind::kCausal, MaskKind::kLocal, MaskKind::kAlibiBatch,
               MaskKind::kSoftcap, MaskKind::kCausalAlibi, MaskKind::kCausalSoftcap});
    c.head_dim = 128;
    add_masks(c, "zeroLengths", {MaskKind::kCausalAlibi, MaskKind::kCausalSoftcap});
  }
  {
    FwdCase c = varlen_case(DType::kBFloat16, 128, 8, 2, {1, 1, 0, 1, 1, 1, 0, 1},
                            {1023, 0, 17, 1, 239, 500, 3, 64});
    c.tail_q = 2;
    add_masks(c, "decode",
              {MaskKind::kNone, MaskKind::kCausal, MaskKind::kAlibi, MaskKind::kLocal,
               MaskKind::kCausalSoftcap});
  }
  {
    FwdCase c = varlen_case(DType::kBFloat16, 96, 6, 1, {17, 17, 3, 113}, {239, 113, 17, 64});
    c.used_k = {100, 0, 17, 1};
    c.tail_k = 4;
    add_masks(c, "sequsedK",
              {MaskKind::kNone, MaskKind::kCausal, MaskKind::kLocal, MaskKind::kSoftcap,
               MaskKind::kAlibiBatch});
  }
  {
    FwdCase c = varlen_case(DType::kBFloat16, 64, 4, 4, {17, 1, 30}, {40, 40, 5});
    c.extra_max_seqlen_q = 5;  // softmax_lse is [batch, heads, max_seqlen_q]
    add_masks(c, "looseMaxSeqlenQ", {MaskKind::kCausal, MaskKind::kNone});
    c.head_dim = 72;
    add_masks(c, "looseMaxSeqlenQ", {MaskKind::kCausal});
  }
  {
    FwdCase c = varlen_case(DType::kBFloat16, 256, 2, 1, {239}, {1023});
    c.tail_q = 64;
    c.tail_k = 128;
    add_masks(c, "singleSequenceTail", {MaskKind::kCausalAlibi, MaskKind::kNone});
  }
  {
    FwdCase c = varlen_case(DType::kBFloat16, 40, 6, 2, {0, 0, 0, 9, 0}, {5, 17, 0, 33, 2});
    add_masks(c, "oneNonEmpty", {MaskKind::kNone, MaskKind::kCausal});
  }
  return cases;
}

// Masks that leave query rows without keys (out 0 and lse -inf; dq 0), keys without rows (dk, dv
// 0), or exactly one key per row.
inline std::vector<FwdCase> empty_row_grid() {
  std::vector<FwdCase> cases;
  auto add = [&](FwdCase c, const std::string& what) {
    c.name = what + "_" + short_dtype_name(c.dtype) + "_d" + std::to_string(c.head_dim);
    cases.push_back(c);
  };
  {
    FwdCase c = fixed_case(DType::kBFloat16, 64, 6, 2, 2, 239, 17);  // rows 0..221 see nothing
    c.causal = true;
    add(c, "causalSqGtSk");
  }
  // rows 0..95 see nothing
  add(windowed(fixed_case(DType::kFloat16, 128, 6, 6, 2, 113, 17), 0, 0), "window0x0SqGtSk");
  // keys 0..221 seen by none
  add(windowed(fixed_case(DType::kBFloat16, 64, 6, 2, 2, 17, 239), 0, 0), "window0x0SqLtSk");
  add(windowed(fixed_case(DType::kBFloat16, 96, 8, 2, 1, 300, 40), 5, 2), "window5x2");
  // one key per row: out = v
  add(windowed(fixed_case(DType::kFloat16, 64, 4, 2, 2, 113, 113), 0, 0), "diagonalOnly");
  {
    FwdCase c = fixed_case(DType::kBFloat16, 128, 6, 2, 2, 239, 113);
    c.causal = true;
    c.alibi = AlibiKind::kPerBatchHead;
    add(c, "causalAlibiSqGtSk");
  }
  {
    FwdCase c = fixed_case(DType::kFloat16, 256, 2, 1, 3, 64, 1);  // only the last row sees a key
    c.causal = true;
    c.softcap = 50.0f;
    c.q_scale = 16.0f;
    add(c, "causalSoftcapOneKey");
  }
  add(windowed(fixed_case(DType::kBFloat16, 40, 6, 2, 1, 17, 1023), 3, 0), "narrowWindow");
  {
    FwdCase c = varlen_case(DType::kBFloat16, 64, 6, 2, {50, 17, 8}, {10, 17, 64});
    c.used_k = {3, 0, 64};
    c.causal = true;
    add(c, "varlenCausalUsedK");
  }
  return cases;
}

}  // namespace flashkit::test
