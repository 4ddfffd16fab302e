// tests/cpp/test_gpu_dropout.cpp
// \brief Dropout in the CUDA forward (mha_fwd / mha_varlen_fwd with dropout.p > 0) against the CPU
// oracle, which regenerates the Philox mask from the same seed and offset; the return_softmax
// output (attn_probs) against the CPU backend's, bit for bit in the signs (the mask) and the zeros,
// to the dtype's rounding in the magnitudes; seed / offset semantics; p = 0 bitwise identical to
// the call without dropout. The backward with dropout is tested in test_gpu_bwd.cpp (Dropout/*).
//
// The suites:
//   Grid/*            dtype x head dim (40 ... 256) x mask (none, causal, local, ALiBi, softcap)
//                     x GQA (6/6, 6/2, 6/1) x {fixed, varlen} x odd lengths x p in {0.1, 0.5}:
//                     out and lse by the error-ratio rule of DESIGN.md, attn_probs checked too
//                     (a call with attn_probs runs the sm80 kernel), and again without attn_probs
//                     on the automatic path (the sm90 kernel on Hopper where it covers the case)
//   GpuDropoutTest.*  determinism, offsets and seeds, a key in device memory (rng_state), p = 0,
//                     the kept fraction of a large tile
//
// The oracle runs on the whole problem, not on the (batch, head) pieces of run_oracle: a piece is
// renumbered to batch 0, head 0, and the mask is addressed by batch * heads_q + head.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/reference_common.h"
#include "flashkit/flashkit.h"
#include "gpu_case_builders.h"
#include "gpu_test_util.h"

