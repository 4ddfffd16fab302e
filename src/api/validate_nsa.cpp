// src/api/validate_nsa.cpp
// \brief The checks of nsa_fwd / nsa_bwd and the defaults they resolve (see validate_nsa.h).
//
// Checks run from the most basic to the most specific (presence, dtype, device, rank, sizes,
// shapes, strides and pointers, aliasing, scalars), so the first message names the root cause.
// The backward runs every forward check on the arguments it shares with the forward (under its own
// function name), then checks the gradients.
//
// Where NSA's rules differ from mha_fwd's:
//  - batch 0 is valid, a call with nothing to do (mha_fwd asks for batch >= 1);
//  - out may not be q (nsa_params.h: "not q itself"), where mha_fwd allows an in-place forward;
//  - there is no softcap, window, ALiBi or dropout: only softmax_scale and causal.
#include "api/validate_nsa.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include "api/tensor_checks.h"
#include "flashkit/error.h"
#include "flashkit/params.h"

namespace flashkit::api {
namespace {

constexpr int kBlockSizeMultiple = 16;  // the kernels walk the keys in 16-key mma slices
constexpr int kMaxBlockSize = 256;

// Presence, dtypes and devices of the forward's tensors.
void check_presence_dtypes_devices(const char* fn, const NsaFwdParams& p) {
  check_defined(fn, "q", p.q, "the queries [batch, seqlen_q, heads_q, head_dim]");
  check_defined(fn, "k", p.k, "the keys [batch, seqlen_k, heads_kv, head_dim]");
  check_defined(fn, "v", p.v, "the values [batch, seqlen_k, heads_kv, head_dim]");
  check_defined(fn, "block_indices", p.block_indices,
                "the int32 selected key blocks [batch, seqlen_q, heads_kv, selected]");
  check_defined(fn, "out", p.out, "the output, same shape and dtype as q");
  check_defined(fn, "softmax_lse", p.softmax_lse,
                "the float32 log-sum-exp [batch, heads_q, seqlen_q]");

  if (p.q.dtype != DType::kFloat16 && p.q.dtype != DType::kBFloat16) {
    fail(fn, "q.dtype is ", dtype_name(p.q.dtype), "; supported: float16, bfloat16");
  }
  check_same_dtype_as_q(fn, "k", p.k, p.q);
  check_same_dtype_as_q(fn, "v", p.v, p.q);
  check_same_dtype_as_q(fn, "out", p.out, p.q);
  check_dtype(fn, "softmax_lse", p.softmax_lse, DType::kFloat32);
  check_dtype(fn, "block_indices", p.block_indices, DType::kInt32);
  if (p.block_counts.defined()) check_dtype(fn, "block_counts", p.block_counts, DType::kInt32);

  check_device_index(fn, p.q);
  const std::pair<const char*, const TensorView*> others[] = {
      {"k", &p.k},
      {"v", &p.v},
      {"block_indices", &p.block_indices},
      {"block_counts", &p.block_counts},
      {"out", &p.out},
      {"softmax_lse", &p.softmax_lse}};
  for (const auto& [name, view] : others) {
    if (view->defined()) check_same_device_as_q(fn, name, *view, p.q);
  }
}

// block_indices [batch, seqlen_q, heads_kv, selected] and the optional block_counts
// [batch, seqlen_q, heads_kv]: shapes and layouts. Their contents are never checked (every value
// has a meaning, nsa_params.h). Returns `selected`.
int64_t check_selection_arrays(const char* fn, const NsaFwdParams& p, int64_t batch,
                               int64_t seqlen_q, int64_t heads_kv) {
  check_rank(fn, "block_indices", p.block_indices, 4, "[batch, seqlen_q, heads_kv, selected]");
  const int64_t selected = p.block_indices.sizes[3];
  check_shape(fn, "block_indices", p.block_indices, {batch, seqlen_q, heads_kv, selected},
              "([batch, seqlen_q, heads_kv, selected], batch and seqlen_q from q, heads_kv "
              "from k)");
  if (selected < 1 || selected > kNsaMaxSelected) {
    fail(fn, "block_indices.size(3) (selected) is ", selected, "; supported: 1 to ",
         kNsaMaxSelected, " slots per token and kv head (kNsaMaxSelected)");
  }
  check_last_dim_contiguous(fn, "block_indices", p.block_indices);
  check_data_pointer(fn, "block_indices", p.block_indices);
  if (p.block_counts.defined()) {
    check_rank(fn, "block_counts", p.block_counts, 3, "[batch, seqlen_q, heads_kv]");
    check_shape(fn, "block_counts", p.block_counts, {batch, seqlen_q, heads_kv},
                "([batch, seqlen_q, heads_kv], from block_indices)");
    check_last_dim_contiguous(fn, "block_counts", p.block_counts);
    check_data_pointer(fn, "block_counts", p.block_counts);
  }
  return selected;
}

// Strides and pointers of q/k/v/out and softmax_lse, once their shapes are known to be right.
void check_layouts(const char* fn, const NsaFwdParams& p) {
  check_attention_layouts(fn, p.q, p.k, p.v, p.out, p.softmax_lse);
}

// out and softmax_lse are written while the inputs are still read (by the other tokens and
// query-head groups): only the common mistake of passing a view twice (same data pointer) is
// caught, as in every validator.
void check_output_aliasing(const char* fn, const NsaFwdParams& p) {
  check_own_memory(fn, "out", p.out,
                   {{"q", &p.q},
                    {"k", &p.k},
                    {"v", &p.v},
                    {"block_indices", &p.block_indices},
                    {"block_counts", &p.block_counts},
                    {"softmax_lse", &p.softmax_lse}},
                   "out needs memory of its own (nsa_fwd has no in-place form, unlike mha_fwd: "
                   "out may not be q)");
  check_own_memory(fn, "softmax_lse", p.softmax_lse,
                   {{"q", &p.q},
                    {"k", &p.k},
                    {"v", &p.v},
                    {"block_indices", &p.block_indices},
                    {"block_counts", &p.block_counts}},
                   "softmax_lse needs memory of its own");
}

// Batch, row and head strides of a [batch, seqlen, heads, dim] view.
void strides_of(const TensorView& view, int64_t& batch_stride, int64_t& row_stride,
                int64_t& head_stride) {
  batch_stride = view.strides[0];
  row_stride = view.strides[1];
  head_stride = view.strides[2];
}

// Every check of the forward's arguments, under the name `fn` (the backward shares them).
NsaProblem validate_forward(const char* fn, const NsaFwdParams& p) {
  check_presence_dtypes_devices(fn, p);
  check_rank(fn, "q", p.q, 4, "[batch, seqlen_q, heads_q, head_dim]");
  check_rank(fn, "k", p.k, 4, "[batch, seqlen_k, heads_kv, head_dim]");

  const int64_t batch = p.q.sizes[0];
  const int64_t seqlen_q = p.q.sizes[1];
  const int64_t heads_q = p.q.sizes[2];
  const int64_t head_dim = p.q.sizes[3];
  const int64_t seqlen_k = p.k.sizes[1];
  const int64_t heads_kv = p.k.sizes[2];
  check_head_counts_and_dim(fn, heads_q, "k", heads_kv, head_dim);

  check_shape(fn, "k", p.k, {batch, seqlen_k, heads_kv, head_dim},
              "([batch, seqlen_k, heads_kv, head_dim], batch and head_dim from q)");
  check_shape(fn, "v", p.v, {batch, seqlen_k, heads_kv, head_dim},
              "(the shape of k: [batch, seqlen_k, heads_kv, head_dim])");
  check_shape(fn, "out", p.out, {batch, seqlen_q, heads_q, head_dim}, "(the shape of q)");
  check_shape(fn, "softmax_lse", p.softmax_lse, {batch, heads_q, seqlen_q},
              "([batch, heads_q, seqlen_q])");
  const int64_t selected = check_selection_arrays(fn, p, batch, seqlen_q, heads_kv);
  if (p.block_size < kBlockSizeMultiple || p.block_size % kBlockSizeMultiple != 0 ||
      p.block_size > kMaxBlockSize) {
    fail(fn, "block_size is ", p.block_size, "; supported: a multiple of ", kBlockSizeMultiple,
         " from ", kBlockSizeMultiple, " to ", kMaxBlockSize);
  }
  check_layouts(fn, p);
  check_output_aliasing(fn, p);
  // NSA has no softcap and no window: the shared score check sees them off, so only the scale
  // can fail it (finite and >= 0, exactly as mha_fwd takes it).
  check_score_options(fn, p.softmax_scale, 0.0f, MaskSpec{});

  NsaProblem problem;
  problem.dtype = p.q.dtype;
  problem.batch = to_int(fn, "batch (q.size(0))", batch);
  problem.seqlen_q = to_int(fn, "seqlen_q (q.size(1))", seqlen_q);
  problem.seqlen_k = to_int(fn, "seqlen_k (k.size(1))", seqlen_k);
  problem.heads_q = to_int(fn, "heads_q (q.size(2))", heads_q);
  problem.heads_kv = to_int(fn, "heads_kv (k.size(2))", heads_kv);
  problem.head_dim = static_cast<int>(head_dim);
  problem.block_size = p.block_size;
  problem.num_key_blocks = static_cast<int>((seqlen_k + p.block_size - 1) / p.block_size);
  problem.selected = static_cast<int>(selected);

  problem.q = p.q.data;
  strides_of(p.q, problem.q_batch_stride, problem.q_row_stride, problem.q_head_stride);
  problem.k = p.k.data;
  strides_of(p.k, problem.k_batch_stride, problem.k_row_stride, problem.k_head_stride);
  problem.v = p.v.data;
  strides_of(p.v, problem.v_batch_stride, problem.v_row_stride, problem.v_head_stride);
  problem.block_indices = static_cast<const int*>(p.block_indices.data);
  strides_of(p.block_indices, problem.bi_batch_stride, problem.bi_row_stride,
             problem.bi_head_stride);
  if (p.block_counts.defined()) {
    problem.block_counts = static_cast<const int*>(p.block_counts.data);
    problem.bc_batch_stride = p.block_counts.strides[0];
    problem.bc_row_stride = p.block_counts.strides[1];
  }
  problem.out = p.out.data;
  strides_of(p.out, problem.out_batch_stride, problem.out_row_stride, problem.out_head_stride);
  problem.lse = static_cast<float*>(p.softmax_lse.data);
  problem.lse_batch_stride = p.softmax_lse.strides[0];
  problem.lse_head_stride = p.softmax_lse.strides[1];

  problem.softmax_scale =
      p.softmax_scale == 0.0f
          ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(problem.head_dim)))
          : p.softmax_scale;
  problem.causal = p.causal;
  return problem;
}

