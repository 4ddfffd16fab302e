// bench/bwd_kernel_probe.cu
// \brief flashkit_bwd_probe: the sm80 backward kernels driven directly through sm80::run_bwd, below
// the public API, for kernel work on the GPU machine.
//
//   flashkit_bwd_probe check   a fixed list of small cases (fixed length and varlen with empty
//                              sequences and seqused_k; MHA/GQA/MQA; causal, window, ALiBi,
//                              softcap; odd lengths; default and deterministic) against an fp64
//                              CPU backward, dq/dk/dv and the workspace poisoned with NaN first;
//                              deterministic cases run three times and must be bit-identical
//   flashkit_bwd_probe time    backward TFLOP/s on the benchmark grid (bf16, 16k tokens, model dim
//                              2048: batch = 16384 / s, heads = 2048 / d), default and
//                              deterministic, one line per case
// The forward (out, softmax_lse) comes from flashkit::mha_fwd. The gradient suite proper is
// tests/cpp/test_gpu_bwd.cpp through mha_bwd; this tool exists so that the kernels can be checked
// and timed on their own.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "api/validate_fwd.h"
#include "build_config.h"
#include "common/bwd_problem.h"
#include "common/half_float.h"
#include "cuda/sm80/bwd_sm80.h"
#include "cuda/sm80/fwd_sm80.h"
#include "flashkit/flashkit.h"

namespace {

using flashkit::BwdProblem;
using flashkit::DType;
using flashkit::FwdProblem;

void cuda_ok(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(code));
    std::exit(2);
  }
}

void run_bwd(const BwdProblem& problem, cudaStream_t stream) {
  const int family = flashkit::sm80::fwd_head_dim_family(problem.fwd.head_dim);
#define FLASHKIT_SM80_BWD_INSTANCE(kind, fam)                                    \
  if (problem.fwd.dtype == DType::kind && family == fam) {                       \
    flashkit::sm80::run_bwd<DType::kind, fam>(problem, stream);                  \
    return;                                                                      \
  }
  FLASHKIT_SM80_BWD_INSTANCES
#undef FLASHKIT_SM80_BWD_INSTANCE
  std::fprintf(stderr, "no backward instance for head dim %d\n", problem.fwd.head_dim);
  std::exit(2);
}

struct Case {
  int batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  bool causal = false;
  int window_left = -1, window_right = -1;
  int alibi = 0;  // 0 none, 1 [h], 2 [b, h]
  float softcap = 0.0f;
  bool deterministic = false;
  // Varlen: per-sequence lengths (empty: fixed length) and optional seqused_k.
  std::vector<int> lens_q, lens_k, used_k;
};

struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(size_t bytes) { cuda_ok(cudaMalloc(&p, std::max<size_t>(bytes, 256)), "cudaMalloc"); }
  ~DeviceMem() { cudaFree(p); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
};

// Everything one case needs on the device, the forward already run.
struct Prepared {
  Case c;
  bool varlen;
  int64_t rows_q, rows_k;  // rows of the packed (varlen) or [batch * seqlen] tensors
  std::vector<uint16_t> q, k, v, dout, out;
  std::vector<float> lse, slopes;
  std::vector<int> cu_q, cu_k;
  std::vector<DeviceMem*> owned;
  BwdProblem problem;
  size_t ws_bytes;
};

std::vector<uint16_t> random_bits(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> x(n);
  for (auto& e : x) e = flashkit::float_to_bf16_bits(u(rng));
  return x;
}

void* upload(Prepared& pr, const void* host, size_t bytes) {
  auto* m = new DeviceMem(bytes);
  pr.owned.push_back(m);
  if (host != nullptr) cuda_ok(cudaMemcpy(m->p, host, bytes, cudaMemcpyHostToDevice), "upload");
  return m->p;
}

