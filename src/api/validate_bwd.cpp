// src/api/validate_bwd.cpp
// \brief The checks of mha_bwd / mha_varlen_bwd (see validate_bwd.h): the forward part through the
// forward's validation, then the gradients (dout read; dq, dk, dv written) and the workspace.
//
// Checks run from the most basic to the most specific (presence, dtype, device, shape, strides and
// pointers, overlap), so the first message names the root cause.
#include "api/validate_bwd.h"

#include <cstdint>
#include <utility>

#include "api/tensor_checks.h"
#include "api/validate_fwd.h"
#include "flashkit/error.h"

namespace flashkit::api {
namespace {

// The forward arguments of a backward call, as the forward took them.
FwdCommon forward_view(const BwdCommon& p) {
  FwdCommon f;
  f.q = p.q;
  f.k = p.k;
  f.v = p.v;
  f.out = p.out;
  f.softmax_lse = p.softmax_lse;
  f.alibi_slopes = p.alibi_slopes;
  f.softmax_scale = p.softmax_scale;
  f.softcap = p.softcap;
  f.mask = p.mask;
  f.dropout = p.dropout;
  return f;
}

// A written gradient may share memory with no other tensor of the call: the kernels read the
// inputs while they write the gradients. Only the cheap, common mistake is caught (a view passed
// twice, e.g. dq = q for an in-place update); interleaved views such as the dq / dk / dv slices of
// one packed dqkv buffer are legitimate and start at different addresses.
void check_no_aliasing(const char* fn, const BwdCommon& p) {
  const std::pair<const char*, const TensorView*> outputs[] = {
      {"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv}};
  for (const auto& [name, view] : outputs) {
    check_own_memory(fn, name, *view,
                     {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out},
                      {"softmax_lse", &p.softmax_lse}, {"dout", &p.dout}, {"dq", &p.dq},
                      {"dk", &p.dk}, {"dv", &p.dv}},
                     "every gradient needs memory of its own, apart from the inputs and the other "
                     "gradients");
  }
}

// Pointer and strides of a [batch, seqlen, heads, dim] (varlen: [total, heads, dim]) view.
void strides_of(const TensorView& view, int64_t& batch_stride, int64_t& row_stride,
                int64_t& head_stride) {
  batch_stride = view.rank == 4 ? view.strides[0] : 0;
  row_stride = view.stride(-3);
  head_stride = view.stride(-2);
}

BwdProblem make_problem(const char* fn, const BwdCommon& p, const FwdProblem& fwd) {
  check_gradient(fn, "dout", p.dout, "the gradient of out, same shape and dtype as q", "q", p.q,
                 p.q);
  check_gradient(fn, "dq", p.dq, "the gradient of q (written), same shape and dtype as q", "q", p.q,
                 p.q);
  check_gradient(fn, "dk", p.dk, "the gradient of k (written), same shape and dtype as k", "k", p.k,
                 p.q);
  check_gradient(fn, "dv", p.dv, "the gradient of v (written), same shape and dtype as v", "v", p.v,
                 p.q);
  check_no_aliasing(fn, p);

  BwdProblem problem;
  problem.fwd = fwd;
  problem.dout = p.dout.data;
  strides_of(p.dout, problem.dout_batch_stride, problem.dout_row_stride, problem.dout_head_stride);
  problem.dq = p.dq.data;
  strides_of(p.dq, problem.dq_batch_stride, problem.dq_row_stride, problem.dq_head_stride);
  problem.dk = p.dk.data;
  strides_of(p.dk, problem.dk_batch_stride, problem.dk_row_stride, problem.dk_head_stride);
  problem.dv = p.dv.data;
  strides_of(p.dv, problem.dv_batch_stride, problem.dv_row_stride, problem.dv_head_stride);
  problem.deterministic = p.deterministic;
  problem.workspace = p.workspace;
  problem.workspace_bytes = p.workspace_bytes;
  return problem;
}

// The backward writes dk / dv for every key a sequence stores (zeros past seqused_k), and the
// kernels size their grid by max_seqlen_k: it must bound the stored key lengths too, not only the
// used ones the forward checks. Checked on the CPU, where the prefix sums are host memory (the
// forward's checks have made them nondecreasing and in bounds); on CUDA the caller's promise.
void check_stored_key_lengths(const char* fn, const MhaVarlenBwdParams& p, int batch) {
  if (p.q.device.kind != DeviceKind::kCpu || !p.seqused_k.defined()) return;
  const auto* cu_k = static_cast<const int*>(p.cu_seqlens_k.data);
  for (int b = 0; b < batch; ++b) {
    const int stored = cu_k[b + 1] - cu_k[b];
    if (stored > p.max_seqlen_k) {
      fail(fn, "sequence ", b, " stores ", stored, " keys (cu_seqlens_k) but max_seqlen_k is ",
           p.max_seqlen_k, "; the backward writes dk and dv for every stored key, so max_seqlen_k ",
           "must bound the lengths in cu_seqlens_k too");
    }
  }
}

}  // namespace

BwdProblem validate_mha_bwd(const MhaBwdParams& p, const char* fn) {
  MhaFwdParams forward;
  static_cast<FwdCommon&>(forward) = forward_view(p);
  BwdProblem problem = make_problem(fn, p, validate_mha_fwd(forward, fn));
  problem.total_q = int64_t{problem.fwd.batch} * problem.fwd.seqlen_q;
  problem.total_k = int64_t{problem.fwd.batch} * problem.fwd.seqlen_k;
  return problem;
}

BwdProblem validate_mha_varlen_bwd(const MhaVarlenBwdParams& p, const char* fn) {
  MhaVarlenFwdParams forward;
  static_cast<FwdCommon&>(forward) = forward_view(p);
  forward.cu_seqlens_q = p.cu_seqlens_q;
  forward.cu_seqlens_k = p.cu_seqlens_k;
  forward.seqused_k = p.seqused_k;
  forward.max_seqlen_q = p.max_seqlen_q;
  forward.max_seqlen_k = p.max_seqlen_k;
  BwdProblem problem = make_problem(fn, p, validate_mha_varlen_fwd(forward, fn));
  check_stored_key_lengths(fn, p, problem.fwd.batch);
  problem.total_q = p.q.sizes[0];
  problem.total_k = p.k.sizes[0];
  return problem;
}

void check_bwd_workspace(const char* fn, const char* size_query, const BwdProblem& problem,
                         size_t required_bytes) {
  if (problem.workspace == nullptr && problem.workspace_bytes > 0) {
    fail(fn, "workspace is null but workspace_bytes is ", problem.workspace_bytes,
         "; pass the buffer, or 0 bytes when ", size_query, " returns 0");
  }
  if (required_bytes == 0) return;
  if (problem.workspace == nullptr) {
    fail(fn, "workspace is null; this call needs ", required_bytes, " bytes (", size_query,
         "(params)) of scratch memory on the tensors' device");
  }
  if (problem.workspace_bytes < required_bytes) {
    fail(fn, "workspace_bytes is ", problem.workspace_bytes, " but this call needs ",
         required_bytes, " bytes (", size_query, "(params))");
  }
  const auto address = reinterpret_cast<uintptr_t>(problem.workspace);
  if (address % kWorkspaceAlignmentBytes != 0) {
    fail(fn, "workspace (", problem.workspace, ") is not ", kWorkspaceAlignmentBytes,
         "-byte aligned; pass the start of an allocation (cudaMalloc and PyTorch's allocator "
         "return such addresses)");
  }
}

}  // namespace flashkit::api