namespace flashkit::test {
namespace {

// ------------------------------------------------------------------------------------------------
// Running a case with dropout
// ------------------------------------------------------------------------------------------------

int64_t rounded_128(int64_t n) { return (n + 127) / 128 * 128; }

int64_t probs_elems(const FwdCase& c) {
  return int64_t{c.batch} * c.heads_q * rounded_128(c.max_len_q()) * rounded_128(c.max_len_k());
}

// The fp64 and input-dtype oracles of the whole problem, with the case's dropout.
Oracle run_dropout_oracle(const FwdCase& c, const HostInputs& in) {
  using flashkit::cpu::RefPrecision;
  Oracle o;
  o.items = all_items(c);  // (b, h) in the order reference_fwd_fp32 lays its blocks out
  o.rows = c.lse_rows();
  const size_t out_elems = o.items.size() * static_cast<size_t>(o.rows) * c.head_dim;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  o.ref_out.assign(out_elems, nan);
  o.low_out.assign(out_elems, nan);
  o.ref_lse.assign(o.items.size() * o.rows, nan);
  o.low_lse.assign(o.items.size() * o.rows, nan);
  FwdProblem full = host_problem(c, in);
  full.dropout_p = c.dropout.p;
  full.dropout_seed = c.dropout.seed;
  full.dropout_offset = c.dropout.offset;
  flashkit::cpu::reference_fwd_fp32(full, RefPrecision::kExact, o.ref_out.data(), o.ref_lse.data());
  flashkit::cpu::reference_fwd_fp32(full, RefPrecision::kInputDtype, o.low_out.data(),
                                    o.low_lse.data());
  for (float& x : o.low_out) {
    if (std::isfinite(x)) x = flashkit::round_to(c.dtype, x);
  }
  return o;
}

struct DropoutRun {
  KernelOut kernel;
  std::vector<uint16_t> probs;  // attn_probs, when asked for
  int64_t out_gaps_written = 0;
};

// Runs the case on the GPU (contiguous layout, outputs and attn_probs poisoned with NaN) with the
// case's dropout, writing attn_probs when `with_probs`.
DropoutRun run_on_gpu(const FwdCase& c, const HostInputs& in, bool with_probs,
                      cudaStream_t stream = nullptr) {
  DeviceProblem dev(c, in, contiguous_layout(c));
  DeviceBuffer probs(with_probs ? static_cast<size_t>(probs_elems(c)) * 2 : 0);
  dev.upload(stream);
  dev.poison_outputs(stream);
  probs.poison(stream);
  const std::initializer_list<int64_t> probs_shape = {
      c.batch, c.heads_q, rounded_128(c.max_len_q()), rounded_128(c.max_len_k())};
  auto attach = [&](flashkit::FwdCommon& f) {
    f.dropout = c.dropout;
    if (with_probs)
      f.attn_probs = flashkit::make_view(probs.get(), c.dtype, probs_shape, dev.device());
  };
  if (c.varlen) {
    flashkit::MhaVarlenFwdParams params = dev.varlen_params();
    attach(params);
    flashkit::mha_varlen_fwd(params, stream);
  } else {
    flashkit::MhaFwdParams params = dev.fixed_params();
    attach(params);
    flashkit::mha_fwd(params, stream);
  }
  FK_CUDA_CHECK(cudaGetLastError());
  DropoutRun run;
  run.kernel = dev.download(stream);
  run.out_gaps_written = dev.out_gaps_written();
  if (with_probs) {
    run.probs.resize(static_cast<size_t>(probs_elems(c)));
    FK_CUDA_CHECK(
        cudaMemcpy(run.probs.data(), probs.get(), run.probs.size() * 2, cudaMemcpyDeviceToHost));
  }
  return run;
}

// attn_probs of the CPU backend on the same inputs: exact probabilities rounded to the dtype, signs
// from the host's Philox.
std::vector<uint16_t> cpu_attn_probs(const FwdCase& c) {
  AttentionCase host(c);
  std::vector<uint16_t> probs(static_cast<size_t>(probs_elems(c)), nan_bits(c.dtype));
  const TensorView view = flashkit::make_view(
      probs.data(), c.dtype,
      {c.batch, c.heads_q, rounded_128(c.max_len_q()), rounded_128(c.max_len_k())}, Device{});
  if (c.varlen) {
    MhaVarlenFwdParams params = host.varlen_params();
    params.attn_probs = view;
    mha_varlen_fwd(params);
  } else {
    MhaFwdParams params = host.fwd_params();
    params.attn_probs = view;
    mha_fwd(params);
  }
  return probs;
}

// The kernel's attn_probs against the CPU backend's, element by element of the rounded tensor:
// outside the visible pairs (padding rows and columns, masked keys, rows past a sequence) both are
// exactly +0; on a visible pair the sign bits (the dropout mask) are identical and the magnitudes
// agree within two units in the last place of the dtype plus 1e-6 (the kernel recomputes
// exp(s - lse) in fp32 with its own lse and flushes denormals; the CPU rounds the exact value).
void expect_probs_match(const FwdCase& c, const HostInputs& in, const std::vector<uint16_t>& gpu,
                        const std::vector<uint16_t>& cpu) {
  ASSERT_EQ(gpu.size(), cpu.size());
  const FwdProblem p = host_problem(c, in);
  const std::vector<flashkit::cpu::Sequence> sequences = flashkit::cpu::sequences_of(p, "test");
  const int64_t rows = rounded_128(c.max_len_q()), cols = rounded_128(c.max_len_k());
  const double ulp = c.dtype == DType::kBFloat16 ? 0x1p-8 : 0x1p-11;
  int64_t bad_zero = 0, bad_sign = 0, bad_value = 0, dropped = 0, visible = 0;
  std::string first_bad;
  auto note = [&](int64_t& counter, size_t n, const char* what) {
    if (counter++ == 0 && first_bad.empty()) {
      std::ostringstream os;
      os << what << " at element " << n << ": kernel 0x" << std::hex << gpu[n] << ", cpu 0x"
         << cpu[n];
      first_bad = os.str();
    }
  };
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads_q; ++h) {
      for (int64_t i = 0; i < rows; ++i) {
        const flashkit::cpu::KeyRange range = i < sequences[b].len_q
                                                  ? flashkit::cpu::allowed_keys(p, sequences[b], i)
                                                  : flashkit::cpu::KeyRange{0, 0};
        for (int64_t j = 0; j < cols; ++j) {
          const size_t n =
              static_cast<size_t>(((int64_t{b} * c.heads_q + h) * rows + i) * cols + j);
          if (j < range.first || j >= range.end) {
            if (gpu[n] != 0 || cpu[n] != 0) note(bad_zero, n, "not +0 outside the visible keys");
            continue;
          }
          ++visible;
          dropped += (cpu[n] & 0x8000) != 0;
          if ((gpu[n] & 0x8000) != (cpu[n] & 0x8000)) note(bad_sign, n, "dropout bit differs");
          const double a = std::fabs(bits_to_float(c.dtype, gpu[n]));
          const double e = std::fabs(bits_to_float(c.dtype, cpu[n]));
          if (!(std::fabs(a - e) <= 2 * ulp * e + 1e-6)) note(bad_value, n, "probability differs");
        }
      }
    }
  }
  EXPECT_EQ(bad_sign, 0) << "dropout bits differ from the host's Philox; " << first_bad;
  EXPECT_EQ(bad_zero, 0) << "padding / masked elements; " << first_bad;
  EXPECT_EQ(bad_value, 0) << "probabilities; " << first_bad;
  if (c.dropout.p > 0.0f && visible > 1000) {
    EXPECT_GT(dropped, visible / 20) << "nothing much was dropped of " << visible;
  }
}

class GpuDropoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount reports none";
  }
};

class GpuDropoutCaseTest : public GpuDropoutTest, public ::testing::WithParamInterface<FwdCase> {};

// ------------------------------------------------------------------------------------------------
// The grid
// ------------------------------------------------------------------------------------------------

// dtype x head dim x mask, each with one fixed-length and one varlen case whose heads (6/6, 6/2,
// 6/1) rotate so that every pairing occurs; p alternates 0.1 / 0.5 and the lengths rotate through
// odd pairs with s_q < s_k and s_q > s_k, crossing the 128-row CTA and 64-key block edges and the
// 16 x 32 Philox blocks. 2 x 6 x 5 x 2 = 120 cases.
std::vector<FwdCase> grid_cases() {
  const std::vector<int> dims = {40, 64, 96, 128, 192, 256};
  const std::vector<MaskKind> masks = {MaskKind::kNone, MaskKind::kCausal, MaskKind::kLocal,
                                       MaskKind::kCausalAlibi, MaskKind::kSoftcap};
  const std::pair<int, int> heads[] = {{6, 6}, {6, 2}, {6, 1}};
  const std::pair<int, int> lengths[] = {{17, 113}, {239, 97}, {129, 257}, {1, 65}, {300, 300}};
  std::vector<FwdCase> cases;
  Rng rng(0xD50F);
  int combo = 0, n = 0;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int d : dims) {
      for (MaskKind mask : masks) {
        for (bool varlen : {false, true}) {
          const auto [hq, hkv] = heads[(combo + (varlen ? 1 : 0)) % 3];
          const auto [sq, sk] = lengths[n % 5];
          FwdCase c = fixed_case(dtype, d, hq, hkv, 2, sq, sk);
          if (varlen) fill_varlen(c, 3, sq, sk, rng);
          apply_mask(c, mask, rng);
          c.dropout = {(n / 2 + n) % 2 == 0 ? 0.1f : 0.5f, rng.next(), rng.next() >> 8};
          c.name = default_name(c, mask_name(mask)) + (c.dropout.p < 0.3f ? "_p10" : "_p50");
          cases.push_back(c);
          ++n;
        }
        ++combo;
      }
    }
  }
  return finish(cases, 0xD50F0);
}

// out / lse against the oracle with the regenerated mask (error-ratio rule), and attn_probs
// against the CPU backend's.
TEST_P(GpuDropoutCaseTest, MatchesOracleAndTheHostMask) {
  const FwdCase& c = GetParam();
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const Oracle oracle = run_dropout_oracle(c, in);
  const DropoutRun run = run_on_gpu(c, in, true);
  const CheckReport r = check_against_oracle(c, oracle, run.kernel, run.out_gaps_written);
  EXPECT_TRUE(r.ok) << r.text;
  if (r.ok && verbose()) std::cout << r.text << "\n";
  expect_probs_match(c, in, run.probs, cpu_attn_probs(c));
}

