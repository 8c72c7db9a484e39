"""Write the tiny Qwen 3.5 checkpoint the Qwen 3.5 multimodal tests load.

    python tools/make_qwen35_fixtures.py [--out tests/fixtures/hf]

Writes `qwen3_5-native-tiny/`: transformers' `Qwen3_5ForConditionalGeneration` at test sizes (a vision tower
over 4-pixel patches of two frames, width 32, one block, merging 2 x 2 patches into a token, a learned
position grid of 4 x 4; a text decoder of width 32 with a Gated DeltaNet layer then a gated attention layer
whose rotary turns 8 of 16 features in three interleaved axes, sections (2, 1, 1); vocabulary 128), saved by
`save_pretrained`; its tokenizer (word level over `token7 ... token127` with Qwen's specials,
`<|vision_start|>` 3, `<|vision_end|>` 4, `<|image_pad|>` 5, `<|video_pad|>` 6); `processor_config.json`
naming `Qwen3VLProcessor` over the PIL `Qwen2VLImageProcessorPil` (images resized to multiples of 8 pixels
between 8 x 8 and 32 x 32); and a generation_config.json. Weights are drawn at std 0.2 (norm scales around
one, Gated DeltaNet's decays spread) so a misplaced tensor shows. Nothing is downloaded; the seed gives
the same files on every machine.

transformers' `Qwen3VLProcessor` also holds a video processor, which needs torchvision (not a Dew
dependency; its PyPI wheels are CUDA builds that do not load beside a CPU torch), so the processor config
is written as JSON here rather than by `Qwen3VLProcessor.save_pretrained`; the tests build the processor
class itself over the image processor and tokenizer (`reference_processor`).
"""

from __future__ import annotations

from pathlib import Path

from fixture_parts import main, word_level, write_checkpoint

VOCAB = 128
SPECIALS = {"<|endoftext|>": 0, "<|im_end|>": 1, "<unk>": 2, "<|vision_start|>": 3, "<|vision_end|>": 4,
            "<|image_pad|>": 5, "<|video_pad|>": 6}
START, END, IMAGE, VIDEO = 3, 4, 5, 6
TEXT_CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention"], "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "pad_token_id": 0, "eos_token_id": 1,
}
VISION_CONFIG = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                 "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 32,
                 "num_position_embeddings": 16}
IMAGE_PROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
                   "size": {"shortest_edge": 8 * 8, "longest_edge": 32 * 32}}
PROCESSOR = {
    "processor_class": "Qwen3VLProcessor",
    "image_processor": {"image_processor_type": "Qwen2VLImageProcessor", **IMAGE_PROCESSOR, "do_resize": True,
                        "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
                        "image_mean": [0.48145466, 0.4578275, 0.40821073],
                        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3},
}
GENERATION = {"eos_token_id": 1, "pad_token_id": 0}


def build_model(seed: int = 0):
    """transformers' Qwen3_5ForConditionalGeneration at fixture sizes, weights redrawn (see the module)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG), image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("A_log"):
                tensor.copy_(torch.log(torch.linspace(0.5, 4.0, tensor.numel())))
            elif name.endswith("dt_bias"):
                tensor.copy_(torch.linspace(-3.0, 0.5, tensor.numel()))
            else:
                draw = 0.2 * torch.randn(tensor.shape, generator=generator)
                tensor.copy_(1 + draw if "norm" in name and name.endswith(".weight") else draw)
    return model


def tokenizer():
    """A word-level tokenizer over `token7 ... token127` and Qwen's specials, padding on the left."""
    from transformers import PreTrainedTokenizerFast

    backend = word_level(VOCAB, SPECIALS)
    made = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", padding_side="left")
    made.add_special_tokens({"additional_special_tokens": list(SPECIALS)[3:]})
    return made


def write(out: Path, seed: int = 0) -> Path:
    return write_checkpoint(out / "qwen3_5-native-tiny", build_model(seed), tokenizer(), PROCESSOR, GENERATION)


if __name__ == "__main__":
    main(write, __doc__.splitlines()[0])
