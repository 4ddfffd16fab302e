// tests/cpp/test_validation_bwd.cpp
// \brief Every bad input of mha_bwd / mha_varlen_bwd (and of their workspace size queries) raises
// flashkit::Error whose message names the function, the argument and the value it got; what the
// validated BwdProblem holds; the workspace rules; and the library works for the next call after an
// error.
//
// Views labelled DeviceKind::kCuda here point at host memory: every call that gets one is rejected
// by validation (or, in a build without CUDA, by dispatch) before any CUDA runtime call.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "api/validate_bwd.h"
#include "attention_case.h"
#include "build_config.h"
#include "expect_error.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {
namespace {

constexpr Device kCuda0{DeviceKind::kCuda, 0};

// fp16, batch 2, 5 queries, 7 keys, 4 query heads over 2 kv heads, head dim 16.
FwdCase fixed_case() {
  FwdCase s;
  s.dtype = DType::kFloat16;
  s.batch = 2;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 16;
  s.seqlen_q = 5;
  s.seqlen_k = 7;
  s.seed = 42;
  return s;
}

// 3 sequences, one without queries, one whose keys are not used at all (seqused_k 0).
FwdCase varlen_case() {
  FwdCase s = fixed_case();
  s.varlen = true;
  s.batch = 3;
  s.lens_q = {3, 0, 5};
  s.lens_k = {4, 2, 6};
  s.used_k = {4, 2, 0};
  return s;
}

void label_all_cuda(BwdCommon& p) {
  for (TensorView* view :
       {&p.q, &p.k, &p.v, &p.out, &p.softmax_lse, &p.alibi_slopes, &p.dout, &p.dq, &p.dk, &p.dv}) {
    view->device = kCuda0;
  }
}

class MhaBwdValidation : public ::testing::Test {
 protected:
  BackwardCase c{fixed_case()};
  MhaBwdParams p = c.bwd_params();
};

class MhaVarlenBwdValidation : public ::testing::Test {
 protected:
  BackwardCase c{varlen_case()};
  MhaVarlenBwdParams p = c.varlen_bwd_params();
};

// ---- the gradient tensors ----

TEST_F(MhaBwdValidation, TheValidCaseRuns) { EXPECT_NO_THROW(mha_bwd(p)); }

TEST_F(MhaBwdValidation, UndefinedGradientsAreNamed) {
  const std::pair<const char*, TensorView MhaBwdParams::*> required[] = {
      {"mha_bwd: dout is undefined", &MhaBwdParams::dout},
      {"mha_bwd: dq is undefined", &MhaBwdParams::dq},
      {"mha_bwd: dk is undefined", &MhaBwdParams::dk},
      {"mha_bwd: dv is undefined", &MhaBwdParams::dv}};
  for (const auto& [message, member] : required) {
    MhaBwdParams bad = p;
    bad.*member = TensorView{};
    EXPECT_ERROR_MENTIONS(mha_bwd(bad), message);
  }
}

// The forward's arguments go through the forward's checks, under the backward's name.
TEST_F(MhaBwdValidation, ForwardArgumentsAreCheckedUnderTheBackwardsName) {
  MhaBwdParams bad = p;
  bad.out = TensorView{};
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: out is undefined");
  bad = p;
  bad.k.dtype = DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: k.dtype is bfloat16 but q.dtype is float16");
  bad = p;
  bad.softmax_lse = make_view(c.lse.data(), DType::kFloat32, {2, 5, 4}, Device{});
  EXPECT_ERROR_MENTIONS(mha_bwd(bad),
                        "mha_bwd: softmax_lse has shape [2, 5, 4]; expected [2, 4, 5]");
  bad = p;
  bad.softcap = -1.0f;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: softcap is -1");
  bad = p;
  bad.mask.window_left = -3;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: mask.window_left is -3");
}

TEST_F(MhaBwdValidation, GradientDtypesMustMatchQ) {
  const std::pair<const char*, TensorView MhaBwdParams::*> gradients[] = {
      {"mha_bwd: dout.dtype is bfloat16 but q.dtype is float16", &MhaBwdParams::dout},
      {"mha_bwd: dq.dtype is bfloat16 but q.dtype is float16", &MhaBwdParams::dq},
      {"mha_bwd: dk.dtype is bfloat16 but q.dtype is float16", &MhaBwdParams::dk},
      {"mha_bwd: dv.dtype is bfloat16 but q.dtype is float16", &MhaBwdParams::dv}};
  for (const auto& [message, member] : gradients) {
    MhaBwdParams bad = p;
    (bad.*member).dtype = DType::kBFloat16;
    EXPECT_ERROR_MENTIONS(mha_bwd(bad), message);
  }
}

TEST_F(MhaBwdValidation, GradientsMustBeOnTheDeviceOfQ) {
  MhaBwdParams bad = p;
  bad.dq.device = kCuda0;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dq is on cuda:0 but q is on cpu");
  bad = p;
  bad.dout.device = kCuda0;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dout is on cuda:0 but q is on cpu");
  bad = p;
  label_all_cuda(bad);
  bad.dv.device = Device{DeviceKind::kCuda, 1};
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dv is on cuda:1 but q is on cuda:0");
}

TEST_F(MhaBwdValidation, GradientShapesFollowTheirTensors) {
  MhaBwdParams bad = p;
  bad.dout = make_view(c.dout.data(), DType::kFloat16, {2, 5, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_bwd(bad),
                        "mha_bwd: dout has shape [2, 5, 2, 16]; expected [2, 5, 4, 16] (the shape "
                        "of q)");
  bad = p;
  bad.dq = make_view(c.dq.data(), DType::kFloat16, {2, 4, 4, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "dq has shape [2, 4, 4, 16]; expected [2, 5, 4, 16]");
  bad = p;
  bad.dk = make_view(c.dk.data(), DType::kFloat16, {2, 7, 4, 8}, Device{});
  EXPECT_ERROR_MENTIONS(mha_bwd(bad),
                        "dk has shape [2, 7, 4, 8]; expected [2, 7, 2, 16] (the shape of k)");
  bad = p;
  bad.dv = make_view(c.dv.data(), DType::kFloat16, {14, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "dv has shape [14, 2, 16]; expected [2, 7, 2, 16]");
}

TEST_F(MhaBwdValidation, GradientLastDimMustBeContiguous) {
  c.dq.resize(c.dq.size() * 2);
  p.dq =
      make_strided_view(c.dq.data(), DType::kFloat16, {2, 5, 4, 16}, {640, 128, 32, 2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_bwd(p), "mha_bwd: dq.stride(-1) is 2", "stride 1");
}

TEST_F(MhaBwdValidation, GradientPointersMustBeSetAndElementAligned) {
  MhaBwdParams bad = p;
  bad.dout.data = nullptr;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dout.data is null");
  bad = p;
  bad.dk.data = reinterpret_cast<char*>(c.dk.data()) + 1;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "dk.data", "not aligned to its 2-byte float16");
}

TEST_F(MhaBwdValidation, CudaGradientsMustBe16ByteAligned) {
  label_all_cuda(p);
  MhaBwdParams bad = p;
  bad.dq.data = c.dq.data() + 1;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dq.data", "is not 16-byte aligned");
  bad = p;
  bad.dout.data = c.dout.data() + 4;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dout.data", "is not 16-byte aligned");
  bad = p;
  c.dv.resize(2 * 7 * 2 * 20);
  bad.dv = make_strided_view(c.dv.data(), DType::kFloat16, {2, 7, 2, 16}, {280, 40, 20, 1}, kCuda0);
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "dv.stride(2) is 20", "multiple of 8 elements");
}

TEST_F(MhaBwdValidation, GradientsMustNotShareMemoryWithInputsOrEachOther) {
  MhaBwdParams bad = p;
  bad.dq.data = p.q.data;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "mha_bwd: dq.data", "is also q.data", "memory of its own");
  bad = p;
  bad.dv.data = p.dk.data;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "dk.data", "is also dv.data");
  bad = p;
  bad.dq.data = p.dout.data;
  EXPECT_ERROR_MENTIONS(mha_bwd(bad), "dq.data", "is also dout.data");
  for (uint16_t bits : c.dq) ASSERT_EQ(bits, nan_bits(DType::kFloat16)) << "written before failing";
}

TEST_F(MhaBwdValidation, DropoutRunsOnTheCpuBackend) {
  p.dropout = {0.1f, 3, 4};
  EXPECT_NO_THROW(mha_bwd(p));
  p.dropout.p = 1.0f;
  EXPECT_ERROR_MENTIONS(mha_bwd(p), "mha_bwd: dropout.p is 1", "must be in [0, 1)");
}

// ---- the problem ----

TEST_F(MhaBwdValidation, TheProblemHoldsTheForwardProblemAndTheGradients) {
  c.in.alibi.assign(8, 0.1f);
  p.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {2, 4}, Device{});
  p.mask.causal = true;
  p.deterministic = true;
  std::vector<uint8_t> scratch(512);
  p.workspace = scratch.data();
  p.workspace_bytes = scratch.size();
  const BwdProblem problem = api::validate_mha_bwd(p);
  EXPECT_EQ(problem.fwd.q, c.in.q.data());
  EXPECT_EQ(problem.fwd.out, c.out.data());
  EXPECT_EQ(problem.fwd.lse, c.lse.data());
  EXPECT_EQ(problem.fwd.window_right, 0);
  EXPECT_TRUE(problem.fwd.causal);
  EXPECT_FLOAT_EQ(problem.fwd.softmax_scale, 0.25f);
  EXPECT_EQ(problem.fwd.alibi_batch_stride, 4);
  EXPECT_EQ(problem.dout, c.dout.data());
  EXPECT_EQ(problem.dq, c.dq.data());
  EXPECT_EQ(problem.dk, c.dk.data());
  EXPECT_EQ(problem.dv, c.dv.data());
  EXPECT_EQ(problem.dout_batch_stride, 5 * 4 * 16);
  EXPECT_EQ(problem.dq_row_stride, 4 * 16);
  EXPECT_EQ(problem.dq_head_stride, 16);
  EXPECT_EQ(problem.dk_batch_stride, 7 * 2 * 16);
  EXPECT_EQ(problem.dv_row_stride, 2 * 16);
  EXPECT_EQ(problem.dv_head_stride, 16);
  EXPECT_EQ(problem.total_q, 10);
  EXPECT_EQ(problem.total_k, 14);
  EXPECT_TRUE(problem.deterministic);
  EXPECT_EQ(problem.workspace, scratch.data());
  EXPECT_EQ(problem.workspace_bytes, 512u);
}

