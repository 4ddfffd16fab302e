// tests/cpp/test_gpu_fwd.cpp
// \brief flashkit::mha_fwd / mha_varlen_fwd on CUDA views against the CPU oracle.
//
// Every run poisons out and softmax_lse with 0xFF bytes (NaN), computes the oracle on the same
// rounded inputs in fp64 (kExact) and in the input dtype (kInputDtype), and applies the rule of
// DESIGN.md: max |out - exact| <= 2 x max |low - exact| + slack (3x with softcap), lse within a
// small absolute + relative tolerance, NaN / inf where the oracle has them and nowhere else, rows
// that see no key exactly zero with lse -inf, and nothing written outside the output rows (see
// gpu_test_util.h for the tolerances and why).
//
// The suites:
//   DtypeHeadDimMask/*    dtype x head dim (40 ... 256) x mask (8 kinds) on a medium GQA shape
//   ShapesGqaVarlen/*     mask x {fixed, varlen} x GQA (6/6, 6/2, 6/1, 8/2) x 3 random draws of
//                         (lengths, head dim, dtype): odd lengths 1 ... 1025, s_q <> s_k
//   LongSequences/*       2048 and 4224 tokens, few heads
//   VarlenEdges/*         zero-length q / k sequences, max_seqlen_q == 1, seqused_k, tail tokens
//   EmptyRows/*           windows and causal masks that leave rows without keys
//   ShortQueries/*        up to 32 query tokens (the decode kernel), fixed and varlen, keys split
//                         over the SMs
//   PackedHeads/*         GQA with G = 2 ... 64 (powers of two and others) and 33 ... 257 query
//                         tokens, the sm90 forward's query heads packed and not
//                         (FLASHKIT_SM90_PACK_GQA)
//   SplitKeys/*           the sm90 forward's keys split 3 and 16 ways (FLASHKIT_SM90_SPLITS)
//   NoKeys/*              seqlen_k == 0: out 0, lse -inf
//   GpuFwdTest.*          layout invariance, offsets past 2^31 elements, grid limits, a created
//                         stream, bad input, a head dim left out of the build, determinism, the
//                         forced paths (FLASHKIT_FWD_PATH)
//
// Each case runs on the path the dispatcher picks: the decode kernel for short queries (varlen
// batches included; src/api/fwd_decode_route.h), else sm90 on a Hopper GPU wherever it covers the
// case, else sm80. To run the suite on both paths there, run the binary a second time with
// FLASHKIT_FWD_PATH=sm80 (scripts/gpu_check.sh does: step gpu_tests_sm80).
// Without a GPU every test skips itself (fixture SetUp). FLASHKIT_TEST_VERBOSE=1 prints the errors
// measured for passing cases too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "build_config.h"
#include "cuda/sm90/fwd_sm90.h"
#include "cuda/sm90/tile_counter_slots.h"
#include "flashkit/flashkit.h"
#include "gpu_case_builders.h"
#include "gpu_case_grids.h"
#include "gpu_test_util.h"

namespace flashkit::test {
namespace {

// ------------------------------------------------------------------------------------------------
// The grids (shared with the backward suite in gpu_case_grids.h)
// ------------------------------------------------------------------------------------------------

const std::vector<int> kHeadDims = {40, 64, 72, 96, 128, 160, 192, 256};

// 2 x 8 x 8 = 128 cases.
std::vector<FwdCase> dtype_head_dim_mask_cases() {
  return finish(dtype_head_dim_mask_grid(kHeadDims, 0xD7E4D), 0x1000);
}

// mask x {fixed, varlen} x heads {6/6, 6/2, 6/1, 8/2} x 3 draws: 8 x 2 x 4 x 3 = 192 cases.
std::vector<FwdCase> shape_cases() {
  return finish(shape_grid({40, 64, 96, 128, 192, 256}, {{6, 6}, {6, 2}, {6, 1}, {8, 2}}, 3,
                           0x5A4E5),
                0x2000);
}

std::vector<FwdCase> long_cases() { return finish(long_grid(), 0x3000); }

std::vector<FwdCase> varlen_edge_cases() { return finish(varlen_edge_grid(0xED6E), 0x4000); }

std::vector<FwdCase> empty_row_cases() { return finish(empty_row_grid(), 0x5000); }

// seqlen_k == 0 (fixed length): every row sees nothing.
std::vector<FwdCase> no_key_cases() {
  std::vector<FwdCase> cases;
  Rng rng(0x0C0);
  const std::pair<MaskKind, int> variants[] = {
      {MaskKind::kNone, 17},  {MaskKind::kCausal, 1},  {MaskKind::kLocal, 113},
      {MaskKind::kAlibi, 33}, {MaskKind::kSoftcap, 9}, {MaskKind::kCausalAlibi, 239}};
  int i = 0;
  for (const auto& [mask, sq] : variants) {
    FwdCase c =
        fixed_case(i % 2 ? DType::kFloat16 : DType::kBFloat16, i % 2 ? 128 : 64, 4, 2, 2, sq, 0);
    apply_mask(c, mask, rng);
    if (mask == MaskKind::kLocal) {
      c.window_left = 8;
      c.window_right = 8;
    }
    c.name = default_name(c, mask_name(mask));
    cases.push_back(c);
    ++i;
  }
  return finish(cases, 0x6000);
}

// Short queries (the decode kernel's path, src/api/fwd_decode_route.h): mask x seqlen_q {1, 2, 7,
// 16, 29} x 3 draws of (dtype, head dim, heads, seqlen_k, batch), the third varlen (fill_varlen:
// empty sequences, tails, a third with seqused_k); keys up to 1500
// long, so that the few CTAs of batch 1-3 split them (the harness passes the workspace the size
// query asks for). Where the forward kernels take 16 or 29 tokens instead depends on the heads and
// the batch (fwd_prefers_decode); FLASHKIT_FWD_PATH=sm90 runs them all there (scripts/gpu_check.sh).
// 8 x 5 x 3 = 120 cases.
std::vector<FwdCase> short_query_cases() {
  const std::vector<std::pair<int, int>> heads = {{8, 2}, {4, 1}, {6, 6}, {16, 2}};
  const std::vector<int> head_dims = {40, 64, 96, 128, 256};
  const std::vector<int> key_lengths = {1, 63, 300, 1500};
  std::vector<FwdCase> cases;
  Rng rng(0x5407);
  for (MaskKind mask : kAllMasks) {
    for (int sq : {1, 2, 7, 16, 29}) {
      for (int draw = 0; draw < 3; ++draw) {
        const auto [hq, hkv] = rng.pick(heads);
        FwdCase c = fixed_case(rng.chance(0.5) ? DType::kBFloat16 : DType::kFloat16,
                               rng.pick(head_dims), hq, hkv, rng.uniform_int(1, 2), sq,
                               rng.pick(key_lengths));
        if (draw == 2) fill_varlen(c, 3, sq, c.seqlen_k, rng);
        apply_mask(c, mask, rng);
        c.name = default_name(c, mask_name(mask));
        cases.push_back(c);
      }
    }
  }
  return finish(cases, 0x7000);
}

// The sm90 forward's packed query heads (fwd_pack_gqa_group): mask x G {2, 3, 4, 5, 6, 7, 8, 12, 24,
// 64} (powers of two, whose tokens fill a consumer's 64 rows, and the others, which leave padding
// rows) x {fixed, varlen}, each drawing (dtype, head dim, kv heads, seqlen_q past the decode
// kernel's 32, seqlen_k, batch). ALiBi is left out (it never packs). Run packed and unpacked each
// (GpuFwdPackedHeadsTest); scripts/gpu_check.sh runs the other GQA suites forced packed too.
// 5 x 10 x 2 = 100 cases.
std::vector<FwdCase> packed_head_cases() {
  const std::vector<MaskKind> masks = {MaskKind::kNone, MaskKind::kCausal, MaskKind::kLocal, MaskKind::kSoftcap,
                                       MaskKind::kCausalSoftcap};
  const std::vector<int> head_dims = {64, 96, 128, 256};
  const std::vector<int> query_lengths = {33, 47, 100, 130, 257};
  const std::vector<int> key_lengths = {1, 63, 300, 1500};
  std::vector<FwdCase> cases;
  Rng rng(0x9AC6);
  for (MaskKind mask : masks) {
    for (int group : {2, 3, 4, 5, 6, 7, 8, 12, 24, 64}) {
      for (bool varlen : {false, true}) {
        const int heads_kv = group >= 24 ? 1 : rng.uniform_int(1, 2);
        const int sq = rng.pick(query_lengths);
        FwdCase c = fixed_case(rng.chance(0.5) ? DType::kBFloat16 : DType::kFloat16, rng.pick(head_dims),
                               group * heads_kv, heads_kv, rng.uniform_int(1, 2), sq, rng.pick(key_lengths));
        if (varlen) fill_varlen(c, 3, sq, c.seqlen_k, rng);
        apply_mask(c, mask, rng);
        c.name = default_name(c, mask_name(mask));
        cases.push_back(c);
      }
    }
  }
  return finish(cases, 0x8000);
}

// The sm90 forward's split keys (fwd_split_count), forced by GpuFwdSplitKeysTest: mask (every kind)
// x {fixed, varlen} x 3 draws of (dtype, head dim, heads, seqlen_q 1 ... 300, seqlen_k 1 ... 2000,
// batch). 8 x 2 x 3 = 48 cases.
std::vector<FwdCase> split_key_cases() {
  const std::vector<std::pair<int, int>> heads = {{8, 2}, {4, 1}, {6, 6}, {16, 2}, {6, 2}};
  const std::vector<int> head_dims = {40, 64, 96, 128, 256};
  const std::vector<int> query_lengths = {1, 17, 64, 130, 300};
  const std::vector<int> key_lengths = {1, 100, 700, 2000};
  std::vector<FwdCase> cases;
  Rng rng(0x5B17);
  for (MaskKind mask : kAllMasks) {
    for (bool varlen : {false, true}) {
      for (int draw = 0; draw < 3; ++draw) {
        const auto [hq, hkv] = rng.pick(heads);
        const int sq = rng.pick(query_lengths);
        FwdCase c = fixed_case(rng.chance(0.5) ? DType::kBFloat16 : DType::kFloat16, rng.pick(head_dims), hq, hkv,
                               rng.uniform_int(1, 2), sq, rng.pick(key_lengths));
        if (varlen) fill_varlen(c, 3, sq, c.seqlen_k, rng);
        apply_mask(c, mask, rng);
        c.name = default_name(c, mask_name(mask));
        cases.push_back(c);
      }
    }
  }
  return finish(cases, 0x9000);
}

// `preferred` when this build serves it on CUDA, else the smallest head dim it serves, else
// `preferred` (the test then skips through case_unavailable).
int built_head_dim(int preferred) {
  if (flashkit::cuda_head_dim_built(preferred)) return preferred;
  for (int d = 8; d <= 256; d += 8) {
    if (flashkit::cuda_head_dim_built(d)) return d;
  }
  return preferred;
}

// bf16 when this build has it at `head_dim`, else fp16.
DType built_dtype(int head_dim) {
  return flashkit::cuda_fwd_built(DType::kBFloat16, head_dim) ? DType::kBFloat16 : DType::kFloat16;
}

// ------------------------------------------------------------------------------------------------
// Fixtures and the common run
// ------------------------------------------------------------------------------------------------

class GpuFwdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount reports none";
  }
};