// The same case without attn_probs, on the path the dispatcher picks for it.
TEST_P(GpuDropoutCaseTest, MatchesOracleOnTheAutomaticPath) {
  const FwdCase& c = GetParam();
  if (const std::string why = case_unavailable(c); !why.empty()) GTEST_SKIP() << why;
  const HostInputs in = make_inputs(c);
  const DropoutRun run = run_on_gpu(c, in, false);
  const CheckReport r = check_against_oracle(c, run_dropout_oracle(c, in), run.kernel,
                                             run.out_gaps_written);
  EXPECT_TRUE(r.ok) << r.text;
  if (r.ok && verbose()) std::cout << r.text << "\n";
}

INSTANTIATE_TEST_SUITE_P(Grid, GpuDropoutCaseTest, ::testing::ValuesIn(grid_cases()), param_name);

// ------------------------------------------------------------------------------------------------
// Seeds, offsets, p = 0, statistics
// ------------------------------------------------------------------------------------------------

FwdCase medium_case(DType dtype, int head_dim) {
  FwdCase c = fixed_case(dtype, head_dim, 4, 2, 2, 333, 517);
  c.causal = true;
  c.dropout = {0.25f, 0x5eed5eed5eedULL, 1000};
  c.name = "medium";
  c.seed = 77;
  return c;
}

// The head dim the build has for the tests below (128 if built, else the first built family).
int built_head_dim(DType dtype) {
  for (int d : {128, 64, 96, 256, 192, 32}) {
    if (flashkit::cuda_fwd_built(dtype, d)) return d;
  }
  return 0;
}

// Same seed and offset: identical bytes (out, lse, attn_probs), on the default and on a created
// stream, with attn_probs (sm80) and without (the automatic path). Another offset or seed: another
// output and mask, the same lse.
TEST_F(GpuDropoutTest, SeedAndOffsetDecideTheBytes) {
  const int d = built_head_dim(DType::kBFloat16);
  if (d == 0) GTEST_SKIP() << "no bf16 forward kernel in this build";
  const FwdCase c = medium_case(DType::kBFloat16, d);
  const HostInputs in = make_inputs(c);
  const DropoutRun first = run_on_gpu(c, in, true);
  Stream stream;
  const DropoutRun again = run_on_gpu(c, in, true, stream.get());
  EXPECT_EQ(first.kernel.out, again.kernel.out);
  EXPECT_EQ(first.kernel.lse, again.kernel.lse);
  EXPECT_EQ(first.probs, again.probs);
  const DropoutRun automatic = run_on_gpu(c, in, false);
  const DropoutRun automatic_again = run_on_gpu(c, in, false, stream.get());
  EXPECT_EQ(automatic.kernel.out, automatic_again.kernel.out);
  EXPECT_EQ(automatic.kernel.lse, automatic_again.kernel.lse);
  for (DropoutSpec other : {DropoutSpec{c.dropout.p, c.dropout.seed, c.dropout.offset + 1},
                            DropoutSpec{c.dropout.p, c.dropout.seed + 1, c.dropout.offset}}) {
    FwdCase changed = c;
    changed.dropout = other;
    const DropoutRun run = run_on_gpu(changed, in, true);
    EXPECT_NE(run.kernel.out, first.kernel.out);
    EXPECT_EQ(run.kernel.lse, first.kernel.lse);
    int64_t sign_changes = 0;
    for (size_t n = 0; n < run.probs.size(); ++n) {
      sign_changes += (run.probs[n] & 0x8000) != (first.probs[n] & 0x8000);
    }
    EXPECT_GT(sign_changes, 1000) << "offset " << other.offset << ", seed " << other.seed;
  }
}