Prepared prepare(const Case& c, uint32_t seed) {
  Prepared pr;
  pr.c = c;
  pr.varlen = !c.lens_q.empty();
  const int b = c.batch, hq = c.heads_q, hk = c.heads_kv, d = c.head_dim;
  pr.cu_q = {0};
  pr.cu_k = {0};
  if (pr.varlen) {
    for (int i = 0; i < b; ++i) {
      pr.cu_q.push_back(pr.cu_q.back() + c.lens_q[i]);
      pr.cu_k.push_back(pr.cu_k.back() + c.lens_k[i]);
    }
    pr.rows_q = pr.cu_q.back();
    pr.rows_k = pr.cu_k.back();
  } else {
    pr.rows_q = static_cast<int64_t>(b) * c.seqlen_q;
    pr.rows_k = static_cast<int64_t>(b) * c.seqlen_k;
  }
  std::mt19937 rng(seed);
  pr.q = random_bits(pr.rows_q * hq * d, rng);
  pr.k = random_bits(pr.rows_k * hk * d, rng);
  pr.v = random_bits(pr.rows_k * hk * d, rng);
  pr.dout = random_bits(pr.rows_q * hq * d, rng);
  if (c.alibi > 0) {
    pr.slopes.resize(c.alibi == 2 ? b * hq : hq);
    for (size_t i = 0; i < pr.slopes.size(); ++i) pr.slopes[i] = 0.05f + 0.3f * static_cast<float>(i % 7) / 7.0f;
  }
  const auto cuda = flashkit::Device{flashkit::DeviceKind::kCuda, 0};
  const size_t eq = pr.q.size() * 2, ek = pr.k.size() * 2;
  void* dq_in = upload(pr, pr.q.data(), eq);
  void* dk_in = upload(pr, pr.k.data(), ek);
  void* dv_in = upload(pr, pr.v.data(), ek);
  void* ddout = upload(pr, pr.dout.data(), eq);
  void* dout_fwd = upload(pr, nullptr, eq);
  const int64_t lse_rows = static_cast<int64_t>(b) * hq * c.seqlen_q;
  void* dlse = upload(pr, nullptr, lse_rows * 4);
  void* dslopes = c.alibi > 0 ? upload(pr, pr.slopes.data(), pr.slopes.size() * 4) : nullptr;

  flashkit::FwdCommon* common;
  flashkit::MhaFwdParams fixed;
  flashkit::MhaVarlenFwdParams var;
  common = pr.varlen ? static_cast<flashkit::FwdCommon*>(&var) : static_cast<flashkit::FwdCommon*>(&fixed);
  if (pr.varlen) {
    common->q = flashkit::make_view(dq_in, DType::kBFloat16, {pr.rows_q, hq, d}, cuda);
    common->k = flashkit::make_view(dk_in, DType::kBFloat16, {pr.rows_k, hk, d}, cuda);
    common->v = flashkit::make_view(dv_in, DType::kBFloat16, {pr.rows_k, hk, d}, cuda);
    common->out = flashkit::make_view(dout_fwd, DType::kBFloat16, {pr.rows_q, hq, d}, cuda);
    var.cu_seqlens_q = flashkit::make_view(upload(pr, pr.cu_q.data(), pr.cu_q.size() * 4), DType::kInt32, {b + 1}, cuda);
    var.cu_seqlens_k = flashkit::make_view(upload(pr, pr.cu_k.data(), pr.cu_k.size() * 4), DType::kInt32, {b + 1}, cuda);
    if (!c.used_k.empty()) {
      var.seqused_k = flashkit::make_view(upload(pr, c.used_k.data(), c.used_k.size() * 4), DType::kInt32, {b}, cuda);
    }
    var.max_seqlen_q = c.seqlen_q;
    var.max_seqlen_k = c.seqlen_k;
  } else {
    common->q = flashkit::make_view(dq_in, DType::kBFloat16, {b, c.seqlen_q, hq, d}, cuda);
    common->k = flashkit::make_view(dk_in, DType::kBFloat16, {b, c.seqlen_k, hk, d}, cuda);
    common->v = flashkit::make_view(dv_in, DType::kBFloat16, {b, c.seqlen_k, hk, d}, cuda);
    common->out = flashkit::make_view(dout_fwd, DType::kBFloat16, {b, c.seqlen_q, hq, d}, cuda);
  }
  common->softmax_lse = flashkit::make_view(dlse, DType::kFloat32, {b, hq, c.seqlen_q}, cuda);
  if (c.alibi == 1) common->alibi_slopes = flashkit::make_view(dslopes, DType::kFloat32, {hq}, cuda);
  if (c.alibi == 2) common->alibi_slopes = flashkit::make_view(dslopes, DType::kFloat32, {b, hq}, cuda);
  common->softcap = c.softcap;
  common->mask = {c.causal, c.window_left, c.window_right};

  FwdProblem fwd;
  if (pr.varlen) {
    flashkit::mha_varlen_fwd(var);
    fwd = flashkit::api::validate_mha_varlen_fwd(var);
  } else {
    flashkit::mha_fwd(fixed);
    fwd = flashkit::api::validate_mha_fwd(fixed);
  }
  cuda_ok(cudaDeviceSynchronize(), "forward");
  pr.out.resize(pr.q.size());
  pr.lse.resize(lse_rows);
  cuda_ok(cudaMemcpy(pr.out.data(), dout_fwd, eq, cudaMemcpyDeviceToHost), "download out");
  cuda_ok(cudaMemcpy(pr.lse.data(), dlse, lse_rows * 4, cudaMemcpyDeviceToHost), "download lse");

  BwdProblem& bp = pr.problem;
  bp.fwd = fwd;
  bp.dout = ddout;
  bp.dout_batch_stride = fwd.q_batch_stride;
  bp.dout_row_stride = fwd.q_row_stride;
  bp.dout_head_stride = fwd.q_head_stride;
  bp.dq = upload(pr, nullptr, eq);
  bp.dk = upload(pr, nullptr, ek);
  bp.dv = upload(pr, nullptr, ek);
  bp.dq_batch_stride = fwd.q_batch_stride, bp.dq_row_stride = fwd.q_row_stride, bp.dq_head_stride = fwd.q_head_stride;
  bp.dk_batch_stride = fwd.k_batch_stride, bp.dk_row_stride = fwd.k_row_stride, bp.dk_head_stride = fwd.k_head_stride;
  bp.dv_batch_stride = fwd.v_batch_stride, bp.dv_row_stride = fwd.v_row_stride, bp.dv_head_stride = fwd.v_head_stride;
  bp.deterministic = c.deterministic;
  bp.total_q = pr.rows_q;
  bp.total_k = pr.rows_k;
  pr.ws_bytes = flashkit::sm80::bwd_workspace_bytes(bp);
  bp.workspace = upload(pr, nullptr, pr.ws_bytes);
  bp.workspace_bytes = pr.ws_bytes;
  return pr;
}

