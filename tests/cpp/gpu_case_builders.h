// tests/cpp/gpu_case_builders.h
// \brief Building the GPU tests' cases (forward and backward suites alike): the mask kinds every
// grid crosses (none, causal, local, ALiBi [h] / [b, h], softcap and their causal mixes), drawn
// windows and softcaps, varlen batches with zero-length sequences, seqused_k and tail tokens, and
// unique names and seeds for GoogleTest.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.h"

namespace flashkit::test {

enum class MaskKind {
  kNone,
  kCausal,
  kLocal,       // a window drawn at random
  kAlibi,       // slopes [heads_q]
  kAlibiBatch,  // slopes [batch, heads_q]
  kSoftcap,
  kCausalAlibi,
  kCausalSoftcap,
};

inline const std::vector<MaskKind> kAllMasks = {
    MaskKind::kNone,       MaskKind::kCausal,  MaskKind::kLocal,       MaskKind::kAlibi,
    MaskKind::kAlibiBatch, MaskKind::kSoftcap, MaskKind::kCausalAlibi, MaskKind::kCausalSoftcap};

inline const char* mask_name(MaskKind m) {
  switch (m) {
    case MaskKind::kNone: return "none";
    case MaskKind::kCausal: return "causal";
    case MaskKind::kLocal: return "local";
    case MaskKind::kAlibi: return "alibi";
    case MaskKind::kAlibiBatch: return "alibiBatch";
    case MaskKind::kSoftcap: return "softcap";
    case MaskKind::kCausalAlibi: return "causalAlibi";
    case MaskKind::kCausalSoftcap: return "causalSoftcap";
  }
  return "?";
}

// Softcap only matters when scores reach the cap: the queries are scaled so that the scores have a
// standard deviation of about cap / 3 (tanh bends visibly past cap / 2, and some scores pass the
// cap itself).
inline void set_softcap(FwdCase& c, Rng& rng) {
  c.softcap = rng.chance(0.5) ? 30.0f : 50.0f;
  c.q_scale = c.softcap / 3.0f;
}

// A window drawn for the case's lengths: each side bounded with probability 3/4 (at least one
// side), left up to seqlen_k, right up to seqlen_k / 2. With seqlen_q > seqlen_k some rows see no
// key, and sides past seqlen_k exercise the "unbounded" resolution.
inline void draw_window(FwdCase& c, Rng& rng) {
  const int sk = std::max(1, c.max_len_k());
  c.window_left = rng.chance(0.25) ? -1 : rng.uniform_int(0, sk);
  const bool right_unbounded = c.window_left >= 0 && rng.chance(0.25);
  c.window_right = right_unbounded ? -1 : rng.uniform_int(0, std::max(1, sk / 2));
}

// `c` with a fixed sliding window: each row sees keys [diagonal - left, diagonal + right] (-1: that
// side unbounded).
inline FwdCase windowed(FwdCase c, int left, int right) {
  c.window_left = left;
  c.window_right = right;
  return c;
}

inline void apply_mask(FwdCase& c, MaskKind m, Rng& rng) {
  switch (m) {
    case MaskKind::kNone: break;
    case MaskKind::kCausal: c.causal = true; break;
    case MaskKind::kLocal: draw_window(c, rng); break;
    case MaskKind::kAlibi: c.alibi = AlibiKind::kPerHead; break;
    case MaskKind::kAlibiBatch: c.alibi = AlibiKind::kPerBatchHead; break;
    case MaskKind::kSoftcap: set_softcap(c, rng); break;
    case MaskKind::kCausalAlibi:
      c.causal = true;
      c.alibi = rng.chance(0.5) ? AlibiKind::kPerHead : AlibiKind::kPerBatchHead;
      break;
    case MaskKind::kCausalSoftcap:
      c.causal = true;
      set_softcap(c, rng);
      break;
  }
}

// Varlen lengths whose longest sequences are max_q / max_k (one sequence each), the others random
// in [0, max]. Half the draws get a zero-length query sequence, half a zero-length key sequence
// (placed on a sequence with queries, whose rows then see nothing), a third seqused_k below the
// key lengths, half unused tail tokens after the last sequence.
inline void fill_varlen(FwdCase& c, int batch, int max_q, int max_k, Rng& rng) {
  c.varlen = true;
  c.batch = batch;
  c.lens_q.resize(batch);
  c.lens_k.resize(batch);
  for (int b = 0; b < batch; ++b) {
    c.lens_q[b] = rng.uniform_int(0, max_q);
    c.lens_k[b] = rng.uniform_int(0, max_k);
  }
  const int longest_q = rng.uniform_int(0, batch - 1);
  const int longest_k = rng.uniform_int(0, batch - 1);
  c.lens_q[longest_q] = max_q;
  c.lens_k[longest_k] = max_k;
  if (batch >= 3 && rng.chance(0.5)) c.lens_q[(longest_q + 1) % batch] = 0;
  if (batch >= 3 && rng.chance(0.5)) {
    for (int b = 0; b < batch; ++b) {
      if (b != longest_k && c.lens_q[b] > 0) {
        c.lens_k[b] = 0;
        break;
      }
    }
  }
  if (rng.chance(1.0 / 3.0)) {
    c.used_k.resize(batch);
    for (int b = 0; b < batch; ++b) c.used_k[b] = rng.uniform_int(0, c.lens_k[b]);
  }
  c.tail_q = rng.chance(0.5) ? rng.uniform_int(1, 9) : 0;
  c.tail_k = rng.chance(0.5) ? rng.uniform_int(1, 9) : 0;
}

inline FwdCase fixed_case(DType dtype, int head_dim, int heads_q, int heads_kv, int batch,
                          int seqlen_q, int seqlen_k) {
  FwdCase c;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.batch = batch;
  c.seqlen_q = seqlen_q;
  c.seqlen_k = seqlen_k;
  return c;
}

inline FwdCase varlen_case(DType dtype, int head_dim, int heads_q, int heads_kv,
                           std::vector<int> lens_q, std::vector<int> lens_k) {
  FwdCase c;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.varlen = true;
  c.batch = static_cast<int>(lens_q.size());
  c.lens_q = std::move(lens_q);
  c.lens_k = std::move(lens_k);
  return c;
}

// "bf16_d128_causal_h6kv2_fixed_q113_k239" (varlen: the longest lengths).
inline std::string default_name(const FwdCase& c, const std::string& mask) {
  return std::string(short_dtype_name(c.dtype)) + "_d" + std::to_string(c.head_dim) + "_" + mask +
         "_h" + std::to_string(c.heads_q) + "kv" + std::to_string(c.heads_kv) +
         (c.varlen ? "_varlen_q" : "_fixed_q") + std::to_string(c.max_len_q()) + "_k" +
         std::to_string(c.max_len_k());
}

// Makes names unique (suffix _2, _3, ...) and gives every case its own seed.
inline std::vector<FwdCase> finish(std::vector<FwdCase> cases, uint64_t seed) {
  std::map<std::string, int> seen;
  for (size_t i = 0; i < cases.size(); ++i) {
    FwdCase& c = cases[i];
    const int n = ++seen[c.name];
    if (n > 1) c.name += "_" + std::to_string(n);
    c.seed = splitmix64(seed + i);
  }
  return cases;
}

inline std::string param_name(const ::testing::TestParamInfo<FwdCase>& info) {
  return info.param.name;
}

}  // namespace flashkit::test
