// src/cuda/sm90/bwd_sm90.cpp
// \brief Which problems the sm90 backward kernels cover (see bwd_sm90.h). Plain C++: the dispatcher
// asks before choosing a path.
#include "cuda/sm90/bwd_sm90.h"

#include <string>

#include "cuda/sm80/fwd_sm80.h"

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
  return "";
}

}  // namespace flashkit::sm90
