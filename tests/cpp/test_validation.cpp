// tests/cpp/test_validation.cpp
// \brief Every bad input of mha_fwd / mha_varlen_fwd raises flashkit::Error whose message names the
// function, the argument and the value it got; the defaults validation resolves; and the library
// works for the next call after an error.
//
// Views labelled DeviceKind::kCuda here point at host memory. That is safe on any machine only
// because each such call is rejected by validation, which runs before any CUDA runtime call: every
// test that builds one makes sure the call fails validation (or, in a build without CUDA, fails
// dispatch before touching a device).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "api/validate_fwd.h"
#include "attention_case.h"
#include "build_config.h"
#include "expect_error.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {
namespace {

constexpr Device kCuda0{DeviceKind::kCuda, 0};

// A valid fixed-length problem: fp16, batch 2, 5 queries, 7 keys, 4 query heads over 2 kv heads,
// head dim 16.
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

// A valid varlen batch of 3 sequences, one of them with no query.
FwdCase varlen_case() {
  FwdCase s = fixed_case();
  s.varlen = true;
  s.batch = 3;
  s.lens_q = {3, 0, 5};
  s.lens_k = {4, 2, 6};
  return s;
}

// Moves every tensor of the params onto cuda:0 (the host pointers stay; nothing dereferences them
// as long as validation rejects the call).
void label_all_cuda(FwdCommon& p) {
  for (TensorView* view : {&p.q, &p.k, &p.v, &p.out, &p.softmax_lse, &p.alibi_slopes}) {
    view->device = kCuda0;
  }
}

class MhaFwdValidation : public ::testing::Test {
 protected:
  AttentionCase c{fixed_case()};
  MhaFwdParams p = c.fwd_params();
};

class MhaVarlenFwdValidation : public ::testing::Test {
 protected:
  AttentionCase c{varlen_case()};
  MhaVarlenFwdParams p = c.varlen_params();
};

// ---- presence, dtype, device ----

TEST_F(MhaFwdValidation, TheValidCaseRuns) { EXPECT_NO_THROW(mha_fwd(p)); }

TEST_F(MhaFwdValidation, UndefinedTensorsAreNamed) {
  const std::pair<const char*, TensorView MhaFwdParams::*> required[] = {
      {"mha_fwd: q is undefined", &MhaFwdParams::q},
      {"mha_fwd: k is undefined", &MhaFwdParams::k},
      {"mha_fwd: v is undefined", &MhaFwdParams::v},
      {"mha_fwd: out is undefined", &MhaFwdParams::out},
      {"mha_fwd: softmax_lse is undefined", &MhaFwdParams::softmax_lse}};
  for (const auto& [message, member] : required) {
    MhaFwdParams bad = p;
    bad.*member = TensorView{};
    EXPECT_ERROR_MENTIONS(mha_fwd(bad), message);
  }
}

TEST_F(MhaFwdValidation, QDtypeMustBeFp16OrBf16) {
  p.q.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "mha_fwd: q.dtype is float32", "float16, bfloat16");
}

TEST_F(MhaFwdValidation, KVAndOutDtypesMustMatchQ) {
  MhaFwdParams bad = p;
  bad.k.dtype = DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "k.dtype is bfloat16 but q.dtype is float16");
  bad = p;
  bad.v.dtype = DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "v.dtype is bfloat16 but q.dtype is float16");
  bad = p;
  bad.out.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "out.dtype is float32 but q.dtype is float16");
}

TEST_F(MhaFwdValidation, LseMustBeFp32) {
  p.softmax_lse.dtype = DType::kFloat16;
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "softmax_lse.dtype is float16", "float32");
}

TEST_F(MhaFwdValidation, AllTensorsMustBeOnOneDevice) {
  MhaFwdParams bad = p;
  bad.k.device = kCuda0;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "k is on cuda:0 but q is on cpu");
  bad = p;
  bad.out.device = Device{DeviceKind::kCuda, 1};
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "out is on cuda:1 but q is on cpu");
  bad = p;
  label_all_cuda(bad);
  bad.softmax_lse.device = Device{DeviceKind::kCuda, 1};
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "softmax_lse is on cuda:1 but q is on cuda:0");
  bad = p;
  label_all_cuda(bad);
  for (TensorView* view : {&bad.q, &bad.k, &bad.v, &bad.out, &bad.softmax_lse}) {
    view->device.index = -1;
  }
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "q.device is cuda:-1");
}

TEST_F(MhaFwdValidation, AlibiMustBeOnTheDeviceOfQ) {
  c.in.alibi.assign(4, 0.1f);
  p.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {4}, kCuda0);
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "alibi_slopes is on cuda:0 but q is on cpu");
}

// ---- ranks, sizes, shapes ----

