// tests/cpp/gpu_bwd_test_util.h
// \brief The machinery of the GPU backward tests (test_gpu_bwd.cpp), on top of the forward tests'
// CUDA plumbing (gpu_test_util.h: DeviceBuffer, Placement, copy_tensor, ...) and the host-side
// BackwardCase of attention_case.h: the gradient oracle, device buffers for the eight tensors of a
// backward call in any layout, and the comparison rule for dq, dk and dv.
//
// One run of a case:
//   BackwardCase host(c);                     // inputs, out / lse of the CPU forward, dout
//   BwdOracle o = run_bwd_oracle(host);       // fp64 gradients + input-dtype gradients
//   DeviceBwdProblem dev(host, contiguous_bwd_layout(c));
//   dev.upload(stream); dev.poison_gradients(stream); dev.launch(stream, deterministic);
//   BwdKernelOut k = dev.download(stream);
//   CheckReport r = check_gradients(host, o, k, dev.gaps_written());
//
// The forward's out and lse come from the CPU reference, not from the GPU forward: the backward is
// a function of (q, k, v, out, lse, dout), and the oracle and the kernel get the same six.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "api/validate_bwd.h"
#include "attention_case.h"
#include "cpu/reference_bwd.h"
#include "cpu/reference_common.h"
#include "flashkit/flashkit.h"
#include "gpu_test_util.h"