// ---- the workspace ----

TEST_F(MhaBwdValidation, TheCpuBackendNeedsNoWorkspace) {
  EXPECT_EQ(mha_bwd_workspace_size(p), 0u);
  std::vector<uint8_t> scratch(3);
  p.workspace = scratch.data() + 1;  // any pointer and size will do when none is needed
  p.workspace_bytes = 2;
  EXPECT_NO_THROW(mha_bwd(p));
}

TEST_F(MhaBwdValidation, ANullWorkspaceMustHaveZeroBytes) {
  p.workspace_bytes = 64;
  EXPECT_ERROR_MENTIONS(mha_bwd(p), "mha_bwd: workspace is null but workspace_bytes is 64");
}

// The rules a backend that needs a workspace applies (the CUDA one, with its size).
TEST_F(MhaBwdValidation, AWorkspaceMustBeLargeEnoughAndAligned) {
  alignas(256) static uint8_t scratch[8192];
  const char* fn = "mha_bwd";
  const char* query = "mha_bwd_workspace_size";
  BwdProblem problem = api::validate_mha_bwd(p);
  EXPECT_ERROR_MENTIONS(api::check_bwd_workspace(fn, query, problem, 4096),
                        "mha_bwd: workspace is null; this call needs 4096 bytes",
                        "mha_bwd_workspace_size(params)");
  problem.workspace = scratch;
  problem.workspace_bytes = 4000;
  EXPECT_ERROR_MENTIONS(api::check_bwd_workspace(fn, query, problem, 4096),
                        "mha_bwd: workspace_bytes is 4000 but this call needs 4096 bytes");
  problem.workspace = scratch + 128;
  problem.workspace_bytes = 4096;
  EXPECT_ERROR_MENTIONS(api::check_bwd_workspace(fn, query, problem, 4096), "mha_bwd: workspace",
                        "is not 256-byte aligned");
  problem.workspace = scratch;
  EXPECT_NO_THROW(api::check_bwd_workspace(fn, query, problem, 4096));
  problem.workspace = nullptr;
  problem.workspace_bytes = 0;
  EXPECT_NO_THROW(api::check_bwd_workspace(fn, query, problem, 0));
}