class GpuFwdCaseTest : public GpuFwdTest, public ::testing::WithParamInterface<FwdCase> {};
class GpuFwdPackedHeadsTest : public GpuFwdTest, public ::testing::WithParamInterface<FwdCase> {};
class GpuFwdSplitKeysTest : public GpuFwdTest, public ::testing::WithParamInterface<FwdCase> {};
class GpuFwdNoKeysTest : public GpuFwdTest, public ::testing::WithParamInterface<FwdCase> {};

void report(const CheckReport& r) {
  EXPECT_TRUE(r.ok) << r.text;
  if (r.ok && verbose()) std::cout << r.text << "\n";
}

// Runs `c` in `layout` on `stream` and checks it against a freshly computed oracle on `items`.
// Returns the kernel's outputs for further checks.
KernelOut run_and_check(const FwdCase& c, const HostInputs& in, const Oracle& oracle,
                        const Layout& layout, cudaStream_t stream = nullptr) {
  DeviceProblem dev(c, in, layout);
  KernelOut out = run_on_device(dev, stream);
  report(check_against_oracle(c, oracle, out, dev.out_gaps_written()));
  return out;
}

TEST_P(GpuFwdCaseTest, MatchesOracle) {
  const FwdCase& c = GetParam();
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  run_and_check(c, in, oracle, contiguous_layout(c));
}

