// src/api/validate_fwd.cpp
// \brief The checks of mha_fwd / mha_varlen_fwd and the defaults they resolve (see validate_fwd.h).
//
// Checks run from the most basic to the most specific (presence, dtype, device, rank, sizes,
// shapes, strides and pointers, optional tensors, scalars), so the first message names the root
// cause.
#include "api/validate_fwd.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "api/tensor_checks.h"
#include "flashkit/api.h"
#include "flashkit/error.h"

namespace flashkit::api {
namespace {

// Presence, dtypes and devices of the tensors both entry points share.
void check_common_tensors(const char* fn, const FwdCommon& p) {
  check_defined(fn, "q", p.q, "the queries");
  check_defined(fn, "k", p.k, "the keys");
  check_defined(fn, "v", p.v, "the values");
  check_defined(fn, "out", p.out, "the output, same shape and dtype as q");
  check_defined(fn, "softmax_lse", p.softmax_lse, "the float32 log-sum-exp output");

  if (p.q.dtype != DType::kFloat16 && p.q.dtype != DType::kBFloat16) {
    fail(fn, "q.dtype is ", dtype_name(p.q.dtype), "; supported: float16, bfloat16");
  }
  check_same_dtype_as_q(fn, "k", p.k, p.q);
  check_same_dtype_as_q(fn, "v", p.v, p.q);
  check_same_dtype_as_q(fn, "out", p.out, p.q);
  check_dtype(fn, "softmax_lse", p.softmax_lse, DType::kFloat32);

  check_device_index(fn, p.q);
  check_same_device_as_q(fn, "k", p.k, p.q);
  check_same_device_as_q(fn, "v", p.v, p.q);
  check_same_device_as_q(fn, "out", p.out, p.q);
  check_same_device_as_q(fn, "softmax_lse", p.softmax_lse, p.q);
  if (p.alibi_slopes.defined()) {
    check_dtype(fn, "alibi_slopes", p.alibi_slopes, DType::kFloat32);
    check_same_device_as_q(fn, "alibi_slopes", p.alibi_slopes, p.q);
  }
}

// Strides and pointers of q/k/v/out and softmax_lse, once their shapes are known to be right.
void check_layouts(const char* fn, const FwdCommon& p) {
  check_attention_layouts(fn, p.q, p.k, p.v, p.out, p.softmax_lse);
}

void check_scalars(const char* fn, const FwdCommon& p) {
  check_score_options(fn, p.softmax_scale, p.softcap, p.mask);
  // p = 1 would drop everything and scale by 1 / 0; FlashAttention rejects it too.
  if (!(p.dropout.p >= 0.0f && p.dropout.p < 1.0f)) {
    fail(fn, "dropout.p is ", p.dropout.p, "; it must be in [0, 1)");
  }
  // The CPU backend reads the key on the host; a device rng_state is for the kernels only.
  if (p.dropout.p > 0.0f && p.dropout.rng_state != nullptr &&
      p.q.device.kind == DeviceKind::kCpu) {
    fail(fn, "dropout.rng_state is set (", static_cast<const void*>(p.dropout.rng_state),
         ") with CPU tensors; it is device memory that CUDA kernels read: pass the key as "
         "dropout.seed and dropout.offset");
  }
}

// The outputs (out, softmax_lse) may share memory with no input they are written over while other
// rows still read it: out over k or v, softmax_lse over any attention tensor. out == q (an in-place
// forward) is fine, as in FlashAttention: each query row is read before its own output row is
// written, and no other row reads it; but not with attn_probs, which the CUDA backend recomputes
// from q after the forward has written out. As for the backward's gradients, only the common
// mistake (a view passed twice, same data pointer) is caught.
void check_output_aliasing(const char* fn, const FwdCommon& p) {
  check_own_memory(fn, "out", p.out, {{"k", &p.k}, {"v", &p.v}, {"softmax_lse", &p.softmax_lse}},
                   "out needs memory of its own, apart from k, v and softmax_lse (it may be q: an "
                   "in-place forward)");
  check_own_memory(fn, "softmax_lse", p.softmax_lse, {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}},
                   "softmax_lse needs memory of its own");
  if (p.attn_probs.defined() && shares_data(p.out, p.q)) {
    fail(fn, "out.data (", p.out.data, ") is also q.data with attn_probs requested; the "
         "probabilities are recomputed from q after out is written, so out needs memory of its own "
         "when attn_probs is given");
  }
}

// The optional return_softmax output: [batch, heads_q, seqlen_q, seqlen_k], each length rounded up
// by attn_probs_length (api.h), in q's dtype on q's device.
void check_attn_probs(const char* fn, const FwdCommon& p, int64_t batch, int64_t heads_q,
                      int64_t seqlen_q, int64_t seqlen_k, FwdProblem& problem) {
  if (!p.attn_probs.defined()) return;
  const TensorView& view = p.attn_probs;
  check_same_dtype_as_q(fn, "attn_probs", view, p.q);
  check_same_device_as_q(fn, "attn_probs", view, p.q);
  check_rank(fn, "attn_probs", view, 4, "[batch, heads_q, seqlen_q_rounded, seqlen_k_rounded]");
  check_shape(fn, "attn_probs", view,
              {batch, heads_q, attn_probs_length(seqlen_q), attn_probs_length(seqlen_k)},
              "([batch, heads_q, seqlen_q, seqlen_k] with both lengths rounded up to a multiple "
              "of 128; varlen: max_seqlen_q and max_seqlen_k)");
  check_last_dim_contiguous(fn, "attn_probs", view);
  check_data_pointer(fn, "attn_probs", view);
  // Written after the forward, from q, k and the lse: the common mistake of passing one of them
  // (or out) again would overwrite an input.
  check_own_memory(fn, "attn_probs", view,
                   {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out},
                    {"softmax_lse", &p.softmax_lse}},
                   "attn_probs needs memory of its own");
  problem.attn_probs = view.data;
  problem.attn_probs_batch_stride = view.strides[0];
  problem.attn_probs_head_stride = view.strides[1];
  problem.attn_probs_row_stride = view.strides[2];
  problem.attn_probs_rows = to_int(fn, "attn_probs.size(2)", view.sizes[2]);
  problem.attn_probs_cols = to_int(fn, "attn_probs.size(3)", view.sizes[3]);
}

