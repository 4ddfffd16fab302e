"""A script written for flash_attn, switched to flashkit by its import line alone.

    python examples/flash_attn_dropin.py        # needs a CUDA GPU and an installed flashkit

It calls the flash_attn 2.x API the way training and serving code does (fixed-length GQA with a
causal mask and its gradients, packed variable-length sequences, a decode step that appends to a
KV cache, dropout while training) and checks each result against PyTorch's own attention in fp32:
flashkit's error must be within 2x that of PyTorch SDPA's flash backend (FlashAttention-2) on the
same bf16 inputs (the error-ratio rule of docs/TESTING.md). Prints one line per check; exits 1 if
any fails.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

# The one line that changes: `from flash_attn import ...` before.
from flashkit import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

torch.manual_seed(0)
DEVICE, DTYPE = "cuda", torch.bfloat16
failures = []


def sdpa(q, k, v, causal, backend=None):
    """SDPA on [b, s, h, d] tensors, KV heads repeated for GQA; causal only where s_q == s_k (then
    SDPA's top-left mask is flash_attn's bottom-right one)."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    args = [t.transpose(1, 2) for t in (q, k, v)]
    if backend is None:
        out = F.scaled_dot_product_attention(*args, is_causal=causal)
    else:
        with torch.nn.attention.sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*args, is_causal=causal)
    return out.transpose(1, 2)


def check(name, got, fa2, ref):
    err = (got.float() - ref.float()).abs().max().item()
    err_fa2 = (fa2.float() - ref.float()).abs().max().item()
    ok = err <= 2 * err_fa2 + 1e-5
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max error {err:.3g} (SDPA flash: {err_fa2:.3g})")
    if not ok:
        failures.append(name)


def grads(fn, inputs, dout):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return [out] + [t.grad for t in leaves]


# 1. Training step: GQA (16 query heads, 4 KV heads), causal, head dim 128, forward + backward.
q = torch.randn(2, 1024, 16, 128, device=DEVICE, dtype=DTYPE)
k, v = (torch.randn(2, 1024, 4, 128, device=DEVICE, dtype=DTYPE) for _ in range(2))
dout = torch.randn_like(q)
ours = grads(lambda q, k, v: flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
fa2 = grads(lambda q, k, v: sdpa(q, k, v, True, torch.nn.attention.SDPBackend.FLASH_ATTENTION),
            (q, k, v), dout)
ref = grads(lambda q, k, v: sdpa(q, k, v, True), [t.float() for t in (q, k, v)], dout.float())
for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, fa2, ref):
    check(f"flash_attn_func causal GQA {name}", a, b, c)

# 2. Packed variable-length sequences (as a data loader without padding feeds them).
lengths = [300, 17, 1000, 1]
cu_seqlens = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
qkv = torch.randn(sum(lengths), 3, 8, 64, device=DEVICE, dtype=DTYPE)
out = flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                             max(lengths), max(lengths), causal=True)
for b, length in enumerate(lengths):
    rows = slice(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))
    one = [qkv[rows, i][None] for i in range(3)]
    check(f"flash_attn_varlen_func sequence {b} (length {length})", out[rows][None],
          sdpa(*one, True, torch.nn.attention.SDPBackend.FLASH_ATTENTION),
          sdpa(*[t.float() for t in one], True))

# 3. Decode: one new token per sequence appended in place to a KV cache, then attention over it.
batch, cache_len, heads_kv = 4, 2048, 4
k_cache, v_cache = (torch.randn(batch, cache_len, heads_kv, 128, device=DEVICE, dtype=DTYPE)
                    for _ in range(2))
cache_seqlens = torch.tensor([5, 700, 2000, 1500], dtype=torch.int32, device=DEVICE)
q1 = torch.randn(batch, 1, 16, 128, device=DEVICE, dtype=DTYPE)
k1, v1 = (torch.randn(batch, 1, heads_kv, 128, device=DEVICE, dtype=DTYPE) for _ in range(2))
out = flash_attn_with_kvcache(q1, k_cache, v_cache, k1, v1, cache_seqlens=cache_seqlens,
                              causal=True)
for b in range(batch):
    n = int(cache_seqlens[b]) + 1
    assert torch.equal(k_cache[b, n - 1], k1[b, 0]) and torch.equal(v_cache[b, n - 1], v1[b, 0])
    one = (q1[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n])
    check(f"flash_attn_with_kvcache sequence {b} (cache {n})", out[b:b + 1],
          sdpa(*one, False, torch.nn.attention.SDPBackend.FLASH_ATTENTION),
          sdpa(*[t.float() for t in one], False))

# 4. Dropout while training: reproducible under torch.manual_seed, a fresh mask otherwise.
torch.manual_seed(1)
first = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
second = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
torch.manual_seed(1)
replayed = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
ok = torch.equal(first, replayed) and not torch.equal(first, second)
print(f"{'ok  ' if ok else 'FAIL'} dropout: same seed same output, next call a fresh mask")
if not ok:
    failures.append("dropout")

print(f"{len(failures)} of the checks failed" if failures else "all checks passed")
sys.exit(1 if failures else 0)