INSTANTIATE_TEST_SUITE_P(DtypeHeadDimMask, GpuFwdCaseTest,
                         ::testing::ValuesIn(dtype_head_dim_mask_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(ShapesGqaVarlen, GpuFwdCaseTest, ::testing::ValuesIn(shape_cases()),
                         param_name);
INSTANTIATE_TEST_SUITE_P(LongSequences, GpuFwdCaseTest, ::testing::ValuesIn(long_cases()),
                         param_name);
INSTANTIATE_TEST_SUITE_P(VarlenEdges, GpuFwdCaseTest, ::testing::ValuesIn(varlen_edge_cases()),
                         param_name);
INSTANTIATE_TEST_SUITE_P(EmptyRows, GpuFwdCaseTest, ::testing::ValuesIn(empty_row_cases()),
                         param_name);
INSTANTIATE_TEST_SUITE_P(ShortQueries, GpuFwdCaseTest, ::testing::ValuesIn(short_query_cases()),
                         param_name);

// Runs `c` once under each of `runs` (environment variables set for that run only), each against
// the same oracle: the sm90 forward's plan forced one way and another.
using EnvRun = std::vector<std::pair<const char*, const char*>>;
void check_under_each_env(const FwdCase& c, const std::vector<EnvRun>& runs) {
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  for (const EnvRun& run : runs) {
    std::string trace;
    std::deque<ScopedEnv> env;
    for (const auto& [name, value] : run) {
      trace += std::string(name) + "=" + value + " ";
      env.emplace_back(name, value);
    }
    SCOPED_TRACE(trace);
    run_and_check(c, in, oracle, contiguous_layout(c));
  }
}

// Each case with the query heads packed wherever the sm90 forward can (FLASHKIT_SM90_PACK_GQA=1)
// and never (=0). Elsewhere than sm90 both runs take the same kernel.
TEST_P(GpuFwdPackedHeadsTest, PackedAndUnpackedMatchTheOracle) {
  check_under_each_env(GetParam(), {{{"FLASHKIT_SM90_PACK_GQA", "1"}}, {{"FLASHKIT_SM90_PACK_GQA", "0"}}});
}

INSTANTIATE_TEST_SUITE_P(PackedHeads, GpuFwdPackedHeadsTest, ::testing::ValuesIn(packed_head_cases()),
                         param_name);

// Each case with the sm90 forward's keys split 3 ways, and 16 ways with the query heads packed
// wherever it can (FLASHKIT_SM90_SPLITS, FLASHKIT_SM90_PACK_GQA; the harness passes the workspace the
// size query asks for). Elsewhere than sm90, and where the sm90 forward does not split (dropout, a
// window's left edge), the same kernel runs twice.
TEST_P(GpuFwdSplitKeysTest, SplitKeysMatchTheOracle) {
  check_under_each_env(GetParam(), {{{"FLASHKIT_SM90_SPLITS", "3"}, {"FLASHKIT_SM90_PACK_GQA", "0"}},
                                    {{"FLASHKIT_SM90_SPLITS", "16"}, {"FLASHKIT_SM90_PACK_GQA", "1"}}});
}

INSTANTIATE_TEST_SUITE_P(SplitKeys, GpuFwdSplitKeysTest, ::testing::ValuesIn(split_key_cases()), param_name);

// One query token of few sequences against many keys: the decode kernel splits the keys through
// the workspace, and without a workspace runs unsplit; both match the oracle. On the automatic
// path whatever FLASHKIT_FWD_PATH the suite runs under (one query token: the decode kernel).
TEST_F(GpuFwdTest, ShortQueriesSplitTheKeysWithAWorkspace) {
  const ScopedEnv automatic("FLASHKIT_FWD_PATH", "");
  const int d = built_head_dim(128);
  FwdCase c = fixed_case(built_dtype(d), d, 8, 2, 1, 1, 4000);
  c.name = "shortQuerySplit";
  c.seed = 71;
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  DeviceProblem dev(c, in, contiguous_layout(c));
  EXPECT_GT(flashkit::mha_fwd_workspace_size(dev.fixed_params()), 0u);
  report(check_against_oracle(c, oracle, run_on_device(dev, nullptr)));
  flashkit::MhaFwdParams p = dev.fixed_params();
  p.workspace = nullptr;
  p.workspace_bytes = 0;
  dev.poison_outputs(nullptr);
  flashkit::mha_fwd(p, nullptr);
  report(check_against_oracle(c, oracle, dev.download(nullptr)));
  // A workspace smaller than the size query's is refused before any launch.
  p = dev.fixed_params();
  p.workspace_bytes -= 1;
  EXPECT_THROW(flashkit::mha_fwd(p, nullptr), flashkit::Error);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// seqlen_k == 0: besides the oracle comparison, every lse is -inf and every output exactly 0,
// stated directly rather than through the oracle.
TEST_P(GpuFwdNoKeysTest, ZeroOutputAndMinusInfLse) {
  const FwdCase& c = GetParam();
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  const KernelOut out = run_and_check(c, in, oracle, contiguous_layout(c));
  int64_t bad_lse = 0, bad_out = 0;
  for (float l : out.lse) bad_lse += !(std::isinf(l) && l < 0);
  for (uint16_t bits : out.out) bad_out += flashkit::bits_to_float(c.dtype, bits) != 0.0f;
  EXPECT_EQ(bad_lse, 0) << "lse entries that are not -inf; " << c.describe();
  EXPECT_EQ(bad_out, 0) << "output elements that are not 0; " << c.describe();
}

INSTANTIATE_TEST_SUITE_P(NoKeys, GpuFwdNoKeysTest, ::testing::ValuesIn(no_key_cases()), param_name);

// ------------------------------------------------------------------------------------------------
// Layout invariance: the same values through other strides give bitwise the same results
// ------------------------------------------------------------------------------------------------

// q, k and v as slices of one packed [batch, seqlen, 3, heads, d] buffer (varlen: [total, 3, heads,
// d]), as flash_attn_qkvpacked_func takes them. Needs heads_q == heads_kv and equal q / k tokens.
Layout packed_qkv_layout(const FwdCase& c) {
  Layout l = contiguous_layout(c);
  l.name = "packed qkv [b, s, 3, h, d]";
  const int64_t hd = int64_t{c.heads_q} * c.head_dim;
  const int64_t row = 3 * hd;
  for (int i = 0; i < 3; ++i) {
    Placement& p = i == 0 ? l.q : i == 1 ? l.k : l.v;
    p.buffer = 0;
    p.offset = i * hd;
    p.row_stride = row;
    p.head_stride = c.head_dim;
    p.batch_stride = c.varlen ? 0 : c.seqlen_q * row;
  }
  l.input_buffers = {c.total_q() * row};
  return l;
}

// q stored head-major ([batch, heads, seqlen, d] in memory, i.e. a transposed view), k and v slices
// of a packed [batch, seqlen_k, 2, heads_kv, d] buffer, out with head stride d + 8 and 24 extra
// elements per row and 64 per batch (the gaps must keep their poison).
Layout transposed_layout(const FwdCase& c) {
  Layout l = contiguous_layout(c);
  l.name = "q head-major, packed kv, padded out";
  const int64_t d = c.head_dim;
  const int64_t tq = c.varlen ? c.total_q() : c.seqlen_q;
  l.q.row_stride = d;
  l.q.head_stride = tq * d;
  l.q.batch_stride = c.varlen ? 0 : int64_t{c.heads_q} * tq * d;
  const int64_t kv_row = 2 * int64_t{c.heads_kv} * d;
  for (int i = 0; i < 2; ++i) {
    Placement& p = i == 0 ? l.k : l.v;
    p.buffer = 1;
    p.offset = i * int64_t{c.heads_kv} * d;
    p.row_stride = kv_row;
    p.head_stride = d;
    p.batch_stride = c.varlen ? 0 : c.seqlen_k * kv_row;
  }
  l.input_buffers = {c.total_q() * c.heads_q * d, c.total_k() * kv_row};
  l.out.head_stride = d + 8;
  l.out.row_stride = c.heads_q * (d + 8) + 24;
  l.out.batch_stride = c.varlen ? 0 : c.seqlen_q * l.out.row_stride + 64;
  l.out.offset = 8;
  l.out_elems = l.out.offset + (c.varlen ? 0 : (c.batch - 1) * l.out.batch_stride) +
                (c.varlen ? c.total_q() : c.seqlen_q) * l.out.row_stride;
  return l;
}

// Runs `c` contiguously and in `layout`; both must match the oracle, and each other bitwise.
void expect_layout_invariance(const FwdCase& c, const Layout& layout) {
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  SCOPED_TRACE("layout: " + layout.name + "; " + c.describe());
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  const KernelOut dense = run_and_check(c, in, oracle, contiguous_layout(c));
  const KernelOut strided = run_and_check(c, in, oracle, layout);
  ASSERT_EQ(dense.out.size(), strided.out.size());
  int64_t out_diff = 0;
  for (size_t i = 0; i < dense.out.size(); ++i) out_diff += dense.out[i] != strided.out[i];
  EXPECT_EQ(out_diff, 0) << "output elements that differ from the contiguous run";
  // Compare lse bits on the rows that exist (varlen rows past a sequence may stay unwritten).
  int64_t lse_diff = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads_q; ++h) {
      for (int i = 0; i < c.len_q(b); ++i) {
        const size_t at = (static_cast<size_t>(b) * c.heads_q + h) * c.lse_rows() + i;
        lse_diff += std::memcmp(&dense.lse[at], &strided.lse[at], sizeof(float)) != 0;
      }
    }
  }
  EXPECT_EQ(lse_diff, 0) << "lse entries that differ from the contiguous run";
}

TEST_F(GpuFwdTest, LayoutPackedQkvFixed) {
  FwdCase c = fixed_case(DType::kBFloat16, 128, 4, 4, 2, 239, 239);
  c.causal = true;
  c.name = "packedQkvFixed";
  c.seed = 11;
  expect_layout_invariance(c, packed_qkv_layout(c));
}

TEST_F(GpuFwdTest, LayoutPackedQkvVarlen) {
  FwdCase c = varlen_case(DType::kFloat16, 64, 6, 6, {17, 0, 113, 40}, {17, 0, 113, 40});
  c.tail_q = c.tail_k = 3;
  c.alibi = AlibiKind::kPerHead;
  c.name = "packedQkvVarlen";
  c.seed = 12;
  expect_layout_invariance(c, packed_qkv_layout(c));
}

TEST_F(GpuFwdTest, LayoutTransposedQPackedKvPaddedOutFixed) {
  FwdCase c = fixed_case(DType::kFloat16, 64, 6, 2, 2, 113, 239);
  c.alibi = AlibiKind::kPerBatchHead;
  c.name = "transposedFixed";
  c.seed = 13;
  expect_layout_invariance(c, transposed_layout(c));
}

TEST_F(GpuFwdTest, LayoutTransposedQPackedKvPaddedOutVarlen) {
  FwdCase c = varlen_case(DType::kBFloat16, 96, 8, 2, {33, 1, 0, 200}, {100, 7, 5, 199});
  c.tail_q = 6;
  c.tail_k = 2;
  c.causal = true;
  c.softcap = 30.0f;
  c.q_scale = 10.0f;
  c.name = "transposedVarlen";
  c.seed = 14;
  expect_layout_invariance(c, transposed_layout(c));
}

TEST_F(GpuFwdTest, LayoutTransposedHeadDim256Local) {
  FwdCase c = fixed_case(DType::kBFloat16, 256, 4, 1, 1, 203, 97);
  c.window_left = 20;
  c.window_right = 5;
  c.name = "transposedD256";
  c.seed = 15;
  expect_layout_invariance(c, transposed_layout(c));
}

// ------------------------------------------------------------------------------------------------
// Element offsets past 2^31
// ------------------------------------------------------------------------------------------------
//
// A kernel that computes an offset such as row * row_stride in 32 bits reads or writes the wrong
// place once the offset passes 2^31 elements. A contiguous K of more than 2^31 elements would need
// one CTA to stream 4 GB of keys (minutes); spreading a normal number of rows with huge strides
// makes the same offsets at a fraction of the cost: the buffers are about 4.3 GB each (two per
// test, about 8.6 GB) but only the rows of the view are copied, and the oracle runs on compact host
// copies of the same values.

constexpr int64_t k2Pow31 = int64_t{1} << 31;

int64_t round_up8(int64_t x) { return (x + 7) / 8 * 8; }

// Skips (returns false with `why` set) unless the device has `bytes` free with 1 GiB to spare.
bool device_has_free(size_t bytes, std::string& why) {
  size_t free_bytes = 0, total_bytes = 0;
  FK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes >= bytes + (size_t{1} << 30)) return true;
  why = "needs " + std::to_string(bytes >> 20) + " MiB of device memory, " +
        std::to_string(free_bytes >> 20) + " MiB free";
  return false;
}