TEST_F(MhaFwdValidation, RanksMustBeFour) {
  MhaFwdParams bad = p;
  bad.q = make_view(c.in.q.data(), DType::kFloat16, {10, 4, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "q has rank 3", "expected rank 4");
  bad = p;
  bad.k = make_view(c.in.k.data(), DType::kFloat16, {14, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "k has rank 3", "[batch, seqlen_k, heads_kv, head_dim]");
}

TEST_F(MhaFwdValidation, BatchMustBePositive) {
  p.q = make_view(c.in.q.data(), DType::kFloat16, {0, 5, 4, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "batch (q.size(0)) is 0");
}

TEST_F(MhaFwdValidation, HeadDimMustBeAMultipleOf8UpTo256) {
  for (int64_t head_dim : {12, 264, 0}) {
    MhaFwdParams bad = p;
    bad.q = make_view(c.in.q.data(), DType::kFloat16, {2, 5, 4, head_dim}, Device{});
    const std::string value = "head_dim (q.size(-1)) is " + std::to_string(head_dim);
    EXPECT_ERROR_MENTIONS(mha_fwd(bad), value.c_str(), "a multiple of 8 from 8 to 256");
  }
}

TEST_F(MhaFwdValidation, QueryHeadsMustBeAMultipleOfKvHeads) {
  p.k = make_view(c.in.k.data(), DType::kFloat16, {2, 7, 3, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "q has 4 heads and k has 3", "multiple of heads_kv");
}

TEST_F(MhaFwdValidation, ShapesMustMatchAndNameTheExpectedShape) {
  MhaFwdParams bad = p;
  bad.k = make_view(c.in.k.data(), DType::kFloat16, {1, 7, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "k has shape [1, 7, 2, 16]; expected [2, 7, 2, 16]");
  bad = p;
  bad.v = make_view(c.in.v.data(), DType::kFloat16, {2, 6, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "v has shape [2, 6, 2, 16]; expected [2, 7, 2, 16]");
  bad = p;
  bad.out = make_view(c.out.data(), DType::kFloat16, {2, 5, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "out has shape [2, 5, 2, 16]; expected [2, 5, 4, 16]");
  bad = p;
  bad.softmax_lse = make_view(c.lse.data(), DType::kFloat32, {2, 5, 4}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "softmax_lse has shape [2, 5, 4]; expected [2, 4, 5]");
}

// ---- strides and pointers ----

TEST_F(MhaFwdValidation, LastDimMustBeContiguous) {
  MhaFwdParams bad = p;
  bad.q =
      make_strided_view(c.in.q.data(), DType::kFloat16, {2, 5, 4, 8}, {320, 64, 16, 2}, Device{});
  bad.out =
      make_strided_view(c.out.data(), DType::kFloat16, {2, 5, 4, 8}, {320, 64, 16, 2}, Device{});
  bad.k =
      make_strided_view(c.in.k.data(), DType::kFloat16, {2, 7, 2, 8}, {224, 32, 16, 2}, Device{});
  bad.v =
      make_strided_view(c.in.v.data(), DType::kFloat16, {2, 7, 2, 8}, {224, 32, 16, 2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "q.stride(-1) is 2", "stride 1");
}

TEST_F(MhaFwdValidation, LseLastDimMustBeContiguous) {
  c.lse.resize(c.lse.size() * 2);
  p.softmax_lse =
      make_strided_view(c.lse.data(), DType::kFloat32, {2, 4, 5}, {40, 10, 2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "softmax_lse.stride(-1) is 2");
}

TEST_F(MhaFwdValidation, DataPointersMustBeSetAndElementAligned) {
  MhaFwdParams bad = p;
  bad.v.data = nullptr;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "v.data is null");
  bad = p;
  bad.softmax_lse.data = reinterpret_cast<char*>(c.lse.data()) + 2;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "softmax_lse.data", "not aligned to its 4-byte float32");
}

TEST_F(MhaFwdValidation, CudaPointersMustBe16ByteAligned) {
  label_all_cuda(p);
  MhaFwdParams bad = p;
  bad.q.data = c.in.q.data() + 1;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "q.data", "is not 16-byte aligned");
  bad = p;
  bad.v.data = c.in.v.data() + 4;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "v.data", "is not 16-byte aligned");
}

TEST_F(MhaFwdValidation, CudaStridesMustBeMultiplesOf8Elements) {
  label_all_cuda(p);
  c.in.q.resize(2 * 5 * 4 * 20);
  p.q = make_strided_view(c.in.q.data(), DType::kFloat16, {2, 5, 4, 16}, {400, 80, 20, 1}, kCuda0);
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "q.stride(2) is 20", "multiple of 8 elements");
}

// CPU views are read element by element: no alignment beyond the element's own is needed.
TEST_F(MhaFwdValidation, CpuViewsMayHaveAnyStridesAndOffsets) {
  mha_fwd(p);
  const std::vector<uint16_t> expected = c.out;
  // q and out shifted by one element, with a head stride of 17.
  std::vector<uint16_t> q(1 + 2 * 5 * 4 * 17), out(q.size(), nan_bits(DType::kFloat16));
  for (int64_t t = 0; t < 10; ++t) {
    for (int h = 0; h < 4; ++h) {
      for (int e = 0; e < 16; ++e) q[1 + (t * 4 + h) * 17 + e] = c.in.q[c.q_index(t, h, e)];
    }
  }
  p.q = make_strided_view(q.data() + 1, DType::kFloat16, {2, 5, 4, 16}, {340, 68, 17, 1}, Device{});
  p.out =
      make_strided_view(out.data() + 1, DType::kFloat16, {2, 5, 4, 16}, {340, 68, 17, 1}, Device{});
  ASSERT_NO_THROW(mha_fwd(p));
  for (int64_t t = 0; t < 10; ++t) {
    for (int h = 0; h < 4; ++h) {
      for (int e = 0; e < 16; ++e) {
        ASSERT_EQ(out[1 + (t * 4 + h) * 17 + e], expected[c.q_index(t, h, e)]);
      }
    }
  }
}

// ---- ALiBi ----

TEST_F(MhaFwdValidation, AlibiMustBeFp32) {
  std::vector<uint16_t> slopes(4);
  p.alibi_slopes = make_view(slopes.data(), DType::kFloat16, {4}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "alibi_slopes.dtype is float16", "float32");
}

TEST_F(MhaFwdValidation, AlibiShapeMustBeHeadsOrBatchByHeads) {
  c.in.alibi.assign(16, 0.25f);
  MhaFwdParams ok = p;
  ok.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {4}, Device{});
  EXPECT_NO_THROW(mha_fwd(ok));
  ok.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {2, 4}, Device{});
  EXPECT_NO_THROW(mha_fwd(ok));

  MhaFwdParams bad = p;
  bad.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {3}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "alibi_slopes has shape [3]",
                        "expected [heads_q] = [4] or [batch, heads_q] = [2, 4]");
  bad.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {4, 2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "alibi_slopes has shape [4, 2]");
}

TEST_F(MhaFwdValidation, AlibiLastDimMustBeContiguous) {
  c.in.alibi.assign(16, 0.25f);
  p.alibi_slopes = make_strided_view(c.in.alibi.data(), DType::kFloat32, {2, 4}, {8, 2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "alibi_slopes.stride(-1) is 2");
}

// ---- scalars ----

TEST_F(MhaFwdValidation, SoftcapMustBeFiniteAndNonNegative) {
  for (float softcap : {-1.0f, std::nanf(""), INFINITY}) {
    MhaFwdParams bad = p;
    bad.softcap = softcap;
    EXPECT_ERROR_MENTIONS(mha_fwd(bad), "mha_fwd: softcap is", "finite and >= 0");
  }
  MhaFwdParams bad = p;
  bad.softcap = -1.0f;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "softcap is -1");
}

TEST_F(MhaFwdValidation, SoftmaxScaleMustBeFiniteAndNonNegative) {
  MhaFwdParams bad = p;
  bad.softmax_scale = -0.5f;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "softmax_scale is -0.5", "finite and >= 0");
  bad.softmax_scale = std::nanf("");
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "softmax_scale is nan");
}

