"""flashkit's transformers attention (flashkit_hf.NAME) across the model families and calls that
users run: each case builds the same small random model (no downloaded weights) under
"fk_attention" (bf16), "eager" (bf16) and "eager" (fp32, the reference) and checks flashkit's
logits by the error-ratio rule against the bf16 eager model. Where flashkit cannot express what a
model asks for (attention sinks, T5's position bias, a 4D mask), it must refuse, not drop it.

Found by an audit against transformers 5.23: static caches, encoder-decoder cross-attention with a
padded encoder, multi-head latent attention (v head dim < q head dim), fp32 activations under
autocast, packed position ids that do not restart at 0 or that come in a batch of several rows."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from reference import check_close

transformers = pytest.importorskip("transformers")
import flashkit.integrations.transformers as flashkit_hf  # noqa: E402

LOWP = torch.bfloat16
VOCAB = 96


def tiny(config_cls, **extra):
    """A tiny decoder config (GQA, 2 layers, head dim 16)."""
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    sizes.update(extra)
    return config_cls(**sizes)


def make_models(model_cls, config, device, impls=("fk", "eager", "ref")):
    """The same random weights under flashkit (bf16), eager (bf16) and eager (fp32)."""
    flashkit_hf.register()
    table = {"fk": (flashkit_hf.NAME, LOWP), "eager": ("eager", LOWP),
             "ref": ("eager", torch.float32), "fk32": (flashkit_hf.NAME, torch.float32)}
    torch.manual_seed(0)
    base = model_cls._from_config(copy.deepcopy(config), attn_implementation="eager")
    models = {}
    for name in impls:
        impl, dtype = table[name]
        model = model_cls._from_config(copy.deepcopy(config), attn_implementation=impl)
        model.load_state_dict(base.state_dict())
        models[name] = model.to(device=device, dtype=dtype).eval()
    return models


def check_models(name, outs, keep=None, factor=3.0):
    pick = (lambda t: t.float()[keep]) if keep is not None else (lambda t: t.float())
    check_close(name, pick(outs["fk"]), pick(outs["ref"]), pick(outs["eager"]), factor=factor)


def padded(batch, length, device, left=True):
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    for row in range(1, batch):
        cut = (7 * row) % (length - 2) + 1
        if left:
            mask[row, :cut] = 0
        else:
            mask[row, length - cut:] = 0
    return mask


# ---- decoders: sliding windows, softcapping, scaling, head dims ------------------------------

DECODERS = {
    "llama-gqa": lambda: (transformers.LlamaForCausalLM, tiny(transformers.LlamaConfig)),
    "llama-hd12": lambda: (transformers.LlamaForCausalLM,
                           tiny(transformers.LlamaConfig, hidden_size=48, head_dim=12)),
    "mistral-sw6": lambda: (transformers.MistralForCausalLM,
                            tiny(transformers.MistralConfig, sliding_window=6)),
    "gemma2": lambda: (transformers.Gemma2ForCausalLM,
                       tiny(transformers.Gemma2Config, head_dim=16, sliding_window=6,
                            query_pre_attn_scalar=37, attn_logit_softcapping=5.0)),
    "gemma3": lambda: (transformers.Gemma3ForCausalLM,
                       tiny(transformers.Gemma3TextConfig, head_dim=16, sliding_window=6,
                            query_pre_attn_scalar=37, sliding_window_pattern=2)),
    # Qwen2-7B's 7 query heads per kv head (28 / 4), with biased q / k / v projections.
    "qwen2-g7": lambda: (transformers.Qwen2ForCausalLM,
                         tiny(transformers.Qwen2Config, hidden_size=112, num_attention_heads=7,
                              num_key_value_heads=1)),
}


@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
@pytest.mark.parametrize("family", sorted(DECODERS))
@torch.no_grad()
def test_decoder_padded_logits_match_eager(device, family, left):
    models = make_models(*DECODERS[family](), device)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 30), device=device)
    mask = padded(3, 30, device, left)
    outs = {k: m(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for k, m in models.items()}
    check_models(f"{family} padded logits", outs, mask.bool())


def decode_stepwise(model, ids, mask, prompt, cache):
    """Prefill `prompt` tokens, then decode the rest one token at a time through `cache`."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = [model(input_ids=ids[:, :prompt], attention_mask=mask[:, :prompt],
                    position_ids=positions[:, :prompt], past_key_values=cache,
                    use_cache=True).logits]
    for t in range(prompt, ids.shape[1]):
        logits.append(model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1],
                            position_ids=positions[:, t:t + 1], past_key_values=cache,
                            use_cache=True).logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama-gqa", "mistral-sw6", "gemma2", "gemma3"])
