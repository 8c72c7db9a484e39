"""What the multimodal fixture scripts (tools/make_*_fixtures.py) share: a word-level tokenizer over the words
`token<i>` and a checkpoint's special tokens, the files of a fixture written by hand, and the command line that
writes a fixture."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path


def word_level(vocab_size: int, specials: Mapping[str, int]):
    """A `tokenizers.Tokenizer` mapping each word `token<i>` to id i, and each of `specials` to its id, split at
    whitespace and read back with a space between words; ids the specials take have no `token<i>` word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"token{i}": i for i in range(vocab_size) if i not in specials.values()}
    vocab.update(specials)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # words read back with a space between them
    return backend


def redraw_buffers(model, generator) -> None:
    """A Gemma 4 vision or audio tower's buffers in `model` drawn afresh from `generator` (a `torch.Generator`): the
    clipping bounds finite and near the activations' size, so that clipping bites; the standardization and the layer
    scalars away from their neutral values, so that a misplaced one shows."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("input_min", "input_max", "output_min", "output_max")):
                sign = -1.0 if name.endswith("min") else 1.0
                buffer.copy_(torch.tensor(sign * (1.0 + 2.0 * float(torch.rand((), generator=generator)))))
            elif name.endswith("std_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith(("std_scale", "layer_scalar")):
                buffer.copy_(1 + 0.3 * torch.randn(buffer.shape, generator=generator))


def write_checkpoint(directory: Path, model, tokenizer, processor: Mapping, generation: Mapping) -> Path:
    """`model` and `tokenizer` saved by transformers into `directory`, beside processor_config.json and
    generation_config.json written from `processor` and `generation` (the processors whose image or video
    classes need torchvision cannot save themselves here)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory


def main(write: Callable[[Path, int], Path], description: str) -> None:
    """`--out DIR --seed N`: write the fixture under DIR (tests/fixtures/hf by default) and print where."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/hf"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.out, args.seed))
