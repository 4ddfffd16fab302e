// src/cuda/sm90/fwd_sm90.cpp
// \brief Which problems the sm90 forward kernels cover (see fwd_sm90.h). Plain C++: the dispatcher
// asks before choosing a path.
#include "cuda/sm90/fwd_sm90.h"

#include <cstdint>
#include <string>

namespace flashkit::sm90 {
namespace {

// The copy engine reads 16-byte aligned rows with strides that are positive multiples of 16 bytes
// below 2^40, and the epilogue stores O the same way (TMA). A dim of extent 1 has no stride to check.
std::string stride_problem(const char* tensor, const char* dim, int64_t extent, int64_t stride) {
  if (extent == 1) return "";
  if (stride <= 0 || stride % 8 != 0 || stride * 2 >= (int64_t{1} << 40)) {
    return std::string(tensor) + " " + dim + " stride " + std::to_string(stride) +
           " is not a positive multiple of 8 elements (16 bytes) below 2^39";
  }
  return "";
}

}  // namespace

std::string fwd_unsupported_reason(const FwdProblem& p) {
  if (fwd_head_dim_family(p.head_dim) < 0) {
    return "head dim " + std::to_string(p.head_dim) + " is above 256";
  }
  if (p.attn_probs != nullptr) return "return_softmax (attn_probs) is written by the sm80 path";
  const bool varlen = p.is_varlen();
  const struct {
    const char* name;
    const void* data;
    int64_t rows, heads;
    int64_t row_stride, head_stride, batch_stride;
  } tensors[] = {
      {"q", p.q, varlen ? p.total_q : p.seqlen_q, p.heads_q, p.q_row_stride, p.q_head_stride,
       p.q_batch_stride},
      {"k", p.k, varlen ? p.total_k : p.seqlen_k, p.heads_kv, p.k_row_stride, p.k_head_stride,
       p.k_batch_stride},
      {"v", p.v, varlen ? p.total_k : p.seqlen_k, p.heads_kv, p.v_row_stride, p.v_head_stride,
       p.v_batch_stride},
      {"out", p.out, varlen ? p.total_q : p.seqlen_q, p.heads_q, p.out_row_stride,
       p.out_head_stride, p.out_batch_stride},
  };
  for (const auto& t : tensors) {
    if (t.rows <= 0) continue;  // never read or written (e.g. k and v when seqlen_k is 0)
    if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) {
      return std::string(t.name) + " is not 16-byte aligned";
    }
    std::string why = stride_problem(t.name, "row", t.rows, t.row_stride);
    if (why.empty()) why = stride_problem(t.name, "head", t.heads, t.head_stride);
    if (why.empty() && !varlen) why = stride_problem(t.name, "batch", p.batch, t.batch_stride);
    if (!why.empty()) return why;
  }
  return "";
}

}  // namespace flashkit::sm90
