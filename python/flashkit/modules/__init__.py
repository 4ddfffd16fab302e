"""nn.Module wrappers of flashkit attention, named as flash_attn.modules.mha's."""

from flashkit.modules.mha import MHA, FlashCrossAttention, FlashSelfAttention
from flashkit.modules.rotary import RotaryEmbedding, apply_rotary_emb

__all__ = ["MHA", "FlashCrossAttention", "FlashSelfAttention", "RotaryEmbedding",
           "apply_rotary_emb"]