void release(Prepared& pr) {
  for (auto* m : pr.owned) delete m;
  pr.owned.clear();
}

// The fp64 backward of one case: dq, dk, dv as doubles in the tensors' packed layouts.
struct Grads {
  std::vector<double> dq, dk, dv;
};

Grads reference(const Prepared& pr) {
  const Case& c = pr.c;
  const FwdProblem& f = pr.problem.fwd;
  const int hq = c.heads_q, hk = c.heads_kv, d = c.head_dim;
  Grads g;
  g.dq.assign(pr.q.size(), 0.0);
  g.dk.assign(pr.k.size(), 0.0);
  g.dv.assign(pr.k.size(), 0.0);
  auto val = [](const std::vector<uint16_t>& x, int64_t i) { return static_cast<double>(flashkit::bf16_bits_to_float(x[i])); };
  for (int b = 0; b < c.batch; ++b) {
    const int64_t q0 = pr.varlen ? pr.cu_q[b] : static_cast<int64_t>(b) * c.seqlen_q;
    const int64_t k0 = pr.varlen ? pr.cu_k[b] : static_cast<int64_t>(b) * c.seqlen_k;
    const int lq = pr.varlen ? pr.cu_q[b + 1] - pr.cu_q[b] : c.seqlen_q;
    const int lk = pr.varlen ? (c.used_k.empty() ? pr.cu_k[b + 1] - pr.cu_k[b] : c.used_k[b]) : c.seqlen_k;
    const int diag = lk - lq;
    for (int h = 0; h < hq; ++h) {
      const int kh = h / (hq / hk);
      const double slope = c.alibi == 0 ? 0.0 : pr.slopes[c.alibi == 2 ? b * hq + h : h];
      auto qi = [&](int i, int x) { return ((q0 + i) * hq + h) * d + x; };
      auto kj = [&](int j, int x) { return ((k0 + j) * hk + kh) * d + x; };
      for (int i = 0; i < lq; ++i) {
        const int begin = f.window_left < 0 ? 0 : std::max(0, i + diag - f.window_left);
        const int end = f.window_right < 0 ? lk : std::min(lk, i + diag + f.window_right + 1);
        if (begin >= end) continue;
        std::vector<double> s(end - begin), dtanh(end - begin, 1.0);
        double mx = -INFINITY;
        for (int j = begin; j < end; ++j) {
          double dotqk = 0;
          for (int x = 0; x < d; ++x) dotqk += val(pr.q, qi(i, x)) * val(pr.k, kj(j, x));
          double sc = dotqk * f.softmax_scale;
          if (c.softcap > 0) {
            const double t = std::tanh(sc / c.softcap);
            sc = c.softcap * t;
            dtanh[j - begin] = 1.0 - t * t;
          }
          sc -= slope * std::abs(static_cast<double>(i + diag - j));
          s[j - begin] = sc;
          mx = std::max(mx, sc);
        }
        double sum = 0;
        for (auto& e : s) sum += (e = std::exp(e - mx));
        std::vector<double> dp(end - begin);
        double dsum = 0;
        for (int j = begin; j < end; ++j) {
          const double p = s[j - begin] / sum;
          s[j - begin] = p;
          double acc = 0;
          for (int x = 0; x < d; ++x) {
            acc += val(pr.dout, qi(i, x)) * val(pr.v, kj(j, x));
            g.dv[kj(j, x)] += p * val(pr.dout, qi(i, x));
          }
          dp[j - begin] = acc;
          dsum += p * acc;
        }
        for (int j = begin; j < end; ++j) {
          const double ds = s[j - begin] * (dp[j - begin] - dsum) * dtanh[j - begin] * f.softmax_scale;
          for (int x = 0; x < d; ++x) {
            g.dq[qi(i, x)] += ds * val(pr.k, kj(j, x));
            g.dk[kj(j, x)] += ds * val(pr.q, qi(i, x));
          }
        }
      }
    }
  }
  return g;
}