TEST_F(MhaBwdValidation, TheSizeQueryValidatesUnderItsOwnName) {
  MhaBwdParams bad = p;
  bad.dk = TensorView{};
  EXPECT_ERROR_MENTIONS(mha_bwd_workspace_size(bad), "mha_bwd_workspace_size: dk is undefined");
  bad = p;
  bad.q.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(mha_bwd_workspace_size(bad), "mha_bwd_workspace_size: q.dtype is float32");
}

// ---- after an error ----

TEST_F(MhaBwdValidation, TheNextValidCallWorksAfterAnError) {
  MhaBwdParams bad = p;
  bad.dv.dtype = DType::kBFloat16;
  EXPECT_THROW(mha_bwd(bad), Error);
  for (const std::vector<uint16_t>* grad : {&c.dq, &c.dk, &c.dv}) {
    for (uint16_t bits : *grad) ASSERT_EQ(bits, nan_bits(DType::kFloat16)) << "written";
  }
  ASSERT_NO_THROW(mha_bwd(p));
  for (const std::vector<uint16_t>* grad : {&c.dq, &c.dk, &c.dv}) {
    for (uint16_t bits : *grad) ASSERT_FALSE(std::isnan(bits_to_float(DType::kFloat16, bits)));
  }
}

// ---- CUDA dispatch without touching a GPU ----

