// tests/cpp/test_gpu_bwd.cpp
// \brief flashkit::mha_bwd / mha_varlen_bwd on CUDA views against the CPU oracle.
//
// Each case: inputs rounded into the dtype, out / lse from the CPU reference forward, a random
// dout; dq / dk / dv and the workspace poisoned with 0xFF bytes (NaN) before every run; the oracle
// in fp64 (kExact) and in the input dtype (kInputDtype) from the same six tensors; then the rule
// of TESTING.md per gradient: max |kernel - exact| <= 3 x max |low - exact| + slack. Also: every
// gradient element finite, rows the mask gives nothing (query rows without keys, keys without
// rows, keys past seqused_k) exactly zero, varlen tail tokens and layout gaps never written (see
// gpu_bwd_test_util.h).
//
// The suites:
//   DtypeHeadDimMask/*    dtype x head dim (40 ... 256, padded ones included) x mask (8 kinds)
//                         on a GQA shape, s_q < s_k, s_q > s_k, s_q == s_k
//   ShapesGqaVarlen/*     mask x {fixed, varlen} x {MHA, GQA, MQA} x 2 draws of (lengths 1 ...
//                         1025, head dim, dtype, softmax_scale)
//   LongSequences/*       2048 and 4224 tokens, few heads
//   VarlenEdges/*         zero-length sequences, max_seqlen_q == 1, seqused_k, tails
//   EmptyRows/*           masks that leave query rows without keys or keys without rows
//   NoKeysNoQueries/*     seqlen_k == 0 (dq zero) and seqlen_q == 0 (dk, dv zero)
//   Dropout/*             the DtypeHeadDimMask grid and one draw of the ShapesGqaVarlen grid with
//                         dropout (p 0.1 / 0.5, seed and offset drawn per case): the oracle
//                         regenerates the forward's Philox mask
//   GpuBwdTest.*          layout invariance (bitwise), 50 deterministic runs bitwise equal,
//                         offsets past 2^31 elements (q / dout / dq batches, k / dk rows, v / dv
//                         heads), more than 65,535 (batch x heads), a created stream, workspace
//                         and bad-input errors on real device memory, a kernel left out of the
//                         build, forced paths (FLASHKIT_BWD_PATH); with dropout: 50
//                         deterministic runs bitwise equal, the same seed and offset giving the
//                         same bytes and another seed or offset other gradients, p = 0 bitwise
//                         the call without dropout
// About a quarter of the grid cases (names ending in _det) run in deterministic mode.
//
// A case whose (dtype, head dim) this build has no backward kernel for is skipped, not failed.
// Without a GPU every test skips itself. FLASHKIT_TEST_VERBOSE=1 prints the errors measured for
// passing cases too. On a Hopper GPU the automatic path runs the sm90 backward where it covers a
// case (head-dim families 64, 128 and 256, deterministic mode and dropout included); run the suite again
// with FLASHKIT_BWD_PATH=sm80 for the sm80 kernel (scripts/gpu_check.sh does: step
// gpu_tests_bwd_sm80).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "build_config.h"
#include "cuda/sm80/fwd_sm80.h"
#include "expect_error.h"
#include "flashkit/flashkit.h"
#include "gpu_bwd_test_util.h"
#include "gpu_case_builders.h"
#include "gpu_case_grids.h"
#include "gpu_test_util.h"

