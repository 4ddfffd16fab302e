// src/api/kvcache_fwd_route.h
// \brief mha_fwd_kvcache with many query tokens on the sm90 forward: which calls go there, and the
// call as a forward problem.
//
// The decode kernel packs a kv head's query rows into 16-row mma.sync tiles: it is built for one
// token, or a few, per sequence. With many (chunked prefill against a cache, speculative decoding's
// drafts) it took 1.4x (16 tokens) to 4.3x (256 and more) the time of the sm90 forward on the same
// problem (H200, bf16 d128, 32 / 8 heads, batch 4, 8k and 32k keys; bench/NOTES.md, session 29).
// A call that appends nothing and reads a contiguous cache without a batch index or left pad is a
// forward problem: q against k_cache / v_cache, each batch entry attending to its cache_seqlens[b]
// first keys (FwdProblem::seqused_k; seqlen_k the cache's capacity), causal masks and windows
// aligned to that length's end as the decode aligns them.
#pragma once

#include <string>

#include "common/fwd_problem.h"
#include "common/kvcache_problem.h"

namespace flashkit::api {

// Why `problem` (a validated mha_fwd_kvcache call) is not a forward problem ("" when it is).
std::string kvcache_fwd_unsupported_reason(const KvcacheProblem& problem);

// `problem` (one kvcache_fwd_unsupported_reason passes) as a forward problem: the same q, out, lse,
// masks, scale, softcap and ALiBi; the caches as k and v.
FwdProblem fwd_view_of_kvcache(const KvcacheProblem& problem);

// Whether the automatic choice runs `problem` (a forward problem, see above) on the sm90 forward,
// unsplit, with `pack_group` query heads per token in its tiles, rather than on the decode kernel of
// a GPU with `sm_count` SMs: where mha_fwd makes the same choice for the same problem
// (fwd_prefers_decode against a forward that does not split), since the decode kernel and the
// forward see the same work either way.
bool kvcache_prefers_fwd(const KvcacheProblem& problem, int sm_count, int pack_group);

}  // namespace flashkit::api