#ifndef FLASHKIT_WITH_CUDA
TEST_F(MhaBwdValidation, CudaViewsNeedACudaBuild) {
  label_all_cuda(p);
  EXPECT_ERROR_MENTIONS(mha_bwd(p), "mha_bwd:", "has no CUDA kernels (configured without nvcc)");
  EXPECT_ERROR_MENTIONS(mha_bwd_workspace_size(p),
                        "mha_bwd_workspace_size:", "has no CUDA kernels");
  EXPECT_FALSE(cuda_bwd_built(DType::kBFloat16, 128));
}
#else
// A (dtype, head dim) without a backward kernel in this build is refused before any device call,
// by the call and by the size query.
TEST_F(MhaBwdValidation, ABackwardKernelLeftOutOfTheBuildIsRefused) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int head_dim = 8; head_dim <= 256; head_dim += 8) {
      if (cuda_bwd_built(dtype, head_dim)) continue;
      FwdCase s = fixed_case();
      s.dtype = dtype;
      s.head_dim = head_dim;
      BackwardCase missing(s);
      MhaBwdParams params = missing.bwd_params();
      label_all_cuda(params);
      EXPECT_ERROR_MENTIONS(mha_bwd(params),
                            "mha_bwd:", "does not include the CUDA backward kernel", "rebuild with",
                            "(built: head dims " FLASHKIT_BUILT_HEAD_DIMS);
      EXPECT_ERROR_MENTIONS(mha_bwd_workspace_size(params),
                            "mha_bwd_workspace_size:", "does not include the CUDA backward kernel");
      return;
    }
  }
  GTEST_SKIP() << "this build includes every backward (dtype, head dim)";
}
#endif

TEST(CudaBwdBuiltQuery, InvalidHeadDimsAreNeverBuilt) {
  for (int head_dim : {0, -8, 12, 264}) {
    EXPECT_FALSE(cuda_bwd_built(DType::kBFloat16, head_dim)) << head_dim;
  }
}

// ---- varlen ----

TEST_F(MhaVarlenBwdValidation, TheValidCaseRuns) {
  EXPECT_EQ(mha_varlen_bwd_workspace_size(p), 0u);
  EXPECT_NO_THROW(mha_varlen_bwd(p));
}

TEST_F(MhaVarlenBwdValidation, VarlenArgumentsAreCheckedUnderTheBackwardsName) {
  MhaVarlenBwdParams bad = p;
  bad.cu_seqlens_k = TensorView{};
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(bad), "mha_varlen_bwd: cu_seqlens_k is undefined");
  bad = p;
  bad.max_seqlen_q = -1;
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(bad), "mha_varlen_bwd: max_seqlen_q is -1");
  bad = p;
  bad.cu_seqlens_q.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd_workspace_size(bad),
                        "mha_varlen_bwd_workspace_size: cu_seqlens_q.dtype is float32");
}