TEST_F(MhaFwdValidation, WindowSidesMustBeAtLeastMinusOne) {
  MhaFwdParams bad = p;
  bad.mask.window_left = -2;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "mask.window_left is -2", "-1 for unbounded");
  bad = p;
  bad.mask.window_right = -5;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "mask.window_right is -5");
}

TEST_F(MhaFwdValidation, DropoutProbabilityMustBeInZeroOne) {
  for (float prob : {1.0f, -0.1f, std::nanf("")}) {
    MhaFwdParams bad = p;
    bad.dropout.p = prob;
    EXPECT_ERROR_MENTIONS(mha_fwd(bad), "dropout.p is", "must be in [0, 1)");
  }
}

TEST_F(MhaFwdValidation, DropoutInZeroOneIsAccepted) {
  p.dropout = {0.1f, 12345, 678};
  EXPECT_NO_THROW(mha_fwd(p));
  const FwdProblem problem = api::validate_mha_fwd(p, "mha_fwd");
  EXPECT_EQ(problem.dropout_p, 0.1f);
  EXPECT_EQ(problem.dropout_seed, 12345u);
  EXPECT_EQ(problem.dropout_offset, 678u);
}

// A device rng_state is for the kernels: CPU views take the key on the host. With p = 0 it is unused.
TEST_F(MhaFwdValidation, DeviceRngStateIsRefusedWithCpuTensors) {
  const int64_t key[2] = {12345, 678};
  p.dropout = {0.1f, 0, 0, key};
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "dropout.rng_state is set", "CPU tensors", "dropout.seed");
  p.dropout.p = 0.0f;
  EXPECT_NO_THROW(mha_fwd(p));
  EXPECT_EQ(api::validate_mha_fwd(p, "mha_fwd").dropout_rng_state, nullptr);
}