void run_big_layout_case(const FwdCase& c, const Layout& layout) {
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  size_t bytes = static_cast<size_t>(layout.out_elems) * 2;
  for (int64_t elems : layout.input_buffers) bytes += static_cast<size_t>(elems) * 2;
  std::string why;
  if (!device_has_free(bytes, why)) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  try {
    run_and_check(c, in, oracle, layout);
  } catch (const OutOfMemory& e) {
    GTEST_SKIP() << "out of device memory: " << e.what();
  }
}

// k rows spread so that its last rows start past 2^31 elements; v heads spread so that head 1
// starts past 2^31.
TEST_F(GpuFwdTest, OffsetsPast2Pow31InKRowsAndVHeads) {
  FwdCase c = fixed_case(DType::kBFloat16, 128, 4, 2, 1, 77, 1000);
  c.name = "bigKV";
  c.seed = 21;
  Layout l = contiguous_layout(c);
  l.name = "k row stride > 2^31 / seqlen_k, v head stride > 2^31";
  const int64_t d = c.head_dim;
  const int64_t k_row = round_up8((k2Pow31 + c.seqlen_k - 2) / (c.seqlen_k - 1));
  l.k.row_stride = k_row;
  l.k.head_stride = d;
  l.k.batch_stride = c.seqlen_k * k_row;
  l.input_buffers[1] = (c.seqlen_k - 1) * k_row + c.heads_kv * d;
  const int64_t v_head = k2Pow31 + 64;
  l.v.row_stride = d;
  l.v.head_stride = v_head;
  l.v.batch_stride = v_head + c.seqlen_k * d;
  l.input_buffers[2] = (c.heads_kv - 1) * v_head + c.seqlen_k * d;
  ASSERT_GT((c.seqlen_k - 1) * k_row, k2Pow31);
  run_big_layout_case(c, l);
}

// q read from and out written to a second batch that starts past 2^31 elements; causal, so the
// mask offsets are exercised too.
TEST_F(GpuFwdTest, OffsetsPast2Pow31InQAndOutBatches) {
  FwdCase c = fixed_case(DType::kFloat16, 64, 3, 1, 2, 113, 239);
  c.causal = true;
  c.name = "bigQOut";
  c.seed = 22;
  Layout l = contiguous_layout(c);
  l.name = "q and out batch stride > 2^31";
  const int64_t batch_stride = k2Pow31 + 8;
  const int64_t rows = int64_t{c.seqlen_q} * c.heads_q * c.head_dim;
  l.q.batch_stride = batch_stride;
  l.input_buffers[0] = batch_stride + rows;
  l.out.batch_stride = batch_stride;
  l.out_elems = batch_stride + rows;
  run_big_layout_case(c, l);
}

// ------------------------------------------------------------------------------------------------
// Grid limits: more than 65,535 (batch x heads) tiles, checked on a sample against the oracle
// ------------------------------------------------------------------------------------------------

void run_sampled_case(const FwdCase& c, int samples) {
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, sampled_items(c, samples, c.seed));
  // Every row of every piece is still checked for being written and finite.
  run_and_check(c, in, oracle, contiguous_layout(c));
}