namespace flashkit::test {

// ------------------------------------------------------------------------------------------------
// The oracle
// ------------------------------------------------------------------------------------------------

// The three gradients in the logical packed layout ([total_q, heads_q, d] and [total_k, heads_kv,
// d]; fixed length: token b * seqlen + i), in the order dq, dk, dv. Tail tokens stay NaN.
struct BwdOracle {
  std::vector<float> ref[3];  // kExact
  std::vector<float> low[3];  // kInputDtype: rounded like plain framework code in the input dtype
};

// The problem as mha_bwd / mha_varlen_bwd resolve it (same windows, defaults), over host memory.
inline BwdProblem host_bwd_problem(BackwardCase& host) {
  if (host.fwd_case().varlen) return api::validate_mha_varlen_bwd(host.varlen_bwd_params());
  return api::validate_mha_bwd(host.bwd_params());
}

inline BwdOracle run_bwd_oracle(BackwardCase& host) {
  using cpu::BwdStatistics;
  using cpu::RefPrecision;
  const FwdCase& c = host.fwd_case();
  const BwdProblem problem = host_bwd_problem(host);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const size_t q_elems = static_cast<size_t>(c.total_q()) * c.heads_q * c.head_dim;
  const size_t k_elems = static_cast<size_t>(c.total_k()) * c.heads_kv * c.head_dim;
  BwdOracle o;
  for (std::vector<float>* set : {o.ref, o.low}) {
    set[0].assign(q_elems, nan);
    set[1].assign(k_elems, nan);
    set[2].assign(k_elems, nan);
  }
  cpu::reference_bwd_fp32(problem, RefPrecision::kExact, BwdStatistics::kFromForward,
                          o.ref[0].data(), o.ref[1].data(), o.ref[2].data());
  cpu::reference_bwd_fp32(problem, RefPrecision::kInputDtype, BwdStatistics::kFromForward,
                          o.low[0].data(), o.low[1].data(), o.low[2].data());
  return o;
}

// Which gradient rows must be exactly zero because the mask gives them nothing: dq rows of query
// rows that see no key, dk / dv rows of keys that no query row sees (keys past seqused_k
// included). Indexed like the oracle's rows ([tokens, heads]); dk / dv share one mask.
struct ZeroRows {
  std::vector<uint8_t> dq;   // [total_q * heads_q]
  std::vector<uint8_t> dkv;  // [total_k * heads_kv]
};

inline ZeroRows zero_rows(BackwardCase& host) {
  const FwdCase& c = host.fwd_case();
  const BwdProblem problem = host_bwd_problem(host);
  const std::vector<cpu::Sequence> sequences = cpu::sequences_of(problem.fwd, "zero_rows");
  ZeroRows z{std::vector<uint8_t>(static_cast<size_t>(c.total_q()) * c.heads_q, 0),
             std::vector<uint8_t>(static_cast<size_t>(c.total_k()) * c.heads_kv, 0)};
  for (int b = 0; b < c.batch; ++b) {
    const cpu::Sequence& s = sequences[b];
    // Keys seen by some row: the ranges are the same for every head (the mask ignores heads).
    std::vector<int> coverage(static_cast<size_t>(s.stored_len_k) + 1, 0);
    for (int i = 0; i < s.len_q; ++i) {
      const cpu::KeyRange range = cpu::allowed_keys(problem.fwd, s, i);
      if (range.empty()) {
        for (int h = 0; h < c.heads_q; ++h) z.dq[(c.start_q(b) + i) * c.heads_q + h] = 1;
        continue;
      }
      ++coverage[range.first];
      --coverage[range.end];
    }
    int seen = 0;
    for (int j = 0; j < s.stored_len_k; ++j) {
      seen += coverage[j];
      if (seen > 0) continue;
      for (int g = 0; g < c.heads_kv; ++g) z.dkv[(c.start_k(b) + j) * c.heads_kv + g] = 1;
    }
  }
  return z;
}

// ------------------------------------------------------------------------------------------------
// Device layouts
// ------------------------------------------------------------------------------------------------

// Where the eight tensors of a backward call live: placements (gpu_test_util.h) into `buffers`
// (element counts). The gradients must not share a buffer with an input: the gradient buffers are
// poisoned before every run.
struct BwdLayout {
  std::string name = "contiguous";
  std::vector<int64_t> buffers;
  Placement q, k, v, out, dout, dq, dk, dv;
};

// Every tensor dense in a buffer of its own.
inline BwdLayout contiguous_bwd_layout(const FwdCase& c) {
  BwdLayout l;
  const int64_t q_elems = c.total_q() * c.heads_q * c.head_dim;
  const int64_t k_elems = c.total_k() * c.heads_kv * c.head_dim;
  Placement* tensors[] = {&l.q, &l.k, &l.v, &l.out, &l.dout, &l.dq, &l.dk, &l.dv};
  for (int n = 0; n < 8; ++n) {
    const bool query_side = n == 0 || n == 3 || n == 4 || n == 5;
    *tensors[n] = dense_placement(c, n, query_side ? c.heads_q : c.heads_kv,
                                  query_side ? c.seqlen_q : c.seqlen_k);
    l.buffers.push_back(query_side ? q_elems : k_elems);
  }
  return l;
}

// ------------------------------------------------------------------------------------------------
// The problem on the device
// ------------------------------------------------------------------------------------------------

struct BwdKernelOut {
  std::vector<uint16_t> grad[3];  // dq, dk, dv gathered into the logical packed layout
};

class DeviceBwdProblem {
 public:
  // Allocates every buffer of the layout and fills it with 0xFF bytes (NaN), gaps included.
  DeviceBwdProblem(BackwardCase& host, BwdLayout layout)
      : host_(host), c_(host.fwd_case()), layout_(std::move(layout)), device_(current_device()) {
    for (int64_t elems : layout_.buffers) buffers_.emplace_back(static_cast<size_t>(elems) * 2);
    lse_ = DeviceBuffer(host_.lse.size() * sizeof(float));
    const HostInputs& in = host_.in;
    if (c_.varlen) {
      cu_q_ = DeviceBuffer(in.cu_q.size() * sizeof(int));
      cu_k_ = DeviceBuffer(in.cu_k.size() * sizeof(int));
      if (!in.used_k.empty()) used_k_ = DeviceBuffer(in.used_k.size() * sizeof(int));
    }
    if (!in.alibi.empty()) alibi_ = DeviceBuffer(in.alibi.size() * sizeof(float));
    for (const DeviceBuffer& buffer : buffers_) buffer.poison(nullptr);
    FK_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Copies q, k, v, out, dout, lse and the small tensors to the device on `stream`.
  void upload(cudaStream_t stream) {
    HostInputs& in = host_.in;
    copy(layout_.q, c_.heads_q, c_.seqlen_q, c_.total_q(), in.q.data(), true, stream);
    copy(layout_.k, c_.heads_kv, c_.seqlen_k, c_.total_k(), in.k.data(), true, stream);
    copy(layout_.v, c_.heads_kv, c_.seqlen_k, c_.total_k(), in.v.data(), true, stream);
    copy(layout_.out, c_.heads_q, c_.seqlen_q, c_.total_q(), host_.out.data(), true, stream);
    copy(layout_.dout, c_.heads_q, c_.seqlen_q, c_.total_q(), host_.dout.data(), true, stream);
    upload_small(host_.lse.data(), host_.lse.size() * sizeof(float), lse_, stream);
    upload_small(in.cu_q.data(), in.cu_q.size() * sizeof(int), cu_q_, stream);
    upload_small(in.cu_k.data(), in.cu_k.size() * sizeof(int), cu_k_, stream);
    upload_small(in.used_k.data(), in.used_k.size() * sizeof(int), used_k_, stream);
    upload_small(in.alibi.data(), in.alibi.size() * sizeof(float), alibi_, stream);
    FK_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // The buffers holding dq / dk / dv, and the workspace, back to NaN.
  void poison_gradients(cudaStream_t stream) const {
    for (const Placement* p : {&layout_.dq, &layout_.dk, &layout_.dv}) {
      buffers_[p->buffer].poison(stream);
    }
    if (workspace_.get() != nullptr) workspace_.poison(stream);
  }

  MhaBwdParams fixed_params(bool deterministic) const {
    MhaBwdParams p;
    fill_common(p, deterministic);
    return p;
  }

  MhaVarlenBwdParams varlen_params(bool deterministic) const {
    MhaVarlenBwdParams p;
    fill_common(p, deterministic);
    p.cu_seqlens_q = make_view(cu_q_.get(), DType::kInt32, {c_.batch + 1}, device());
    p.cu_seqlens_k = make_view(cu_k_.get(), DType::kInt32, {c_.batch + 1}, device());
    if (!host_.in.used_k.empty()) {
      p.seqused_k = make_view(used_k_.get(), DType::kInt32, {c_.batch}, device());
    }
    p.max_seqlen_q = c_.max_len_q();
    p.max_seqlen_k = c_.max_len_k();
    return p;
  }

  // Asks the API for the workspace size, grows the (poisoned) workspace to it, and calls the API
  // (it throws flashkit::Error on bad input); checks the launch.
  void launch(cudaStream_t stream, bool deterministic) {
    if (c_.varlen) {
      MhaVarlenBwdParams p = varlen_params(deterministic);
      attach_workspace(p, mha_varlen_bwd_workspace_size(p), stream);
      mha_varlen_bwd(p, stream);
    } else {
      MhaBwdParams p = fixed_params(deterministic);
      attach_workspace(p, mha_bwd_workspace_size(p), stream);
      mha_bwd(p, stream);
    }
    FK_CUDA_CHECK(cudaGetLastError());
  }

  BwdKernelOut download(cudaStream_t stream) {
    BwdKernelOut k;
    k.grad[0].assign(host_.in.q.size(), 0);
    k.grad[1].assign(host_.in.k.size(), 0);
    k.grad[2].assign(host_.in.v.size(), 0);
    copy(layout_.dq, c_.heads_q, c_.seqlen_q, c_.total_q(), k.grad[0].data(), false, stream);
    copy(layout_.dk, c_.heads_kv, c_.seqlen_k, c_.total_k(), k.grad[1].data(), false, stream);
    copy(layout_.dv, c_.heads_kv, c_.seqlen_k, c_.total_k(), k.grad[2].data(), false, stream);
    FK_CUDA_CHECK(cudaStreamSynchronize(stream));
    return k;
  }

  // Elements of the gradient buffers outside the dq / dk / dv views (gaps of strided layouts,
  // the slack past the end) that lost their poison: the kernel wrote where it must not. Returns
  // -1 when a buffer is too large to scan (the layouts with offsets past 2^31 elements).
  int64_t gaps_written() const {
    constexpr int64_t kMaxScan = int64_t{1} << 28;
    int64_t written = 0;
    std::vector<int> scanned;
    for (const Placement* p : {&layout_.dq, &layout_.dk, &layout_.dv}) {
      if (std::find(scanned.begin(), scanned.end(), p->buffer) != scanned.end()) continue;
      scanned.push_back(p->buffer);
      const int64_t elems =
          layout_.buffers[p->buffer] + static_cast<int64_t>(DeviceBuffer::kSlackBytes / 2);
      if (elems > kMaxScan) return -1;
      std::vector<uint16_t> all(static_cast<size_t>(elems));
      FK_CUDA_CHECK(cudaMemcpy(all.data(), buffers_[p->buffer].get(), all.size() * 2,
                               cudaMemcpyDeviceToHost));
      std::vector<uint8_t> logical(all.size(), 0);
      for (const Placement* g : {&layout_.dq, &layout_.dk, &layout_.dv}) {
        if (g->buffer != p->buffer) continue;
        const bool query_side = g == &layout_.dq;
        const int heads = query_side ? c_.heads_q : c_.heads_kv;
        for (const RowBlock& blk : row_blocks(c_, *g, heads, query_side ? c_.seqlen_q : c_.seqlen_k,
                                              query_side ? c_.total_q() : c_.total_k())) {
          for (int64_t r = 0; r < blk.rows; ++r) {
            std::fill_n(logical.begin() + blk.device_offset + r * g->row_stride, c_.head_dim,
                        uint8_t{1});
          }
        }
      }
      for (size_t i = 0; i < all.size(); ++i) written += !logical[i] && all[i] != kPoison16;
    }
    return written;
  }

  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  Device device() const { return {DeviceKind::kCuda, device_}; }

  void copy(const Placement& p, int heads, int seqlen, int64_t tokens, uint16_t* host,
            bool to_device, cudaStream_t stream) {
    copy_tensor(c_, p, heads, seqlen, tokens, host, buffers_[p.buffer].bytes_ptr(), to_device,
                stream);
  }

  static void upload_small(const void* host, size_t bytes, const DeviceBuffer& dev,
                           cudaStream_t stream) {
    if (bytes == 0) return;
    FK_CUDA_CHECK(cudaMemcpyAsync(dev.get(), host, bytes, cudaMemcpyHostToDevice, stream));
  }

  TensorView view(const Placement& p, int heads, int seqlen, int64_t tokens) const {
    void* data = buffers_[p.buffer].bytes_ptr() + p.offset * 2;
    if (c_.varlen) {
      return make_strided_view(data, c_.dtype, {tokens, heads, c_.head_dim},
                               {p.row_stride, p.head_stride, 1}, device());
    }
    return make_strided_view(data, c_.dtype, {c_.batch, seqlen, heads, c_.head_dim},
                             {p.batch_stride, p.row_stride, p.head_stride, 1}, device());
  }

  void fill_common(BwdCommon& b, bool deterministic) const {
    b.q = view(layout_.q, c_.heads_q, c_.seqlen_q, c_.total_q());
    b.k = view(layout_.k, c_.heads_kv, c_.seqlen_k, c_.total_k());
    b.v = view(layout_.v, c_.heads_kv, c_.seqlen_k, c_.total_k());
    b.out = view(layout_.out, c_.heads_q, c_.seqlen_q, c_.total_q());
    b.dout = view(layout_.dout, c_.heads_q, c_.seqlen_q, c_.total_q());
    b.dq = view(layout_.dq, c_.heads_q, c_.seqlen_q, c_.total_q());
    b.dk = view(layout_.dk, c_.heads_kv, c_.seqlen_k, c_.total_k());
    b.dv = view(layout_.dv, c_.heads_kv, c_.seqlen_k, c_.total_k());
    b.softmax_lse =
        make_view(lse_.get(), DType::kFloat32, {c_.batch, c_.heads_q, c_.lse_rows()}, device());
    if (c_.alibi == AlibiKind::kPerHead) {
      b.alibi_slopes = make_view(alibi_.get(), DType::kFloat32, {c_.heads_q}, device());
    } else if (c_.alibi == AlibiKind::kPerBatchHead) {
      b.alibi_slopes = make_view(alibi_.get(), DType::kFloat32, {c_.batch, c_.heads_q}, device());
    }
    b.softmax_scale = c_.softmax_scale;
    b.softcap = c_.softcap;
    b.mask = MaskSpec{c_.causal, c_.window_left, c_.window_right};
    b.dropout = c_.dropout;
    b.deterministic = deterministic;
  }

  // A size query's answer may differ between modes: the workspace only grows, and a fresh one is
  // poisoned on `stream` like the old one was.
  void attach_workspace(BwdCommon& b, size_t bytes, cudaStream_t stream) {
    if (bytes > workspace_.bytes()) {
      workspace_ = DeviceBuffer(bytes);
      workspace_.poison(stream);
    }
    workspace_bytes_ = bytes;
    b.workspace = bytes > 0 ? workspace_.get() : nullptr;
    b.workspace_bytes = bytes;
  }

  BackwardCase& host_;
  const FwdCase& c_;
  BwdLayout layout_;
  int device_;
  std::vector<DeviceBuffer> buffers_;
  DeviceBuffer lse_, cu_q_, cu_k_, used_k_, alibi_, workspace_;
  size_t workspace_bytes_ = 0;
};

// ------------------------------------------------------------------------------------------------
// The comparison rule
// ------------------------------------------------------------------------------------------------

// Gradients (TESTING.md, "The oracle"): per tensor, with err_kernel = max |kernel - exact| and
// err_low = max |low - exact| over every checked element,
//     err_kernel <= 3 * err_low + slack,     slack = 1e-5 * max(1, max |exact|).
// 3x rather than the forward's 2x: the backward chains more roundings (P and dS in the input dtype
// for the tensor-core products, dq accumulated in fp32 across key blocks in any order) and the low
// reference makes its own roundings at slightly different places. The slack covers fp32 arithmetic
// where err_low is itself near zero (one visible key: dS = P (dP - D) cancels exactly in fp64 and
// only up to summation order in fp32).
//
// Besides the rule: every gradient element of every sequence finite; rows the mask gives nothing
// (ZeroRows) exactly zero; varlen tail tokens and layout gaps still poisoned.
inline double gradient_slack(double max_abs_ref) { return 1e-5 * std::max(1.0, max_abs_ref); }
constexpr double kGradientErrorFactor = 3.0;

inline CheckReport check_gradients(BackwardCase& host, const BwdOracle& o, const BwdKernelOut& k,
                                   int64_t gaps_written = 0) {
  const FwdCase& c = host.fwd_case();
  const ZeroRows zero = zero_rows(host);
  const char* names[3] = {"dq", "dk", "dv"};
  CheckReport r;
  std::ostringstream os;
  os << "case " << c.describe();
  std::vector<std::string> examples;
  auto note = [&](const std::string& s) {
    if (examples.size() < 8) examples.push_back(s);
  };
  for (int t = 0; t < 3; ++t) {
    const bool query_side = t == 0;
    const int heads = query_side ? c.heads_q : c.heads_kv;
    const int64_t used_tokens =
        query_side ? c.used_tokens_q() : (c.varlen ? c.start_k(c.batch) : c.total_k());
    const std::vector<uint8_t>& zero_row = query_side ? zero.dq : zero.dkv;
    const int d = c.head_dim;
    double err_kernel = 0, err_low = 0, max_abs_ref = 0;
    std::string err_at = "-";
    int64_t not_finite = 0, zero_bad = 0, tail_written = 0, zero_rows_seen = 0;
    for (int64_t row = 0; row < used_tokens * heads; ++row) {
      const bool must_be_zero = zero_row[row] != 0;
      zero_rows_seen += must_be_zero;
      for (int col = 0; col < d; ++col) {
        const int64_t n = row * d + col;
        const double x = bits_to_float(c.dtype, k.grad[t][n]);
        const double ref = o.ref[t][n];
        const double low = o.low[t][n];
        if (!std::isfinite(x)) {
          if (++not_finite <= 2) {
            note(std::string(names[t]) + " token " + std::to_string(row / heads) + " head " +
                 std::to_string(row % heads) + " col " + std::to_string(col) + " is " +
                 std::to_string(x) + (k.grad[t][n] == kPoison16 ? " (poison: never written)" : ""));
          }
          continue;
        }
        if (must_be_zero && x != 0.0) {
          if (++zero_bad <= 2) {
            note(std::string(names[t]) + " token " + std::to_string(row / heads) + " head " +
                 std::to_string(row % heads) + " sees nothing but is " + std::to_string(x));
          }
        }
        max_abs_ref = std::max(max_abs_ref, std::fabs(ref));
        const double e = std::fabs(x - ref);
        if (e > err_kernel) {
          err_kernel = e;
          std::ostringstream at;
          at << "token " << row / heads << " head " << row % heads << " col " << col << ": kernel "
             << x << " ref " << ref << " low " << low;
          err_at = at.str();
        }
        if (std::isfinite(low)) err_low = std::max(err_low, std::fabs(low - ref));
      }
    }
    for (int64_t n = used_tokens * heads * d; n < static_cast<int64_t>(k.grad[t].size()); ++n) {
      tail_written += k.grad[t][n] != kPoison16;
    }
    const double bound = kGradientErrorFactor * err_low + gradient_slack(max_abs_ref);
    const bool ok = err_kernel <= bound && not_finite == 0 && zero_bad == 0 && tail_written == 0;
    r.ok = r.ok && ok;
    os << "\n  " << names[t] << ": err_kernel = " << err_kernel << " at " << err_at
       << "\n      err_low = " << err_low << ", bound = " << kGradientErrorFactor << " * err_low + "
       << gradient_slack(max_abs_ref) << " = " << bound
       << (err_kernel <= bound ? " (ok)" : " (EXCEEDED)") << "; non-finite: " << not_finite
       << "; zero rows: " << zero_rows_seen << ", not zero: " << zero_bad
       << "; tail elements written: " << tail_written;
  }
  if (gaps_written > 0) {
    r.ok = false;
    note("the kernel wrote " + std::to_string(gaps_written) + " elements outside dq / dk / dv");
  }
  if (gaps_written < 0) os << "\n  gaps outside dq / dk / dv: not scanned (buffers too large)";
  for (const std::string& e : examples) os << "\n    " << e;
  r.text = os.str();
  return r;
}

// Why a case cannot run in this build ("" when it can): a backward kernel this build left out.
inline std::string bwd_case_unavailable(const FwdCase& c) {
  if (!cuda_bwd_built(c.dtype, c.head_dim)) {
    return std::string("this build has no CUDA backward kernel for ") + short_dtype_name(c.dtype) +
           " head dim " + std::to_string(c.head_dim) + " (FLASHKIT_DTYPES / FLASHKIT_HEAD_DIMS)";
  }
  return "";
}

}  // namespace flashkit::test
