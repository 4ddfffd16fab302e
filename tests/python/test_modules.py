"""flashkit.modules against the functions and a plain PyTorch multi-head attention: FlashSelfAttention
and FlashCrossAttention forward to the packed functions; MHA (fused QKV, rotary, GQA) matches the
same computation written with torch's scaled_dot_product_attention, padded and packed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashkit import flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashkit.modules import MHA, FlashCrossAttention, FlashSelfAttention, apply_rotary_emb
from reference import check_close
from test_forward import randn


def test_self_and_cross_attention_modules(device):
    qkv = randn((2, 21, 3, 4, 64), torch.bfloat16, device, 900)
    expected = flash_attn_qkvpacked_func(qkv, causal=True)
    assert torch.equal(FlashSelfAttention(causal=True)(qkv), expected)
    assert torch.equal(FlashSelfAttention()(qkv, causal=True), expected)
    cu = torch.tensor([0, 21, 42], dtype=torch.int32, device=device)
    packed = FlashSelfAttention(causal=True)(qkv.flatten(0, 1), cu_seqlens=cu, max_seqlen=21)
    assert torch.equal(packed, expected.flatten(0, 1))

    q, kv = qkv[:, :, 0], qkv[:, :, 1:]
    assert torch.equal(FlashCrossAttention()(q, kv), flash_attn_kvpacked_func(q, kv))
    cross = FlashCrossAttention()(q.flatten(0, 1), kv.flatten(0, 1), cu_seqlens=cu, max_seqlen=21,
                                  cu_seqlens_k=cu, max_seqlen_k=21)
    assert torch.equal(cross, flash_attn_kvpacked_func(q, kv).flatten(0, 1))


def mha_reference(module: MHA, x: torch.Tensor, upcast: bool) -> torch.Tensor:
    """The MHA module's computation with SDPA, in fp32 (upcast) or the module's dtype."""
    dtype = torch.float32 if upcast else x.dtype
    w_qkv, b_qkv = module.Wqkv.weight.to(dtype), module.Wqkv.bias.to(dtype)
    w_out, b_out = module.out_proj.weight.to(dtype), module.out_proj.bias.to(dtype)
    h, hkv, d = module.num_heads, module.num_heads_kv, module.head_dim
    qkv = F.linear(x.to(dtype), w_qkv, b_qkv).unflatten(-1, (h + 2 * hkv, d))
    q, k, v = qkv.split([h, hkv, hkv], dim=-2)
    cos, sin = module.rotary_emb.cos_sin(torch.arange(x.shape[1], device=x.device))
    q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    k, v = k.repeat_interleave(h // hkv, 2), v.repeat_interleave(h // hkv, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True)
    return F.linear(out.transpose(1, 2).flatten(-2), w_out, b_out)


def test_mha_gqa_rotary(device):
    torch.manual_seed(0)
    module = MHA(128, num_heads=8, num_heads_kv=2, causal=True, rotary_emb_dim=16,
                 device=device, dtype=torch.bfloat16)
    x = randn((2, 37, 128), torch.bfloat16, device, 901)
    with torch.no_grad():
        out = module(x)
        check_close("MHA out", out, mha_reference(module, x, True),
                    mha_reference(module, x, False))
        # The same two sequences packed give the same rows (positions restart per sequence).
        cu = torch.tensor([0, 37, 74], dtype=torch.int32, device=device)
        packed = module(x.flatten(0, 1), cu_seqlens=cu, max_seqlen=37)
        assert torch.equal(packed, out.flatten(0, 1))


def test_mha_kv_cache_decode(device):
    """Prefill a cache with a prompt, then decode token by token: the rows equal one causal pass
    over the whole sequence (the fp32 SDPA reference, error-ratio rule), the rotary running in the
    decode kernel."""
    torch.manual_seed(0)
    module = MHA(128, num_heads=8, num_heads_kv=2, causal=True, rotary_emb_dim=16,
                 device=device, dtype=torch.bfloat16)
    x = randn((2, 37, 128), torch.bfloat16, device, 902)
    prompt = 30
    with torch.no_grad():
        kv_cache = module.allocate_kv_cache(2, 48)
        seqlens = torch.zeros(2, dtype=torch.int32, device=device)
        rows = [module(x[:, :prompt], kv_cache=kv_cache, cache_seqlens=seqlens)]
        seqlens += prompt
        for i in range(prompt, x.shape[1]):
            rows.append(module(x[:, i:i + 1], kv_cache=kv_cache, cache_seqlens=seqlens))
            seqlens += 1
        out = torch.cat(rows, dim=1)
        check_close("MHA decoded", out, mha_reference(module, x, True),
                    mha_reference(module, x, False), factor=3.0)


def test_alibi_slopes_move_with_the_module(device):
    """The slopes are a buffer, as in flash_attn: .to() moves them, state_dict() leaves them out."""
    for module in (FlashSelfAttention(alibi_slopes=torch.rand(4)),
                   FlashCrossAttention(alibi_slopes=torch.rand(4))):
        assert "alibi_slopes" in dict(module.named_buffers())
        assert "alibi_slopes" not in module.state_dict()
        assert module.to(device).alibi_slopes.device.type == device