// The fields both entry points fill the same way. `seqlen_q` / `seqlen_k` are the lengths (fixed)
// or their bounds (varlen) that the window defaults are resolved against.
void fill_options(const FwdCommon& p, int seqlen_q, int seqlen_k, FwdProblem& problem) {
  problem.softmax_scale =
      p.softmax_scale == 0.0f
          ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(problem.head_dim)))
          : p.softmax_scale;
  problem.softcap = p.softcap;

  const bool has_alibi = p.alibi_slopes.defined();
  // One query row sees every key under the causal mask: turning it off changes nothing but lets
  // the kernel take the unmasked path. ALiBi keeps it, as FlashAttention does.
  const bool causal = p.mask.causal && !(seqlen_q == 1 && !has_alibi);
  int window_left = p.mask.window_left;
  int window_right = p.mask.window_right;
  if (window_left >= seqlen_k) window_left = -1;
  if (window_right >= seqlen_k) window_right = -1;
  if (causal) window_right = 0;
  problem.window_left = window_left;
  problem.window_right = window_right;
  problem.causal = window_left < 0 && window_right == 0;

  problem.dropout_p = p.dropout.p;
  problem.dropout_seed = p.dropout.seed;
  problem.dropout_offset = p.dropout.offset;
  problem.dropout_rng_state = p.dropout.p > 0.0f ? p.dropout.rng_state : nullptr;
}