// Contiguous k and v of more than 2^31 elements each (520 x 16400 x 2 x 128 = 2.18e9): a
// decode-shaped problem (one query row per sequence) reads all of them while each CTA streams only
// its own 8 MB of keys. The last 8 sequences start past 2^31 elements.
TEST_F(GpuFwdTest, TensorsOver2Pow31Elements) {
  FwdCase c = fixed_case(DType::kBFloat16, 128, 16, 2, 520, 1, 16400);
  c.name = "kvOver2Pow31";
  c.seed = 23;
  const int64_t kv_elems = int64_t{c.batch} * c.seqlen_k * c.heads_kv * c.head_dim;
  ASSERT_GT(kv_elems, k2Pow31);
  std::string why;
  if (!device_has_free(static_cast<size_t>(kv_elems) * 2 * 2, why)) GTEST_SKIP() << why;
  // The four corner pieces (first and last batch) are always among the sampled ones.
  run_sampled_case(c, 60);
}

TEST_F(GpuFwdTest, GridBatch70000) {
  FwdCase c = fixed_case(DType::kBFloat16, 64, 1, 1, 70000, 9, 17);
  c.causal = true;
  c.name = "batch70000";
  c.seed = 31;
  run_sampled_case(c, 400);
}

TEST_F(GpuFwdTest, GridBatch4500Heads16) {
  FwdCase c = fixed_case(DType::kFloat16, 64, 16, 4, 4500, 33, 47);
  c.alibi = AlibiKind::kPerBatchHead;
  c.name = "batch4500heads16";
  c.seed = 32;
  run_sampled_case(c, 400);
}

// Many tiles under a causal mask with seqlen_q > seqlen_k: tiles with keys beside tiles whose rows
// see none (O = 0, LSE = -inf); with FLASHKIT_SM90_GRID=persistent a CTA walks both kinds.
TEST_F(GpuFwdTest, GridCausalRowsWithoutKeys) {
  FwdCase c = fixed_case(DType::kBFloat16, 64, 6, 2, 64, 239, 17);
  c.causal = true;
  c.name = "gridCausalRowsWithoutKeys";
  c.seed = 34;
  run_sampled_case(c, 400);
}

TEST_F(GpuFwdTest, GridVarlenBatch66000) {
  Rng rng(33);
  std::vector<int> lens_q(66000), lens_k(66000);
  for (int& len : lens_q) len = rng.uniform_int(0, 12);
  for (int& len : lens_k) len = rng.uniform_int(0, 12);
  lens_q[0] = lens_k[0] = 12;
  FwdCase c = varlen_case(DType::kBFloat16, 128, 2, 1, lens_q, lens_k);
  c.tail_q = 5;
  c.window_left = 4;
  c.window_right = 1;
  c.name = "varlenBatch66000";
  c.seed = 33;
  run_sampled_case(c, 400);
}

// The sm90 forward's dynamic tile scheduler (masked or varlen problems on Hopper; elsewhere these
// launches run another grid and the test still holds). Consecutive launches on one stream share a
// tile counter that each must leave at zero, launches on other streams have counters of their own,
// and a launch captured into a CUDA graph runs one CTA per tile. Each result must equal, bit for bit,
// the one-CTA-per-tile grid's (FLASHKIT_SM90_GRID=tile; the same code computes every tile): a
// counter left non-zero would skip tiles (rows keep their NaN poison), a shared one would run some
// tiles twice and skip others.
TEST_F(GpuFwdTest, GridDynamicAcrossLaunchesStreamsAndGraphs) {
  FwdCase causal = fixed_case(DType::kBFloat16, 128, 8, 2, 4, 1000, 1000);  // 256 tiles of 128 rows
  causal.causal = true;
  causal.name = "dynamicCausal";
  causal.seed = 61;
  FwdCase varlen = varlen_case(DType::kFloat16, 64, 4, 2, {700, 0, 333, 1200, 64}, {700, 17, 1000, 1200, 300});
  varlen.window_left = 100;
  varlen.window_right = 3;
  varlen.name = "dynamicVarlenWindow";
  varlen.seed = 62;
  int ran = 0;
  for (const FwdCase& c : {causal, varlen}) {
    if (!case_unavailable(c).empty()) continue;
    ++ran;
    const HostInputs in = make_inputs(c);
    KernelOut expected;
    {
      const ScopedEnv tile_grid("FLASHKIT_SM90_GRID", "tile");
      DeviceProblem dev(c, in, contiguous_layout(c));
      expected = run_on_device(dev, nullptr);
    }
    auto expect_same = [&](const KernelOut& got, const std::string& what) {
      const bool out_same = got.out == expected.out;  // 16-bit patterns: NaN poison compares too
      const bool lse_same = got.lse.size() == expected.lse.size() &&
                            std::memcmp(got.lse.data(), expected.lse.data(), got.lse.size() * 4) == 0;
      EXPECT_TRUE(out_same && lse_same) << c.name << ", " << what << ": out " << (out_same ? "" : "not ")
                                        << "bitwise equal, lse " << (lse_same ? "" : "not ") << "bitwise equal";
    };
    {  // consecutive launches on one stream
      Stream stream;
      DeviceProblem dev(c, in, contiguous_layout(c));
      for (int i = 0; i < 3; ++i) expect_same(run_on_device(dev, stream.get()), "launch " + std::to_string(i));
    }
    {  // four streams at once, twice
      constexpr int kStreams = 4;
      std::vector<std::unique_ptr<Stream>> streams;
      std::vector<std::unique_ptr<DeviceProblem>> devs;
      for (int i = 0; i < kStreams; ++i) {
        streams.push_back(std::make_unique<Stream>());
        devs.push_back(std::make_unique<DeviceProblem>(c, in, contiguous_layout(c)));
      }
      for (int round = 0; round < 2; ++round) {
        for (int i = 0; i < kStreams; ++i) {
          devs[i]->upload(streams[i]->get());
          devs[i]->poison_outputs(streams[i]->get());
          devs[i]->launch(streams[i]->get());
        }
        for (int i = 0; i < kStreams; ++i) {
          expect_same(devs[i]->download(streams[i]->get()),
                      "stream " + std::to_string(i) + " round " + std::to_string(round));
        }
      }
    }
    {  // a captured launch, replayed
      Stream stream;
      DeviceProblem dev(c, in, contiguous_layout(c));
      dev.upload(stream.get());
      cudaGraph_t graph = nullptr;
      FK_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
      dev.poison_outputs(stream.get());
      dev.launch(stream.get());
      FK_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
      cudaGraphExec_t exec = nullptr;
      FK_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 0; i < 3; ++i) {
        FK_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
        expect_same(dev.download(stream.get()), "graph replay " + std::to_string(i));
      }
      FK_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FK_CUDA_CHECK(cudaGraphDestroy(graph));
    }
  }
  if (ran == 0) GTEST_SKIP() << "neither case's kernels are built";
}

