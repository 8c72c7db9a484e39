"""Flax layers: attention, rotary, norms, the gated MLP, the KV cache and the decoder."""

from dew.nn.attention import Attention, attend, attention_mask
from dew.nn.kv_cache import LayerCache
from dew.nn.linear import Linear, matmul
from dew.nn.mlp import GatedMLP
from dew.nn.norms import RMSNorm
from dew.nn.transformer import CausalTransformer, DecoderConfig, head_weight, vocab_logits

__all__ = [
    "Attention", "CausalTransformer", "DecoderConfig", "GatedMLP", "LayerCache", "Linear", "RMSNorm",
    "attend", "attention_mask", "head_weight", "matmul", "vocab_logits",
]
