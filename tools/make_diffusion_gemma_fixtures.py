"""Write the tiny DiffusionGemma checkpoint the tests and the guide load, built with transformers' own class.

    python tools/make_diffusion_gemma_fixtures.py [--out tests/fixtures/hf]

Writes `diffusion-gemma-workflow/`, `diffusion-gemma-sft/` (the same checkpoint with `reference.npz`:
`tokens`, two training rows of a 4-token prompt and two canvases of 4, the second row's response ending
early in padding, so the rows' targets differ in number). Each is transformers' `DiffusionGemmaForBlockDiffusion` at test sizes (64
tokens, width 32, three layers: two sliding with 8-wide heads and two key/value heads, one full with a
16-wide head and one key/value head, 4 experts choosing 2, canvas length 4), saved by `save_pretrained`
(config.json, model.safetensors with the tiny vision tower it always holds), a generation_config.json
with the released defaults and a short step limit, and a word-level tokenizer over `<pad> <eos> <bos>
t3 ... t63`. Weights are drawn at std 0.2 and the norm scales, router scales and per-layer scalars
perturbed around one (the encoder's scalars apart from the decoder's), so logits reach a few units and a
misplaced tensor would show.

`diffusion-gemma-vision/` is the checkpoint the media tests load: the same text sizes over a vocabulary of 128
holding Gemma 4's specials (`<|image>` 4, `<image|>` 5, `<|image|>` 6, ..., as tools/make_gemma4_fixtures.py
writes them; config.json's image ids inside the vocabulary), a sliding window of 16, image tokens reading each
other in both directions (`use_bidirectional_attention` "vision"), and a vision tower over 8-pixel patches (width
16, two blocks, pooling 2 x 2 patches into a soft token, clipped linears whose bounds bite, standardization),
every vision weight redrawn at std 0.2; beside it Gemma 4's `processor_config.json` (transformers maps
diffusion_gemma to `Gemma4Processor`), its tokenizer and generation_config.json. Nothing is downloaded; the seed
gives the same weights on every machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

VOCAB, CANVAS = 64, 4
TEXT_CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
    "num_global_key_value_heads": 1, "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 24, "max_position_embeddings": 64,
    "use_bidirectional_attention": "vision", "initializer_range": 0.2,
}
VISION_CONFIG = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "head_dim": 8, "position_embedding_size": 8}
GENERATION = {
    "max_new_tokens": 16, "max_denoising_steps": 8, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
    "confidence_threshold": 0.005, "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "return_dict_in_generate": True,
}


def build_model(seed: int = 0):
    """transformers' DiffusionGemmaForBlockDiffusion at fixture sizes, weights perturbed (see the module)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    config = DiffusionGemmaConfig(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG),
                                  canvas_length=CANVAS, initializer_range=0.2)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1 + 0.2 * torch.randn(buffer.shape, generator=generator))
    return model


VISION_VOCAB = 128
VISION_TEXT_CONFIG = {**TEXT_CONFIG, "vocab_size": VISION_VOCAB, "sliding_window": 16, "max_position_embeddings": 128,
                      "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
VISION_TOWER = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 8, "patch_size": 8, "pooling_kernel_size": 2,
                "position_embedding_size": 32, "use_clipped_linears": True, "standardize": True}


def build_vision_model(seed: int = 0):
    """transformers' DiffusionGemmaForBlockDiffusion with a vision tower, the ids of make_gemma4_fixtures.py (see the
    module): the text weights perturbed as `build_model`'s, the vision side's redrawn."""
    import torch
    from fixture_parts import redraw_buffers
    from make_gemma4_fixtures import IDS
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    ids = {name: IDS[name] for name in ("boi_token_id", "eoi_token_id", "image_token_id")}
    config = DiffusionGemmaConfig(text_config=dict(VISION_TEXT_CONFIG), vision_config=dict(VISION_TOWER),
                                  canvas_length=CANVAS, initializer_range=0.2, **ids)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    draw = lambda shape: torch.randn(shape, generator=generator)  # noqa: E731
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            vision = ".vision_tower." in name or ".embed_vision." in name
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                tensor.copy_(1 + 0.2 * draw(tensor.shape))
            elif vision:
                tensor.copy_(0.2 * draw(tensor.shape))
    redraw_buffers(model, generator)
    return model


def write_vision(out: Path, seed: int = 0) -> Path:
    """`diffusion-gemma-vision/` under `out` (see the module)."""
    from fixture_parts import write_checkpoint
    from make_gemma4_fixtures import PROCESSOR, tokenizer

    return write_checkpoint(out / "diffusion-gemma-vision", build_vision_model(seed), tokenizer(), PROCESSOR,
                            GENERATION)


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    from tokenizers import decoders

    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/hf")
    out = Path(parser.parse_args().out) / "diffusion-gemma-workflow"
    model = build_model()
    for name in ("diffusion-gemma-workflow", "diffusion-gemma-sft"):
        directory = out.parent / name
        model.save_pretrained(directory)
        (directory / "generation_config.json").write_text(json.dumps(GENERATION, indent=2, sort_keys=True) + "\n")
        write_tokenizer(directory)
        print(f"wrote {directory}")
    rows = np.array([[2, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 1],
                     [2, 6, 8, 10, 12, 14, 1, 0, 0, 0, 0, 0]], np.int32)
    np.savez(out.parent / "diffusion-gemma-sft" / "reference.npz", tokens=rows)
    print(f"wrote {write_vision(out.parent)}")


if __name__ == "__main__":
    main()