// The public length rule that front ends size S_dmask with (and the check below enforces).
TEST(AttnProbsLength, RoundsUpToMultiplesOf128) {
  EXPECT_EQ(attn_probs_length(0), 0);
  EXPECT_EQ(attn_probs_length(-5), 0);
  EXPECT_EQ(attn_probs_length(1), 128);
  EXPECT_EQ(attn_probs_length(128), 128);
  EXPECT_EQ(attn_probs_length(129), 256);
  EXPECT_EQ(attn_probs_length(int64_t{1} << 40), int64_t{1} << 40);
}

// attn_probs (return_softmax): [batch, heads_q, round128(seqlen_q), round128(seqlen_k)] of q's
// dtype and device, last dim contiguous.
TEST_F(MhaFwdValidation, AttnProbsShapeDtypeAndLayout) {
  std::vector<uint16_t> probs(2 * 4 * 128 * 128);
  const Device cpu{};
  p.attn_probs = make_view(probs.data(), DType::kFloat16, {2, 4, 128, 128}, cpu);
  EXPECT_NO_THROW(mha_fwd(p));
  const FwdProblem problem = api::validate_mha_fwd(p, "mha_fwd");
  EXPECT_EQ(problem.attn_probs, probs.data());
  EXPECT_EQ(problem.attn_probs_rows, 128);
  EXPECT_EQ(problem.attn_probs_cols, 128);
  EXPECT_EQ(problem.attn_probs_row_stride, 128);

  MhaFwdParams bad = p;
  bad.attn_probs = make_view(probs.data(), DType::kFloat16, {2, 4, 5, 7}, cpu);
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "attn_probs has shape [2, 4, 5, 7]", "[2, 4, 128, 128]",
                        "rounded up to a multiple of 128");
  bad = p;
  bad.attn_probs.dtype = DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "attn_probs");
  bad = p;
  bad.attn_probs = make_view(probs.data(), DType::kFloat16, {2, 4, 128 * 128}, cpu);
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "attn_probs");
  bad = p;
  bad.attn_probs.strides[3] = 2;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "attn_probs");
  bad = p;
  bad.attn_probs.device = kCuda0;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "attn_probs");
  bad = p;
  bad.attn_probs.data = p.out.data;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "attn_probs.data", "is also out.data");
}

TEST_F(MhaVarlenFwdValidation, AttnProbsAreSizedByTheRoundedMaxima) {
  std::vector<uint16_t> probs(3 * 4 * 128 * 128);
  const Device cpu{};
  p.attn_probs = make_view(probs.data(), DType::kFloat16, {3, 4, 128, 128}, cpu);
  EXPECT_NO_THROW(mha_varlen_fwd(p));
  MhaVarlenFwdParams bad = p;
  bad.attn_probs = make_view(probs.data(), DType::kFloat16, {3, 4, 128, 256}, cpu);
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "attn_probs has shape [3, 4, 128, 256]");
}

// ---- outputs that share memory with inputs ----

// out written over k (or v) corrupts the keys other rows still read: with 300 rows a head runs as
// several tasks on the CPU backend, and before the check more than half of out came back wrong
// (on CUDA, CTAs race the same way). FlashAttention does not check it either; flashkit refuses the
// view passed twice, as it does for attn_probs and the backward's gradients.
TEST(MhaFwdAliasing, OutOverKOrVOrLseIsRefused) {
  FwdCase s = fixed_case();
  s.heads_kv = s.heads_q;
  s.seqlen_q = s.seqlen_k = 300;
  AttentionCase c(s);
  const MhaFwdParams p = c.fwd_params();
  MhaFwdParams bad = p;
  bad.out.data = p.k.data;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "mha_fwd: out.data", "is also k.data", "it may be q");
  bad = p;
  bad.out.data = p.v.data;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "out.data", "is also v.data");
  bad = p;
  bad.out.data = p.softmax_lse.data;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "out.data", "is also softmax_lse.data");
  bad = p;
  bad.softmax_lse.data = p.q.data;
  EXPECT_ERROR_MENTIONS(mha_fwd(bad), "softmax_lse.data", "is also q.data");
}

// out == q (an in-place forward) is fine, as in FlashAttention: each query row is read before its
// own output row is written. The result is that of separate buffers.
TEST(MhaFwdAliasing, InPlaceOutOverQGivesTheSameResult) {
  FwdCase s = fixed_case();
  s.seqlen_q = s.seqlen_k = 300;
  AttentionCase separate(s);
  mha_fwd(separate.fwd_params());
  AttentionCase in_place(s);
  MhaFwdParams p = in_place.fwd_params();
  p.out.data = p.q.data;
  ASSERT_NO_THROW(mha_fwd(p));
  EXPECT_EQ(in_place.in.q, separate.out);
  EXPECT_EQ(in_place.lse, separate.lse);
}