namespace flashkit::test {
namespace {

// ------------------------------------------------------------------------------------------------
// The grids
// ------------------------------------------------------------------------------------------------

// A backward case: the forward case it differentiates, and the mode it runs in.
struct BwdCase {
  FwdCase c;
  bool deterministic = false;
  std::string name() const { return c.name + (deterministic ? "_det" : ""); }
};

void PrintTo(const BwdCase& b, std::ostream* os) {
  *os << b.c.describe() << (b.deterministic ? " deterministic" : "");
}

std::string bwd_param_name(const ::testing::TestParamInfo<BwdCase>& info) {
  return info.param.name();
}

// Every fourth case in deterministic mode.
std::vector<BwdCase> as_bwd_cases(const std::vector<FwdCase>& cases) {
  std::vector<BwdCase> out;
  for (size_t i = 0; i < cases.size(); ++i) out.push_back({cases[i], i % 4 == 3});
  return out;
}

const std::vector<int> kBwdHeadDims = {40, 64, 72, 96, 128, 192, 256};

// 2 x 7 x 8 = 112 cases.
std::vector<BwdCase> dtype_head_dim_mask_cases() {
  return as_bwd_cases(finish(dtype_head_dim_mask_grid(kBwdHeadDims, 0xB7E4D), 0x11000));
}

// mask x {fixed, varlen} x heads {6/6, 6/2, 6/1} x 2 draws: 96 cases.
std::vector<BwdCase> shape_cases() {
  return as_bwd_cases(
      finish(shape_grid(kBwdHeadDims, {{6, 6}, {6, 2}, {6, 1}}, 2, 0xB5A4E), 0x12000));
}

std::vector<BwdCase> long_cases() { return as_bwd_cases(finish(long_grid(), 0x13000)); }

std::vector<BwdCase> varlen_edge_cases() {
  return as_bwd_cases(finish(varlen_edge_grid(0xBED6E), 0x14000));
}

std::vector<BwdCase> empty_row_cases() { return as_bwd_cases(finish(empty_row_grid(), 0x15000)); }

// Each case with dropout: p alternating 0.1 and 0.5, seed and offset drawn; "_p10" / "_p50".
std::vector<FwdCase> with_dropout(std::vector<FwdCase> cases, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < cases.size(); ++i) {
    FwdCase& c = cases[i];
    c.dropout = {i % 2 == 0 ? 0.1f : 0.5f, rng.next(), rng.next() >> 8};
    c.name += i % 2 == 0 ? "_p10" : "_p50";
  }
  return cases;
}

// 2 x 7 x 8 + 8 x 2 x 3 = 160 cases: every head-dim family, mask, GQA/MQA, varlen and odd length.
std::vector<BwdCase> dropout_cases() {
  std::vector<FwdCase> cases = dtype_head_dim_mask_grid(kBwdHeadDims, 0xD0B7E4D);
  for (FwdCase& c : shape_grid(kBwdHeadDims, {{6, 6}, {6, 2}, {6, 1}}, 1, 0xD0B5A4E)) {
    cases.push_back(c);
  }
  return as_bwd_cases(finish(with_dropout(cases, 0xD0D0), 0x17000));
}

// Head dims that end inside a 32-column box of the sm90 kernels' dQ reductions (80 and 112 in family
// 128, 208 and 224 in family 256): the box that straddles head_dim must be clipped by the copy
// engine and the boxes past it dropped, or the neighbouring head's dQ takes the adds.
// mask x {fixed, varlen} x heads {6/6, 6/2} over the four head dims: 32 cases.
std::vector<BwdCase> partial_head_dim_cases() {
  return as_bwd_cases(finish(shape_grid({80, 112, 208, 224}, {{6, 6}, {6, 2}}, 1, 0xB9A27), 0x18000));
}

// seqlen_k == 0: every dq row is zero. seqlen_q == 0: every dk / dv row is zero.
std::vector<BwdCase> no_key_no_query_cases() {
  std::vector<FwdCase> cases;
  Rng rng(0xB0C0);
  const std::pair<MaskKind, int> variants[] = {{MaskKind::kNone, 17},
                                               {MaskKind::kCausal, 1},
                                               {MaskKind::kAlibi, 33},
                                               {MaskKind::kSoftcap, 9}};
  int i = 0;
  for (const auto& [mask, len] : variants) {
    for (bool no_keys : {true, false}) {
      const DType dtype = i % 2 ? DType::kFloat16 : DType::kBFloat16;
      const int d = i % 2 ? 128 : 64;
      FwdCase c =
          no_keys ? fixed_case(dtype, d, 4, 2, 2, len, 0) : fixed_case(dtype, d, 4, 2, 2, 0, len);
      apply_mask(c, mask, rng);
      c.name = default_name(c, mask_name(mask));
      cases.push_back(c);
      ++i;
    }
  }
  return as_bwd_cases(finish(cases, 0x16000));
}

// `preferred` when this build has its backward on CUDA in some dtype, else the smallest head dim
// it has, else `preferred` (the test then skips).
int built_bwd_head_dim(int preferred) {
  auto built = [](int d) {
    return cuda_bwd_built(DType::kBFloat16, d) || cuda_bwd_built(DType::kFloat16, d);
  };
  if (built(preferred)) return preferred;
  for (int d = 8; d <= 256; d += 8) {
    if (built(d)) return d;
  }
  return preferred;
}

DType built_bwd_dtype(int head_dim) {
  return cuda_bwd_built(DType::kBFloat16, head_dim) ? DType::kBFloat16 : DType::kFloat16;
}

// ------------------------------------------------------------------------------------------------
// Fixtures and the common run
// ------------------------------------------------------------------------------------------------

class GpuBwdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount reports none";
  }
};

