"""Flax layers: attention, rotary, norms, the gated MLP, layer specs, the KV cache and the decoder."""

from dew.nn.attention import Attention, AttentionSpec, attend, attention_mask
from dew.nn.head import Head, cap_logits, vocab_logits
from dew.nn.kv_cache import AttentionCache, Cache
from dew.nn.layer import DecoderLayer, LayerSpec
from dew.nn.linear import Linear, matmul
from dew.nn.mlp import DenseSpec, GatedMLP
from dew.nn.norms import RMSNorm
from dew.nn.transformer import CausalTransformer, DecoderConfig, ModelOutput

__all__ = [
    "Attention", "AttentionCache", "AttentionSpec", "Cache", "CausalTransformer", "DecoderConfig", "DecoderLayer",
    "DenseSpec", "GatedMLP", "Head", "LayerSpec", "Linear", "ModelOutput", "RMSNorm", "attend", "attention_mask",
    "cap_logits", "matmul", "vocab_logits",
]