std::vector<uint16_t> download(const void* p, size_t n) {
  std::vector<uint16_t> x(n);
  cuda_ok(cudaMemcpy(x.data(), p, n * 2, cudaMemcpyDeviceToHost), "download");
  return x;
}

// Max |got - ref| / max |ref| (NaN anywhere counts as failure: returns +inf).
double relative_error(const std::vector<uint16_t>& got, const std::vector<double>& ref) {
  double max_ref = 1e-30, max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double x = flashkit::bf16_bits_to_float(got[i]);
    if (!std::isfinite(x)) return INFINITY;
    max_ref = std::max(max_ref, std::abs(ref[i]));
    max_err = std::max(max_err, std::abs(x - ref[i]));
  }
  return max_err / max_ref;
}

std::string describe(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "b%d hq%d hk%d sq%d sk%d d%d%s%s%s%s%s%s", c.batch, c.heads_q, c.heads_kv,
                c.seqlen_q, c.seqlen_k, c.head_dim, c.causal ? " causal" : "",
                c.window_left >= 0 || c.window_right >= 0 ? " window" : "", c.alibi == 1 ? " alibi[h]" : c.alibi == 2 ? " alibi[b,h]" : "",
                c.softcap > 0 ? " softcap" : "", c.lens_q.empty() ? "" : (c.used_k.empty() ? " varlen" : " varlen+seqused"),
                c.deterministic ? " det" : "");
  return buf;
}

