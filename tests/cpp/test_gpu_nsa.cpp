// tests/cpp/test_gpu_nsa.cpp
// \brief nsa_fwd and nsa_bwd on CUDA against the CPU reference (reference_nsa.h), on every rule
// case of nsa_case.h and on a grid of dtypes, head dims, group sizes, block sizes and masks.
//
// One run of a case: the inputs go to the device, every output (padding included) is poisoned
// with 0xFF bytes, the forward runs, then the backward on the forward's own out and lse. The
// oracle is the reference at fp64 (exact) and rounded as plain framework code in the dtype (low);
// a kernel passes when its error against the exact reference is at most 2x the low reference's
// (3x for gradients) plus an fp32 slack (TESTING.md), when every row the exact reference holds at
// zero (a row that sees no key; a key no token selected) is exactly zero, when empty rows have an
// lse of -inf, and when nothing outside the views (the padding of a dim_pad layout) was written.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/reference_nsa.h"
#include "flashkit/flashkit.h"
#include "gpu_test_util.h"
#include "nsa_case.h"

namespace flashkit::test {
namespace {

template <typename T>
DeviceBuffer upload(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer buffer(host.size() * sizeof(T));
  if (!host.empty()) {
    FK_CUDA_CHECK(cudaMemcpyAsync(buffer.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  return buffer;
}

template <typename T>
void download(std::vector<T>& host, const DeviceBuffer& buffer, cudaStream_t stream) {
  if (host.empty()) return;
  FK_CUDA_CHECK(cudaMemcpyAsync(host.data(), buffer.get(), host.size() * sizeof(T), cudaMemcpyDeviceToHost, stream));
}

DeviceBuffer poisoned(size_t bytes, cudaStream_t stream) {
  DeviceBuffer buffer(bytes);
  buffer.poison(stream);
  return buffer;
}

// The error of one 16-bit tensor against the oracle, over its logical rows.
struct TensorCheck {
  explicit TensorCheck(const char* tensor) : name(tensor) {}
  const char* name;
  double err_kernel = 0, err_low = 0, max_abs_ref = 0;
  std::string worst = "-";
  int64_t not_finite = 0, zero_rows_bad = 0, padding_written = 0;
  std::vector<std::string> notes;

  // `row_offset(r)` is the element offset of logical row r in `kernel`; exact and low hold the row
  // contiguously at r * head_dim. `zero[r]`: the row must be exactly zero (it sees no key, or no
  // token sees its key), whatever rounding does elsewhere.
  template <typename RowOffset>
  void compare(const NsaCase& c, const std::vector<uint16_t>& kernel, const float* exact, const float* low,
               const std::vector<char>& zero, RowOffset row_offset) {
    const int d = c.head_dim;
    const int64_t rows = static_cast<int64_t>(zero.size());
    std::vector<bool> logical(kernel.size(), false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = row_offset(r);
      const bool zero_row = zero[r] != 0;
      for (int col = 0; col < d; ++col) {
        logical[at + col] = true;
        const double x = bits_to_float(c.dtype, kernel[at + col]);
        const double e = exact[r * d + col];
        if (!std::isfinite(x)) {
          if (++not_finite <= 2) notes.push_back(std::string(name) + " row " + std::to_string(r) + " not finite");
          continue;
        }
        if (zero_row && x != 0.0) {
          if (++zero_rows_bad <= 2) {
            notes.push_back(std::string(name) + " row " + std::to_string(r) + " should be exactly 0, col " +
                            std::to_string(col) + " = " + std::to_string(x));
          }
        }
        max_abs_ref = std::max(max_abs_ref, std::fabs(e));
        if (std::fabs(x - e) > err_kernel) {
          err_kernel = std::fabs(x - e);
          worst = "row " + std::to_string(r) + " col " + std::to_string(col) + ": kernel " + std::to_string(x) +
                  " exact " + std::to_string(e) + " low " + std::to_string(low[r * d + col]);
        }
        if (std::isfinite(low[r * d + col])) err_low = std::max(err_low, std::fabs(low[r * d + col] - e));
      }
    }
    for (size_t i = 0; i < kernel.size(); ++i) padding_written += !logical[i] && kernel[i] != 0xFFFF;
  }

  bool ok(double factor, std::ostringstream& report) const {
    const double bound = factor * err_low + 1e-5 * std::max(1.0, max_abs_ref);
    const bool pass = err_kernel <= bound && not_finite == 0 && zero_rows_bad == 0 && padding_written == 0;
    report << "  " << name << ": err_kernel " << err_kernel << " (" << worst << "), bound " << factor << " * "
           << err_low << " + slack = " << bound << (pass ? " ok" : " FAILED") << "; not finite " << not_finite
           << ", nonzero zero-rows " << zero_rows_bad << ", padding written " << padding_written << "\n";
    for (const std::string& n : notes) report << "    " << n << "\n";
    return pass;
  }
};

std::string unavailable(const NsaCase& c) {
  if (!has_cuda_device()) return "no CUDA device";
  if (!cuda_nsa_built(c.dtype, c.head_dim)) return "this build has no NSA kernel for " + c.describe();
  return "";
}

void run_case(const NsaCase& c) {
  NsaHostCase host(c);
  Stream stream;
  const cudaStream_t s = stream.get();

  // ---- Forward on the device.
  DeviceBuffer q = upload(host.in.q, s), k = upload(host.in.k, s), v = upload(host.in.v, s);
  DeviceBuffer indices = upload(host.in.block_indices, s), counts = upload(host.in.block_counts, s);
  DeviceBuffer dout = upload(host.in.dout, s);
  DeviceBuffer out = poisoned(c.q_elements() * 2, s), lse = poisoned(c.lse_elements() * 4, s);
  DeviceBuffer dq = poisoned(c.q_elements() * 2, s), dk = poisoned(c.kv_elements() * 2, s);
  DeviceBuffer dv = poisoned(c.kv_elements() * 2, s);
  NsaBuffers dev;
  dev.q = q.get();
  dev.k = k.get();
  dev.v = v.get();
  dev.block_indices = indices.get();
  dev.block_counts = c.counts != CountsKind::kNone ? counts.get() : nullptr;
  dev.out = out.get();
  dev.lse = lse.get();
  dev.dout = dout.get();
  dev.dq = dq.get();
  dev.dk = dk.get();
  dev.dv = dv.get();
  const Device cuda{DeviceKind::kCuda, current_device()};
  nsa_fwd(nsa_fwd_params(c, dev, cuda), s);

  // ---- Backward on the forward's out and lse.
  NsaBwdParams bwd = nsa_bwd_params(c, dev, cuda);
  DeviceBuffer workspace = poisoned(nsa_bwd_workspace_size(bwd), s);
  bwd.workspace = workspace.get();
  bwd.workspace_bytes = workspace.bytes();
  nsa_bwd(bwd, s);

  download(host.out, out, s);
  download(host.lse, lse, s);
  download(host.dq, dq, s);
  download(host.dk, dk, s);
  download(host.dv, dv, s);
  FK_CUDA_CHECK(cudaStreamSynchronize(s));

  // ---- The oracle, on the kernel's own out and lse for the backward (what the kernel read).
  const int64_t q_rows = int64_t{c.batch} * c.seqlen_q * c.heads_q;
  const int64_t kv_rows = int64_t{c.batch} * c.seqlen_k * c.heads_kv;
  std::vector<float> out_exact(q_rows * c.head_dim), out_low(q_rows * c.head_dim);
  std::vector<float> lse_exact(c.lse_elements()), lse_low(c.lse_elements());
  const NsaProblem problem = host.problem();
  cpu::reference_nsa_fwd_fp32(problem, cpu::RefPrecision::kExact, out_exact.data(), lse_exact.data());
  cpu::reference_nsa_fwd_fp32(problem, cpu::RefPrecision::kInputDtype, out_low.data(), lse_low.data());
  std::vector<float> grads_exact[3] = {std::vector<float>(q_rows * c.head_dim), std::vector<float>(kv_rows * c.head_dim),
                                       std::vector<float>(kv_rows * c.head_dim)};
  std::vector<float> grads_low[3] = {grads_exact[0], grads_exact[1], grads_exact[2]};
  const NsaBwdProblem bwd_problem = host.bwd_problem();
  cpu::reference_nsa_bwd_fp32(bwd_problem, cpu::RefPrecision::kExact, false, grads_exact[0].data(),
                              grads_exact[1].data(), grads_exact[2].data());
  cpu::reference_nsa_bwd_fp32(bwd_problem, cpu::RefPrecision::kInputDtype, false, grads_low[0].data(),
                              grads_low[1].data(), grads_low[2].data());

  // ---- Which rows the semantics hold at zero: queries that see no key (out, dq), keys that no
  // query sees (dk, dv).
  std::vector<char> out_zero(q_rows, 0), dq_zero(q_rows, 0), kv_zero(kv_rows, 1);
  for (int b = 0; b < c.batch; ++b) {
    for (int g = 0; g < c.heads_kv; ++g) {
      const std::vector<char> mask = nsa_dense_mask(c, host.in, b, g);
      for (int i = 0; i < c.seqlen_q; ++i) {
        bool sees = false;
        for (int j = 0; j < c.seqlen_k; ++j) {
          if (mask[int64_t{i} * c.seqlen_k + j] == 0) continue;
          sees = true;
          kv_zero[(int64_t{b} * c.seqlen_k + j) * c.heads_kv + g] = 0;
        }
        for (int h = g * c.group(); h < (g + 1) * c.group(); ++h) {
          out_zero[(int64_t{b} * c.heads_q + h) * c.seqlen_q + i] = !sees;
          dq_zero[(int64_t{b} * c.seqlen_q + i) * c.heads_q + h] = !sees;
        }
      }
    }
  }

  // ---- Compare. The forward's oracle is [batch, heads_q, seqlen_q, d]; the gradients' are
  // [batch, seqlen, heads, d].
  std::ostringstream report;
  report << c.describe() << "\n";
  TensorCheck out_check{"out"};
  out_check.compare(c, host.out, out_exact.data(), out_low.data(), out_zero, [&](int64_t r) {
    const int i = static_cast<int>(r % c.seqlen_q);
    const int h = static_cast<int>(r / c.seqlen_q % c.heads_q);
    const int b = static_cast<int>(r / c.seqlen_q / c.heads_q);
    return c.q_offset(b, i, h);
  });
  bool pass = out_check.ok(2.0, report);

  int64_t lse_bad = 0;
  double lse_err = 0;
  for (int64_t n = 0; n < c.lse_elements(); ++n) {
    const double ref = lse_exact[n];
    const double x = host.lse[n];
    const bool good = ref == -std::numeric_limits<double>::infinity()
                          ? x == ref
                          : std::fabs(x - ref) <= 1e-3 + 2e-5 * std::fabs(ref);
    if (std::isfinite(ref) && std::isfinite(x)) lse_err = std::max(lse_err, std::fabs(x - ref));
    if (!good && ++lse_bad <= 2) report << "  lse " << n << ": kernel " << x << " exact " << ref << "\n";
  }
  report << "  lse: max error " << lse_err << ", bad " << lse_bad << "\n";
  pass &= lse_bad == 0;

  const char* names[3] = {"dq", "dk", "dv"};
  const std::vector<uint16_t>* kernels[3] = {&host.dq, &host.dk, &host.dv};
  for (int t = 0; t < 3; ++t) {
    TensorCheck check{names[t]};
    const bool is_q = t == 0;
    const int seqlen = is_q ? c.seqlen_q : c.seqlen_k;
    const int heads = is_q ? c.heads_q : c.heads_kv;
    check.compare(c, *kernels[t], grads_exact[t].data(), grads_low[t].data(), is_q ? dq_zero : kv_zero,
                  [&](int64_t r) {
                    const int h = static_cast<int>(r % heads);
                    const int i = static_cast<int>(r / heads % seqlen);
                    const int b = static_cast<int>(r / heads / seqlen);
                    return is_q ? c.q_offset(b, i, h) : c.kv_offset(b, i, h);
                  });
    pass &= check.ok(3.0, report);
  }
  EXPECT_TRUE(pass) << report.str();
  if (pass && verbose()) std::printf("%s", report.str().c_str());
}

std::string case_name(const ::testing::TestParamInfo<NsaCase>& info) { return info.param.name; }

class GpuNsa : public ::testing::TestWithParam<NsaCase> {};

TEST_P(GpuNsa, ForwardAndBackwardMatchTheReference) {
  if (const std::string why = unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  run_case(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Rules, GpuNsa, ::testing::ValuesIn(nsa_rule_cases()), case_name);

// dtype x head dim x GQA group x block size x mask, at sizes where every kernel path runs several
// chunks per token (selected blocks x block size past one 64-key chunk, groups past 16 heads).
std::vector<NsaCase> grid_cases() {
  std::vector<NsaCase> cases;
  uint64_t seed = 100;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int head_dim : {64, 96, 128, 256}) {
      for (int group : {1, 16, 32}) {
        for (int block_size : {16, 64, 128}) {
          for (bool causal : {false, true}) {
            if ((group == 32) != (block_size == 64) && group != 16) continue;  // keep the grid small
            NsaCase c;
            c.dtype = dtype;
            c.head_dim = head_dim;
            c.heads_kv = group == 1 ? 4 : 2;
            c.heads_q = c.heads_kv * group;
            c.block_size = block_size;
            c.causal = causal;
            c.seqlen_q = 96;
            c.seqlen_k = causal ? 96 : 200;
            c.selected = block_size == 16 ? 12 : 4;
            c.mix = SelectionMix{0.1, 0.1, 0.05};
            c.batch = 2;
            c.seed = seed++;
            std::ostringstream name;
            name << short_dtype_name(dtype) << "_d" << head_dim << "_g" << group << "_bs" << block_size
                 << (causal ? "_causal" : "");
            c.name = name.str();
            cases.push_back(c);
          }
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, GpuNsa, ::testing::ValuesIn(grid_cases()), case_name);

// A large selection (every visible block of a 4k-key sequence) at the paper's shape, on a sample
// of tokens' worth of work: the kernels' long loops and the atomics of many tokens on one block.
TEST(GpuNsaLarge, PaperShapeLongSelection) {
  NsaCase c;
  c.name = "paper_shape";
  c.heads_q = 64;
  c.heads_kv = 4;
  c.head_dim = 128;
  c.seqlen_q = 24;
  c.seqlen_k = 4096;
  c.block_size = 64;
  c.selected = 64;
  c.causal = false;
  c.seed = 7;
  if (const std::string why = unavailable(c); !why.empty()) GTEST_SKIP() << why;
  run_case(c);
}

}  // namespace
}  // namespace flashkit::test