class GpuBwdCaseTest : public GpuBwdTest, public ::testing::WithParamInterface<BwdCase> {};

void report(const CheckReport& r) {
  EXPECT_TRUE(r.ok) << r.text;
  if (r.ok && verbose()) std::cout << r.text << "\n";
}

// Uploads, poisons dq / dk / dv and the workspace, runs, downloads and checks against `oracle`.
BwdKernelOut run_and_check(BackwardCase& host, const BwdOracle& oracle, const BwdLayout& layout,
                           bool deterministic) {
  DeviceBwdProblem dev(host, layout);
  dev.upload(nullptr);
  dev.poison_gradients(nullptr);
  dev.launch(nullptr, deterministic);
  BwdKernelOut k = dev.download(nullptr);
  report(check_gradients(host, oracle, k, dev.gaps_written()));
  return k;
}

TEST_P(GpuBwdCaseTest, MatchesOracle) {
  const BwdCase& b = GetParam();
  if (const std::string why = bwd_case_unavailable(b.c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(b.c);
  const BwdOracle oracle = run_bwd_oracle(host);
  run_and_check(host, oracle, contiguous_bwd_layout(b.c), b.deterministic);
}

INSTANTIATE_TEST_SUITE_P(DtypeHeadDimMask, GpuBwdCaseTest,
                         ::testing::ValuesIn(dtype_head_dim_mask_cases()), bwd_param_name);
INSTANTIATE_TEST_SUITE_P(ShapesGqaVarlen, GpuBwdCaseTest, ::testing::ValuesIn(shape_cases()),
                         bwd_param_name);
INSTANTIATE_TEST_SUITE_P(LongSequences, GpuBwdCaseTest, ::testing::ValuesIn(long_cases()),
                         bwd_param_name);
INSTANTIATE_TEST_SUITE_P(VarlenEdges, GpuBwdCaseTest, ::testing::ValuesIn(varlen_edge_cases()),
                         bwd_param_name);
INSTANTIATE_TEST_SUITE_P(EmptyRows, GpuBwdCaseTest, ::testing::ValuesIn(empty_row_cases()),
                         bwd_param_name);
INSTANTIATE_TEST_SUITE_P(NoKeysNoQueries, GpuBwdCaseTest,
                         ::testing::ValuesIn(no_key_no_query_cases()), bwd_param_name);
INSTANTIATE_TEST_SUITE_P(Dropout, GpuBwdCaseTest, ::testing::ValuesIn(dropout_cases()),
                         bwd_param_name);
INSTANTIATE_TEST_SUITE_P(PartialHeadDims, GpuBwdCaseTest, ::testing::ValuesIn(partial_head_dim_cases()),
                         bwd_param_name);

// ------------------------------------------------------------------------------------------------
// Layout invariance: the same values through other strides give bitwise the same gradients
// ------------------------------------------------------------------------------------------------

// q and dout head-major ([batch, heads, seqlen, d] in memory; varlen [heads, total, d]), k / v
// and dk / dv as the two halves of packed [batch, seqlen, 2, heads_kv, d] buffers (as
// flash_attn_kvpacked_func takes and returns them), out and dq with head stride d + 8, 24 extra
// elements per row and 64 per batch (the gaps of dq must keep their poison).
BwdLayout strided_bwd_layout(const FwdCase& c) {
  BwdLayout l;
  l.name = "head-major q / dout, packed kv / dkv, padded out / dq";
  const int64_t d = c.head_dim, hq = c.heads_q, hkv = c.heads_kv;
  const int64_t sq = c.varlen ? c.total_q() : c.seqlen_q;
  const int64_t sk = c.varlen ? c.total_k() : c.seqlen_k;
  const int64_t batches = c.varlen ? 1 : c.batch;
  auto head_major = [&](int buffer) {
    Placement p;
    p.buffer = buffer;
    p.row_stride = d;
    p.head_stride = sq * d;
    p.batch_stride = c.varlen ? 0 : hq * sq * d;
    return p;
  };
  auto packed = [&](int buffer, int half) {
    Placement p;
    p.buffer = buffer;
    p.offset = half * hkv * d;
    p.row_stride = 2 * hkv * d;
    p.head_stride = d;
    p.batch_stride = c.varlen ? 0 : sk * 2 * hkv * d;
    return p;
  };
  auto padded = [&](int buffer) {
    Placement p;
    p.buffer = buffer;
    p.head_stride = d + 8;
    p.row_stride = hq * (d + 8) + 24;
    p.batch_stride = c.varlen ? 0 : sq * p.row_stride + 64;
    return p;
  };
  l.q = head_major(0);
  l.k = packed(1, 0);
  l.v = packed(1, 1);
  l.out = padded(2);
  l.dout = head_major(3);
  l.dq = padded(4);
  l.dk = packed(5, 0);
  l.dv = packed(5, 1);
  const int64_t q_elems = batches * hq * sq * d;
  const int64_t kv_elems = batches * sk * 2 * hkv * d;
  const int64_t padded_elems = batches * (sq * l.out.row_stride + 64);
  l.buffers = {q_elems, kv_elems, padded_elems, q_elems, padded_elems, kv_elems};
  return l;
}

// Runs `c` contiguously and in the strided layout, both deterministic: both must match the
// oracle, and each other bit for bit.
void expect_layout_invariance(const FwdCase& c) {
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(c);
  const BwdOracle oracle = run_bwd_oracle(host);
  const BwdKernelOut dense = run_and_check(host, oracle, contiguous_bwd_layout(c), true);
  const BwdLayout layout = strided_bwd_layout(c);
  SCOPED_TRACE(layout.name);
  const BwdKernelOut strided = run_and_check(host, oracle, layout, true);
  const char* names[3] = {"dq", "dk", "dv"};
  for (int t = 0; t < 3; ++t) {
    int64_t differ = 0;
    for (size_t n = 0; n < dense.grad[t].size(); ++n)
      differ += dense.grad[t][n] != strided.grad[t][n];
    EXPECT_EQ(differ, 0) << names[t] << " elements that differ from the contiguous run";
  }
}

TEST_F(GpuBwdTest, LayoutStridedFixedGqaAlibi) {
  FwdCase c = fixed_case(DType::kFloat16, 64, 6, 2, 2, 113, 239);
  c.alibi = AlibiKind::kPerBatchHead;
  c.name = "stridedFixed";
  c.seed = 101;
  expect_layout_invariance(c);
}

TEST_F(GpuBwdTest, LayoutStridedVarlenCausalSoftcap) {
  FwdCase c = varlen_case(DType::kBFloat16, 96, 8, 2, {33, 1, 0, 200}, {100, 7, 5, 199});
  c.tail_q = 6;
  c.tail_k = 2;
  c.causal = true;
  c.softcap = 30.0f;
  c.q_scale = 10.0f;
  c.name = "stridedVarlen";
  c.seed = 102;
  expect_layout_invariance(c);
}

TEST_F(GpuBwdTest, LayoutStridedHeadDim256Local) {
  FwdCase c = fixed_case(DType::kBFloat16, 256, 4, 1, 1, 203, 97);
  c.window_left = 20;
  c.window_right = 5;
  c.name = "stridedD256";
  c.seed = 103;
  expect_layout_invariance(c);
}

// ------------------------------------------------------------------------------------------------
// Deterministic mode: 50 runs, bitwise equal
// ------------------------------------------------------------------------------------------------

// Many key blocks per query block and several query heads per kv head, so that both the dq
// accumulation over key blocks and the dk / dv sum over the group would show any order dependence.
void expect_deterministic(const FwdCase& c, int runs) {
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(c);
  const BwdOracle oracle = run_bwd_oracle(host);
  DeviceBwdProblem dev(host, contiguous_bwd_layout(c));
  dev.upload(nullptr);
  dev.poison_gradients(nullptr);
  dev.launch(nullptr, true);
  const BwdKernelOut first = dev.download(nullptr);
  report(check_gradients(host, oracle, first));
  for (int run = 1; run < runs; ++run) {
    dev.poison_gradients(nullptr);
    dev.launch(nullptr, true);
    const BwdKernelOut again = dev.download(nullptr);
    for (int t = 0; t < 3; ++t) {
      ASSERT_EQ(std::memcmp(first.grad[t].data(), again.grad[t].data(), first.grad[t].size() * 2),
                0)
          << "run " << run << ": "
          << (t == 0   ? "dq"
              : t == 1 ? "dk"
                       : "dv")
          << " differs from run 0";
    }
  }
}

TEST_F(GpuBwdTest, DeterministicFixedCausalGqa) {
  const int d = built_bwd_head_dim(128);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 8, 2, 2, 1023, 1025);
  c.causal = true;
  c.name = "deterministicFixed";
  c.seed = 201;
  expect_deterministic(c, 50);
}

TEST_F(GpuBwdTest, DeterministicVarlenMqaAlibiSoftcap) {
  const int d = built_bwd_head_dim(64);
  FwdCase c = varlen_case(built_bwd_dtype(d), d, 6, 1, {700, 0, 1, 333}, {1024, 17, 600, 333});
  c.used_k = {1000, 17, 0, 300};
  c.alibi = AlibiKind::kPerHead;
  c.softcap = 30.0f;
  c.q_scale = 10.0f;
  c.name = "deterministicVarlen";
  c.seed = 202;
  expect_deterministic(c, 50);
}

// With dropout: the mask is a function of (seed, offset), so the gradients are too.
TEST_F(GpuBwdTest, DeterministicDropoutVarlenGqaCausal) {
  const int d = built_bwd_head_dim(128);
  FwdCase c = varlen_case(built_bwd_dtype(d), d, 8, 2, {513, 1, 300}, {1025, 33, 300});
  c.causal = true;
  c.dropout = {0.2f, 0xD0D0D0D0D0ULL, 12345};
  c.name = "deterministicDropout";
  c.seed = 203;
  expect_deterministic(c, 50);
}

// The same seed and offset give the same bytes, another seed or offset other gradients, and p = 0
// with any seed and offset is bitwise the call without dropout (deterministic mode, so that dq's
// adds run in one order and all three gradients compare bitwise).
TEST_F(GpuBwdTest, DropoutSeedAndOffsetDecideTheGradients) {
  const int d = built_bwd_head_dim(64);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 4, 4, 2, 300, 517);
  c.dropout = {0.25f, 0x5eed5eed5eedULL, 1000};
  c.name = "dropoutSeedOffset";
  c.seed = 204;
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  auto run = [](const FwdCase& fc) {
    BackwardCase host(fc);
    DeviceBwdProblem dev(host, contiguous_bwd_layout(fc));
    dev.upload(nullptr);
    dev.poison_gradients(nullptr);
    dev.launch(nullptr, true);
    return dev.download(nullptr);
  };
  const BwdKernelOut first = run(c);
  const BwdKernelOut again = run(c);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(first.grad[t], again.grad[t]) << "gradient " << t;
  for (DropoutSpec other : {DropoutSpec{c.dropout.p, c.dropout.seed, c.dropout.offset + 1},
                            DropoutSpec{c.dropout.p, c.dropout.seed + 1, c.dropout.offset}}) {
    FwdCase changed = c;
    changed.dropout = other;
    const BwdKernelOut run_other = run(changed);
    for (int t = 0; t < 3; ++t) {
      EXPECT_NE(run_other.grad[t], first.grad[t]) << "gradient " << t << ", offset "
                                                  << other.offset << ", seed " << other.seed;
    }
  }
  FwdCase zero = c;
  zero.dropout = {0.0f, 12345, 678};
  FwdCase without = c;
  without.dropout = {};
  const BwdKernelOut with_zero = run(zero);
  const BwdKernelOut plain = run(without);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(with_zero.grad[t], plain.grad[t]) << "gradient " << t;
}

