"""flashkit: exact, fast attention for NVIDIA GPUs, with flash_attn 2.x's Python API.

    from flashkit import flash_attn_func   # instead of: from flash_attn import flash_attn_func

CPU tensors run flashkit's fp64 reference backend with the same semantics, so code using flashkit
runs (slowly) without a GPU. See flashkit.flash_attn_interface for shapes and semantics,
flashkit.modules for the nn.Module wrappers, flashkit.bert_padding for flash_attn's unpad_input /
pad_input, and flashkit.nsa for native sparse attention (nsa_selection_attn_func,
native_sparse_attn_func).
"""

import torch  # noqa: F401  (loads libtorch before flashkit._C)

from flashkit._ops import cuda_bwd_built, cuda_fwd_built, cuda_kvcache_built, cuda_nsa_built
from flashkit.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flashkit.nsa import native_sparse_attn_func, nsa_selection_attn_func

__version__ = "0.1.0"

__all__ = [
    "cuda_bwd_built",
    "cuda_fwd_built",
    "cuda_kvcache_built",
    "cuda_nsa_built",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "native_sparse_attn_func",
    "nsa_selection_attn_func",
]