@torch.no_grad()
def test_decoder_kv_cache_decode_matches_eager(device, family, cache):
    """generate()'s calls with a left-padded batch: a 14-token prompt, then 8 single tokens. A
    static cache (cache_implementation="static") hands the attention max_cache_len keys and a mask
    covering the ones written so far."""
    model_cls, config = DECODERS[family]()
    models = make_models(model_cls, config, device)
    torch.manual_seed(2)
    ids = torch.randint(1, VOCAB, (3, 22), device=device)
    mask = padded(3, 22, device, left=True)
    outs = {}
    for k, m in models.items():
        kv = (transformers.StaticCache(config=m.config, max_cache_len=48) if cache == "static"
              else transformers.DynamicCache(config=m.config))
        outs[k] = decode_stepwise(m, ids, mask, 14, kv)
    check_models(f"{family} {cache}-cache decode", outs, mask.bool())


@pytest.mark.parametrize("pack", ["0", "1"], ids=["unpacked", "packed"])
@torch.no_grad()
def test_qwen2_packed_query_heads_match_eager(device, monkeypatch, pack):
    """G = 7 with the sm90 forward's query heads packed into its tiles wherever it can, and never
    (FLASHKIT_SM90_PACK_GQA, read at each call; elsewhere than Hopper both run the same kernel):
    padded prefill logits, then single-token decode steps through a dynamic cache."""
    monkeypatch.setenv("FLASHKIT_SM90_PACK_GQA", pack)
    model_cls, config = DECODERS["qwen2-g7"]()
    models = make_models(model_cls, config, device)
    torch.manual_seed(4)
    ids = torch.randint(1, VOCAB, (3, 40), device=device)
    mask = padded(3, 40, device, left=True)
    outs = {k: decode_stepwise(m, ids, mask, 33, transformers.DynamicCache(config=m.config))
            for k, m in models.items()}
    check_models(f"qwen2 G = 7 (pack {pack}) prefill + decode", outs, mask.bool())


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama-gqa", "mistral-sw6", "gemma3"])
@torch.no_grad()
def test_generate_logits_match_eager(device, family, cache, pad):
    """model.generate(): flashkit's logits at each generated step against the eager models run
    without a cache on the same tokens. generate() drops an all-ones mask unless the
    implementation's name says "flash", so a static cache reaches flashkit without a mask."""
    models = make_models(*DECODERS[family](), device)
    torch.manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 12), device=device)
    mask = padded(3, 12, device, left=True) if pad else torch.ones_like(ids)
    new = 10
    out = models["fk"].generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                do_sample=False, cache_implementation=cache, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
    got = torch.stack(out.logits, 1)
    full_mask = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype, device=device)], 1)
    outs = {"fk": got}
    for k in ("eager", "ref"):
        outs[k] = models[k](input_ids=out.sequences[:, :-1], attention_mask=full_mask[:, :-1],
                            use_cache=False).logits[:, ids.shape[1] - 1:]
    check_models(f"{family} generate ({cache} cache)", outs)


# ---- packed sequences ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["restart-at-0", "first-continues", "two-rows"])
@torch.no_grad()
def test_packed_position_ids_match_eager(device, layout):
    """Packed sequences are split where the position ids stop counting up by 1, as transformers'
    eager and sdpa masks split them (masking_utils.find_packed_sequence_indices), also when the
    first sequence continues a document (positions 5, 6, ...) or the batch has several rows."""
    models = make_models(transformers.LlamaForCausalLM, tiny(transformers.LlamaConfig), device)
    torch.manual_seed(4)
    if layout == "two-rows":
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6],
                                  [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]], device=device)
    else:
        first = 5 if layout == "first-continues" else 0
        positions = torch.cat([torch.arange(first, first + 7), torch.arange(12),
                               torch.arange(1), torch.arange(9)]).to(device)[None]
    ids = torch.randint(0, VOCAB, positions.shape, device=device)
    outs = {k: m(input_ids=ids, position_ids=positions, use_cache=False).logits
            for k, m in models.items()}
    check_models(f"packed ({layout}) logits", outs)


# ---- encoders and encoder-decoders -----------------------------------------------------------

@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
@torch.no_grad()
def test_bert_padded_matches_eager(device, left):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=64)
    models = make_models(transformers.BertModel, config, device)
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 20), device=device)
    mask = padded(3, 20, device, left)
    outs = {k: m(input_ids=ids, attention_mask=mask).last_hidden_state for k, m in models.items()}
    check_models("bert padded hidden states", outs, mask.bool())


def bart():
    return transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2,
                                   decoder_layers=2, encoder_attention_heads=4,
                                   decoder_attention_heads=4, encoder_ffn_dim=128,
                                   decoder_ffn_dim=128, max_position_embeddings=64,
                                   init_std=0.1)