// ------------------------------------------------------------------------------------------------
// Element offsets past 2^31
// ------------------------------------------------------------------------------------------------
//
// An offset such as row * row_stride computed in 32 bits lands in the wrong place past 2^31
// elements. As in the forward tests, normal numbers of rows are spread with huge strides (buffers
// of about 4.3 GB, two or three per test), only the rows of the views are copied, and the oracle
// runs on compact host copies of the same values.

constexpr int64_t k2Pow31 = int64_t{1} << 31;

int64_t round_up8(int64_t x) { return (x + 7) / 8 * 8; }

// Runs `layout` when the device has its bytes free with 1 GiB to spare; skips otherwise.
void run_big_layout_case(const FwdCase& c, const BwdLayout& layout) {
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  size_t bytes = 0;
  for (int64_t elems : layout.buffers) bytes += static_cast<size_t>(elems) * 2;
  size_t free_bytes = 0, total_bytes = 0;
  FK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < bytes + (size_t{1} << 30)) {
    GTEST_SKIP() << "needs " << (bytes >> 20) << " MiB of device memory, " << (free_bytes >> 20)
                 << " MiB free";
  }
  BackwardCase host(c);
  const BwdOracle oracle = run_bwd_oracle(host);
  SCOPED_TRACE(layout.name);
  try {
    run_and_check(host, oracle, layout, false);
  } catch (const OutOfMemory& e) {
    GTEST_SKIP() << "out of device memory: " << e.what();
  }
}