// Pointers and strides of the validated tensors. q/k/v/out are [batch, seqlen, heads, dim] or, for
// varlen, [total, heads, dim]: row and head strides are those of the last-but-two and last-but-one
// dims either way, and a varlen batch has no batch stride (cu_seqlens gives its offsets).
void fill_tensors(const FwdCommon& p, int64_t alibi_batch_stride, FwdProblem& problem) {
  problem.dtype = p.q.dtype;
  const struct {
    const TensorView& view;
    int64_t& batch_stride;
    int64_t& row_stride;
    int64_t& head_stride;
  } tensors[] = {
      {p.q, problem.q_batch_stride, problem.q_row_stride, problem.q_head_stride},
      {p.k, problem.k_batch_stride, problem.k_row_stride, problem.k_head_stride},
      {p.v, problem.v_batch_stride, problem.v_row_stride, problem.v_head_stride},
      {p.out, problem.out_batch_stride, problem.out_row_stride, problem.out_head_stride},
  };
  for (const auto& t : tensors) {
    t.batch_stride = t.view.rank == 4 ? t.view.strides[0] : 0;
    t.row_stride = t.view.stride(-3);
    t.head_stride = t.view.stride(-2);
  }
  problem.q = p.q.data;
  problem.k = p.k.data;
  problem.v = p.v.data;
  problem.out = p.out.data;
  problem.lse = static_cast<float*>(p.softmax_lse.data);
  problem.lse_batch_stride = p.softmax_lse.strides[0];
  problem.lse_head_stride = p.softmax_lse.strides[1];
  problem.alibi_slopes = static_cast<const float*>(p.alibi_slopes.data);
  problem.alibi_batch_stride = alibi_batch_stride;
}

// cu_seqlens_q / cu_seqlens_k / seqused_k of a varlen batch: shapes here, contents (CPU only) in
// check_varlen_lengths. Returns the batch size.
int check_varlen_index_tensors(const char* fn, const MhaVarlenFwdParams& p) {
  const std::pair<const char*, const TensorView*> cu_seqlens[] = {
      {"cu_seqlens_q", &p.cu_seqlens_q}, {"cu_seqlens_k", &p.cu_seqlens_k}};
  for (const auto& [name, view] : cu_seqlens) {
    check_defined(fn, name, *view, "int32 [batch + 1] prefix sums of the sequence lengths");
    check_dtype(fn, name, *view, DType::kInt32);
    check_same_device_as_q(fn, name, *view, p.q);
    check_rank(fn, name, *view, 1, "[batch + 1]");
    check_contiguous(fn, name, *view);
    check_data_pointer(fn, name, *view);
  }
  if (p.cu_seqlens_q.sizes[0] < 2) {
    fail(fn, "cu_seqlens_q has shape ", p.cu_seqlens_q.shape_string(),
         "; it must be [batch + 1] with batch >= 1");
  }
  if (p.cu_seqlens_k.sizes[0] != p.cu_seqlens_q.sizes[0]) {
    fail(fn, "cu_seqlens_k has shape ", p.cu_seqlens_k.shape_string(), " but cu_seqlens_q has ",
         p.cu_seqlens_q.shape_string(), "; both must be [batch + 1]");
  }
  const int batch = to_int(fn, "batch (cu_seqlens_q.size(0) - 1)", p.cu_seqlens_q.sizes[0] - 1);
  if (p.seqused_k.defined()) {
    check_dtype(fn, "seqused_k", p.seqused_k, DType::kInt32);
    check_same_device_as_q(fn, "seqused_k", p.seqused_k, p.q);
    check_rank(fn, "seqused_k", p.seqused_k, 1, "[batch]");
    check_shape(fn, "seqused_k", p.seqused_k, {batch}, "([batch])");
    check_contiguous(fn, "seqused_k", p.seqused_k);
    check_data_pointer(fn, "seqused_k", p.seqused_k);
  }
  if (p.max_seqlen_q < 0) fail(fn, "max_seqlen_q is ", p.max_seqlen_q, "; it must be >= 0");
  if (p.max_seqlen_k < 0) fail(fn, "max_seqlen_k is ", p.max_seqlen_k, "; it must be >= 0");
  return batch;
}

