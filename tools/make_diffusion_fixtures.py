"""Write the tiny masked-diffusion checkpoints the tests and the guide load: LLaDA's and Dream's released
layouts (config.json fields and tensor names) at test sizes, with seeded random weights.

    python tools/make_diffusion_fixtures.py [--out tests/fixtures/hf]

Writes `llada-tiny/` (model_type "llada": OLMo's field names, `model.transformer.*` tensors, the Llama
block, mask id 120 as the released 8B's 126336 is its vocabulary's) and `dream-tiny/` (model_type
"Dream": Qwen 2's fields and tensors with query/key/value biases, mask id 126), each a config.json, a
float32 model.safetensors and a generation_config.json. Nothing is downloaded: the layouts are the
released ones, written out here; the same seeds give byte-identical files on every machine. Weights
are drawn at a scale (0.25) that gives logits of a few units, so a numerical error would show.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

VOCAB, WIDTH, HEADS, KV_HEADS, LAYERS, MLP, MAX_LEN = 128, 32, 4, 2, 2, 64, 64
HEAD_DIM = WIDTH // HEADS
SCALE = 0.25

LLADA_CONFIG = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": WIDTH, "n_heads": HEADS,
    "n_kv_heads": KV_HEADS, "n_layers": LAYERS, "mlp_ratio": 4, "mlp_hidden_size": MLP, "activation_type": "silu",
    "block_type": "llama", "block_group_size": 1, "alibi": False, "alibi_bias_max": 8.0, "rope": True,
    "rope_full_precision": True, "rope_theta": 500000.0, "flash_attention": False, "attention_dropout": 0.0,
    "multi_query_attention": None, "attention_layer_norm": False, "residual_dropout": 0.0, "embedding_dropout": 0.0,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True, "rms_norm_eps": 1e-05,
    "attention_layer_norm_with_affine": True, "max_sequence_length": MAX_LEN, "include_qkv_bias": False,
    "include_bias": False, "bias_for_layer_norm": False, "scale_logits": False, "vocab_size": VOCAB,
    "embedding_size": VOCAB, "weight_tying": False, "eos_token_id": 121, "pad_token_id": 121, "mask_token_id": 120,
    "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "init_cutoff_factor": None,
    "precision": "amp_bf16", "use_cache": False, "transformers_version": "4.46.3",
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
}
DREAM_CONFIG = {
    "architectures": ["DreamModel"], "model_type": "Dream", "vocab_size": VOCAB, "hidden_size": WIDTH,
    "intermediate_size": MLP, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "hidden_act": "silu", "max_position_embeddings": MAX_LEN,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": False, "tie_word_embeddings": False,
    "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": LAYERS, "attention_dropout": 0.0, "mask_token_id": 126, "pad_token_id": 125,
    "bos_token_id": 124, "eos_token_id": 125, "torch_dtype": "float32", "transformers_version": "4.46.2",
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
}


def llada_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """LLaDA's tensor names (`model.transformer.*`), each `[out, in]` as torch stores a Linear."""
    t = {"model.transformer.wte.weight": _weight(rng, VOCAB, WIDTH),
         "model.transformer.ln_f.weight": _norm(rng),
         "model.transformer.ff_out.weight": _weight(rng, VOCAB, WIDTH)}
    for layer in range(LAYERS):
        block = f"model.transformer.blocks.{layer}"
        t.update({
            f"{block}.attn_norm.weight": _norm(rng), f"{block}.ff_norm.weight": _norm(rng),
            f"{block}.q_proj.weight": _weight(rng, HEADS * HEAD_DIM, WIDTH),
            f"{block}.k_proj.weight": _weight(rng, KV_HEADS * HEAD_DIM, WIDTH),
            f"{block}.v_proj.weight": _weight(rng, KV_HEADS * HEAD_DIM, WIDTH),
            f"{block}.attn_out.weight": _weight(rng, WIDTH, HEADS * HEAD_DIM),
            f"{block}.ff_proj.weight": _weight(rng, MLP, WIDTH), f"{block}.up_proj.weight": _weight(rng, MLP, WIDTH),
            f"{block}.ff_out.weight": _weight(rng, WIDTH, MLP),
        })
    return t


def dream_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Dream's tensor names (Qwen 2's), with the query/key/value biases its attention always has."""
    t = {"model.embed_tokens.weight": _weight(rng, VOCAB, WIDTH), "model.norm.weight": _norm(rng),
         "lm_head.weight": _weight(rng, VOCAB, WIDTH)}
    for layer in range(LAYERS):
        block = f"model.layers.{layer}"
        t.update({
            f"{block}.input_layernorm.weight": _norm(rng), f"{block}.post_attention_layernorm.weight": _norm(rng),
            f"{block}.self_attn.q_proj.weight": _weight(rng, HEADS * HEAD_DIM, WIDTH),
            f"{block}.self_attn.q_proj.bias": _weight(rng, HEADS * HEAD_DIM),
            f"{block}.self_attn.k_proj.weight": _weight(rng, KV_HEADS * HEAD_DIM, WIDTH),
            f"{block}.self_attn.k_proj.bias": _weight(rng, KV_HEADS * HEAD_DIM),
            f"{block}.self_attn.v_proj.weight": _weight(rng, KV_HEADS * HEAD_DIM, WIDTH),
            f"{block}.self_attn.v_proj.bias": _weight(rng, KV_HEADS * HEAD_DIM),
            f"{block}.self_attn.o_proj.weight": _weight(rng, WIDTH, HEADS * HEAD_DIM),
            f"{block}.mlp.gate_proj.weight": _weight(rng, MLP, WIDTH),
            f"{block}.mlp.up_proj.weight": _weight(rng, MLP, WIDTH),
            f"{block}.mlp.down_proj.weight": _weight(rng, WIDTH, MLP),
        })
    return t


def _weight(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * SCALE).astype(np.float32)


def _norm(rng: np.random.Generator) -> np.ndarray:
    return (1.0 + rng.standard_normal(WIDTH) * 0.1).astype(np.float32)


def write(directory: Path, config: dict, tensors: dict[str, np.ndarray], generation: dict) -> None:
    """config.json, model.safetensors and generation_config.json in `directory`, each written beside and renamed."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
             "generation_config.json": json.dumps(generation, indent=2, sort_keys=True) + "\n"}
    for name, text in files.items():
        partial = directory / (name + ".partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, directory / name)
    partial = directory / "model.safetensors.partial"
    save_file(dict(sorted(tensors.items())), str(partial), metadata={"format": "pt"})
    os.replace(partial, directory / "model.safetensors")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/hf", help="the directory the two checkpoints go in")
    args = parser.parse_args()
    out = Path(args.out)
    write(out / "llada-tiny", LLADA_CONFIG, llada_tensors(np.random.default_rng(120)),
          {"bos_token_id": None, "eos_token_id": 121, "pad_token_id": 121, "transformers_version": "4.46.3"})
    write(out / "dream-tiny", DREAM_CONFIG, dream_tensors(np.random.default_rng(126)),
          {"bos_token_id": 124, "eos_token_id": 125, "pad_token_id": 125, "transformers_version": "4.46.2"})
    print(f"wrote {out / 'llada-tiny'} and {out / 'dream-tiny'}")


if __name__ == "__main__":
    main()