// k and dk rows spread so that their last rows start past 2^31 elements (GQA: dk goes through
// the group sum), v and dv heads spread so that head 1 starts past 2^31.
TEST_F(GpuBwdTest, OffsetsPast2Pow31InKeyRowsAndHeads) {
  const int d = built_bwd_head_dim(128);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 4, 2, 1, 77, 1000);
  c.name = "bigKV";
  c.seed = 501;
  BwdLayout l = contiguous_bwd_layout(c);
  l.name = "k / dk row stride > 2^31 / seqlen_k, v / dv head stride > 2^31";
  const int64_t k_row = round_up8((k2Pow31 + c.seqlen_k - 2) / (c.seqlen_k - 1));
  const int64_t v_head = k2Pow31 + 64;
  for (Placement* p : {&l.k, &l.dk}) {
    p->row_stride = k_row;
    p->head_stride = d;
    p->batch_stride = c.seqlen_k * k_row;
    l.buffers[p->buffer] = (c.seqlen_k - 1) * k_row + c.heads_kv * d;
  }
  for (Placement* p : {&l.v, &l.dv}) {
    p->row_stride = d;
    p->head_stride = v_head;
    p->batch_stride = v_head + int64_t{c.seqlen_k} * d;
    l.buffers[p->buffer] = (c.heads_kv - 1) * v_head + int64_t{c.seqlen_k} * d;
  }
  ASSERT_GT((c.seqlen_k - 1) * k_row, k2Pow31);
  run_big_layout_case(c, l);
}