// The dynamic scheduler's counter slots (tile_counter_slots.h): host bookkeeping, no GPU needed. One
// slot per (device, stream), the same on every call; the per-thread default stream gets one per host
// thread; -1 once a device's slots are all taken (the launch then runs one CTA per tile), while the
// keys that have a slot keep it. Device ids far from real ones keep the process's launches apart.
TEST(TileCounterSlots, OnePerDeviceAndStreamAndThreadForThePerThreadStream) {
  using flashkit::sm90::kTileCounterSlots;
  using flashkit::sm90::tile_counter_slot;
  constexpr int kDevice = 1000;
  constexpr int kOtherDevice = 1001;
  auto stream = [](uintptr_t i) { return reinterpret_cast<void*>(0x10000 + 16 * i); };
  const int first = tile_counter_slot(kDevice, stream(1));
  const int second = tile_counter_slot(kDevice, stream(2));
  EXPECT_EQ(first, 0);
  EXPECT_EQ(second, 1);
  EXPECT_EQ(tile_counter_slot(kDevice, stream(1)), first);
  EXPECT_EQ(tile_counter_slot(kOtherDevice, stream(1)), 0) << "slots are counted per device";
  void* per_thread = static_cast<void*>(cudaStreamPerThread);
  const int mine = tile_counter_slot(kDevice, per_thread);
  int theirs = -2;
  std::thread([&] { theirs = tile_counter_slot(kDevice, per_thread); }).join();
  EXPECT_EQ(mine, 2);
  EXPECT_EQ(theirs, 3) << "another host thread's per-thread stream is another stream";
  EXPECT_EQ(tile_counter_slot(kDevice, per_thread), mine);
  for (int i = 3; i < kTileCounterSlots - 1; ++i) EXPECT_EQ(tile_counter_slot(kDevice, stream(i)), i + 1);
  EXPECT_EQ(tile_counter_slot(kDevice, stream(kTileCounterSlots)), -1);
  EXPECT_EQ(tile_counter_slot(kDevice, stream(kTileCounterSlots + 1)), -1);
  EXPECT_EQ(tile_counter_slot(kDevice, stream(2)), second);
}

// Which problems the sm90 forward packs (fwd_pack_gqa_group): host logic, no GPU needed.
TEST(Sm90PackedHeads, WhichProblemsArePacked) {
  using flashkit::sm90::fwd_pack_gqa_group;
  using flashkit::sm90::PackGqa;
  constexpr int kSms = 132;
  FwdProblem p;
  p.batch = 8;
  p.heads_q = 32;
  p.heads_kv = 8;
  p.head_dim = 128;
  p.seqlen_k = 4096;
  auto group = [&p](int seqlen_q, PackGqa mode = PackGqa::kAuto, bool can_split = true) {
    p.seqlen_q = seqlen_q;
    return fwd_pack_gqa_group(p, 128, 128, kSms, can_split, mode);
  };
  // 256 unpacked tiles and more (G = 4, tiles of 128 rows): pack where the rows in use per row run
  // improve by more than 1%.
  EXPECT_EQ(group(1), 4) << "1 / 128 against 4 / 128";
  EXPECT_EQ(group(33), 4) << "33 / 128 against 132 / 256";
  EXPECT_EQ(group(100), 1) << "100 / 128 against 400 / 512: the same";
  EXPECT_EQ(group(200), 4) << "200 / 256 against 800 / 896";
  EXPECT_EQ(group(4096), 1) << "whole tiles either way";
  p.seqlen_q = 2048;
  EXPECT_EQ(fwd_pack_gqa_group(p, 192, 128, kSms, true, PackGqa::kAuto), 4) << "2048 / 2112 against 8192 / 8256";
  p.seqlen_q = 8192;
  EXPECT_EQ(fwd_pack_gqa_group(p, 192, 128, kSms, true, PackGqa::kAuto), 1) << "8192 / 8256 against 32768 / 32832";
  EXPECT_EQ(group(4096, PackGqa::kWherever), 4);
  EXPECT_EQ(group(33, PackGqa::kNever), 1);
  // Varlen: wherever the unpacked tiles (at max_seqlen_q) exceed a wave and packing leaves no more
  // rows empty.
  p.cu_seqlens_q = reinterpret_cast<const int*>(0x100);
  EXPECT_EQ(group(4096), 4);
  p.cu_seqlens_q = nullptr;
  // Unpacked tiles within one wave (4 x 32 = 128 at up to 128 tokens): only where the busiest CTA
  // costs less packed (key blocks of its split x 1.3 with two consumers busy, + 8 for a split).
  p.batch = 4;
  EXPECT_EQ(group(32), 4) << "32 packed tiles split 4 ways: 8 x 1.3 + 8 against 32";
  EXPECT_EQ(group(32, PackGqa::kAuto, false), 1) << "no split without a workspace: 32 x 1.3 against 32";
  p.seqlen_k = 2048;
  EXPECT_EQ(group(16), 4) << "16 blocks of keys: 4 + 8 against 16";
  EXPECT_EQ(group(64), 1) << "64 packed tiles split 2 ways: 8 x 1.3 + 8 against 16";
  p.batch = 1;
  EXPECT_EQ(group(8), 1) << "4 splits either way: 4 + 8 against 4 + 8";
  EXPECT_EQ(group(32), 1) << "4 x 1.3 + 8 against 4 + 8";
  p.seqlen_k = 8192;
  EXPECT_EQ(group(32), 4) << "16 splits packed, 4 unpacked: 4 x 1.3 + 8 against 16 + 8";
  EXPECT_EQ(group(64), 4) << "8 splits packed: 8 x 1.3 + 8 against 16 + 8";
  EXPECT_EQ(group(128), 1) << "4 splits either way: 16 x 1.3 + 8 against 16 x 1.3 + 8";
  p.batch = 4;
  p.seqlen_k = 4096;
  EXPECT_EQ(group(32, PackGqa::kWherever, false), 4);
  EXPECT_EQ(group(129), 4) << "256 tiles";
  p.batch = 8;
  // G = 7 (28 / 4 heads): 9 tokens per consumer, 18 per tile of 128 rows (126 in use).
  p.heads_q = 28;
  p.heads_kv = 4;
  EXPECT_EQ(group(33), 7) << "33 / 128 against 231 / 256";
  EXPECT_EQ(group(128), 1) << "128 / 128 against 896 / 1024";
  EXPECT_EQ(group(200), 7) << "200 / 256 against 1400 / 1536";
  p.cu_seqlens_q = reinterpret_cast<const int*>(0x100);
  EXPECT_EQ(group(128), 1) << "varlen, but packed leaves more rows empty";
  p.cu_seqlens_q = nullptr;
  // Every G from 2 to 64 is covered; what is not runs unpacked, also when packing is asked for
  // everywhere.
  for (auto [hq, hkv, g] : {std::tuple{24, 8, 3}, {6, 1, 6}, {28, 4, 7}, {48, 2, 24}, {64, 1, 64}, {8, 8, 1},
                            {128, 1, 1}, {130, 2, 1}}) {
    p.heads_q = hq;
    p.heads_kv = hkv;
    EXPECT_EQ(group(33, PackGqa::kWherever), g) << hq << "/" << hkv << " heads";
  }
  p.heads_q = 64;
  p.heads_kv = 1;
  p.dropout_p = 0.1f;
  EXPECT_EQ(group(33, PackGqa::kWherever), 1) << "dropout";
  p.dropout_p = 0.0f;
  const float slopes[64] = {};
  p.alibi_slopes = slopes;
  EXPECT_EQ(group(33, PackGqa::kWherever), 1) << "ALiBi";
  p.alibi_slopes = nullptr;
  EXPECT_EQ(group(INT32_MAX / 64, PackGqa::kWherever), 1) << "s_q x G past 2^31";
  EXPECT_EQ(group(0, PackGqa::kWherever), 1) << "no query rows";
}