// The forward arguments of a backward call, as the forward took them.
NsaFwdParams forward_view(const NsaBwdParams& p) {
  NsaFwdParams f;
  f.q = p.q;
  f.k = p.k;
  f.v = p.v;
  f.block_indices = p.block_indices;
  f.block_counts = p.block_counts;
  f.block_size = p.block_size;
  f.out = p.out;
  f.softmax_lse = p.softmax_lse;
  f.softmax_scale = p.softmax_scale;
  f.causal = p.causal;
  return f;
}

// A written gradient may share its memory with no other tensor of the call: the inputs are read
// while the gradients are written (and the CUDA backward accumulates dk / dv from many tokens).
void check_gradient_aliasing(const char* fn, const NsaBwdParams& p) {
  const std::pair<const char*, const TensorView*> outputs[] = {
      {"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv}};
  for (const auto& [name, view] : outputs) {
    check_own_memory(fn, name, *view,
                     {{"q", &p.q},
                      {"k", &p.k},
                      {"v", &p.v},
                      {"block_indices", &p.block_indices},
                      {"block_counts", &p.block_counts},
                      {"out", &p.out},
                      {"softmax_lse", &p.softmax_lse},
                      {"dout", &p.dout},
                      {"dq", &p.dq},
                      {"dk", &p.dk},
                      {"dv", &p.dv}},
                     "every gradient needs memory of its own, apart from the inputs and the other "
                     "gradients");
  }
}

}  // namespace

NsaProblem validate_nsa_fwd(const NsaFwdParams& params) {
  return validate_forward("nsa_fwd", params);
}

NsaBwdProblem validate_nsa_bwd(const NsaBwdParams& p) {
  constexpr const char* kFn = "nsa_bwd";
  NsaBwdProblem problem;
  problem.fwd = validate_forward(kFn, forward_view(p));
  check_gradient(kFn, "dout", p.dout, "the gradient of out, same shape and dtype as q", "q", p.q,
                 p.q);
  check_gradient(kFn, "dq", p.dq, "the gradient of q (written), same shape and dtype as q", "q",
                 p.q, p.q);
  check_gradient(kFn, "dk", p.dk, "the gradient of k (written), same shape and dtype as k", "k",
                 p.k, p.q);
  check_gradient(kFn, "dv", p.dv, "the gradient of v (written), same shape and dtype as v", "v",
                 p.v, p.q);
  check_gradient_aliasing(kFn, p);

  problem.dout = p.dout.data;
  strides_of(p.dout, problem.dout_batch_stride, problem.dout_row_stride, problem.dout_head_stride);
  problem.dq = p.dq.data;
  strides_of(p.dq, problem.dq_batch_stride, problem.dq_row_stride, problem.dq_head_stride);
  problem.dk = p.dk.data;
  strides_of(p.dk, problem.dk_batch_stride, problem.dk_row_stride, problem.dk_head_stride);
  problem.dv = p.dv.data;
  strides_of(p.dv, problem.dv_batch_stride, problem.dv_row_stride, problem.dv_head_stride);
  problem.workspace = p.workspace;
  problem.workspace_bytes = p.workspace_bytes;
  return problem;
}

}  // namespace flashkit::api