// q, dout and dq of a second batch that starts past 2^31 elements; causal, so the mask offsets
// are exercised too.
TEST_F(GpuBwdTest, OffsetsPast2Pow31InQueryBatches) {
  const int d = built_bwd_head_dim(64);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 3, 1, 2, 113, 239);
  c.causal = true;
  c.name = "bigQ";
  c.seed = 502;
  BwdLayout l = contiguous_bwd_layout(c);
  l.name = "q / dout / dq batch stride > 2^31";
  const int64_t batch_stride = k2Pow31 + 8;
  const int64_t rows = int64_t{c.seqlen_q} * c.heads_q * d;
  for (Placement* p : {&l.q, &l.dout, &l.dq}) {
    p->batch_stride = batch_stride;
    l.buffers[p->buffer] = batch_stride + rows;
  }
  run_big_layout_case(c, l);
}

// ------------------------------------------------------------------------------------------------
// Grid limits: more than 65,535 (batch x heads)
// ------------------------------------------------------------------------------------------------

void run_full_case(const FwdCase& c, bool deterministic) {
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(c);
  const BwdOracle oracle = run_bwd_oracle(host);
  run_and_check(host, oracle, contiguous_bwd_layout(c), deterministic);
}

TEST_F(GpuBwdTest, GridBatch70000) {
  const int d = built_bwd_head_dim(64);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 1, 1, 70000, 9, 17);
  c.causal = true;
  c.name = "batch70000";
  c.seed = 301;
  run_full_case(c, false);
}

TEST_F(GpuBwdTest, GridBatch4500Heads16Deterministic) {
  const int d = built_bwd_head_dim(64);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 16, 4, 4500, 33, 47);
  c.alibi = AlibiKind::kPerBatchHead;
  c.name = "batch4500heads16";
  c.seed = 302;
  run_full_case(c, true);
}

TEST_F(GpuBwdTest, GridVarlenBatch66000) {
  Rng rng(303);
  std::vector<int> lens_q(66000), lens_k(66000);
  for (int& len : lens_q) len = rng.uniform_int(0, 12);
  for (int& len : lens_k) len = rng.uniform_int(0, 12);
  lens_q[0] = lens_k[0] = 12;
  const int d = built_bwd_head_dim(128);
  FwdCase c = varlen_case(built_bwd_dtype(d), d, 2, 1, lens_q, lens_k);
  c.tail_q = 5;
  c.window_left = 4;
  c.window_right = 1;
  c.name = "varlenBatch66000";
  c.seed = 303;
  run_full_case(c, false);
}

