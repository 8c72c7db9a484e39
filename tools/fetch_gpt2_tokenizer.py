"""Write the GPT-2 tokenizer as a Hugging Face tokenizer.json, without the Hugging Face hub.

    python tools/fetch_gpt2_tokenizer.py --out data/tokenizers/gpt2

The GPT-2 byte-level BPE ranks ship inside the `openai-whisper` source distribution on PyPI
(whisper/assets/gpt2.tiktoken). This tool downloads that sdist with pip into a temporary
directory, converts the ranks into a `tokenizers` BPE model (vocabulary and merges in the GPT-2
byte-to-unicode alphabet, the GPT-2 pre-tokenizer, `<|endoftext|>` = 50256), checks the result
against tiktoken's own encoder on the same ranks, and writes tokenizer.json and
tokenizer_config.json. It does nothing when tokenizer.json already exists. Needs `tiktoken`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tiktoken
import tiktoken.load
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

WHISPER = "openai-whisper==20250625"
RANKS_MEMBER = "whisper/assets/gpt2.tiktoken"
ENDOFTEXT = "<|endoftext|>"
ENDOFTEXT_ID = 50256
# tiktoken's r50k pattern: the regex GPT-2 splits text with before BPE.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CHECKS = (
    "Hello world",
    "  leading spaces,\ttabs\n\n\nand blank lines\r\n",
    "naïve café — 東京 🙂 don't we'll I'M 12345 3.14",
    f"one document{ENDOFTEXT}the next one",
)


def download_ranks(workdir: Path) -> Path:
    """Download the openai-whisper sdist and extract gpt2.tiktoken; returns its path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--quiet", "--dest", str(workdir), WHISPER],
        check=True,
    )
    (sdist,) = workdir.glob("openai_whisper-*.tar.gz")
    with tarfile.open(sdist) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("/" + RANKS_MEMBER)]
        ranks = workdir / "gpt2.tiktoken"
        ranks.write_bytes(archive.extractfile(member).read())
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def build_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    """A byte-level BPE `Tokenizer` equal to tiktoken's encoder over the same ranks.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank. A BPE merge list
    ordered by the merged token's rank, holding every split of each token into two tokens, gives
    the same choice, so the merges are derived that way.
    """
    alphabet = bytes_to_unicode()

    def to_unicode(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {to_unicode(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((to_unicode(left), to_unicode(right)) for left, right in splits)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # ByteLevel's built-in regex is GPT-2's pattern; no prefix space, as in GPT-2.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
    if tokenizer.token_to_id(ENDOFTEXT) != ENDOFTEXT_ID:
        raise RuntimeError(f"{ENDOFTEXT} got id {tokenizer.token_to_id(ENDOFTEXT)}, not {ENDOFTEXT_ID}")
    return tokenizer


def verify(tokenizer: Tokenizer, ranks: dict[bytes, int]) -> None:
    """Check the tokenizer against GPT-2's known ids and tiktoken's encoder; raises on a mismatch."""
    hello = tokenizer.encode("Hello world", add_special_tokens=False).ids
    if hello != [15496, 995]:
        raise RuntimeError(f'"Hello world" encodes to {hello}, GPT-2 gives [15496, 995]')
    reference = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={ENDOFTEXT: ENDOFTEXT_ID})
    for text in CHECKS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        expected = reference.encode(text, allowed_special="all")
        if ids != expected:
            raise RuntimeError(f"{text!r} encodes to {ids}, tiktoken gives {expected}")
        if tokenizer.decode(ids, skip_special_tokens=False) != text:
            raise RuntimeError(f"{text!r} does not survive encode then decode")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/tokenizers/gpt2"),
                        help="directory to write tokenizer.json into")
    args = parser.parse_args(argv)
    target = args.out / "tokenizer.json"
    if target.exists():
        print(f"{target} exists; nothing to do")
        return
    with tempfile.TemporaryDirectory() as workdir:
        ranks_file = download_ranks(Path(workdir))
        # An empty cache directory stops tiktoken copying the file into its cache.
        os.environ["TIKTOKEN_CACHE_DIR"] = ""
        ranks = tiktoken.load.load_tiktoken_bpe(str(ranks_file))
    if len(ranks) != ENDOFTEXT_ID:
        raise RuntimeError(f"{RANKS_MEMBER} holds {len(ranks)} ranks, GPT-2 has {ENDOFTEXT_ID}")
    tokenizer = build_tokenizer(ranks)
    verify(tokenizer, ranks)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024,
              "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT,
              "add_prefix_space": False}
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial = target.with_name("tokenizer.json.partial")
    tokenizer.save(str(partial))
    os.replace(partial, target)
    print(f"wrote {target}: GPT-2 byte-level BPE, {tokenizer.get_vocab_size()} ids, "
          f"{ENDOFTEXT} = {ENDOFTEXT_ID}")


if __name__ == "__main__":
    main()
