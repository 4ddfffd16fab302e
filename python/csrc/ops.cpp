// python/csrc/ops.cpp
// \brief The flashkit operators of PyTorch: torch.ops.flashkit.{fwd, varlen_fwd, bwd, varlen_bwd,
// fwd_kvcache, nsa_fwd, nsa_bwd}.
//
// Each operator turns its tensors into flashkit views, allocates its outputs (and the backward's
// workspace) from torch's caching allocator on the tensors' device, and calls the flashkit entry
// point on torch's current stream. flashkit validates everything and throws flashkit::Error, which
// call_flashkit turns into torch's c10::Error before it leaves the extension (the extension has its
// own C++ runtime, python/CMakeLists.txt says why): Python sees a RuntimeError carrying flashkit's
// message, as flash_attn's checks raise. The same
// kernel function serves the CPU and the CUDA dispatch keys: flashkit picks its backend from the
// views' device, so CPU tensors run the fp64 reference with the same semantics.
//
// What is an output: the forward returns (out, softmax_lse) because the backward needs both; the
// backward returns (dq, dk, dv); fwd_kvcache returns (out, softmax_lse) and, given new keys and
// values, writes them into k_cache / v_cache in place (its schema marks both caches mutable, so
// that functionalization, torch.compile and opcheck know). Outputs are contiguous whatever the
// inputs' strides (the fake implementations in python/flashkit/_ops.py promise the same). Nothing
// here synchronises or reads device memory on the host, so the operators can be captured in CUDA
// graphs.
//
// Dropout: a forward with dropout_p > 0 draws its Philox key from torch's generator and returns it
// as rng_state (int64 [2], dropout_rng.h), which the backward takes back to regenerate the mask;
// with return_softmax it also returns S_dmask, the probabilities with dropped entries negated
// ([batch, heads_q, seqlen_q, seqlen_k] each rounded up to 128, as flash_attn sizes it). Without
// dropout both are empty tensors.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/enum_tag.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "dropout_rng.h"

#include "flashkit/api.h"
#include "flashkit/error.h"
#include "flashkit/params.h"
#include "tensor_view.h"