// The prefix sums must stay inside q and k and every length inside its max_seqlen bound, or the
// CPU backend would index out of bounds. (On CUDA the contents live on the device and stay the
// caller's promise.)
void check_prefix_sums(const char* fn, const char* name, const int* cu, int batch, int64_t total,
                       const char* total_name) {
  if (cu[0] < 0) fail(fn, name, "[0] is ", cu[0], "; token offsets must be >= 0");
  for (int b = 0; b < batch; ++b) {
    if (cu[b + 1] < cu[b]) {
      fail(fn, name, "[", b + 1, "] = ", cu[b + 1], " is less than ", name, "[", b, "] = ", cu[b],
           "; the prefix sums must be nondecreasing");
    }
  }
  if (cu[batch] > total) {
    fail(fn, name, "[", batch, "] is ", cu[batch], " but ", total_name, " is ", total,
         "; the sequences must fit in the packed tensor");
  }
}

void check_varlen_lengths(const char* fn, const MhaVarlenFwdParams& p, int batch) {
  const auto* cu_q = static_cast<const int*>(p.cu_seqlens_q.data);
  const auto* cu_k = static_cast<const int*>(p.cu_seqlens_k.data);
  const auto* used_k = static_cast<const int*>(p.seqused_k.data);
  check_prefix_sums(fn, "cu_seqlens_q", cu_q, batch, p.q.sizes[0], "q.size(0) (total_q)");
  check_prefix_sums(fn, "cu_seqlens_k", cu_k, batch, p.k.sizes[0], "k.size(0) (total_k)");
  for (int b = 0; b < batch; ++b) {
    const int len_q = cu_q[b + 1] - cu_q[b];
    const int stored_len_k = cu_k[b + 1] - cu_k[b];
    if (len_q > p.max_seqlen_q) {
      fail(fn, "sequence ", b, " has ", len_q, " query tokens (cu_seqlens_q) but max_seqlen_q is ",
           p.max_seqlen_q, "; max_seqlen_q must bound every query length");
    }
    if (used_k != nullptr && (used_k[b] < 0 || used_k[b] > stored_len_k)) {
      fail(fn, "seqused_k[", b, "] is ", used_k[b], "; it must be in [0, ", stored_len_k,
           "], the key length of sequence ", b, " in cu_seqlens_k");
    }
    const int len_k = used_k != nullptr ? used_k[b] : stored_len_k;
    if (len_k > p.max_seqlen_k) {
      fail(fn, "sequence ", b, " uses ", len_k, " keys but max_seqlen_k is ", p.max_seqlen_k,
           "; max_seqlen_k must bound every key length");
    }
  }
}

}  // namespace

FwdProblem validate_mha_fwd(const MhaFwdParams& p, const char* fn) {
  check_common_tensors(fn, p);
  check_rank(fn, "q", p.q, 4, "[batch, seqlen_q, heads_q, head_dim]");
  check_rank(fn, "k", p.k, 4, "[batch, seqlen_k, heads_kv, head_dim]");

  const int64_t batch = p.q.sizes[0];
  const int64_t seqlen_q = p.q.sizes[1];
  const int64_t heads_q = p.q.sizes[2];
  const int64_t head_dim = p.q.sizes[3];
  const int64_t seqlen_k = p.k.sizes[1];
  const int64_t heads_kv = p.k.sizes[2];
  if (batch <= 0) fail(fn, "batch (q.size(0)) is ", batch, "; it must be >= 1");
  check_head_counts_and_dim(fn, heads_q, "k", heads_kv, head_dim);

  check_shape(fn, "k", p.k, {batch, seqlen_k, heads_kv, head_dim},
              "([batch, seqlen_k, heads_kv, head_dim], batch and head_dim from q)");
  check_shape(fn, "v", p.v, {batch, seqlen_k, heads_kv, head_dim},
              "(the shape of k: [batch, seqlen_k, heads_kv, head_dim])");
  check_shape(fn, "out", p.out, {batch, seqlen_q, heads_q, head_dim}, "(the shape of q)");
  check_shape(fn, "softmax_lse", p.softmax_lse, {batch, heads_q, seqlen_q},
              "([batch, heads_q, seqlen_q])");
  check_layouts(fn, p);
  check_output_aliasing(fn, p);
  const int64_t alibi_batch_stride =
      p.alibi_slopes.defined() ? check_alibi(fn, p.alibi_slopes, batch, heads_q) : 0;
  check_scalars(fn, p);

  FwdProblem problem;
  problem.batch = to_int(fn, "batch (q.size(0))", batch);
  problem.heads_q = to_int(fn, "heads_q (q.size(2))", heads_q);
  problem.heads_kv = to_int(fn, "heads_kv (k.size(2))", heads_kv);
  problem.head_dim = static_cast<int>(head_dim);
  problem.seqlen_q = to_int(fn, "seqlen_q (q.size(1))", seqlen_q);
  problem.seqlen_k = to_int(fn, "seqlen_k (k.size(1))", seqlen_k);
  fill_tensors(p, alibi_batch_stride, problem);
  fill_options(p, problem.seqlen_q, problem.seqlen_k, problem);
  check_attn_probs(fn, p, batch, heads_q, seqlen_q, seqlen_k, problem);
  return problem;
}