// ------------------------------------------------------------------------------------------------
// A created stream
// ------------------------------------------------------------------------------------------------

// Holds a stream for 50 ms from the host. (A host function may not call CUDA; sleeping is fine.)
void CUDART_CB hold_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }

// The poison, the backward and the download run on a created non-blocking stream held for 50 ms
// by a host function; only that stream is synchronized. A launch on another stream (e.g. the
// legacy default stream, which does not wait for non-blocking streams) would run at once, and the
// poison queued behind the hold would then overwrite its gradients. A warm-up run comes first: the
// first launch of a kernel loads its module (lazy loading waits for the whole device), and the
// first size query allocates the workspace.
void expect_stream_run(const FwdCase& c, bool deterministic) {
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(c);
  const BwdOracle oracle = run_bwd_oracle(host);
  Stream stream;
  DeviceBwdProblem dev(host, contiguous_bwd_layout(c));
  dev.upload(stream.get());
  dev.poison_gradients(stream.get());
  dev.launch(stream.get(), deterministic);
  dev.download(stream.get());
  FK_CUDA_CHECK(cudaLaunchHostFunc(stream.get(), hold_stream, nullptr));
  dev.poison_gradients(stream.get());
  dev.launch(stream.get(), deterministic);
  report(check_gradients(host, oracle, dev.download(stream.get()), dev.gaps_written()));
  FK_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST_F(GpuBwdTest, NonDefaultStreamFixed) {
  const int d = built_bwd_head_dim(128);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 6, 2, 2, 1023, 1023);
  c.causal = true;
  c.name = "streamFixed";
  c.seed = 601;
  expect_stream_run(c, false);
}

TEST_F(GpuBwdTest, NonDefaultStreamVarlenDeterministic) {
  const int d = built_bwd_head_dim(64);
  FwdCase c = varlen_case(built_bwd_dtype(d), d, 4, 1, {100, 0, 239, 17}, {239, 5, 239, 0});
  c.tail_q = 4;
  c.alibi = AlibiKind::kPerHead;
  c.name = "streamVarlen";
  c.seed = 602;
  expect_stream_run(c, true);
}

// ------------------------------------------------------------------------------------------------
// Errors on real device memory
// ------------------------------------------------------------------------------------------------

FwdCase small_built_case() {
  const int d = built_bwd_head_dim(64);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 4, 2, 2, 65, 97);
  c.causal = true;
  c.name = "small";
  c.seed = 401;
  return c;
}

// A workspace below the size query's answer, or none, is refused before any launch: the gradients
// keep their poison. Then the same call with the right workspace works.
TEST_F(GpuBwdTest, WorkspaceTooSmallIsRefusedAndTheNextCallWorks) {
  const FwdCase c = small_built_case();
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(c);
  DeviceBwdProblem dev(host, contiguous_bwd_layout(c));
  dev.upload(nullptr);
  dev.poison_gradients(nullptr);
  for (bool deterministic : {false, true}) {
    MhaBwdParams p = dev.fixed_params(deterministic);
    const size_t required = mha_bwd_workspace_size(p);
    if (required == 0) continue;
    DeviceBuffer scratch(required);
    p.workspace = scratch.get();
    p.workspace_bytes = required - 1;
    const std::string needs = "but this call needs " + std::to_string(required) + " bytes";
    EXPECT_ERROR_MENTIONS(mha_bwd(p), "mha_bwd: workspace_bytes is", needs.c_str());
    p.workspace = nullptr;
    p.workspace_bytes = 0;
    EXPECT_ERROR_MENTIONS(mha_bwd(p), "mha_bwd: workspace is null; this call needs");
    p.workspace = scratch.bytes_ptr() + 128;
    p.workspace_bytes = required;
    EXPECT_ERROR_MENTIONS(mha_bwd(p), "is not 256-byte aligned");
  }
  const BwdKernelOut untouched = dev.download(nullptr);
  for (const std::vector<uint16_t>& grad : untouched.grad) {
    for (uint16_t bits : grad) ASSERT_EQ(bits, kPoison16) << "written by a refused call";
  }
  dev.launch(nullptr, false);
  const BwdOracle oracle = run_bwd_oracle(host);
  report(check_gradients(host, oracle, dev.download(nullptr)));
}