namespace flashkit::torch_glue {
namespace {

using OptionalTensor = std::optional<at::Tensor>;

// Runs one flashkit entry point, rethrowing its error as torch's.
template <typename Call>
auto call_flashkit(Call&& call) {
  try {
    return call();
  } catch (const Error& error) {
    TORCH_CHECK(false, error.what());
  }
}

constexpr const char* kFixedLayout = "[batch, seqlen, heads, head_dim]";
constexpr const char* kPackedLayout = "[total_tokens, heads, head_dim]";

// Python ints beyond int32 saturate instead of wrapping, so flashkit sees (and names) a value of
// the same sign and order.
int to_int(int64_t value) {
  return static_cast<int>(std::clamp<int64_t>(value, INT32_MIN, INT32_MAX));
}

// A read-only attention input (q, k, v, dout, out, new keys and values) as the CUDA kernels read
// it: the data pointer and every stride but the last on 16-byte boundaries (they move 16-byte
// vectors). A view off them (an odd storage offset, a row stride that is not a multiple of 8
// elements) is a tensor flash_attn's operators take (and fault on), so it runs on a contiguous copy
// instead of being refused. The copy lives until the op returns, after the call is enqueued (the
// caching allocator's stream order makes that safe, as for the workspace). Not copied: a strided
// last dim, which flashkit refuses at the operator as flash_attn does (the Python functions copy
// it), and the caches written in place, whose misalignment flashkit names. Done here on real
// tensors rather than in the Python functions, where torch.compile cannot trace data_ptr().
at::Tensor vector_ready(const at::Tensor& t) {
  if (!t.is_cuda() || t.numel() == 0 || t.dim() == 0 || t.stride(-1) != 1) return t;
  bool ready = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; ready && d + 1 < t.dim(); ++d) {
    ready = t.size(d) <= 1 || t.stride(d) * static_cast<int64_t>(t.element_size()) % 16 == 0;
  }
  return ready ? t : t.clone(at::MemoryFormat::Contiguous);
}

OptionalTensor vector_ready(const OptionalTensor& t) {
  return t ? OptionalTensor(vector_ready(*t)) : t;
}

MaskSpec make_mask(bool causal, int64_t window_left, int64_t window_right) {
  MaskSpec mask;
  mask.causal = causal;
  mask.window_left = to_int(window_left);
  mask.window_right = to_int(window_right);
  return mask;
}

// The output, its LSE and the score options: every forward-shaped call has them (FwdCommon,
// BwdCommon and MhaFwdKvcacheParams name them the same).
template <typename Params>
void fill_output_and_scores(const char* fn, Params& p, const at::Tensor& out,
                            const at::Tensor& softmax_lse, const OptionalTensor& alibi_slopes,
                            double softmax_scale, bool causal, int64_t window_left,
                            int64_t window_right, double softcap) {
  p.out = to_view(fn, "out", out);
  p.softmax_lse = to_view(fn, "softmax_lse", softmax_lse);
  p.alibi_slopes = to_optional_view(fn, "alibi_slopes", alibi_slopes);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softcap = static_cast<float>(softcap);
  p.mask = make_mask(causal, window_left, window_right);
}

// The tensors and options the forward and the backward share, fixed-length and varlen alike
// (FwdCommon and BwdCommon name them the same).
template <typename Common>
void fill_fwd_common(const char* fn, Common& p, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& softmax_lse,
                     const OptionalTensor& alibi_slopes, const DropoutSpec& dropout,
                     double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                     double softcap) {
  p.q = to_view(fn, "q", q);
  p.k = to_view(fn, "k", k);
  p.v = to_view(fn, "v", v);
  fill_output_and_scores(fn, p, out, softmax_lse, alibi_slopes, softmax_scale, causal, window_left,
                         window_right, softcap);
  p.dropout = dropout;
}

// The backward's tensors: its read-only inputs as the kernels read them (vector_ready) and its
// gradients, allocated like q, k and v on the current device (the caller's DeviceGuard).
struct BwdTensors {
  at::Tensor dout, q, k, v, out;
  at::Tensor dq, dk, dv;