int check(const std::vector<int>& dims) {
  std::vector<Case> cases;
  for (int d : dims) {
    const int hd = d;
    cases.push_back({2, 4, 4, 257, 257, hd});
    cases.push_back({2, 4, 4, 300, 200, hd, true});
    cases.push_back({1, 4, 2, 200, 333, hd, true});
    cases.push_back({2, 4, 1, 129, 257, hd, false, 64, 16});
    cases.push_back({2, 4, 4, 190, 190, hd, false, -1, -1, 1});
    cases.push_back({2, 4, 4, 190, 250, hd, true, -1, -1, 2});
    cases.push_back({2, 4, 4, 190, 250, hd, false, -1, -1, 0, 5.0f});
    cases.push_back({2, 4, 2, 150, 150, hd, true, -1, -1, 1, 5.0f});
    cases.push_back({2, 4, 4, 333, 333, hd, true, -1, -1, 0, 0.0f, true});
    cases.push_back({2, 4, 2, 200, 300, hd, false, -1, -1, 0, 0.0f, true});
    Case var{4, 4, 2, 300, 280, hd};
    var.lens_q = {0, 300, 17, 129};
    var.lens_k = {5, 280, 0, 200};
    cases.push_back(var);
    var.used_k = {3, 150, 0, 200};
    var.causal = true;
    cases.push_back(var);
    var.deterministic = true;
    cases.push_back(var);
  }
  cases.push_back({1, 2, 2, 1, 4224, 128});
  cases.push_back({1, 2, 2, 4224, 65, 64, true});
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    Prepared pr = prepare(cases[i], 1234 + static_cast<uint32_t>(i));
    const BwdProblem& bp = pr.problem;
    cuda_ok(cudaMemset(bp.dq, 0xFF, pr.q.size() * 2), "poison");
    cuda_ok(cudaMemset(bp.dk, 0xFF, pr.k.size() * 2), "poison");
    cuda_ok(cudaMemset(bp.dv, 0xFF, pr.k.size() * 2), "poison");
    cuda_ok(cudaMemset(bp.workspace, 0xFF, pr.ws_bytes), "poison");
    run_bwd(bp, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "backward");
    const auto dq = download(bp.dq, pr.q.size());
    const auto dk = download(bp.dk, pr.k.size());
    const auto dv = download(bp.dv, pr.k.size());
    bool identical = true;
    if (cases[i].deterministic) {
      for (int rep = 0; rep < 2; ++rep) {
        run_bwd(bp, nullptr);
        cuda_ok(cudaDeviceSynchronize(), "backward");
        identical = identical && download(bp.dq, pr.q.size()) == dq && download(bp.dk, pr.k.size()) == dk &&
                    download(bp.dv, pr.k.size()) == dv;
      }
    }
    const Grads g = reference(pr);
    const double eq = relative_error(dq, g.dq), ek = relative_error(dk, g.dk), ev = relative_error(dv, g.dv);
    const bool ok = eq < 2e-2 && ek < 2e-2 && ev < 2e-2 && identical;
    failures += ok ? 0 : 1;
    std::printf("%s  %-60s dq %.2e dk %.2e dv %.2e%s\n", ok ? "PASS" : "FAIL", describe(cases[i]).c_str(), eq, ek, ev,
                cases[i].deterministic ? (identical ? " bitwise-equal x3" : " NOT DETERMINISTIC") : "");
    release(pr);
  }
  std::printf("check: %zu cases, %d failed\n", cases.size(), failures);
  return failures == 0 ? 0 : 1;
}

int time_grid(const std::vector<int>& dims, const std::vector<int>& seqlens) {
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "event");
  cuda_ok(cudaEventCreate(&stop), "event");
  std::printf("%-6s %-6s %-7s %12s %12s %8s\n", "hdim", "seqlen", "causal", "bwd TFLOP/s", "det TFLOP/s", "det/def");
  for (int d : dims) {
    for (int s : seqlens) {
      for (bool causal : {false, true}) {
        const Case c{16384 / s, 2048 / d, 2048 / d, s, s, d, causal};
        Prepared pr = prepare(c, 7);
        double tflops[2];
        for (int det = 0; det < 2; ++det) {
          pr.problem.deterministic = det == 1;
          DeviceMem ws(flashkit::sm80::bwd_workspace_bytes(pr.problem));
          pr.problem.workspace = ws.p;
          for (int w = 0; w < 3; ++w) run_bwd(pr.problem, nullptr);
          constexpr int kReps = 10;
          cuda_ok(cudaEventRecord(start), "record");
          for (int r = 0; r < kReps; ++r) run_bwd(pr.problem, nullptr);
          cuda_ok(cudaEventRecord(stop), "record");
          cuda_ok(cudaEventSynchronize(stop), "sync");
          float ms = 0;
          cuda_ok(cudaEventElapsedTime(&ms, start, stop), "elapsed");
          const double flops = 2.5 * 4.0 * c.batch * c.heads_q * double(s) * s * d * (causal ? 0.5 : 1.0);
          tflops[det] = flops / (ms / kReps * 1e-3) / 1e12;
        }
        std::printf("%-6d %-6d %-7s %12.1f %12.1f %8.3f\n", d, s, causal ? "yes" : "no", tflops[0], tflops[1],
                    tflops[1] / tflops[0]);
        std::fflush(stdout);
        release(pr);
      }
    }
  }
  return 0;
}

std::vector<int> parse_list(const char* text) {
  std::vector<int> v;
  for (const char* p = text; *p != '\0';) {
    v.push_back(std::atoi(p));
    while (*p != '\0' && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: flashkit_bwd_probe check [dims] | time [dims] [seqlens]\n");
    return 2;
  }
  const std::string mode = argv[1];
  const std::vector<int> dims = parse_list(argc > 2 ? argv[2] : "64,128");
  if (mode == "check") return check(dims);
  if (mode == "time") return time_grid(dims, parse_list(argc > 3 ? argv[3] : "2048,8192"));
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