// ... but not with attn_probs: the CUDA backend recomputes the probabilities from q after the
// forward kernel has written out (src/cuda/sm80/fwd_attn_probs.cuh), so an in-place call got
// probabilities of the output rows on CUDA and the right ones on the CPU.
TEST(MhaFwdAliasing, InPlaceOutOverQIsRefusedWithAttnProbs) {
  AttentionCase c(fixed_case());
  MhaFwdParams p = c.fwd_params();
  std::vector<uint16_t> probs(2 * 4 * 128 * 128);
  p.attn_probs = make_view(probs.data(), DType::kFloat16, {2, 4, 128, 128}, Device{});
  p.out.data = p.q.data;
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "out.data", "is also q.data with attn_probs");
}

TEST(MhaFwdAliasing, TheVarlenForwardChecksToo) {
  AttentionCase c(varlen_case());
  MhaVarlenFwdParams p = c.varlen_params();
  p.out.data = p.k.data;
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "mha_varlen_fwd: out.data", "is also k.data");
}

// ---- views whose element count overflows ----

// numel() of sizes multiplying past 2^63 wrapped (to exactly 0 for [2^20, 2^20, 2^16, 256]), and a
// view with no elements skips the pointer and alignment checks: a null (or misaligned) CUDA
// k_cache passed validation and reached the decode kernel. The count now saturates.
TEST(TensorViewNumel, SaturatesInsteadOfWrapping) {
  const TensorView huge =
      make_view(nullptr, DType::kFloat16, {1 << 20, 1 << 20, 1 << 16, 256}, Device{});
  EXPECT_EQ(huge.numel(), INT64_MAX);
  EXPECT_EQ(make_view(nullptr, DType::kFloat16, {1 << 20, 0, 1 << 16, 256}, Device{}).numel(), 0);
  EXPECT_EQ(make_view(nullptr, DType::kFloat16, {3, 5, 7, 8}, Device{}).numel(), 3 * 5 * 7 * 8);

  alignas(16) static uint16_t fake[64];
  MhaFwdKvcacheParams p;
  p.q = make_view(fake, DType::kFloat16, {1, 1, 1 << 16, 256}, kCuda0);
  p.out = make_view(fake + 16, DType::kFloat16, {1, 1, 1 << 16, 256}, kCuda0);
  p.softmax_lse = make_view(fake + 32, DType::kFloat32, {1, 1 << 16, 1}, kCuda0);
  p.k_cache = make_view(nullptr, DType::kFloat16, {1 << 20, 1 << 20, 1 << 16, 256}, kCuda0);
  p.v_cache = make_view(fake + 48, DType::kFloat16, {1 << 20, 1 << 20, 1 << 16, 256}, kCuda0);
  p.cache_seqlen = 1;
  p.num_splits = 1;
  EXPECT_ERROR_MENTIONS(mha_fwd_kvcache(p), "k_cache.data is null");
}

// A CPU view with another device index was refused as "k is on cpu but q is on cpu".
TEST_F(MhaFwdValidation, ADeviceMismatchBetweenCpuIndicesIsNamed) {
  p.k.device.index = 1;
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "k is on cpu:1 but q is on cpu");
}

// ---- defaults ----

TEST_F(MhaFwdValidation, SoftmaxScaleDefaultsToInverseSqrtHeadDim) {
  EXPECT_FLOAT_EQ(api::validate_mha_fwd(p).softmax_scale, 0.25f);
  p.softmax_scale = 0.7f;
  EXPECT_FLOAT_EQ(api::validate_mha_fwd(p).softmax_scale, 0.7f);
}

TEST_F(MhaFwdValidation, CausalIsWindowRightZero) {
  p.mask = MaskSpec{true, -1, 3};
  FwdProblem problem = api::validate_mha_fwd(p);
  EXPECT_EQ(problem.window_left, -1);
  EXPECT_EQ(problem.window_right, 0);
  EXPECT_TRUE(problem.causal);

  p.mask = MaskSpec{true, 2, -1};
  problem = api::validate_mha_fwd(p);
  EXPECT_EQ(problem.window_left, 2);
  EXPECT_EQ(problem.window_right, 0);
  EXPECT_FALSE(problem.causal) << "a left window makes the mask local, not causal";
}

TEST_F(MhaFwdValidation, WindowSidesReachingSeqlenKBecomeUnbounded) {
  p.mask = MaskSpec{false, 7, 6};  // seqlen_k is 7
  FwdProblem problem = api::validate_mha_fwd(p);
  EXPECT_EQ(problem.window_left, -1);
  EXPECT_EQ(problem.window_right, 6);
  p.mask = MaskSpec{false, 6, 100};
  problem = api::validate_mha_fwd(p);
  EXPECT_EQ(problem.window_left, 6);
  EXPECT_EQ(problem.window_right, -1);
}