  BwdTensors(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
             const at::Tensor& v_in, const at::Tensor& out_in)
      : dout(vector_ready(dout_in)), q(vector_ready(q_in)), k(vector_ready(k_in)),
        v(vector_ready(v_in)), out(vector_ready(out_in)), dq(at::empty(q.sizes(), q.options())),
        dk(at::empty(k.sizes(), k.options())), dv(at::empty(v.sizes(), v.options())) {}
};

void fill_bwd_common(const char* fn, BwdCommon& p, const BwdTensors& t,
                     const at::Tensor& softmax_lse, const OptionalTensor& alibi_slopes,
                     double dropout_p, const OptionalTensor& rng_state, double softmax_scale,
                     bool causal, int64_t window_left, int64_t window_right, double softcap,
                     bool deterministic) {
  fill_fwd_common(fn, p, t.q, t.k, t.v, t.out, softmax_lse, alibi_slopes,
                  dropout_spec(fn, dropout_p, rng_state, t.q), softmax_scale, causal, window_left,
                  window_right, softcap);
  p.dout = to_view(fn, "dout", t.dout);
  p.dq = to_view(fn, "dq", t.dq);
  p.dk = to_view(fn, "dk", t.dk);
  p.dv = to_view(fn, "dv", t.dv);
  p.deterministic = deterministic;
}

// The workspace the size query asks for, from the caching allocator on q's device (its blocks are
// 512-byte aligned, more than the 256 bytes flashkit needs). Kept alive by the caller until the
// call is enqueued; the caching allocator's stream semantics make reuse after that safe.
template <typename Params>
at::Tensor allocate_workspace(Params& p, size_t bytes, const at::Tensor& q) {
  at::Tensor workspace;
  if (bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }
  p.workspace_bytes = bytes;
  return workspace;
}

using FwdOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The dropout outputs of a forward: rng_state and S_dmask (see the file comment), and the spec
// that makes the call use them.
struct DropoutOutputs {
  at::Tensor rng_state;
  at::Tensor s_dmask;
  DropoutSpec spec;
};

DropoutOutputs dropout_outputs(const char* fn, const at::Tensor& q, double dropout_p,
                               bool return_softmax, int64_t batch, int64_t max_seqlen_q,
                               int64_t max_seqlen_k,
                               const std::optional<at::Generator>& generator) {
  DropoutOutputs outputs;
  if (dropout_p <= 0.0) {  // 0: no key to draw; negative: flashkit names the bad value
    outputs.rng_state = at::empty({0}, q.options().dtype(at::kLong));
    outputs.s_dmask = at::empty({0}, q.options());
    outputs.spec.p = static_cast<float>(dropout_p);
    return outputs;
  }
  outputs.rng_state = draw_rng_state(q, max_seqlen_k, generator);
  outputs.spec = dropout_spec(fn, dropout_p, outputs.rng_state, q);
  outputs.s_dmask =
      return_softmax ? at::empty({batch, q.size(-2), flashkit::attn_probs_length(max_seqlen_q),
                                  flashkit::attn_probs_length(max_seqlen_k)},
                                 q.options())
                     : at::empty({0}, q.options());
  return outputs;
}

FwdOutputs fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
               const OptionalTensor& alibi_slopes, double dropout_p, double softmax_scale,
               bool causal, int64_t window_left, int64_t window_right, double softcap,
               bool return_softmax, const std::optional<at::Generator>& generator) {
  const auto q = vector_ready(q_in);
  const auto k = vector_ready(k_in);
  const auto v = vector_ready(v_in);
  constexpr const char* fn = "flashkit::fwd";
  check_rank(fn, "q", q, 4, kFixedLayout);
  check_rank(fn, "k", k, 4, kFixedLayout);
  const c10::DeviceGuard device_guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor softmax_lse =
      at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  const DropoutOutputs dropout = dropout_outputs(fn, q, dropout_p, return_softmax, q.size(0),
                                                 q.size(1), k.size(1), generator);
  MhaFwdParams p;
  fill_fwd_common(fn, p, q, k, v, out, softmax_lse, alibi_slopes, dropout.spec, softmax_scale,
                  causal, window_left, window_right, softcap);
  if (dropout.s_dmask.numel() > 0) p.attn_probs = to_view(fn, "S_dmask", dropout.s_dmask);
  // Short queries run on the decode kernel, which splits long keys over the SMs through it.
  const size_t workspace_bytes = call_flashkit([&] { return mha_fwd_workspace_size(p); });
  const at::Tensor workspace = allocate_workspace(p, workspace_bytes, q);
  call_flashkit([&] { mha_fwd(p, current_stream(q.device())); });
  return {out, softmax_lse, dropout.rng_state, dropout.s_dmask};
}

