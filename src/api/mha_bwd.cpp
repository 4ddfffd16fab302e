// src/api/mha_bwd.cpp
// \brief The backward entry points. Placeholder until the backward issue lands: every call is
// refused with a clear error, so that callers (the PyTorch front end) can be written against the API.
#include <string>

#include "flashkit/api.h"
#include "flashkit/error.h"

namespace flashkit {
namespace {

[[noreturn]] void not_built(const char* fn) {
  throw Error(std::string(fn) + ": the backward pass is not part of this build of flashkit yet");
}

}  // namespace

void mha_bwd(const MhaBwdParams&, void*) { not_built("mha_bwd"); }
void mha_varlen_bwd(const MhaVarlenBwdParams&, void*) { not_built("mha_varlen_bwd"); }
size_t mha_bwd_workspace_size(const MhaBwdParams&) { not_built("mha_bwd_workspace_size"); }
size_t mha_varlen_bwd_workspace_size(const MhaVarlenBwdParams&) {
  not_built("mha_varlen_bwd_workspace_size");
}

}  // namespace flashkit