TEST(MhaFwdDefaults, OneQueryRowWithoutAlibiDropsCausal) {
  FwdCase s = fixed_case();
  s.seqlen_q = 1;
  s.causal = true;
  AttentionCase c(s);
  MhaFwdParams p = c.fwd_params();
  FwdProblem problem = api::validate_mha_fwd(p);
  EXPECT_FALSE(problem.causal);
  EXPECT_EQ(problem.window_right, -1);

  c.in.alibi.assign(4, 0.3f);
  p.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {4}, Device{});
  problem = api::validate_mha_fwd(p);
  EXPECT_TRUE(problem.causal);
  EXPECT_EQ(problem.window_right, 0);
}

TEST_F(MhaFwdValidation, StridesAndPointersReachTheProblem) {
  c.in.alibi.assign(8, 0.1f);
  p.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {2, 4}, Device{});
  const FwdProblem problem = api::validate_mha_fwd(p);
  EXPECT_EQ(problem.dtype, DType::kFloat16);
  EXPECT_EQ(problem.batch, 2);
  EXPECT_EQ(problem.seqlen_q, 5);
  EXPECT_EQ(problem.seqlen_k, 7);
  EXPECT_EQ(problem.heads_q, 4);
  EXPECT_EQ(problem.heads_kv, 2);
  EXPECT_EQ(problem.head_dim, 16);
  EXPECT_EQ(problem.q, c.in.q.data());
  EXPECT_EQ(problem.out, c.out.data());
  EXPECT_EQ(problem.q_batch_stride, 5 * 4 * 16);
  EXPECT_EQ(problem.q_row_stride, 4 * 16);
  EXPECT_EQ(problem.q_head_stride, 16);
  EXPECT_EQ(problem.k_batch_stride, 7 * 2 * 16);
  EXPECT_EQ(problem.v_row_stride, 2 * 16);
  EXPECT_EQ(problem.out_head_stride, 16);
  EXPECT_EQ(problem.lse_batch_stride, 4 * 5);
  EXPECT_EQ(problem.lse_head_stride, 5);
  EXPECT_EQ(problem.alibi_batch_stride, 4);
  EXPECT_FALSE(problem.is_varlen());
}

// ---- after an error ----

TEST_F(MhaFwdValidation, TheNextValidCallWorksAfterAnError) {
  MhaFwdParams bad = p;
  bad.k.dtype = DType::kBFloat16;
  EXPECT_THROW(mha_fwd(bad), Error);
  for (uint16_t bits : c.out)
    ASSERT_EQ(bits, nan_bits(DType::kFloat16)) << "written before failing";
  ASSERT_NO_THROW(mha_fwd(p));
  for (uint16_t bits : c.out) ASSERT_FALSE(std::isnan(bits_to_float(DType::kFloat16, bits)));
}

// ---- CUDA dispatch without touching a GPU ----

#ifndef FLASHKIT_WITH_CUDA
TEST_F(MhaFwdValidation, CudaViewsNeedACudaBuild) {
  label_all_cuda(p);  // valid views: this build rejects them at dispatch, before any device call
  EXPECT_ERROR_MENTIONS(mha_fwd(p), "mha_fwd:", "has no CUDA kernels (configured without nvcc)");
  EXPECT_FALSE(cuda_head_dim_built(64));
  EXPECT_FALSE(cuda_fwd_built(DType::kBFloat16, 128));
}
#else
// A (dtype, head dim) this build left out is refused before any device call; needs a build that
// leaves one out (e.g. the dev preset).
TEST_F(MhaFwdValidation, AKernelLeftOutOfTheBuildIsRefused) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int head_dim = 8; head_dim <= 256; head_dim += 8) {
      if (cuda_fwd_built(dtype, head_dim)) continue;
      FwdCase s = fixed_case();
      s.dtype = dtype;
      s.head_dim = head_dim;
      AttentionCase missing(s);
      MhaFwdParams params = missing.fwd_params();
      label_all_cuda(params);
      EXPECT_ERROR_MENTIONS(mha_fwd(params), "does not include the CUDA forward kernel",
                            "rebuild with", "(built: head dims " FLASHKIT_BUILT_HEAD_DIMS);
      return;
    }
  }
  GTEST_SKIP() << "this build includes every (dtype, head dim)";
}
#endif

TEST(CudaBuiltQueries, InvalidHeadDimsAreNeverBuilt) {
  for (int head_dim : {0, -8, 12, 264}) {
    EXPECT_FALSE(cuda_head_dim_built(head_dim)) << head_dim;
    EXPECT_FALSE(cuda_fwd_built(DType::kBFloat16, head_dim)) << head_dim;
  }
}

// ---- varlen ----

TEST_F(MhaVarlenFwdValidation, TheValidCaseRuns) { EXPECT_NO_THROW(mha_varlen_fwd(p)); }

TEST_F(MhaVarlenFwdValidation, CuSeqlensAreRequired) {
  MhaVarlenFwdParams bad = p;
  bad.cu_seqlens_q = TensorView{};
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "mha_varlen_fwd: cu_seqlens_q is undefined");
  bad = p;
  bad.cu_seqlens_k = TensorView{};
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "mha_varlen_fwd: cu_seqlens_k is undefined");
}

