"""Write the tiny Gemma 4 checkpoint the Gemma 4 multimodal tests load.

    python tools/make_gemma4_fixtures.py [--out tests/fixtures/hf]

Writes `gemma4-native-tiny/`: transformers' `Gemma4ForConditionalGeneration` at test sizes, saved by
`save_pretrained`: a text decoder of width 32 (a sliding layer of window 8 then a full layer with its own head
width, per-layer inputs of width 8, image tokens reading each other in both directions in sliding layers,
`use_bidirectional_attention` "vision"; vocabulary 128), a vision tower over 8-pixel patches (width 32, two
blocks, pooling 2 x 2 patches into a soft token, clipped linears and standardization), and an audio tower over
8 mel bins (width 32, one conformer layer, clipped linears); its tokenizer (word level over `token11 ...
token127` with Gemma 4's specials: `<|image>` 4, `<image|>` 5, `<|image|>` 6, `<|video|>` 7, `<|audio>` 8,
`<audio|>` 9, `<|audio|>` 10); `processor_config.json` naming `Gemma4Processor` over the PIL
`Gemma4ImageProcessorPil` (no resizing: images whose sides are multiples of 16 pixels, at most 70 soft
tokens, 280 patches) and `Gemma4AudioFeatureExtractor` (8 mel bins); and a generation_config.json. Weights
are drawn at std 0.2 (norm scales around one), the clipping bounds finite where they bite and the layer
scalars and standardization away from one, so that a misplaced tensor shows. Nothing is downloaded; the seed
gives the same files on every machine.

`Gemma4Processor` also holds a video processor, which needs torchvision (not a Dew dependency; its PyPI wheels
are CUDA builds that do not load beside a CPU torch), so the processor config is written as JSON here rather
than by `Gemma4Processor.save_pretrained`; the tests build the processor class itself over the image processor,
feature extractor and tokenizer, without a video processor.
"""

from __future__ import annotations

from pathlib import Path

from fixture_parts import main, redraw_buffers, word_level, write_checkpoint

VOCAB = 128
SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|image>": 4, "<image|>": 5, "<|image|>": 6,
            "<|video|>": 7, "<|audio>": 8, "<audio|>": 9, "<|audio|>": 10}
TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "video_token": "<|video|>",
          "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
IDS = dict(boi_token_id=4, eoi_token_id=5, image_token_id=6, video_token_id=7, boa_token_id=8, eoa_token_index=9,
           audio_token_id=10)
TEXT_CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 256,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "use_bidirectional_attention": "vision",
    "final_logit_softcapping": 30.0, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
}
VISION_CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "head_dim": 16, "patch_size": 8, "pooling_kernel_size": 2,
                 "position_embedding_size": 32, "use_clipped_linears": True, "standardize": True}
AUDIO_CONFIG = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "subsampling_conv_channels": [8, 4],
                "attention_chunk_size": 4, "attention_context_left": 5, "attention_context_right": 2,
                "attention_logit_cap": 5.0, "output_proj_dims": 24, "use_clipped_linears": True}
IMAGE_PROCESSOR = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 8, "pooling_kernel_size": 2,
                   "max_soft_tokens": 70, "do_resize": False, "do_rescale": True, "rescale_factor": 1 / 255,
                   "do_normalize": False, "do_convert_rgb": True, "image_mean": [0.0, 0.0, 0.0],
                   "image_std": [1.0, 1.0, 1.0], "resample": 3}
FEATURE_EXTRACTOR = {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 8,
                     "sampling_rate": 16000, "padding_value": 0.0, "return_attention_mask": True}
PROCESSOR = {"processor_class": "Gemma4Processor", "image_seq_length": 70, "audio_seq_length": 750,
             "audio_ms_per_token": 40, "image_processor": IMAGE_PROCESSOR, "feature_extractor": FEATURE_EXTRACTOR}
GENERATION = {"eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2}


def build_model(seed: int = 0):
    """transformers' Gemma4ForConditionalGeneration at fixture sizes, weights and buffers redrawn (see the module)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma4Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG),
                          audio_config=dict(AUDIO_CONFIG), **IDS)
    model = Gemma4ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    draw = lambda shape: torch.randn(shape, generator=generator)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("position_embedding_table"):
                tensor.copy_(0.2 * draw(tensor.shape))
            elif name.endswith("per_dim_scale"):
                tensor.copy_(0.3 * draw(tensor.shape))
            else:
                tensor.copy_(1 + 0.2 * draw(tensor.shape) if "norm" in name and name.endswith(".weight")
                             else 0.2 * draw(tensor.shape))
    redraw_buffers(model, generator)
    return model


def tokenizer():
    """A word-level tokenizer over `token11 ... token127` and Gemma 4's specials, padding on the left."""
    from transformers import PreTrainedTokenizerFast

    backend = word_level(VOCAB, SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left", extra_special_tokens=dict(TOKENS))


def write(out: Path, seed: int = 0) -> Path:
    return write_checkpoint(out / "gemma4-native-tiny", build_model(seed), tokenizer(), PROCESSOR, GENERATION)


if __name__ == "__main__":
    main(write, __doc__.splitlines()[0])