TEST_F(GpuBwdTest, BadInputIsRefusedBeforeALaunch) {
  const FwdCase c = small_built_case();
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(c);
  DeviceBwdProblem dev(host, contiguous_bwd_layout(c));
  dev.upload(nullptr);
  dev.poison_gradients(nullptr);
  MhaBwdParams p = dev.fixed_params(false);
  MhaBwdParams bad = p;
  bad.dk.dtype = c.dtype == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dk.dtype is");
  bad = p;
  bad.dq.data = p.q.data;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dq.data", "is also q.data");
  bad = p;
  bad.dv.data = static_cast<char*>(p.dv.data) + 2;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dv.data", "16-byte aligned");
  const BwdKernelOut untouched = dev.download(nullptr);
  for (const std::vector<uint16_t>& grad : untouched.grad) {
    for (uint16_t bits : grad) ASSERT_EQ(bits, kPoison16) << "written by a refused call";
  }
}

// A (dtype, head dim) without a backward kernel in this build: refused with the rebuild flags.
TEST_F(GpuBwdTest, UnbuiltBackwardKernelIsRejected) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int d = 8; d <= 256; d += 8) {
      if (cuda_bwd_built(dtype, d)) continue;
      FwdCase c = fixed_case(dtype, d, 2, 2, 1, 17, 17);
      c.name = "unbuilt";
      c.seed = 402;
      BackwardCase host(c);
      DeviceBwdProblem dev(host, contiguous_bwd_layout(c));
      dev.upload(nullptr);
      EXPECT_ERROR_MENTIONS(dev.launch(nullptr, false), "does not include the CUDA backward kernel",
                            "rebuild with");
      return;
    }
  }
  GTEST_SKIP() << "this build has every backward (dtype, head dim)";
}

// Whether FLASHKIT_BWD_PATH=sm90 can run (dtype, head dim) here (either mode): a compute
// capability 9.0 device and the sm90 backward of its family (64, 128 or 256) in this build.
bool sm90_bwd_runs([[maybe_unused]] DType dtype, int head_dim) {
  cudaDeviceProp prop;
  FK_CUDA_CHECK(cudaGetDeviceProperties(&prop, current_device()));
  // A head dim runs in its sm80 family; sm90 has 64, 128 and 256 of them (bwd_sm90.h).
  [[maybe_unused]] const int family = sm80::fwd_head_dim_family(head_dim);
  bool built = false;
#define FLASHKIT_SM90_BWD_INSTANCE(kDType, kFamily) \
  built = built || (dtype == DType::kDType && family == kFamily);
  FLASHKIT_SM90_BWD_INSTANCES
#undef FLASHKIT_SM90_BWD_INSTANCE
  return built && prop.major == 9 && prop.minor == 0;
}

// Each forced path, in the default and in deterministic mode, either runs and matches the oracle
// or, where it cannot run, is refused with an error naming FLASHKIT_BWD_PATH before any launch; an
// unknown path is refused the same way.
TEST_F(GpuBwdTest, ForcedBwdPaths) {
  const int d = built_bwd_head_dim(64);
  FwdCase c = fixed_case(built_bwd_dtype(d), d, 4, 2, 2, 65, 97);
  c.causal = true;
  c.name = "forcedPath";
  c.seed = 403;
  if (const std::string why = bwd_case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  BackwardCase host(c);
  const BwdOracle oracle = run_bwd_oracle(host);
  DeviceBwdProblem dev(host, contiguous_bwd_layout(c));
  dev.upload(nullptr);
  for (const bool deterministic : {false, true}) {
    for (const char* path : {"sm80", "sm90", "auto", "sm75"}) {
      SCOPED_TRACE(std::string(path) + (deterministic ? " deterministic" : ""));
      const ScopedEnv forced("FLASHKIT_BWD_PATH", path);
      const std::string name(path);
      const bool runs =
          name == "sm80" || name == "auto" || (name == "sm90" && sm90_bwd_runs(c.dtype, c.head_dim));
      dev.poison_gradients(nullptr);
      if (runs) {
        dev.launch(nullptr, deterministic);
        report(check_gradients(host, oracle, dev.download(nullptr)));
      } else {
        EXPECT_ERROR_MENTIONS(dev.launch(nullptr, deterministic), "FLASHKIT_BWD_PATH");
      }
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    }
  }
}

}  // namespace
}  // namespace flashkit::test