TEST_F(MhaVarlenBwdValidation, CpuPrefixSumsAreChecked) {
  c.in.cu_k = {0, 4, 3, 12};
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(p), "mha_varlen_bwd: cu_seqlens_k[2] = 3 is less than");
  c.in.cu_k = {0, 4, 6, 12};
  c.in.used_k = {4, 3, 0};
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(p), "mha_varlen_bwd: seqused_k[1] is 3", "[0, 2]");
}

// With seqused_k, max_seqlen_k must bound the stored key lengths as well: their dk / dv rows are
// all written.
TEST_F(MhaVarlenBwdValidation, MaxSeqlenKMustBoundTheStoredKeyLengths) {
  p.max_seqlen_k = 5;  // every used length (4, 2, 0) fits; sequence 2 stores 6 keys
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(p),
                        "mha_varlen_bwd: sequence 2 stores 6 keys (cu_seqlens_k) but max_seqlen_k "
                        "is 5",
                        "must bound the lengths in cu_seqlens_k");
}

TEST_F(MhaVarlenBwdValidation, PackedGradientsFollowThePackedTensors) {
  MhaVarlenBwdParams bad = p;
  bad.dq = make_view(c.dq.data(), DType::kFloat16, {7, 4, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(bad),
                        "mha_varlen_bwd: dq has shape [7, 4, 16]; expected [8, 4, 16]");
  bad = p;
  bad.dk = make_view(c.dk.data(), DType::kFloat16, {1, 12, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(bad), "dk has shape [1, 12, 2, 16]; expected [12, 2, 16]");
}

TEST_F(MhaVarlenBwdValidation, TheProblemHasNoBatchStridesAndThePackedRowCounts) {
  const BwdProblem problem = api::validate_mha_varlen_bwd(p);
  EXPECT_TRUE(problem.fwd.is_varlen());
  EXPECT_EQ(problem.fwd.batch, 3);
  EXPECT_EQ(problem.fwd.seqused_k, c.in.used_k.data());
  EXPECT_EQ(problem.dq_batch_stride, 0);
  EXPECT_EQ(problem.dk_batch_stride, 0);
  EXPECT_EQ(problem.dout_batch_stride, 0);
  EXPECT_EQ(problem.dq_row_stride, 4 * 16);
  EXPECT_EQ(problem.dv_row_stride, 2 * 16);
  EXPECT_EQ(problem.total_q, 8);
  EXPECT_EQ(problem.total_k, 12);
}

TEST_F(MhaVarlenBwdValidation, CudaGradientsMustBe16ByteAligned) {
  label_all_cuda(p);
  p.cu_seqlens_q.device = p.cu_seqlens_k.device = p.seqused_k.device = kCuda0;
  p.dk.data = c.dk.data() + 2;
  EXPECT_ERROR_MENTIONS(mha_varlen_bwd(p), "mha_varlen_bwd: dk.data", "16-byte aligned");
}

// FLASHKIT_DEBUG=1 names the backend of a backward call. The switch is read once per process, so
// the test reruns this binary (/proc/self/exe) with the variable set, for the one call below.
TEST(BwdDebugSwitch, NamesTheBackend) {
  char self[4096] = {0};
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(length, 0) << "cannot find this test binary";
  const std::string command = std::string("FLASHKIT_DEBUG=1 '") + self +
                              "' --gtest_filter=BwdDebugSwitch.OneCpuCall 2>&1 | "
                              "grep -q 'flashkit: mha_bwd: cpu reference backend'";
  EXPECT_EQ(std::system(command.c_str()), 0) << "no debug line on stderr with FLASHKIT_DEBUG=1";
}

// One valid CPU call; the child process of BwdDebugSwitch.NamesTheBackend runs only this.
TEST(BwdDebugSwitch, OneCpuCall) {
  BackwardCase c(fixed_case());
  mha_bwd(c.bwd_params());
}

}  // namespace
}  // namespace flashkit::test
