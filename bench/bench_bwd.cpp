// bench/bench_bwd.cpp
// \brief flashkit_bench's backward runners (ops bwd and fwd_bwd, default and deterministic mode):
// the same grid, timing method and results format as the forward (bench_fwd.cpp), through the
// public API only.
//
// bwd times mha_bwd alone: each input set first runs one forward for its out and LSE, then the
// timed launches run the backward on them; fwd_bwd times mha_fwd followed by mha_bwd. dq, dk and
// dv are poisoned with 0xFF bytes (NaN) before the timed launches and must all be finite after.
// The workspace comes from mha_bwd_workspace_size and is allocated once per case, outside the
// timing, as a training framework's caching allocator would hand it over.
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "bench_support.h"
#include "flashkit/flashkit.h"

namespace flashkit::bench {
namespace {

// The backward's views over contiguous [b, s, h, d] tensors and an lse [b, h, s].
MhaBwdParams make_bwd_params(const Case& c, const void* q, const void* k, const void* v,
                             const void* out, const float* lse, const void* dout, void* dq,
                             void* dk, void* dv, Device device) {
  MhaBwdParams p;
  const int64_t b = c.batch, s = c.seqlen, h = c.heads, d = c.head_dim;
  auto view = [&](const void* data, int64_t heads) {
    return make_view(const_cast<void*>(data), c.dtype, {b, s, heads, d}, device);
  };
  p.q = view(q, h);
  p.k = view(k, c.kv_heads());
  p.v = view(v, c.kv_heads());
  p.out = view(out, h);
  p.dout = view(dout, h);
  p.dq = view(dq, h);
  p.dk = view(dk, c.kv_heads());
  p.dv = view(dv, c.kv_heads());
  p.softmax_lse = make_view(const_cast<float*>(lse), DType::kFloat32, {b, h, s}, device);
  p.mask.causal = c.causal;
  p.mask.window_left = c.window;
  p.dropout = {c.dropout, 0x5eed, 0};  // the mask of the forward (make_params) that made out
  p.deterministic = c.deterministic;
  return p;
}

std::string gradient_note(const Case& c, const uint16_t* dq, const uint16_t* dk,
                          const uint16_t* dv) {
  const int64_t n = c.tensor_elems(), n_kv = c.kv_elems();
  const int64_t bad = count_nonfinite(dq, n, c.dtype) + count_nonfinite(dk, n_kv, c.dtype) +
                      count_nonfinite(dv, n_kv, c.dtype);
  if (bad == 0) return "";
  return std::to_string(bad) + " of " + std::to_string(n + 2 * n_kv) +
         " dq / dk / dv values are NaN/inf (unwritten or overflowed)";
}

}  // namespace

Result run_cpu_bwd_case(const Case& c) {
  Result r(c);
  const Device cpu{DeviceKind::kCpu, 0};
  const int64_t n = c.tensor_elems();
  std::vector<uint16_t> q(n), k(n), v(n), out(n), dout(n), dq(n), dk(n), dv(n);
  std::vector<float> lse(int64_t(c.batch) * c.heads * c.seqlen);
  fill_uniform(q.data(), n, c.dtype, 1);
  fill_uniform(k.data(), n, c.dtype, 2);
  fill_uniform(v.data(), n, c.dtype, 3);
  fill_uniform(dout.data(), n, c.dtype, 4);
  try {
    mha_fwd(make_params(c, c.seqlen, c.seqlen, q.data(), k.data(), v.data(), out.data(), lse.data(),
                        cpu));
    const MhaBwdParams params =
        make_bwd_params(c, q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(),
                        dq.data(), dk.data(), dv.data(), cpu);
    for (std::vector<uint16_t>* grad : {&dq, &dk, &dv}) {
      std::memset(grad->data(), 0xff, grad->size() * sizeof(uint16_t));
    }
    mha_bwd(params);  // warm-up, and the run whose gradients are checked
    r.note = gradient_note(c, dq.data(), dk.data(), dv.data());
    std::vector<double> times;
    double total = 0;
    while (r.note.empty() && (times.size() < 5 || total < kMinTimedMs) && times.size() < 100) {
      const auto t0 = std::chrono::steady_clock::now();
      mha_bwd(params);
      const std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
      times.push_back(dt.count());
      total += dt.count();
    }
    if (r.note.empty()) {
      r.ms = median(times);
      r.tflops = c.flops() / (r.ms * 1e9);
    }
  } catch (const std::exception& e) {
    r.note = first_line(e.what());
  }
  r.failed = !r.note.empty();
  return r;
}

#ifdef FLASHKIT_BENCH_CUDA

Result run_gpu_bwd_case(const Case& c, Gpu& gpu) {
  Result r(c);
  try {
    const int64_t elems = c.tensor_elems();
    const size_t tensor_bytes = elems * sizeof(uint16_t);
    const int64_t lse_elems = int64_t(c.batch) * c.heads * c.seqlen;
    // Each set is read as q, k, v, out and lse; dout and the gradients are shared. (k, v, dk and dv
    // get q's size whatever --gqa: their views take the first kv_elems.)
    const int64_t set_bytes = (2 * elems + 2 * c.kv_elems()) * static_cast<int64_t>(sizeof(uint16_t));
    const int sets =
        static_cast<int>(std::max<int64_t>(1, (2 * gpu.l2_bytes + set_bytes - 1) / set_bytes));
    const Device device{DeviceKind::kCuda, gpu.device};

    DeviceBuffer dout_buffer, dq_buffer, dk_buffer, dv_buffer, workspace_buffer;
    void* dout = dout_buffer.get(tensor_bytes);
    void* dq = dq_buffer.get(tensor_bytes);
    void* dk = dk_buffer.get(tensor_bytes);
    void* dv = dv_buffer.get(tensor_bytes);
    {
      std::vector<uint16_t> host(elems);
      fill_uniform(host.data(), elems, c.dtype, 77);
      CUDA_OK(cudaMemcpy(dout, host.data(), tensor_bytes, cudaMemcpyHostToDevice));
    }
    std::vector<DeviceBuffer> outs(sets), lses(sets);
    std::vector<MhaFwdParams> fwd_params;
    std::vector<MhaBwdParams> bwd_params;
    for (int s = 0; s < sets; ++s) {
      void* q = gpu.inputs.tensor(c.dtype, elems, sets, s, 0);
      void* k = gpu.inputs.tensor(c.dtype, elems, sets, s, 1);
      void* v = gpu.inputs.tensor(c.dtype, elems, sets, s, 2);
      void* out = outs[s].get(tensor_bytes);
      auto* lse = static_cast<float*>(lses[s].get(lse_elems * sizeof(float)));
      fwd_params.push_back(make_params(c, c.seqlen, c.seqlen, q, k, v, out, lse, device));
      mha_fwd(fwd_params.back(), gpu.stream);  // the out and LSE the backward differentiates
      bwd_params.push_back(make_bwd_params(c, q, k, v, out, lse, dout, dq, dk, dv, device));
    }
    const size_t workspace_bytes = mha_bwd_workspace_size(bwd_params[0]);
    void* workspace = workspace_bytes > 0 ? workspace_buffer.get(workspace_bytes) : nullptr;
    for (MhaBwdParams& p : bwd_params) {
      p.workspace = workspace;
      p.workspace_bytes = workspace_bytes;
    }

    auto launch = [&](int s) {
      if (c.op == Op::kFwdBwd) mha_fwd(fwd_params[s], gpu.stream);
      mha_bwd(bwd_params[s], gpu.stream);
    };
    auto poison = [&] {
      for (void* grad : {dq, dk, dv}) {
        CUDA_OK(cudaMemsetAsync(grad, 0xff, tensor_bytes, gpu.stream));
      }
    };
    int last_set = 0;
    r.ms = time_launches(launch, sets, gpu.stream, poison, &last_set, gpu.energy, &r);

    std::vector<uint16_t> host_dq(elems), host_dk(elems), host_dv(elems);
    CUDA_OK(cudaMemcpy(host_dq.data(), dq, tensor_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(host_dk.data(), dk, tensor_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(host_dv.data(), dv, tensor_bytes, cudaMemcpyDeviceToHost));
    r.note = gradient_note(c, host_dq.data(), host_dk.data(), host_dv.data());
    if (r.note.empty()) r.tflops = c.flops() / (r.ms * 1e9);
  } catch (const std::exception& e) {
    r.note = first_line(e.what());
  }
  r.failed = !r.note.empty() && cuda_bwd_built(c.dtype, c.head_dim);
  return r;
}

#endif  // FLASHKIT_BENCH_CUDA

}  // namespace flashkit::bench
