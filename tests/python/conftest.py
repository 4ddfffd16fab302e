"""Shared fixtures of the Python tests: the devices they run on, and skips with reasons.

Every test that touches data runs on the CPU (flashkit's reference backend) and on CUDA; the CUDA
cases skip with a reason where no GPU is present, and a (dtype, head dim) that the build left out
(FLASHKIT_HEAD_DIMS / FLASHKIT_DTYPES subsets) skips rather than fails.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import flashkit

FLASHKIT_HAS_CUDA = any(flashkit.cuda_fwd_built(dtype, head_dim)
                        for dtype in (torch.float16, torch.bfloat16)
                        for head_dim in (32, 64, 96, 128, 192, 256))
HAS_CUDA = torch.cuda.is_available() and FLASHKIT_HAS_CUDA
NO_GPU_REASON = ("no CUDA GPU visible to torch" if not torch.cuda.is_available()
                 else "this build of flashkit has no CUDA kernels")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA,
                                                               reason=NO_GPU_REASON))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def padded_head_dim(head_dim: int) -> int:
    return (head_dim + 7) // 8 * 8


def skip_unbuilt(device: str, dtype: torch.dtype, head_dim: int) -> None:
    """Skips a CUDA case whose kernel this build of flashkit left out."""
    if device == "cuda" and not flashkit.cuda_fwd_built(dtype, padded_head_dim(head_dim)):
        pytest.skip(f"this build has no CUDA kernel for {dtype} head dim {head_dim}")


def poison_cuda_allocator(device: str) -> None:
    """Fills free blocks of the caching allocator with NaN, so that an output the kernel fails to
    write shows up as NaN instead of as whatever clean memory held. Both pools: allocations up to
    1 MiB come from the small-block pool's 2 MiB segments, larger ones from the large pool."""
    if device != "cuda":
        return
    small = [torch.full((1 << 18,), float("nan"), device=device) for _ in range(64)]  # 1 MiB each
    large = torch.full((1 << 26,), float("nan"), device=device)  # 256 MiB
    del small, large


def fuzz_seeds(default: range) -> range:
    """The seeds of a CUDA fuzz test: `default`, or range(start, stop) where the environment sets
    FLASHKIT_FUZZ_SEEDS="start-stop" (stop excluded), to run many more seeds on a GPU or one
    failing seed again. A malformed value fails the collection instead of running the default."""
    spec = os.environ.get("FLASHKIT_FUZZ_SEEDS")
    if not spec:
        return default
    match = re.fullmatch(r"(\d+)-(\d+)", spec.strip())
    if not match or int(match[1]) >= int(match[2]):
        raise ValueError(f"FLASHKIT_FUZZ_SEEDS is {spec!r}; expected \"start-stop\" with "
                         "start < stop, e.g. \"0-1000\" (stop excluded)")
    return range(int(match[1]), int(match[2]))
