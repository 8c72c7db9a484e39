"""Write the tiny Gemma 3 checkpoint the multimodal tests and the guide's image example load.

    python tools/make_multimodal_fixtures.py [--out tests/fixtures/hf]

Writes `gemma3-native-tiny/`: transformers' `Gemma3ForConditionalGeneration` at test sizes (a SigLIP
tower over 28x28 images in 14-pixel patches, width 32, two layers; four soft tokens an image; a text
decoder of width 64 with a sliding and a full layer, window 4, vocabulary 256), saved by
`save_pretrained`; its processor (`Gemma3Processor`: a word-level tokenizer over `token0 ... token255`
with Gemma's specials at their usual names, `<start_of_image>` 200, `<end_of_image>` 201 and
`<image_soft_token>` 202, and the PIL image processor resizing to 28x28) saved beside it; a
generation_config.json; and `raw_images.npy`, three uint8 `[32, 32, 3]` images. Weights are drawn at
std 0.2 (norm scales around their neutral value) so logits reach a few units and a misplaced tensor
would show. Nothing is downloaded; the seed gives the same files on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from fixture_parts import main, word_level

import numpy as np

VOCAB, BOI, EOI, IMAGE = 256, 200, 201, 202
SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_image>": BOI, "<end_of_image>": EOI,
            "<image_soft_token>": IMAGE}
TEXT_CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 128,
    "final_logit_softcapping": None, "query_pre_attn_scalar": 16, "pad_token_id": 0, "eos_token_id": 1,
    "bos_token_id": 2,
}
# Released Gemma 3 towers have no attention-pooling head (`vision_use_head` false); neither has this one.
VISION_CONFIG = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 28, "patch_size": 14,
                 "vision_use_head": False}
TOKENS_PER_IMAGE = 4
GENERATION = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def build_model(seed: int = 0):
    """transformers' Gemma3ForConditionalGeneration at fixture sizes, weights redrawn (see the module)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma3Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG),
                          mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
                          image_token_index=IMAGE)
    model = Gemma3ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            draw = 0.2 * torch.randn(tensor.shape, generator=generator)
            # SigLIP's LayerNorms scale by their weight, Gemma's RMSNorms by (1 + weight)
            layer_norm = "vision_tower" in name and "layernorm" in name.replace("layer_norm", "layernorm")
            tensor.copy_(1 + draw if layer_norm and name.endswith(".weight") else draw)
    return model


def tokenizer():
    """A word-level tokenizer over `token0 ... token255` and Gemma's specials, with the attributes
    `Gemma3Processor` reads (`boi_token`, `eoi_token`, `image_token`)."""
    from transformers import PreTrainedTokenizerFast

    backend = word_level(VOCAB, SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left", extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                   "image_token": "<image_soft_token>"})


def write(out: Path, seed: int = 0) -> Path:
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    directory = out / "gemma3-native-tiny"
    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(seed)
    model.save_pretrained(directory)
    processor = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer(),
                                image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    images = np.random.default_rng(903).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    np.save(directory / "raw_images.npy", images)
    return directory


if __name__ == "__main__":
    main(write, __doc__.splitlines()[0])