TEST_F(MhaVarlenFwdValidation, CuSeqlensMustBeInt32) {
  MhaVarlenFwdParams bad = p;
  bad.cu_seqlens_q.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "cu_seqlens_q.dtype is float32", "int32");
  bad = p;
  bad.cu_seqlens_k.dtype = DType::kFloat16;
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "cu_seqlens_k.dtype is float16", "int32");
}

TEST_F(MhaVarlenFwdValidation, CuSeqlensMustBeOnTheDeviceOfQ) {
  p.cu_seqlens_k.device = kCuda0;
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "cu_seqlens_k is on cuda:0 but q is on cpu");
}

TEST_F(MhaVarlenFwdValidation, CuSeqlensMustBeOneDimensionalAndContiguous) {
  MhaVarlenFwdParams bad = p;
  bad.cu_seqlens_q = make_view(c.in.cu_q.data(), DType::kInt32, {2, 2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "cu_seqlens_q has rank 2", "[batch + 1]");
  bad = p;
  std::vector<int32_t> spread(8);
  bad.cu_seqlens_k = make_strided_view(spread.data(), DType::kInt32, {4}, {2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "cu_seqlens_k", "has stride 2", "must be contiguous");
}

TEST_F(MhaVarlenFwdValidation, CuSeqlensShapesMustBeBatchPlusOne) {
  MhaVarlenFwdParams bad = p;
  bad.cu_seqlens_k = make_view(c.in.cu_k.data(), DType::kInt32, {3}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "cu_seqlens_k has shape [3] but cu_seqlens_q has [4]");
  bad = p;
  bad.cu_seqlens_q = make_view(c.in.cu_q.data(), DType::kInt32, {1}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "cu_seqlens_q has shape [1]", "batch >= 1");
}

TEST_F(MhaVarlenFwdValidation, SequsedKMustBeContiguousInt32OfShapeBatch) {
  std::vector<int32_t> used = {1, 1, 1, 1, 1, 1};
  MhaVarlenFwdParams bad = p;
  bad.seqused_k = make_view(used.data(), DType::kFloat32, {3}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "seqused_k.dtype is float32", "int32");
  bad.seqused_k = make_view(used.data(), DType::kInt32, {2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "seqused_k has shape [2]; expected [3]");
  bad.seqused_k = make_strided_view(used.data(), DType::kInt32, {3}, {2}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "seqused_k", "must be contiguous");
  bad.seqused_k = make_view(used.data(), DType::kInt32, {3}, kCuda0);
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "seqused_k is on cuda:0 but q is on cpu");
  MhaVarlenFwdParams ok = p;
  ok.seqused_k = make_view(used.data(), DType::kInt32, {3}, Device{});
  EXPECT_NO_THROW(mha_varlen_fwd(ok));
}

TEST_F(MhaVarlenFwdValidation, MaxSeqlensMustBeNonNegative) {
  MhaVarlenFwdParams bad = p;
  bad.max_seqlen_q = -1;
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "max_seqlen_q is -1");
  bad = p;
  bad.max_seqlen_k = -3;
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "max_seqlen_k is -3");
}

TEST_F(MhaVarlenFwdValidation, PackedTensorsHaveRankThree) {
  p.q = make_view(c.in.q.data(), DType::kFloat16, {1, 8, 4, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "q has rank 4", "[total_q, heads_q, head_dim]");
}

TEST_F(MhaVarlenFwdValidation, OutMustMatchTheTokensAndHeadsOfQ) {
  MhaVarlenFwdParams bad = p;
  bad.out = make_view(c.out.data(), DType::kFloat16, {7, 4, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "out has shape [7, 4, 16]; expected [8, 4, 16]");
  bad.out = make_view(c.out.data(), DType::kFloat16, {8, 2, 16}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(bad), "out has shape [8, 2, 16]; expected [8, 4, 16]");
}

TEST_F(MhaVarlenFwdValidation, LseIsBatchByHeadsByMaxSeqlenQ) {
  c.lse.resize(3 * 4 * 6);
  p.softmax_lse = make_view(c.lse.data(), DType::kFloat32, {3, 4, 6}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "softmax_lse has shape [3, 4, 6]; expected [3, 4, 5]",
                        "[batch, heads_q, max_seqlen_q]");
}

TEST_F(MhaVarlenFwdValidation, AlibiBatchComesFromCuSeqlens) {
  c.in.alibi.assign(12, 0.2f);
  MhaVarlenFwdParams ok = p;
  ok.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {3, 4}, Device{});
  EXPECT_NO_THROW(mha_varlen_fwd(ok));
  p.alibi_slopes = make_view(c.in.alibi.data(), DType::kFloat32, {2, 4}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "alibi_slopes has shape [2, 4]", "[3, 4]");
}

// On the CPU the prefix sums are host memory the reference indexes with: they are checked.
TEST_F(MhaVarlenFwdValidation, CpuPrefixSumsAreCheckedAgainstTheTensors) {
  c.in.cu_q = {0, 3, 2, 8};
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "cu_seqlens_q[2] = 2 is less than cu_seqlens_q[1] = 3",
                        "nondecreasing");
  c.in.cu_q = {0, 3, 3, 9};
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "cu_seqlens_q[3] is 9", "q.size(0) (total_q) is 8");
  c.in.cu_q = {0, 1, 1, 8};  // sequence 2 has 7 queries; max_seqlen_q is 5
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "sequence 2 has 7 query tokens", "max_seqlen_q is 5");
  c.in.cu_q = {0, 3, 3, 8};
  c.in.cu_k = {-1, 4, 6, 12};
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "cu_seqlens_k[0] is -1");
  c.in.cu_k = {0, 4, 6, 12};
  std::vector<int32_t> used = {4, 3, 0};
  p.seqused_k = make_view(used.data(), DType::kInt32, {3}, Device{});
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "seqused_k[1] is 3", "[0, 2]");
  p.max_seqlen_k = 5;  // sequence 0 uses 4 keys, sequence 2 stores 6 but uses 0
  used = {4, 2, 0};
  EXPECT_NO_THROW(mha_varlen_fwd(p));
  used = {4, 2, 6};
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "sequence 2 uses 6 keys but max_seqlen_k is 5");
}