FwdOutputs varlen_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                      const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                      const OptionalTensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                      const OptionalTensor& alibi_slopes, double dropout_p, double softmax_scale,
                      bool causal, int64_t window_left, int64_t window_right, double softcap,
                      bool return_softmax, const std::optional<at::Generator>& generator) {
  const auto q = vector_ready(q_in);
  const auto k = vector_ready(k_in);
  const auto v = vector_ready(v_in);
  constexpr const char* fn = "flashkit::varlen_fwd";
  check_rank(fn, "q", q, 3, kPackedLayout);
  check_rank(fn, "cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]");
  const c10::DeviceGuard device_guard(q.device());
  // Sized from arguments flashkit has not validated yet: clamp so that allocation cannot fail
  // before flashkit names the bad argument.
  const int64_t batch = std::max<int64_t>(cu_seqlens_q.size(0) - 1, 0);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor softmax_lse = at::empty({batch, q.size(1), std::max<int64_t>(max_seqlen_q, 0)},
                                     q.options().dtype(at::kFloat));
  const DropoutOutputs dropout = dropout_outputs(fn, q, dropout_p, return_softmax, batch,
                                                 max_seqlen_q, max_seqlen_k, generator);
  MhaVarlenFwdParams p;
  fill_fwd_common(fn, p, q, k, v, out, softmax_lse, alibi_slopes, dropout.spec, softmax_scale,
                  causal, window_left, window_right, softcap);
  if (dropout.s_dmask.numel() > 0) p.attn_probs = to_view(fn, "S_dmask", dropout.s_dmask);
  p.cu_seqlens_q = to_view(fn, "cu_seqlens_q", cu_seqlens_q);
  p.cu_seqlens_k = to_view(fn, "cu_seqlens_k", cu_seqlens_k);
  p.seqused_k = to_optional_view(fn, "seqused_k", seqused_k);
  p.max_seqlen_q = to_int(max_seqlen_q);
  p.max_seqlen_k = to_int(max_seqlen_k);
  const size_t workspace_bytes = call_flashkit([&] { return mha_varlen_fwd_workspace_size(p); });
  const at::Tensor workspace = allocate_workspace(p, workspace_bytes, q);
  call_flashkit([&] { mha_varlen_fwd(p, current_stream(q.device())); });
  return {out, softmax_lse, dropout.rng_state, dropout.s_dmask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const OptionalTensor& alibi_slopes,
    double dropout_p, const OptionalTensor& rng_state, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool deterministic) {
  constexpr const char* fn = "flashkit::bwd";
  const c10::DeviceGuard device_guard(q.device());
  const BwdTensors t(dout, q, k, v, out);
  MhaBwdParams p;
  fill_bwd_common(fn, p, t, softmax_lse, alibi_slopes, dropout_p, rng_state, softmax_scale, causal,
                  window_left, window_right, softcap, deterministic);
  const size_t workspace_bytes = call_flashkit([&] { return mha_bwd_workspace_size(p); });
  const at::Tensor workspace = allocate_workspace(p, workspace_bytes, q);
  call_flashkit([&] { mha_bwd(p, current_stream(q.device())); });
  return {t.dq, t.dk, t.dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const OptionalTensor& seqused_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const OptionalTensor& alibi_slopes, double dropout_p,
    const OptionalTensor& rng_state, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, bool deterministic) {
  constexpr const char* fn = "flashkit::varlen_bwd";
  const c10::DeviceGuard device_guard(q.device());
  const BwdTensors t(dout, q, k, v, out);
  MhaVarlenBwdParams p;
  fill_bwd_common(fn, p, t, softmax_lse, alibi_slopes, dropout_p, rng_state, softmax_scale, causal,
                  window_left, window_right, softcap, deterministic);
  p.cu_seqlens_q = to_view(fn, "cu_seqlens_q", cu_seqlens_q);
  p.cu_seqlens_k = to_view(fn, "cu_seqlens_k", cu_seqlens_k);
  p.seqused_k = to_optional_view(fn, "seqused_k", seqused_k);
  p.max_seqlen_q = to_int(max_seqlen_q);
  p.max_seqlen_k = to_int(max_seqlen_k);
  const size_t workspace_bytes = call_flashkit([&] { return mha_varlen_bwd_workspace_size(p); });
  const at::Tensor workspace = allocate_workspace(p, workspace_bytes, q);
  call_flashkit([&] { mha_varlen_bwd(p, current_stream(q.device())); });
  return {t.dq, t.dk, t.dv};
}

// Decoding against a KV cache. cache_seqlen is the one length of every sequence when cache_seqlens
// is absent (-1: the whole cache); flashkit validates everything, including that the append fits.
std::tuple<at::Tensor, at::Tensor> fwd_kvcache(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const OptionalTensor& k_in, const OptionalTensor& v_in, const OptionalTensor& rotary_cos,
    const OptionalTensor& rotary_sin, const OptionalTensor& cache_seqlens, int64_t cache_seqlen,
    const OptionalTensor& cache_batch_idx, const OptionalTensor& cache_leftpad,
    const OptionalTensor& block_table, const OptionalTensor& alibi_slopes, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    bool rotary_interleaved, int64_t num_splits) {
  const auto q = vector_ready(q_in);
  const auto k = vector_ready(k_in);
  const auto v = vector_ready(v_in);
  constexpr const char* fn = "flashkit::fwd_kvcache";
  check_rank(fn, "q", q, 4, "[batch, seqlen_q, heads_q, head_dim]");
  const c10::DeviceGuard device_guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor softmax_lse =
      at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  MhaFwdKvcacheParams p;
  p.q = to_view(fn, "q", q);
  p.k_cache = to_view(fn, "k_cache", k_cache);
  p.v_cache = to_view(fn, "v_cache", v_cache);
  p.k_new = to_optional_view(fn, "k", k);
  p.v_new = to_optional_view(fn, "v", v);
  p.rotary_cos = to_optional_view(fn, "rotary_cos", rotary_cos);
  p.rotary_sin = to_optional_view(fn, "rotary_sin", rotary_sin);
  p.rotary_interleaved = rotary_interleaved;
  p.cache_seqlens = to_optional_view(fn, "cache_seqlens", cache_seqlens);
  p.cache_seqlen = to_int(cache_seqlen);
  p.cache_batch_idx = to_optional_view(fn, "cache_batch_idx", cache_batch_idx);
  p.cache_leftpad = to_optional_view(fn, "cache_leftpad", cache_leftpad);
  p.block_table = to_optional_view(fn, "block_table", block_table);
  fill_output_and_scores(fn, p, out, softmax_lse, alibi_slopes, softmax_scale, causal, window_left,
                         window_right, softcap);
  p.num_splits = to_int(num_splits);
  const size_t workspace_bytes = call_flashkit([&] { return mha_fwd_kvcache_workspace_size(p); });
  const at::Tensor workspace = allocate_workspace(p, workspace_bytes, q);
  call_flashkit([&] { mha_fwd_kvcache(p, current_stream(q.device())); });
  return {out, softmax_lse};
}

// Native sparse attention's selection branch (flashkit/nsa_params.h). block_indices and the
// optional block_counts go to flashkit as they are: it validates their dtype (int32), shape and
// strides, and reads them one int at a time, so they need no vector_ready copy. Their contents are
// never an error (out-of-range blocks select nothing). NsaFwdParams and NsaBwdParams name these
// arguments the same.
template <typename Params>
void fill_nsa_selection(const char* fn, Params& p, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& block_indices,
                        const OptionalTensor& block_counts, int64_t block_size,
                        double softmax_scale, bool causal) {
  p.q = to_view(fn, "q", q);
  p.k = to_view(fn, "k", k);
  p.v = to_view(fn, "v", v);
  p.block_indices = to_view(fn, "block_indices", block_indices);
  p.block_counts = to_optional_view(fn, "block_counts", block_counts);
  p.block_size = to_int(block_size);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal;
}

std::tuple<at::Tensor, at::Tensor> nsa_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                           const at::Tensor& v_in, const at::Tensor& block_indices,
                                           const OptionalTensor& block_counts, int64_t block_size,
                                           double softmax_scale, bool causal) {
  const auto q = vector_ready(q_in);
  const auto k = vector_ready(k_in);
  const auto v = vector_ready(v_in);
  constexpr const char* fn = "flashkit::nsa_fwd";
  check_rank(fn, "q", q, 4, kFixedLayout);
  const c10::DeviceGuard device_guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor softmax_lse =
      at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  NsaFwdParams p;
  fill_nsa_selection(fn, p, q, k, v, block_indices, block_counts, block_size, softmax_scale,
                     causal);
  p.out = to_view(fn, "out", out);
  p.softmax_lse = to_view(fn, "softmax_lse", softmax_lse);
  call_flashkit([&] { flashkit::nsa_fwd(p, current_stream(q.device())); });
  return {out, softmax_lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nsa_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& block_indices, const OptionalTensor& block_counts, int64_t block_size,
    const at::Tensor& out, const at::Tensor& softmax_lse, double softmax_scale, bool causal) {
  constexpr const char* fn = "flashkit::nsa_bwd";
  const c10::DeviceGuard device_guard(q.device());
  const BwdTensors t(dout, q, k, v, out);
  NsaBwdParams p;
  fill_nsa_selection(fn, p, t.q, t.k, t.v, block_indices, block_counts, block_size,
                     softmax_scale, causal);
  p.dout = to_view(fn, "dout", t.dout);
  p.out = to_view(fn, "out", t.out);
  p.softmax_lse = to_view(fn, "softmax_lse", softmax_lse);
  p.dq = to_view(fn, "dq", t.dq);
  p.dk = to_view(fn, "dk", t.dk);
  p.dv = to_view(fn, "dv", t.dv);
  const size_t workspace_bytes = call_flashkit([&] { return nsa_bwd_workspace_size(p); });
  const at::Tensor workspace = allocate_workspace(p, workspace_bytes, q);
  call_flashkit([&] { flashkit::nsa_bwd(p, current_stream(q.device())); });
  return {t.dq, t.dk, t.dv};
}

}  // namespace
}  // namespace flashkit::torch_glue

