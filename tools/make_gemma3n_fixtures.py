"""Write the tiny Gemma 3n checkpoint the Gemma 3n multimodal tests load.

    python tools/make_gemma3n_fixtures.py [--out tests/fixtures/hf]

Writes `gemma3n-native-tiny/`: transformers' `Gemma3nForConditionalGeneration` at test sizes (a MobileNet-v5
encoder of four short stages, 8 to 24 channels, with both kinds of multi-query attention, fusing its last two
stages into 2 x 2 = 4 soft tokens an image of 64 pixels; a text decoder of width 32 with a sliding and a full
layer, two AltUp streams, LAuReL of rank 4, per-layer inputs of width 8 over a table of 128 ids; a two-layer
conformer audio encoder of width 32 over 16 mel bins, 6 soft tokens a clip), saved by `save_pretrained`. The
vocabulary mirrors the published one's: 128 text ids (`<start_of_image>` 120, `<start_of_audio>` 121), then
the vision embedder's 8 hard ids from 128 (`<end_of_image>` 128, `<image_soft_token>` 129) and the audio
embedder's 8 from 136 (`<end_of_audio>` 136, `<audio_soft_token>` 137), 144 in all. Its processor
(`Gemma3nProcessor`: a word-level tokenizer over `token0 ... token143` and those specials, the PIL
`SiglipImageProcessorPil` resizing to 64 pixels (the published one to 768), `Gemma3nAudioFeatureExtractor` over 16 mel bins) saved
beside it, and a generation_config.json. Weights are drawn so activations stay near one (matrices scaled by
their rows' length, norms' weights around their neutral value) and a misplaced tensor shows. Nothing is
downloaded; the seed gives the same files on every machine.

transformers builds the vision tower through `TimmWrapperModel`, which refuses to start without torchvision
(whose PyPI wheels are CUDA builds that do not load beside the CPU torch); the script builds it with that check
lifted and timm imported over stand-in torchvision modules (tests/interop/timm_oracle.py says why that is sound).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from fixture_parts import main, word_level

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the timm oracle lives with the tests
from tests.interop.timm_oracle import import_timm, timm_wrapper_without_torchvision  # noqa: E402

PER_LAYER_VOCAB, HARD = 128, 8  # the text ids the per-layer table holds; each embedder's hard ids
VISION_OFFSET, AUDIO_OFFSET = PER_LAYER_VOCAB, PER_LAYER_VOCAB + HARD
VOCAB = AUDIO_OFFSET + HARD
BOI, BOA, EOI, IMAGE, EOA, AUDIO = 120, 121, VISION_OFFSET, VISION_OFFSET + 1, AUDIO_OFFSET, AUDIO_OFFSET + 1
SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_image>": BOI, "<start_of_audio>": BOA,
            "<end_of_image>": EOI, "<image_soft_token>": IMAGE, "<end_of_audio>": EOA, "<audio_soft_token>": AUDIO}
TOKENS_PER_IMAGE, TOKENS_PER_CLIP, MEL = 4, 6, 16
SIZE = {"height": 64, "width": 64}  # the published processor's are 768; the load reads the size from here
TEXT_CONFIG = {
    "vocab_size": VOCAB, "vocab_size_per_layer_input": PER_LAYER_VOCAB, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 128,
    "hidden_size_per_layer_input": 8, "laurel_rank": 4, "altup_num_inputs": 2, "num_kv_shared_layers": 0,
    "activation_sparsity_pattern": [0.5, 0.0], "final_logit_softcapping": 9.0, "pad_token_id": 0, "eos_token_id": 1,
    "bos_token_id": 2,
}
# (timm's builder needs each stage to end with a convolution block)
STAGES = (("er_r1_k3_s2_e4_c8",), ("uir_r1_a3_k5_s2_e6_c16",),
          ("uir_r1_a5_k5_s2_e4_c16", "mqa_r1_k3_h2_v2_s1_d8_c16", "uir_r1_a0_k0_s1_e2_c16"),
          ("uir_r1_a5_k5_s2_e4_c24", "mqa_r1_k3_h2_s1_d8_c24", "uir_r1_a0_k0_s1_e2_c24"))
AUDIO_CONFIG = {"input_feat_size": MEL, "hidden_size": 32, "conf_num_attention_heads": 4, "conf_num_hidden_layers": 2,
                "conf_attention_chunk_size": 4, "conf_attention_context_left": 5, "conf_attention_context_right": 1,
                "conf_reduction_factor": 2, "sscp_conv_channel_size": [8, 4], "conf_attention_logit_cap": 5.0,
                "vocab_size": HARD, "vocab_offset": AUDIO_OFFSET}
GENERATION = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def build_model(seed: int = 0):
    """transformers' Gemma3nForConditionalGeneration at fixture sizes, weights redrawn (see the module)."""
    import torch
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    import_timm()
    from timm.models._efficientnet_builder import decode_arch_def

    vision = {"model_args": {"block_args": decode_arch_def([list(stage) for stage in STAGES]), "stem_size": 8,
                             "msfa_output_resolution": 2}, "vocab_size": HARD, "vocab_offset": VISION_OFFSET}
    config = Gemma3nConfig(text_config=dict(TEXT_CONFIG), vision_config=vision, audio_config=dict(AUDIO_CONFIG),
                           vision_soft_tokens_per_image=TOKENS_PER_IMAGE, audio_soft_tokens_per_image=TOKENS_PER_CLIP,
                           boi_token_id=BOI, eoi_token_id=EOI, image_token_id=IMAGE, boa_token_id=BOA,
                           eoa_token_id=EOA, audio_token_id=AUDIO)
    torch.manual_seed(seed)
    model_args = copy.deepcopy(vision["model_args"])
    with timm_wrapper_without_torchvision():
        model = Gemma3nForConditionalGeneration(config).eval()
    # timm's builder pops from (and adds callables to) the block dicts it is given: the saved record keeps a copy
    model.config.vision_config.model_args = model.model.vision_tower.config.model_args = model_args
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, value in model.named_parameters():
            noise = torch.randn(value.shape, generator=generator)
            if ("norm" in name or name.endswith("gamma")) and name.endswith(("weight", "gamma")):
                value.copy_(1 + 0.3 * noise)  # includes the layer scales, which start at 1e-5 and would hide a block
            elif name.endswith("bias"):
                value.copy_(0.3 * noise)
            elif value.ndim >= 2:
                value.copy_(noise * value[0].numel() ** -0.5)
            else:
                value.copy_(0.3 * noise)
    return model


def tokenizer():
    """A word-level tokenizer over `token0 ... token143` and Gemma 3n's specials, with the attributes
    `Gemma3nProcessor` reads."""
    from transformers import PreTrainedTokenizerFast

    backend = word_level(VOCAB, SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>", "boa_token": "<start_of_audio>",
                              "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"})


def write(out: Path, seed: int = 0) -> Path:
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nProcessor, SiglipImageProcessorPil

    directory = out / "gemma3n-native-tiny"
    directory.mkdir(parents=True, exist_ok=True)
    build_model(seed).save_pretrained(directory)
    processor = Gemma3nProcessor(Gemma3nAudioFeatureExtractor(feature_size=MEL), SiglipImageProcessorPil(size=SIZE),
                                 tokenizer(), audio_seq_length=TOKENS_PER_CLIP, image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    return directory


if __name__ == "__main__":
    main(write, __doc__.splitlines()[0])