TEST_F(MhaVarlenFwdValidation, TheProblemHasNoBatchStridesAndTheMaxSeqlens) {
  const FwdProblem problem = api::validate_mha_varlen_fwd(p);
  EXPECT_TRUE(problem.is_varlen());
  EXPECT_EQ(problem.batch, 3);
  EXPECT_EQ(problem.seqlen_q, 5);
  EXPECT_EQ(problem.seqlen_k, 6);
  EXPECT_EQ(problem.q_batch_stride, 0);
  EXPECT_EQ(problem.k_batch_stride, 0);
  EXPECT_EQ(problem.v_batch_stride, 0);
  EXPECT_EQ(problem.out_batch_stride, 0);
  EXPECT_EQ(problem.q_row_stride, 4 * 16);
  EXPECT_EQ(problem.k_row_stride, 2 * 16);
  EXPECT_EQ(problem.lse_batch_stride, 4 * 5);
  EXPECT_EQ(problem.cu_seqlens_q, c.in.cu_q.data());
  EXPECT_EQ(problem.seqused_k, nullptr);
}

TEST_F(MhaVarlenFwdValidation, WindowDefaultsResolveAgainstMaxSeqlenK) {
  p.mask = MaskSpec{false, 6, 5};  // max_seqlen_k is 6
  const FwdProblem problem = api::validate_mha_varlen_fwd(p);
  EXPECT_EQ(problem.window_left, -1);
  EXPECT_EQ(problem.window_right, 5);
}

TEST_F(MhaVarlenFwdValidation, CudaPointersMustBe16ByteAligned) {
  label_all_cuda(p);
  p.cu_seqlens_q.device = p.cu_seqlens_k.device = kCuda0;
  p.out.data = c.out.data() + 2;
  EXPECT_ERROR_MENTIONS(mha_varlen_fwd(p), "mha_varlen_fwd: out.data", "16-byte aligned");
}

TEST_F(MhaVarlenFwdValidation, TheNextValidCallWorksAfterAnError) {
  MhaVarlenFwdParams bad = p;
  bad.max_seqlen_q = -1;
  EXPECT_THROW(mha_varlen_fwd(bad), Error);
  ASSERT_NO_THROW(mha_varlen_fwd(p));
  for (int64_t n = 0; n < c.in.cu_q.back() * 4 * 16; ++n) {
    ASSERT_FALSE(std::isnan(bits_to_float(DType::kFloat16, c.out[n])));
  }
}

// FLASHKIT_DEBUG=1 names the backend a call ran on. The switch is read once per process, so the
// test reruns this binary (/proc/self/exe) with the variable set, for the one call below.
TEST(DebugSwitch, NamesTheBackend) {
  char self[4096] = {0};
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(length, 0) << "cannot find this test binary";
  const std::string command = std::string("FLASHKIT_DEBUG=1 '") + self +
                              "' --gtest_filter=DebugSwitch.OneCpuCall 2>&1 | "
                              "grep -q 'flashkit: mha_fwd: cpu reference backend'";
  EXPECT_EQ(std::system(command.c_str()), 0) << "no debug line on stderr with FLASHKIT_DEBUG=1";
}

// One valid CPU call; the child process of DebugSwitch.NamesTheBackend runs only this.
TEST(DebugSwitch, OneCpuCall) {
  AttentionCase c(fixed_case());
  mha_fwd(c.fwd_params());
}

}  // namespace
}  // namespace flashkit::test
