"""Latent attention: cache bytes per token, absorbed against expanded decode, and a training step against
transformers' DeepseekV3 in torch eager, on one small DeepSeek shape (fp32, CPU).

    PYTHONPATH=. python benchmarks/mla.py

Wall time and process CPU time are both printed: the machine is shared, and CPU time says how much
work each side did whatever else was running.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import machine, timed_wall_and_cpu as timed
from dew.nn.mla import LatentAttention
from dew.nn.transformer import CausalTransformer, DecoderConfig
from dew.objectives.lm import LMObjective

# A small DeepSeek-V3: 4 layers of width 256, 8 heads, latent 128, rotary 16; one dense layer, then 8
# experts (2 per token, one shared) in 2 groups.
SHAPE = dict(vocab_size=2048, emb_features=256, num_layers=4, num_heads=8, mlp_features=512, max_seq_len=2048)
LATENT = dict(kv_rank=128, q_rank=192, nope_dim=32, rope_dim=16, value_dim=32)
MIXTURE = dict(experts=8, top_k=2, expert_features=128, layers=(1, 2, 3), score_function="sigmoid", groups=2,
               groups_per_token=1, bias=True, shared_features=128, scaling=2.5)


def model(absorb: str = "decode") -> CausalTransformer:
    return CausalTransformer(DecoderConfig(**SHAPE, latent=LatentAttention(**LATENT, absorb=absorb), mixture=MIXTURE))


def cache_bytes() -> None:
    latent = LatentAttention(**LATENT)
    width = SHAPE["emb_features"] // SHAPE["num_heads"]
    gqa = 2 * SHAPE["num_heads"] * width  # keys and values of a multi-head layer of the same width
    print(f"cache per token per layer, fp32: MLA {latent.cache_width * 4} bytes ({latent.cache_width} values); "
          f"multi-head attention of width {SHAPE['emb_features']} {gqa * 4} bytes; "
          f"GQA with 2 kv heads {2 * 2 * width * 4} bytes")


def decode(rows: int, context: int) -> None:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (rows, context)), jnp.int32)
    variables = model().init(jax.random.key(0), tokens[:, :8])
    for absorb in ("decode", "never"):
        decoder = model(absorb)
        cache = decoder.init_cache(rows, context + 8)
        _, cache = jax.jit(lambda v, t, c: decoder.apply(v, t, cache=c))(variables, tokens, cache)
        step = jax.jit(lambda v, t, c: decoder.apply(v, t, cache=c)[0])
        one = tokens[:, :1]
        wall, cpu = timed(lambda: step(variables, one, cache).block_until_ready(), repeats=10)
        form = "absorbed" if absorb == "decode" else "expanded"
        print(f"decode, batch {rows}, context {context}, {form}: {rows / wall:8.1f} tokens/s "
              f"({wall * 1e3:.2f} ms wall, {cpu * 1e3:.2f} ms CPU a step)")


def train_step(rows: int = 4, seq: int = 128) -> None:
    import torch
    import transformers

    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (rows, seq + 1)).astype(np.int32)
    decoder = model()
    objective = LMObjective(decoder, seq, ema_decay=None)
    variables = objective.init(jax.random.key(0))
    grad = jax.jit(jax.grad(lambda params, batch: objective.reduce_loss(objective.loss(params, batch, None)[0])[0]))
    batch = {"text": jnp.asarray(tokens)}
    dew_wall, dew_cpu = timed(lambda: jax.block_until_ready(grad(variables, batch)), repeats=5)

    config = transformers.DeepseekV3Config(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["emb_features"], intermediate_size=SHAPE["mlp_features"],
        moe_intermediate_size=128, num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_heads"], n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=2048, attn_implementation="eager",
        num_nextn_predict_layers=0)
    torch_model = transformers.DeepseekV3ForCausalLM(config).train()
    ids = torch.from_numpy(tokens.astype(np.int64))

    def torch_step():
        torch_model.zero_grad(set_to_none=True)
        torch_model(ids[:, :-1], labels=ids[:, :-1]).loss.backward()

    torch_wall, torch_cpu = timed(torch_step, repeats=5)
    print(f"train step (forward + backward), batch {rows} x {seq}: Dew {dew_wall * 1e3:.0f} ms wall, "
          f"{dew_cpu * 1e3:.0f} ms CPU; transformers eager {torch_wall * 1e3:.0f} ms wall, {torch_cpu * 1e3:.0f} ms "
          f"CPU; {torch_wall / dew_wall:.2f}x wall, {torch_cpu / dew_cpu:.2f}x CPU")


if __name__ == "__main__":
    print(machine())
    cache_bytes()
    for rows in (1, 8):
        for context in (256, 1024):
            decode(rows, context)
    train_step()
