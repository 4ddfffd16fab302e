"""flashkit as a transformers attention implementation (registered as flashkit_hf.NAME): a small randomly initialised Llama-style
model (GQA, a few layers, no downloaded weights) gives the same logits under "flashkit" as under
"sdpa" (error-ratio rule against an fp32 sdpa model) for a padded batch and a packed varlen batch,
and one training step's gradients match."""

from __future__ import annotations

import copy

import pytest
import torch

from reference import check_close

transformers = pytest.importorskip("transformers")
import flashkit.integrations.transformers as flashkit_hf  # noqa: E402

DTYPE = torch.bfloat16


def make_models(device):
    """The same random weights as (flashkit bf16, sdpa bf16, sdpa fp32) models."""
    flashkit_hf.register()
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    models = {}
    for name, impl, dtype in (("flashkit", flashkit_hf.NAME, DTYPE), ("sdpa", "sdpa", DTYPE),
                              ("ref", "sdpa", torch.float32)):
        model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config),
                                                          attn_implementation=impl)
        model.load_state_dict(base.state_dict())
        models[name] = model.to(device=device, dtype=dtype).eval()
        assert model.config._attn_implementation == impl
    return models


def check_logits(name, got, ref, lowp, keep):
    check_close(name, got[keep], ref[keep], lowp[keep])


@torch.no_grad()
def test_padded_batch_logits_match_sdpa(device):
    models = make_models(device)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 96, (3, 19), device=device)
    mask = torch.ones(3, 19, dtype=torch.long, device=device)
    mask[1, :6] = 0   # left padding
    mask[2, :11] = 0
    logits = {name: m(input_ids=input_ids, attention_mask=mask).logits.float()
              for name, m in models.items()}
    check_logits("padded-batch logits", logits["flashkit"], logits["ref"], logits["sdpa"],
                 mask.bool())


@torch.no_grad()
def test_packed_batch_logits_match_sdpa(device):
    models = make_models(device)
    torch.manual_seed(2)
    lengths = [7, 12, 1, 9]
    sequences = [torch.randint(0, 96, (n,), device=device) for n in lengths]
    packed = torch.cat(sequences)[None]
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    got = models["flashkit"](input_ids=packed, position_ids=position_ids).logits.float()[0]
    # The reference runs each sequence on its own.
    ref = torch.cat([models["ref"](input_ids=s[None]).logits.float()[0] for s in sequences])
    lowp = torch.cat([models["sdpa"](input_ids=s[None]).logits.float()[0] for s in sequences])
    check_close("packed-batch logits", got, ref, lowp)


def test_training_step_gradients_match_sdpa(device):
    models = make_models(device)
    torch.manual_seed(3)
    input_ids = torch.randint(0, 96, (2, 16), device=device)
    mask = torch.ones(2, 16, dtype=torch.long, device=device)
    mask[1, :5] = 0
    grads = {}
    for name, model in models.items():
        model.train()
        loss = model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss
        loss.backward()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters()
                       if "self_attn" in n and p.grad is not None}
    assert grads["flashkit"].keys() == grads["ref"].keys() and grads["flashkit"]
    for param in grads["ref"]:
        check_close(f"grad of {param}", grads["flashkit"][param], grads["ref"][param],
                    grads["sdpa"][param], factor=3.0)


def test_key_ranges_of_padding_masks():
    """Left / right padding and empty rows give one run per row; a hole gives None; the result is
    kept on the mask for the next layers and recomputed after an in-place change."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    start, end = flashkit_hf._key_ranges(mask, 5)
    assert start.tolist() == [2, 0, 0, 0] and end.tolist() == [5, 3, 0, 5]
    assert flashkit_hf._key_ranges(mask, 5)[0] is start
    assert flashkit_hf._key_ranges(mask, 4)[1].tolist() == [4, 3, 0, 4]  # a shorter key range
    mask[0, 2] = 0
    assert flashkit_hf._key_ranges(mask, 5)[0].tolist() == [3, 0, 0, 0]
    assert flashkit_hf._key_ranges(torch.tensor([[1, 0, 1]]), 3) is None
    with torch.inference_mode():  # a mask made there tracks no version: computed, not kept
        inference_mask = torch.tensor([[0, 1, 1]])
    assert flashkit_hf._key_ranges(inference_mask, 3)[0].tolist() == [1]
    assert getattr(inference_mask, "_flashkit_key_ranges", None) is None


@pytest.mark.parametrize("hole", [False, True], ids=["runs", "hole"])
def test_decoded_token_of_a_padded_batch(device, hole):
    """One query token per row against a padded key mask, as generate() decodes a padded batch:
    runs of kept keys go through flash_attn_with_kvcache in place, a mask with a hole through the
    varlen gather; both match softmax attention over each row's kept keys (fp32)."""
    torch.manual_seed(5)
    b, hq, hk, length, d = 3, 4, 2, 37, 64
    q = torch.randn(b, hq, 1, d, device=device).to(DTYPE)
    k = torch.randn(b, hk, length, d, device=device).to(DTYPE)
    v = torch.randn(b, hk, length, d, device=device).to(DTYPE)
    mask = torch.ones(b, length, dtype=torch.long, device=device)
    mask[0, :5] = 0  # left padding
    mask[1, -7:] = 0  # right padding
    if hole:
        mask[2, 10] = 0
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = flashkit_hf.flashkit_attention_forward(module, q, k, v, mask, scaling=d ** -0.5)
    for row in range(b):
        keep = mask[row].bool()
        kr = k[row].float().repeat_interleave(hq // hk, 0)[:, keep]
        vr = v[row].float().repeat_interleave(hq // hk, 0)[:, keep]
        weights = torch.softmax(q[row].float() @ kr.transpose(1, 2) * d ** -0.5, dim=-1)
        ref = (weights @ vr).transpose(0, 1)  # [1, hq, d]
        torch.testing.assert_close(out[row].float(), ref, atol=2e-2, rtol=2e-2)