// A key in device memory (DropoutSpec::rng_state, what a captured CUDA graph passes) is the same
// key as host values: seed = rng_state[0], offset = rng_state[1] + dropout.offset, and the host
// seed is ignored. Without attn_probs (the sm90 path on Hopper) and with it (sm80).
TEST_F(GpuDropoutTest, DeviceRngStateIsTheSameKey) {
  const int d = built_head_dim(DType::kBFloat16);
  if (d == 0) GTEST_SKIP() << "no bf16 forward kernel in this build";
  const FwdCase c = medium_case(DType::kBFloat16, d);
  const HostInputs in = make_inputs(c);
  constexpr uint64_t kOffsetOnHost = 7;
  const int64_t key[2] = {static_cast<int64_t>(c.dropout.seed),
                          static_cast<int64_t>(c.dropout.offset - kOffsetOnHost)};
  DeviceBuffer rng_state(sizeof key);
  FK_CUDA_CHECK(cudaMemcpy(rng_state.get(), key, sizeof key, cudaMemcpyHostToDevice));
  FwdCase device_key = c;
  device_key.dropout = {c.dropout.p, c.dropout.seed + 1, kOffsetOnHost,
                        static_cast<const int64_t*>(rng_state.get())};
  for (bool with_probs : {false, true}) {
    const DropoutRun host = run_on_gpu(c, in, with_probs);
    const DropoutRun device = run_on_gpu(device_key, in, with_probs);
    EXPECT_EQ(device.kernel.out, host.kernel.out) << "probs " << with_probs;
    EXPECT_EQ(device.kernel.lse, host.kernel.lse) << "probs " << with_probs;
    EXPECT_EQ(device.probs, host.probs) << "probs " << with_probs;
  }
}

// p = 0 (whatever the seed and offset) is bit for bit the call without dropout, for every built
// family and both dtypes, with and without attn_probs (the extra kernel must not disturb out). On
// the sm80 path: there the dropout instances live, and a call with attn_probs runs there on Hopper
// too, while the plain call would take the sm90 path (a different kernel, other rounding).
TEST_F(GpuDropoutTest, PZeroIsBitwiseTheCallWithoutDropout) {
  const ScopedEnv sm80_path("FLASHKIT_FWD_PATH", "sm80");
  int tested = 0;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int d : {32, 64, 96, 128, 192, 256}) {
      if (!flashkit::cuda_fwd_built(dtype, d)) continue;
      FwdCase with_zero = medium_case(dtype, d);
      with_zero.dropout = {0.0f, 12345, 678};
      FwdCase without = with_zero;
      without.dropout = {};
      const HostInputs in = make_inputs(with_zero);
      DeviceProblem plain(without, in, contiguous_layout(without));
      const KernelOut reference = run_on_device(plain, nullptr);
      for (bool with_probs : {false, true}) {
        const DropoutRun run = run_on_gpu(with_zero, in, with_probs);
        EXPECT_EQ(run.kernel.out, reference.out) << "d " << d << " probs " << with_probs;
        EXPECT_EQ(run.kernel.lse, reference.lse) << "d " << d << " probs " << with_probs;
        for (uint16_t bits : run.probs) ASSERT_EQ(bits & 0x8000, 0) << "p = 0 dropped something";
      }
      ++tested;
    }
  }
  if (tested == 0) GTEST_SKIP() << "no forward kernel in this build";
}

// The kernel's mask (read back through attn_probs) over a large tile: the kept fraction within 0.5%
// of 1 - p for several p, and the output against the oracle.
TEST_F(GpuDropoutTest, KeptFractionOfALargeTile) {
  const int d = built_head_dim(DType::kBFloat16);
  if (d == 0) GTEST_SKIP() << "no bf16 forward kernel in this build";
  for (float p : {0.1f, 0.3f, 0.7f}) {
    FwdCase c = fixed_case(DType::kBFloat16, d, 2, 2, 1, 1024, 1024);
    c.dropout = {p, 0xfeedULL + static_cast<uint64_t>(p * 100), 64};
    c.name = "large_tile";
    const HostInputs in = make_inputs(c);
    const DropoutRun run = run_on_gpu(c, in, true);
    int64_t kept = 0;
    for (uint16_t bits : run.probs) kept += (bits & 0x8000) == 0;
    const double fraction = static_cast<double>(kept) / static_cast<double>(run.probs.size());
    EXPECT_NEAR(fraction, 1.0 - p, 0.005) << "p " << p;
    const Oracle oracle = run_dropout_oracle(c, in);
    const CheckReport r = check_against_oracle(c, oracle, run.kernel, run.out_gaps_written);
    EXPECT_TRUE(r.ok) << r.text;
  }
}

}  // namespace
}  // namespace flashkit::test