// The schemas. Argument names follow flash_attn; window sides of -1 are unbounded. The forwards
// are tagged nondeterministic_seeded: with dropout they draw from torch's generator.
TORCH_LIBRARY(flashkit, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, float dropout_p, "
      "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "bool return_softmax, Generator? generator) "
      "-> (Tensor out, Tensor softmax_lse, Tensor rng_state, Tensor S_dmask)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? seqused_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes, "
      "float dropout_p, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, bool return_softmax, Generator? generator) "
      "-> (Tensor out, Tensor softmax_lse, Tensor rng_state, Tensor S_dmask)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor? alibi_slopes, float dropout_p, Tensor? rng_state, float softmax_scale, "
      "bool causal, int window_left, int window_right, float softcap, bool deterministic) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, Tensor? alibi_slopes, float dropout_p, Tensor? rng_state, "
      "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, SymInt cache_seqlen, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, "
      "Tensor? alibi_slopes, float softmax_scale, bool causal, int window_left, "
      "int window_right, float softcap, bool rotary_interleaved, int num_splits) "
      "-> (Tensor out, Tensor softmax_lse)");
  // Native sparse attention's selection branch: block_indices int32 [batch, seqlen_q, heads_kv,
  // selected], block_counts int32 [batch, seqlen_q, heads_kv] or None (every slot in use).
  m.def(
      "nsa_fwd(Tensor q, Tensor k, Tensor v, Tensor block_indices, Tensor? block_counts, "
      "int block_size, float softmax_scale, bool causal) -> (Tensor out, Tensor softmax_lse)");
  m.def(
      "nsa_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor block_indices, "
      "Tensor? block_counts, int block_size, Tensor out, Tensor softmax_lse, "
      "float softmax_scale, bool causal) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flashkit, CPU, m) {
  m.impl("fwd", &flashkit::torch_glue::fwd);
  m.impl("varlen_fwd", &flashkit::torch_glue::varlen_fwd);
  m.impl("bwd", &flashkit::torch_glue::bwd);
  m.impl("varlen_bwd", &flashkit::torch_glue::varlen_bwd);
  m.impl("fwd_kvcache", &flashkit::torch_glue::fwd_kvcache);
  m.impl("nsa_fwd", &flashkit::torch_glue::nsa_fwd);
  m.impl("nsa_bwd", &flashkit::torch_glue::nsa_bwd);
}

// Registered whether or not this build has CUDA kernels: without them flashkit itself refuses CUDA
// tensors with a message that says how to rebuild.
TORCH_LIBRARY_IMPL(flashkit, CUDA, m) {
  m.impl("fwd", &flashkit::torch_glue::fwd);
  m.impl("varlen_fwd", &flashkit::torch_glue::varlen_fwd);
  m.impl("bwd", &flashkit::torch_glue::bwd);
  m.impl("varlen_bwd", &flashkit::torch_glue::varlen_bwd);
  m.impl("fwd_kvcache", &flashkit::torch_glue::fwd_kvcache);
  m.impl("nsa_fwd", &flashkit::torch_glue::nsa_fwd);
  m.impl("nsa_bwd", &flashkit::torch_glue::nsa_bwd);
}
