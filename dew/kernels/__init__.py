"""Dew's native CPU kernels behind one deterministic policy (`dew.kernels.policy`): oneDNN's products and
Dew's few-rows float32 product for decoding (`matmul`), attention's softmax and fused pass (`softmax`),
int8 decoding products (`int8`), decoding's attention over each row's filled cache (`decode_attention`),
and their loader. Only the layers that own a product call them (the linears, attention, the output head);
on any backend but the CPU, and under the `xla` policy, every product is XLA's plain `dot_general`."""

from dew.kernels.policy import (ENVIRONMENT, POLICIES, check, cpu_class, describe, in_force, recording, summary,
                                using)

__all__ = ["ENVIRONMENT", "POLICIES", "check", "cpu_class", "describe", "in_force", "recording", "summary", "using"]