FwdProblem validate_mha_varlen_fwd(const MhaVarlenFwdParams& p, const char* fn) {
  check_common_tensors(fn, p);
  const int batch = check_varlen_index_tensors(fn, p);
  check_rank(fn, "q", p.q, 3, "[total_q, heads_q, head_dim]");
  check_rank(fn, "k", p.k, 3, "[total_k, heads_kv, head_dim]");

  const int64_t total_q = p.q.sizes[0];
  const int64_t heads_q = p.q.sizes[1];
  const int64_t head_dim = p.q.sizes[2];
  const int64_t total_k = p.k.sizes[0];
  const int64_t heads_kv = p.k.sizes[1];
  check_head_counts_and_dim(fn, heads_q, "k", heads_kv, head_dim);

  check_shape(fn, "k", p.k, {total_k, heads_kv, head_dim},
              "([total_k, heads_kv, head_dim], head_dim from q)");
  check_shape(fn, "v", p.v, {total_k, heads_kv, head_dim},
              "(the shape of k: [total_k, heads_kv, head_dim])");
  check_shape(fn, "out", p.out, {total_q, heads_q, head_dim}, "(the shape of q)");
  check_shape(fn, "softmax_lse", p.softmax_lse, {batch, heads_q, p.max_seqlen_q},
              "([batch, heads_q, max_seqlen_q], batch = cu_seqlens_q.size(0) - 1)");
  check_layouts(fn, p);
  check_output_aliasing(fn, p);
  const int64_t alibi_batch_stride =
      p.alibi_slopes.defined() ? check_alibi(fn, p.alibi_slopes, batch, heads_q) : 0;
  check_scalars(fn, p);
  if (p.q.device.kind == DeviceKind::kCpu) check_varlen_lengths(fn, p, batch);

  FwdProblem problem;
  problem.batch = batch;
  problem.heads_q = to_int(fn, "heads_q (q.size(1))", heads_q);
  problem.heads_kv = to_int(fn, "heads_kv (k.size(1))", heads_kv);
  problem.head_dim = static_cast<int>(head_dim);
  problem.seqlen_q = p.max_seqlen_q;
  problem.seqlen_k = p.max_seqlen_k;
  fill_tensors(p, alibi_batch_stride, problem);
  problem.cu_seqlens_q = static_cast<const int*>(p.cu_seqlens_q.data);
  problem.cu_seqlens_k = static_cast<const int*>(p.cu_seqlens_k.data);
  problem.seqused_k = static_cast<const int*>(p.seqused_k.data);
  problem.total_q = total_q;
  problem.total_k = total_k;
  fill_options(p, problem.seqlen_q, problem.seqlen_k, problem);
  check_attn_probs(fn, p, batch, heads_q, p.max_seqlen_q, p.max_seqlen_k, problem);
  return problem;
}

}  // namespace flashkit::api

namespace flashkit {

int64_t attn_probs_length(int64_t seqlen) {
  constexpr int64_t kRounding = 128;
  return seqlen <= 0 ? 0 : (seqlen + kRounding - 1) / kRounding * kRounding;
}

}  // namespace flashkit