// The kernel's row arithmetic (TileRows): j / G through fwd_pack_reciprocal for every row of a
// consumer's 64 (and every row of a tile, up to 256) and every G it packs; and the tokens per tile.
TEST(Sm90PackedHeads, RowDivisionIsExact) {
  using flashkit::sm90::fwd_pack_reciprocal;
  using flashkit::sm90::fwd_tokens_per_tile;
  for (int g = 1; g <= 64; ++g) {
    for (int j = 0; j < 256; ++j) {
      ASSERT_EQ((j * fwd_pack_reciprocal(g)) >> 16, j / g) << "j = " << j << ", G = " << g;
    }
  }
  EXPECT_EQ(fwd_tokens_per_tile(128, 1), 128);
  EXPECT_EQ(fwd_tokens_per_tile(192, 4), 48);
  EXPECT_EQ(fwd_tokens_per_tile(128, 7), 18);
  EXPECT_EQ(fwd_tokens_per_tile(192, 24), 6);
  EXPECT_EQ(fwd_tokens_per_tile(128, 64), 2);
}

// How many ways the sm90 forward splits the keys (fwd_split_count): host logic, no GPU needed.
TEST(Sm90SplitKeys, HowManySplits) {
  using flashkit::sm90::fwd_split_count;
  constexpr int kSms = 132;
  FwdProblem p;
  p.batch = 1;
  p.heads_q = 32;
  p.heads_kv = 8;
  p.head_dim = 128;
  p.seqlen_q = 64;
  p.seqlen_k = 32768;  // 256 blocks of 128 keys
  // 32 tiles unpacked: 4 splits bring them to one wave; packed (8 kv heads x 256 rows: 16 tiles) 8.
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 0), 4);
  EXPECT_EQ(fwd_split_count(p, 128, 128, 4, kSms, 0), 8);
  // At least 4 key blocks per split.
  p.seqlen_k = 1024;
  EXPECT_EQ(fwd_split_count(p, 128, 128, 4, kSms, 0), 2);
  p.seqlen_k = 32768;
  // More than half the SMs busy without a split: none.
  p.batch = 3;
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 0), 1) << "96 tiles";
  EXPECT_EQ(fwd_split_count(p, 128, 128, 4, kSms, 0), 2) << "48 tiles";
  p.batch = 1;
  // Forced: that many, up to the key blocks and 128.
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 7), 7);
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 1), 1);
  p.seqlen_k = 300;
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 16), 3);
  p.seqlen_k = 32768;
  // Never with dropout, a left window edge or no keys.
  p.dropout_p = 0.1f;
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 7), 1);
  p.dropout_p = 0.0f;
  p.window_left = 100;
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 7), 1);
  p.window_left = -1;
  p.seqlen_k = 0;
  EXPECT_EQ(fwd_split_count(p, 128, 128, 1, kSms, 7), 1);
}

// ------------------------------------------------------------------------------------------------
// A created stream
// ------------------------------------------------------------------------------------------------

// Holds a stream for 50 ms from the host: work enqueued behind it waits, work on other streams
// does not. (A host function may not call CUDA; sleeping is fine.)
void CUDART_CB hold_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }

// Everything runs on a created non-blocking stream that is held for 50 ms before the inputs are
// uploaded (asynchronously, from pinned memory) to buffers poisoned with NaN; only that stream is
// synchronized. A launch on any other stream (e.g. the legacy default stream, which does not wait
// for non-blocking streams) would run at once on the poison and produce NaN.
//
// A warm-up run comes first: the first launch of a kernel in a process loads its module (CUDA
// lazy loading), which waits for the whole device and would hide a launch on the wrong stream.
void expect_stream_run(const FwdCase& c) {
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  Stream stream;
  {
    DeviceProblem warm_up(c, in, contiguous_layout(c));
    report(check_against_oracle(c, oracle, run_on_device(warm_up, stream.get())));
  }
  DeviceProblem dev(c, in, contiguous_layout(c));  // inputs poisoned until the upload lands
  FK_CUDA_CHECK(cudaLaunchHostFunc(stream.get(), hold_stream, nullptr));
  const KernelOut out = run_on_device(dev, stream.get());
  report(check_against_oracle(c, oracle, out, dev.out_gaps_written()));
  FK_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST_F(GpuFwdTest, NonDefaultStreamFixed) {
  FwdCase c = fixed_case(DType::kBFloat16, 128, 6, 2, 2, 1023, 1023);
  c.causal = true;
  c.name = "streamFixed";
  c.seed = 41;
  expect_stream_run(c);
}

TEST_F(GpuFwdTest, NonDefaultStreamVarlen) {
  FwdCase c = varlen_case(DType::kFloat16, 64, 4, 1, {100, 0, 239, 17}, {239, 5, 239, 0});
  c.tail_q = 4;
  c.alibi = AlibiKind::kPerHead;
  c.name = "streamVarlen";
  c.seed = 42;
  expect_stream_run(c);
}

// ------------------------------------------------------------------------------------------------
// Bad input on CUDA views
// ------------------------------------------------------------------------------------------------

// Each bad view throws flashkit::Error naming the argument, launches nothing (out keeps its poison,
// no CUDA error is pending), and the valid call right after it works.
TEST_F(GpuFwdTest, BadInputThrowsAndNextCallWorks) {
  const int d = built_head_dim(64);
  FwdCase c = fixed_case(built_dtype(d), d, 4, 2, 2, 33, 47);
  c.name = "badInput";
  c.seed = 51;
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  DeviceProblem dev(c, in, contiguous_layout(c));
  dev.upload(nullptr);
  FK_CUDA_CHECK(cudaDeviceSynchronize());

  struct Bad {
    std::string what;
    std::string argument;  // the name the message must contain
    std::function<void(flashkit::MhaFwdParams&)> spoil;
  };
  auto shift = [](flashkit::TensorView& v, int bytes) {
    v.data = static_cast<char*>(v.data) + bytes;
  };
  const std::vector<Bad> bads = {
      {"q.data 2 bytes past a 16-byte boundary", "q",
       [&](flashkit::MhaFwdParams& p) { shift(p.q, 2); }},
      {"k.data 8 bytes past a 16-byte boundary", "k",
       [&](flashkit::MhaFwdParams& p) { shift(p.k, 8); }},
      {"out.data 4 bytes past a 16-byte boundary", "out",
       [&](flashkit::MhaFwdParams& p) { shift(p.out, 4); }},
      {"k row stride not a multiple of 8", "k",
       [&](flashkit::MhaFwdParams& p) { p.k.strides[1] -= 4; }},
      {"v head stride not a multiple of 8", "v",
       [&](flashkit::MhaFwdParams& p) { p.v.strides[2] = c.head_dim - 4; }},
      {"q batch stride not a multiple of 8", "q",
       [&](flashkit::MhaFwdParams& p) { p.q.strides[0] -= 4; }},
      {"out head stride not a multiple of 8", "out",
       [&](flashkit::MhaFwdParams& p) { p.out.strides[2] = c.head_dim + 4; }},
      {"q last-dim stride 2", "q", [&](flashkit::MhaFwdParams& p) { p.q.strides[3] = 2; }},
  };
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.what);
    dev.poison_outputs(nullptr);
    FK_CUDA_CHECK(cudaDeviceSynchronize());
    flashkit::MhaFwdParams params = dev.fixed_params();
    bad.spoil(params);
    try {
      flashkit::mha_fwd(params, nullptr);
      ADD_FAILURE() << "mha_fwd accepted " << bad.what;
    } catch (const flashkit::Error& e) {
      EXPECT_TRUE(names_argument(e.what(), bad.argument))
          << "the message does not name '" << bad.argument << "': " << e.what();
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    FK_CUDA_CHECK(cudaDeviceSynchronize());
    const KernelOut untouched = dev.download(nullptr);
    const int64_t written = std::count_if(untouched.out.begin(), untouched.out.end(),
                                          [](uint16_t bits) { return bits != kPoison16; });
    EXPECT_EQ(written, 0) << "the rejected call wrote the output";

    // The library is still usable: the valid call right after works.
    dev.poison_outputs(nullptr);
    dev.launch(nullptr);
    report(check_against_oracle(c, oracle, dev.download(nullptr)));
  }
}

