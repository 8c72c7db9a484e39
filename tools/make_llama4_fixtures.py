"""Write the tiny Llama 4 checkpoint the Llama 4 multimodal tests load.

    python tools/make_llama4_fixtures.py [--out tests/fixtures/hf]

Writes `llama4-native-tiny/`: transformers' `Llama4ForConditionalGeneration` at test sizes (a vision tower
over 28x28 tiles in 7-pixel patches, width 32, one layer, folded by the pixel shuffle to 4 soft tokens a
tile; a `llama4_text` decoder of width 32 and 4 layers: layers 1 and 3 route to 4 experts beside a shared
one, layer 3 rotates nothing and tunes its queries' temperature every 4 positions, the others attend within
chunks of 8 positions with the L2 query/key norm; vocabulary 128), saved by `save_pretrained`; its
tokenizer (word level over `token10 ... token127` with Llama 4's specials, `<|image_start|>` 4,
`<|image_end|>` 5, `<|image|>` 6, `<|patch|>` 7, `<|tile_x_separator|>` 8, `<|tile_y_separator|>` 9);
`processor_config.json` naming `Llama4Processor` over `Llama4ImageProcessor` (28x28 tiles, at most 4
local tiles); and a generation_config.json. Weights are drawn at std 0.2 (norm scales around one) so a
misplaced tensor shows. Nothing is downloaded; the seed gives the same files on every machine.

transformers' `Llama4ImageProcessor` needs torchvision, which is not a Dew dependency (its PyPI wheels are
CUDA builds that do not load beside a CPU torch), so the processor config is written as JSON here rather
than by `Llama4Processor.save_pretrained`; transformers reads it back wherever torchvision is installed.
"""

from __future__ import annotations

from pathlib import Path

from fixture_parts import main, word_level, write_checkpoint

VOCAB = 128
SPECIALS = {"<|pad|>": 0, "<|eot|>": 1, "<|begin_of_text|>": 2, "<unk>": 3, "<|image_start|>": 4,
            "<|image_end|>": 5, "<|image|>": 6, "<|patch|>": 7, "<|tile_x_separator|>": 8, "<|tile_y_separator|>": 9}
BOI, EOI, PATCH = 4, 5, 7
TEXT_CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 24, "intermediate_size_mlp": 40,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 4,
    "attention_chunk_size": 8, "floor_scale": 4, "attn_scale": 0.5, "use_qk_norm": True,
    "max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}
VISION_CONFIG = {"image_size": 28, "patch_size": 7, "hidden_size": 32, "num_attention_heads": 2,
                 "num_hidden_layers": 1, "intermediate_size": 128, "projector_input_dim": 32,
                 "projector_output_dim": 32, "vision_output_dim": 32}
PROCESSOR = {
    "processor_class": "Llama4Processor", "patch_size": 7, "pixel_shuffle_ratio": 0.5,
    "image_processor": {"image_processor_type": "Llama4ImageProcessor", "size": {"height": 28, "width": 28},
                        "max_patches": 4, "resize_to_max_canvas": False, "do_resize": True, "do_rescale": True,
                        "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
                        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2},
}
GENERATION = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def build_model(seed: int = 0):
    """transformers' Llama4ForConditionalGeneration at fixture sizes, weights redrawn (see the module)."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(seed)
    config = Llama4Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG), boi_token_index=BOI,
                          eoi_token_index=EOI, image_token_index=PATCH)
    model = Llama4ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            draw = 0.2 * torch.randn(tensor.shape, generator=generator)
            tensor.copy_(1 + draw if "norm" in name and name.endswith(".weight") else draw)
    return model


def tokenizer():
    """A word-level tokenizer over `token10 ... token127` and Llama 4's specials, padding on the left."""
    from transformers import PreTrainedTokenizerFast

    backend = word_level(VOCAB, SPECIALS)
    made = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot|>",
                                   pad_token="<|pad|>", unk_token="<unk>", padding_side="left")
    made.add_special_tokens({"additional_special_tokens": list(SPECIALS)[4:]})
    return made


def write(out: Path, seed: int = 0) -> Path:
    return write_checkpoint(out / "llama4-native-tiny", build_model(seed), tokenizer(), PROCESSOR, GENERATION)


if __name__ == "__main__":
    main(write, __doc__.splitlines()[0])