@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
@torch.no_grad()
def test_bart_cross_attention_padded_encoder_matches_eager(device, left):
    """The decoder's cross-attention gets the encoder's 2D mask (over the keys): its 9 queries
    are all real, whatever the encoder mask's last 9 columns say."""
    models = make_models(transformers.BartForConditionalGeneration, bart(), device)
    torch.manual_seed(6)
    src = torch.randint(3, VOCAB, (3, 20), device=device)
    tgt = torch.randint(3, VOCAB, (3, 9), device=device)
    mask = padded(3, 20, device, left)
    outs = {k: m(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
            for k, m in models.items()}
    check_models("bart logits, padded encoder", outs)


@torch.no_grad()
def test_bart_decode_with_padded_encoder_matches_eager(device):
    models = make_models(transformers.BartForConditionalGeneration, bart(), device)
    torch.manual_seed(7)
    src = torch.randint(3, VOCAB, (3, 20), device=device)
    tgt = torch.randint(3, VOCAB, (3, 6), device=device)
    mask = padded(3, 20, device, left=False)
    outs = {}
    for k, m in models.items():
        encoded = m.get_encoder()(input_ids=src, attention_mask=mask)
        cache = transformers.EncoderDecoderCache(transformers.DynamicCache(),
                                                 transformers.DynamicCache())
        steps = [m(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=tgt[:, t:t + 1],
                   past_key_values=cache, use_cache=True).logits for t in range(tgt.shape[1])]
        outs[k] = torch.cat(steps, 1)
    check_models("bart step-by-step decode, padded encoder", outs)


# ---- multi-head latent attention, autocast ---------------------------------------------------

@torch.no_grad()
def test_deepseek_v3_mla_matches_eager(device):
    """MLA: v's head dim (16) below q's (24); transformers' flash path pads v and crops."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=256)
    models = make_models(transformers.DeepseekV3ForCausalLM, config, device)
    torch.manual_seed(8)
    ids = torch.randint(0, VOCAB, (2, 24), device=device)
    mask = padded(2, 24, device, left=True)
    outs = {k: m(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for k, m in models.items()}
    check_models("deepseek-v3 logits", outs, mask.bool())


def test_fp32_model_under_autocast_trains(device):
    """An fp32 model trained under torch.autocast(bf16) (Trainer's bf16=True): the rotary
    embedding leaves q and k in fp32; transformers' flash path runs them in the autocast dtype."""
    models = make_models(transformers.LlamaForCausalLM, tiny(transformers.LlamaConfig), device,
                         impls=("fk32", "ref"))
    torch.manual_seed(9)
    ids = torch.randint(0, VOCAB, (2, 16), device=device)
    mask = padded(2, 16, device, left=True)
    losses = {}
    for name, model in models.items():
        model.train()
        with torch.autocast(torch.device(device).type, dtype=LOWP):
            losses[name] = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        losses[name].backward()
    assert abs(losses["fk32"].item() - losses["ref"].item()) < 2e-2
    grad = dict(models["fk32"].named_parameters())["model.layers.0.self_attn.q_proj.weight"].grad
    assert grad is not None and torch.isfinite(grad).all()


# ---- what flashkit cannot do: refused, not dropped -------------------------------------------

def test_gpt_oss_sinks_refused(device):
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, sliding_window=8,
                                       num_local_experts=4, num_experts_per_tok=2)
    (model,) = make_models(transformers.GptOssForCausalLM, config, device, ("fk",)).values()
    with pytest.raises(NotImplementedError, match="sinks"), torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 8), device=device))


def test_t5_position_bias_refused(device):
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_heads=4, decoder_start_token_id=0)
    (model,) = make_models(transformers.T5ForConditionalGeneration, config, device,
                           ("fk",)).values()
    ids = torch.randint(0, VOCAB, (1, 8), device=device)
    with pytest.raises(NotImplementedError, match="position bias"), torch.no_grad():
        model(input_ids=ids, decoder_input_ids=ids)


def test_custom_4d_mask_refused(device):
    (model,) = make_models(transformers.LlamaForCausalLM, tiny(transformers.LlamaConfig), device,
                           ("fk",)).values()
    allowed = torch.ones(10, 10, dtype=torch.bool, device=device).tril()
    allowed[4:, :4] = False  # two documents
    mask = torch.zeros(1, 1, 10, 10, device=device, dtype=LOWP)
    mask = mask.masked_fill(~allowed, torch.finfo(LOWP).min)
    with pytest.raises(NotImplementedError, match="4D attention mask"), torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 10), device=device), attention_mask=mask)


def test_output_attentions_warns(device):
    (model,) = make_models(transformers.LlamaForCausalLM, tiny(transformers.LlamaConfig), device,
                           ("fk",)).values()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=torch.randint(0, VOCAB, (1, 6), device=device), output_attentions=True)
    assert any("output_attentions" in str(w.message) for w in caught)