// ------------------------------------------------------------------------------------------------
// A head dim (or dtype) left out of the build
// ------------------------------------------------------------------------------------------------

TEST_F(GpuFwdTest, UnbuiltHeadDimIsRejected) {
  // Prefer a head dim no dtype has (cuda_head_dim_built), else a (dtype, head dim) pair left out.
  int dim = -1;
  DType dtype = DType::kBFloat16;
  for (int d = 256; d >= 8 && dim < 0; d -= 8) {
    if (!flashkit::cuda_head_dim_built(d)) dim = d;
  }
  for (int d = 256; d >= 8 && dim < 0; d -= 8) {
    for (DType t : {DType::kBFloat16, DType::kFloat16}) {
      if (dim < 0 && !flashkit::cuda_fwd_built(t, d)) {
        dim = d;
        dtype = t;
      }
    }
  }
  if (dim < 0) GTEST_SKIP() << "this build has every head dim and dtype";

  FwdCase c = fixed_case(dtype, dim, 2, 1, 1, 17, 33);
  c.name = "unbuilt";
  c.seed = 61;
  const HostInputs in = make_inputs(c);
  DeviceProblem dev(c, in, contiguous_layout(c));
  dev.upload(nullptr);
  FK_CUDA_CHECK(cudaDeviceSynchronize());
  try {
    dev.launch(nullptr);
    ADD_FAILURE() << "mha_fwd ran " << short_dtype_name(dtype) << " head dim " << dim
                  << ", which cuda_fwd_built says this build lacks";
  } catch (const flashkit::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(std::to_string(dim)), std::string::npos)
        << "the message does not give the head dim: " << msg;
    EXPECT_NE(msg.find("build"), std::string::npos)
        << "the message does not say the build left it out: " << msg;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  // A built head dim still runs.
  const int built = built_head_dim(64);
  ASSERT_TRUE(flashkit::cuda_head_dim_built(built)) << "this build has no CUDA forward kernel";
  FwdCase ok = fixed_case(built_dtype(built), built, 2, 1, 1, 17, 33);
  ok.name = "builtAfterUnbuilt";
  ok.seed = 62;
  const HostInputs ok_in = make_inputs(ok);
  run_and_check(ok, ok_in, run_oracle(ok, ok_in, all_items(ok)), contiguous_layout(ok));
}

// ------------------------------------------------------------------------------------------------
// Forcing a forward path (FLASHKIT_FWD_PATH)
// ------------------------------------------------------------------------------------------------

// Whether FLASHKIT_FWD_PATH=sm90 can run (dtype, head dim) here: a compute capability 9.0 device and
// the sm90 kernel of its family (64, 128 or 256) in this build (build_config.h's list).
bool sm90_runs([[maybe_unused]] DType dtype, int head_dim) {
  cudaDeviceProp prop;
  FK_CUDA_CHECK(cudaGetDeviceProperties(&prop, current_device()));
  [[maybe_unused]] const int family = sm90::fwd_head_dim_family(head_dim);
  bool built = false;
#define FLASHKIT_SM90_FWD_INSTANCE(kDType, kFamily) \
  built = built || (dtype == DType::kDType && family == kFamily);
  FLASHKIT_SM90_FWD_INSTANCES
#undef FLASHKIT_SM90_FWD_INSTANCE
  return built && prop.major == 9 && prop.minor == 0;
}

// Each forced path either runs and matches the oracle or, where it cannot run, is refused with an
// error naming FLASHKIT_FWD_PATH before any launch; an unknown path is refused the same way.
TEST_F(GpuFwdTest, ForcedFwdPaths) {
  const int d = built_head_dim(64);
  FwdCase c = fixed_case(built_dtype(d), d, 2, 2, 2, 65, 97);
  c.causal = true;
  c.name = "forcedPath";
  c.seed = 63;
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  DeviceProblem dev(c, in, contiguous_layout(c));
  dev.upload(nullptr);
  FK_CUDA_CHECK(cudaDeviceSynchronize());
  for (const char* path : {"sm80", "sm90", "decode", "sm75"}) {
    SCOPED_TRACE(path);
    const ScopedEnv forced("FLASHKIT_FWD_PATH", path);
    const bool runs = std::string(path) == "sm80" ||
                      (std::string(path) == "sm90" && sm90_runs(c.dtype, c.head_dim)) ||
                      (std::string(path) == "decode" && flashkit::cuda_kvcache_built(c.dtype, c.head_dim));
    dev.poison_outputs(nullptr);
    try {
      dev.launch(nullptr);
      if (runs) {
        report(check_against_oracle(c, oracle, dev.download(nullptr)));
      } else {
        ADD_FAILURE() << "FLASHKIT_FWD_PATH=" << path << " ran, though it cannot run here";
      }
    } catch (const flashkit::Error& e) {
      EXPECT_FALSE(runs) << e.what();
      EXPECT_NE(std::string(e.what()).find("FLASHKIT_FWD_PATH"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

// ------------------------------------------------------------------------------------------------
// Determinism
// ------------------------------------------------------------------------------------------------

void expect_deterministic(const FwdCase& c) {
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_oracle(c, in, all_items(c));
  DeviceProblem dev(c, in, contiguous_layout(c));
  const KernelOut first = run_on_device(dev, nullptr);
  report(check_against_oracle(c, oracle, first));
  for (int repeat = 0; repeat < 3; ++repeat) {
    dev.poison_outputs(nullptr);
    dev.launch(nullptr);
    const KernelOut again = dev.download(nullptr);
    EXPECT_EQ(0, std::memcmp(first.out.data(), again.out.data(), first.out.size() * 2))
        << "out differs on repeat " << repeat << "; " << c.describe();
    EXPECT_EQ(0, std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * sizeof(float)))
        << "lse differs on repeat " << repeat << "; " << c.describe();
  }
}

TEST_F(GpuFwdTest, DeterministicFixedCausal) {
  FwdCase c = fixed_case(DType::kBFloat16, 128, 8, 2, 2, 1023, 1023);
  c.causal = true;
  c.name = "deterministicFixed";
  c.seed = 71;
  expect_deterministic(c);
}

TEST_F(GpuFwdTest, DeterministicVarlenAlibiSoftcap) {
  FwdCase c = varlen_case(DType::kFloat16, 64, 6, 2, {300, 0, 17, 1023}, {1023, 9, 0, 700});
  c.alibi = AlibiKind::kPerBatchHead;
  c.softcap = 30.0f;
  c.q_scale = 10.0f;
  c.tail_q = 7;
  c.name = "deterministicVarlen";
  c.seed = 72;
  expect_deterministic(c);
}

}  // namespace
}  // namespace flashkit::test
