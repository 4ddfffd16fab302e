// src/api/validate_nsa.h
// \brief From NsaFwdParams / NsaBwdParams to an NsaProblem / NsaBwdProblem: every check, every
// default, no side effects.
//
// Like validate_fwd, it reads only the views' metadata and never calls the CUDA runtime, so bad
// input fails before a device is touched. The contents of block_indices and block_counts are not
// checked on any backend: every value is valid (nsa_params.h says what out-of-range ones mean).
#pragma once

#include "common/nsa_problem.h"
#include "flashkit/nsa_params.h"

namespace flashkit::api {

// Throws flashkit::Error("nsa_fwd: ...") naming the argument, its value and what is supported.
NsaProblem validate_nsa_fwd(const NsaFwdParams& params);

// Throws flashkit::Error("nsa_bwd: ..."). The workspace is copied into the problem unchecked: the
// dispatcher compares it with the backend's size.
NsaBwdProblem validate_nsa_bwd(const NsaBwdParams& params);

}  // namespace flashkit::api
