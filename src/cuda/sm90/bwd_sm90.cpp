// src/cuda/sm90/bwd_sm90.cpp
// \brief Which problems the sm90 backward kernels cover (see bwd_sm90.h). Plain C++: the dispatcher
// asks before choosing a path.
#include "cuda/sm90/bwd_sm90.h"

#include <string>

#include "cuda/sm80/fwd_sm80.h"
#include "cuda/sm90/tma_layout.h"

namespace flashkit::sm90 {

std::string bwd_unsupported_reason(const BwdProblem& problem) {
  const FwdProblem& p = problem.fwd;
  const int family = sm80::fwd_head_dim_family(p.head_dim);
  bool covered = false;
  for (int f : kBwdHeadDimFamilies) covered |= f == family;
  if (!covered) {
    return "head dim " + std::to_string(p.head_dim) + " (family " + std::to_string(family) +
           ") is not one of the sm90 backward's families 64, 128 and 256";
  }
  // The copy engine reads q and dout (K, V and the rest are read by the threads).
  const bool varlen = p.is_varlen();
  const int64_t rows = p.q_tensor_rows();
  const TmaTensorLayout tensors[] = {
      {"q", p.q, rows, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride},
      {"dout", problem.dout, rows, p.heads_q, p.batch, problem.dout_row_stride, problem.dout_head_stride,
       problem.dout_batch_stride},
  };
  for (const TmaTensorLayout& t : tensors) {
    if (std::string why = tma_layout_problem(t, varlen); !why.empty()) return why;
  }
  return "";
}

}  // namespace flashkit::sm90
