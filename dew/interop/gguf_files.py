"""GGUF files (llama.cpp): metadata as a transformers config, tensors dequantized to float32, the tokenizer.

The architectures a family converter names GGUF tables for load (llama, Mixtral as llama.cpp's llama
with experts, qwen2, qwen3, qwen2moe and qwen3moe, their experts stacked per projection, and mamba2);
the file's metadata becomes a config.json-style dict through the family's metadata table (and
`Converter.gguf_config` for fields llama.cpp keeps as others), read by the same family code as a
safetensors checkpoint, and each tensor is dequantized from the memory-mapped file when the loader
asks for it (only the rows asked for), under its GGUF name; the family's rules (`Converter.gguf_rules`)
rename it, put llama's query and key rows back in transformers' order, and reshape and map the values
of the tensors llama.cpp stores otherwise (Mamba2's `A = -exp(A_log)`).
The tokenizer is rebuilt from the vocabulary in the metadata the way transformers builds it:
byte-level BPE ("gpt2") or SentencePiece BPE ("llama"). Before gguf's reader sees a file, every
count and length in its header is checked against the file's size (`check_header`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np

from dew.files import write_atomically
from dew.interop.families import gguf_architectures, gguf_families
from dew.interop.hf_decoders import expected
from dew.kernels.blocks import BYTES

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types
_EMBEDDING = "token_embd.weight"  # llama.cpp's name of the token embedding, in every architecture
_SPACE = "\u2581"  # SentencePiece's spelling of a space
# Per-token arrays, read with `field` when the tokenizer is built rather than kept in `metadata`.
_VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
                    "tokenizer.ggml.token_type")
_SPECIAL_TOKEN_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                      "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}
# How llama.cpp's pre-tokenizer names split text before byte-level BPE (as transformers reads them);
# a name not listed splits with GPT-2's own pattern.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's rotary scaling keys (after `{arch}.rope.scaling.`) and the transformers rope_parameters key each is;
# with these alone, llama.cpp's linear and YaRN rotations are transformers' ones.
_ROPE_SCALING_KEYS = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
                      "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
# Tensors llama.cpp reads as a vector of `n_embd` where transformers has a `[1, n_embd]` row (Qwen2-MoE's
# shared-expert gate): files hold either (ggml pads a tensor's dimensions with ones), read as the row.
_ROW_VECTORS = ("ffn_gate_inp_shexp.weight",)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# The name a GGUF file Dew writes gives each split (`dew.interop.gguf_out`).
SPLIT_NAMES = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package: pip install 'dew-ml[gguf]'") from None
    return gguf


# GGUF's metadata value types (gguf.GGUFValueType): each scalar's struct format and name, and the two that hold lengths.
_SCALARS = {0: ("B", "uint8"), 1: ("b", "int8"), 2: ("H", "uint16"), 3: ("h", "int16"), 4: ("I", "uint32"),
            5: ("i", "int32"), 6: ("f", "float32"), 7: ("?", "bool"), 10: ("Q", "uint64"), 11: ("q", "int64"),
            12: ("d", "float64")}
_STRING, _ARRAY = 8, 9
# The fewest bytes each item of a list can take: a string (its length), an array (its type and length),
# a metadata entry (an empty key, a type, a uint8), a tensor's description (an empty name, no dimensions).
_LEAST = {_STRING: 8, _ARRAY: 12, "entry": 8 + 4 + 1, "tensor": 8 + 4 + 4 + 8}
_NESTING = 4  # arrays of arrays deeper than this are refused (llama.cpp writes none)


def check_header(path: Path) -> None:
    """Refuse a GGUF file whose header claims more bytes than the file holds (a count of entries or
    tensors, a string's or an array's length, a tensor's data), or that is no GGUF file of version 2 or 3,
    naming the key or the tensor.

    One forged length must not make a reader grow without bound: the header is walked with the format's
    own field sizes, over a memory map, allocating nothing per element."""
    size = path.stat().st_size
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else \
            contextlib.nullcontext(b"") as view:
        _Header(path, view, size).walk()


def _unreadable(path: Path, size: int, problem: str) -> str:
    """The refusal of a GGUF file that cannot be read as one, saying why (`problem`)."""
    return (f"{path} ({size:,} bytes) is not a readable GGUF file, it is truncated or corrupt ({problem}): download it "
            "again and check its size or checksum against the source's")


@dataclasses.dataclass(frozen=True)
class _Array:
    """A metadata array where the header holds it, decoded when asked for (`_Header.array`)."""
    item: int
    count: int
    at: int


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor's description: its ggml type (a `gguf.GGMLQuantizationType`), its shape rows first,
    and where its bytes start and how many there are."""
    name: str
    kind: object
    shape: tuple[int, ...]
    at: int
    nbytes: int


class _Header:
    """One pass over a GGUF header (see `check_header`): `at` is the byte being read. `walk` checks every
    count and length against the file's size and records the metadata (scalars and strings as values,
    arrays as `_Array`) and the tensors' descriptions."""

    def __init__(self, path: Path, view, size: int):
        self.path, self.view, self.size, self.at, self.order = path, view, size, 0, "<"
        self.metadata: dict[str, object] = {}
        self.tensors: dict[str, _Tensor] = {}

    def walk(self) -> None:
        if self.size < 8 or self.view[:4] != b"GGUF":
            self.refuse("it does not start with GGUF's magic bytes")
        version = struct.unpack_from("<I", self.view, 4)[0]
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order, version = ">", struct.unpack_from(">I", self.view, 4)[0]
        if version not in (2, 3):
            self.refuse(f"GGUF version {version}; Dew reads versions 2 and 3")
        self.at = 8
        tensors, entries = self.number("Q", "the tensor count"), self.number("Q", "the metadata count")
        self.fits(entries * _LEAST["entry"], f"the header's {entries:,} metadata entries", least=True)
        for index in range(entries):
            key = self.string(f"the key of metadata entry {index}").decode("utf-8", "replace")
            kind = self.number("I", f"metadata key {key!r}'s type")
            self.metadata[key] = self.value(kind, f"metadata key {key!r}")
        alignment = self.metadata.get("general.alignment", 32)  # GGUF's default, unless the file says otherwise
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            self.refuse(f"general.alignment {alignment!r} is not a power of two")
        self.fits(tensors * _LEAST["tensor"], f"the header's {tensors:,} tensor descriptions", least=True)
        described = []
        for index in range(tensors):
            name = self.string(f"the name of tensor {index}").decode("utf-8", "replace")
            count = self.number("I", f"tensor {name!r}'s dimension count")
            start = self.take(8 * count, f"tensor {name!r}'s {count:,} dimensions")
            shape = struct.unpack_from(f"{self.order}{count}Q", self.view, start)
            described.append((name, shape, self.number("I", f"tensor {name!r}'s type"),
                              self.number("Q", f"tensor {name!r}'s offset")))
        data = -(-self.at // alignment) * alignment
        gguf = _require_gguf()
        for name, shape, kind, offset in described:
            if kind not in gguf.GGML_QUANT_SIZES:
                raise ValueError(f"{self.path}: tensor {name!r} has ggml type {kind}, which the gguf package does not "
                                 "know: the file is corrupt, or newer than the installed gguf (pip install -U gguf)")
            if name in self.tensors:
                self.refuse(f"it describes tensor {name!r} twice")
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            self.at = data + offset
            nbytes = math.prod(shape) * type_size // block
            self.fits(nbytes, f"tensor {name!r}, {' x '.join(map(str, shape))} "
                              f"{gguf.GGMLQuantizationType(kind).name},")
            self.tensors[name] = _Tensor(name, gguf.GGMLQuantizationType(kind), tuple(reversed(shape)), self.at, nbytes)

    def fits(self, count: int, what: str, least: bool = False) -> None:
        """Refuse `what` unless `count` bytes from `at` lie inside the file."""
        if count > self.size - self.at:
            self.refuse(f"{what} claims {'at least ' if least else ''}{count:,} bytes from byte {self.at:,} and the "
                        f"file holds {max(self.size - self.at, 0):,} more")

    def refuse(self, problem: str):
        raise ValueError(_unreadable(self.path, self.size, problem))

    def take(self, count: int, what: str) -> int:
        """Step over `count` bytes that must lie inside the file; where they start."""
        self.fits(count, what)
        self.at += count
        return self.at - count

    def number(self, code: str, what: str) -> int | float:
        return struct.unpack_from(self.order + code, self.view, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> bytes:
        length = self.number("Q", f"{what}'s length")
        start = self.take(length, f"{what}, a string,")
        return self.view[start:start + length]

    def text(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            self.refuse(f"{what} is not UTF-8 text: {error}")

    def value(self, kind: int, what: str, depth: int = 0):
        """Step over one metadata value of type `kind`: a scalar's or a string's value, an array's `_Array`."""
        if kind in _SCALARS:
            return self.number(_SCALARS[kind][0], what)
        if kind == _STRING:
            return self.text(self.string(what), what)
        if kind != _ARRAY:
            self.refuse(f"{what} has value type {kind}, which GGUF does not define")
        item = self.number("I", f"{what}'s element type")
        count = self.number("Q", f"{what}'s length")
        array = _Array(item, count, self.at)
        if item in _SCALARS:
            code, name = _SCALARS[item]
            self.take(count * struct.calcsize(code), f"{what}, an array of {count:,} {name},")
            return array
        if item == _ARRAY and depth >= _NESTING:
            self.refuse(f"{what} nests arrays more than {_NESTING} deep, which no GGUF writer does")
        if item in _LEAST:
            noun = "strings" if item == _STRING else "arrays"
            self.fits(count * _LEAST[item], f"{what}, an array of {count:,} {noun},", least=True)
        if item == _STRING:  # a vocabulary's 100,000s of strings: lengths read in a tight loop
            length, at, end = struct.Struct(self.order + "Q").unpack_from, self.at, self.size
            for index in range(count):
                if at + 8 > end or at + 8 + length(self.view, at)[0] > end:
                    self.at = at
                    self.string(f"{what}'s string {index}")  # refuses it, naming the length
                at += 8 + length(self.view, at)[0]
            self.at = at
            return array
        for _ in range(count):
            self.value(item, what, depth + 1)
        return array

    def array(self, array: _Array, what: str) -> list:
        """The values of an array `walk` checked: Python numbers, strings, or lists of them."""
        return self._decode(array.item, array.count, array.at, what)[0]

    def _decode(self, item: int, count: int, at: int, what: str) -> tuple[list, int]:
        """(the `count` values of type `item` from byte `at`, the byte after them)."""
        if item in _SCALARS:
            code = _SCALARS[item][0]
            dtype = np.dtype(bool) if code == "?" else np.dtype(self.order + code)
            return np.frombuffer(self.view, dtype, count, at).tolist(), at + count * dtype.itemsize
        values = []
        if item == _STRING:
            length, view = struct.Struct(self.order + "Q").unpack_from, self.view
            for _ in range(count):
                end = at + 8 + length(view, at)[0]
                values.append(view[at + 8:end])
                at = end
            try:
                return [raw.decode("utf-8") for raw in values], at
            except UnicodeDecodeError as error:
                self.refuse(f"{what} holds a string that is not UTF-8 text: {error}")
        header = struct.Struct(self.order + "IQ")
        for _ in range(count):  # arrays of arrays
            inner, length = header.unpack_from(self.view, at)
            decoded, at = self._decode(inner, length, at + header.size, what)
            values.append(decoded)
        return values, at


class GGUFCheckpoint:
    """One GGUF file, memory-mapped: its metadata, its config, its family and its tensors.

    Offers the reader interface the loader uses for safetensors (`names`, `shape`, `dtype`, `read`,
    `location`) under the file's own tensor names; every tensor reads as float32 in row-major
    `[rows, columns]` order. Use as a context manager.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with self.path.open("rb") as file:
            # the map outlives the file's descriptor; the arrays read from it keep it open while they live
            view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._header = _Header(self.path, view, size)
        self._header.walk()
        self.metadata = {key: self._header.array(value, f"metadata key {key!r}") if isinstance(value, _Array) else value
                         for key, value in self._header.metadata.items() if key not in _VOCABULARY_KEYS}
        self.architecture = self.metadata.get("general.architecture")
        self.family = _family(self.architecture, self.metadata)
        if self.family is None:
            raise ValueError(f"{self.path.name} holds a {self.architecture!r} model: Dew reads the GGUF architectures "
                             f"{sorted(set(gguf_architectures()))}; load this model from its safetensors checkpoint "
                             "instead")
        self._tensors = dict(self._header.tensors)
        if "rope_freqs.weight" in self._tensors:
            raise ValueError(f"{self.path.name} holds rope_freqs.weight, llama.cpp's precomputed Llama 3 rotary "
                             "scaling, which Dew does not read: load the safetensors checkpoint, whose config.json "
                             "gives the scaling as rope_parameters")
        self.location = {name: self.path for name in self._tensors}

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc_info):
        self._tensors.clear()

    def field(self, key: str):
        """Metadata key `key`'s value (None when the file has none); a vocabulary's arrays are decoded here."""
        value = self._header.metadata.get(key)
        return self._header.array(value, f"metadata key {key!r}") if isinstance(value, _Array) else value

    def config(self) -> dict:
        """A transformers config.json for the file's model, from its metadata (the family's table)."""
        gguf, meta = self.family.gguf, self.metadata
        config = {field: meta[f"{gguf.architecture}.{key}"] for key, field in gguf.metadata.items()
                  if f"{gguf.architecture}.{key}" in meta}
        get = lambda key, default=None: meta.get(f"{gguf.architecture}.{key}", default)
        for key, field in gguf.metadata.items():
            if field in ("hidden_size", "num_attention_heads") and expected("size", config.get(field)) is not None:
                found = "lacks it" if field not in config else f"holds {config[field]!r}"
                raise ValueError(f"{self.path} gives the model's {field} as metadata key {gguf.architecture}.{key}, a "
                                 f"positive integer, and {found}: the file is damaged or was not written by "
                                 "llama.cpp's converter; download it again")
        if config.get("vocab_size") is None:
            config["vocab_size"] = self.shape(_EMBEDDING)[0]
        config.update(gguf.fixed)
        config.update(
            model_type=self.family.model_type, tie_word_embeddings=gguf.names["lm_head.weight"] not in self._tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        )
        if gguf.attends:
            self._attention(config, get)
        return self.family.gguf_config(config, str(self.path))

    def _attention(self, config: dict, get) -> None:
        """Put an attending family's head counts, head width and rotary settings into `config`."""
        heads = config["num_attention_heads"]
        config.setdefault("num_key_value_heads", heads)
        config.setdefault("rope_theta", 10000.0)
        head_dim = get("attention.key_length", config["hidden_size"] // heads)
        if self.family.reads("head_dim"):
            config["head_dim"] = head_dim
        rotated = get("rope.dimension_count", head_dim)
        if rotated != head_dim:
            config["partial_rotary_factor"] = rotated / head_dim
        scaling = get("rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = self._rope_scaling(scaling)

    def _rope_scaling(self, kind: str) -> dict:
        """transformers' rope_parameters for llama.cpp's `rope.scaling.*` metadata."""
        if kind not in ("linear", "yarn"):
            raise ValueError(f"{self.path.name} uses llama.cpp's {kind!r} rotary scaling, which Dew does not read "
                             "from a GGUF file (linear and yarn it does): load the safetensors checkpoint")
        prefix = f"{self.architecture}.rope.scaling."
        scaling = {"rope_type": kind}
        for key, value in self.metadata.items():
            suffix = key.removeprefix(prefix)
            if key == suffix or suffix in ("type", "finetuned"):
                continue
            if suffix not in _ROPE_SCALING_KEYS:
                raise ValueError(f"{self.path.name} sets {key} = {value!r}, which Dew does not compute: it reads "
                                 f"{sorted(_ROPE_SCALING_KEYS)} of llama.cpp's rotary scaling; load the safetensors "
                                 "checkpoint")
            scaling[_ROPE_SCALING_KEYS[suffix]] = value
        return scaling

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._stored_shape(name)
        return (1, *shape) if len(shape) == 1 and name.endswith(_ROW_VECTORS) else shape

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def dtype(self, name: str) -> str:
        return "F32"  # every tensor is dequantized to float32

    def blocks(self, name: str) -> np.ndarray | None:
        """A 2-D tensor's quantized blocks as they are stored, uint8 `[rows, row's blocks, block's bytes]`
        (a copy, out of the memory map), for the kinds Dew's blocks kernel multiplies
        (`dew.kernels.blocks.BYTES`); None for a tensor of another type or shape."""
        tensor = self._tensors[name]
        size = BYTES.get(tensor.kind.name)
        if size is None or len(tensor.shape) != 2:
            return None
        return np.array(self._bytes(tensor)).reshape(tensor.shape[0], -1, size)

    def _bytes(self, tensor: _Tensor) -> np.ndarray:
        """A tensor's stored bytes, uint8 (a view of the memory map)."""
        return np.frombuffer(self._header.view, np.uint8, tensor.nbytes, tensor.at)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """A tensor's region `index` (slices, rows first) as float32: only its rows are dequantized."""
        index = tuple(index)
        if len(self._stored_shape(name)) < len(self.shape(name)):  # a row stored as a vector: the vector is the row
            return self._read_stored(name, index[1:])[None][index[:1]]
        return self._read_stored(name, index)

    def _read_stored(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        tensor = self._tensors[name]
        shape = tensor.shape
        rows = index[0] if index else slice(None)
        # the file holds one row per leading index (quantized rows as their bytes), so rows slice alike
        data = self._bytes(tensor).reshape(shape[0] if len(shape) > 1 else 1, -1)
        count = len(range(*rows.indices(shape[0])))
        array = self._dequantize(tensor, data[rows] if len(shape) > 1 else data)
        if len(shape) == 1:
            return array.reshape(shape)[rows]
        return array.reshape(count, *shape[1:])[(slice(None), *index[1:])]

    def _dequantize(self, tensor: _Tensor, raw: np.ndarray) -> np.ndarray:
        """Rows of stored bytes `[rows, row's bytes]` as float32 `[rows, row's values]`, the values gguf's
        own dequantization gives; the common kinds are computed here in a few passes over the rows."""
        kind = tensor.kind.name
        if kind in ("F32", "F16"):
            dtype = np.dtype(self._header.order + ("f4" if kind == "F32" else "f2"))
            return raw.view(dtype).astype(np.float32)
        if kind in _BLOCKS:
            return _dequantize_blocks(raw, kind)
        gguf = _require_gguf()
        try:
            return np.asarray(gguf.quants.dequantize(raw, tensor.kind), np.float32)
        except NotImplementedError:
            raise ValueError(f"tensor {tensor.name} in {self.path.name} is quantized as {kind}, which the gguf "
                             f"package ({gguf.__name__}) cannot dequantize; use a file quantized with a K-quant, "
                             "Q8_0, Q4_0/Q4_1 or a float type") from None


# Block kinds dequantized by `_dequantize_blocks`: (block's bytes, its float16 scales).
_BLOCKS = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q8_0": (34, 1)}
_BLOCKS_AT_ONCE = 4096  # 512 KiB of float32 values


def _dequantize_blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """Q4_0 (`d * (q - 8)`), Q4_1 (`d * q + m`) or Q8_0 (`d * q`) blocks of 32 values `[rows, row's bytes]`
    as float32 `[rows, row's values]`, rounded as gguf's dequantization rounds them (the product, then
    the sum, each once in float32). A 4-bit block holds value i in byte i's low nibble, 16 + i in its high one."""
    size, scales = _BLOCKS[kind]
    rows = raw.shape[0]
    blocks = raw.reshape(-1, size)
    out = np.empty((blocks.shape[0], 32), np.float32)
    # a few thousand blocks at a time, so that each pass over them reads and writes the CPU's cache, not memory
    for start in range(0, blocks.shape[0], _BLOCKS_AT_ONCE):
        part, values = blocks[start:start + _BLOCKS_AT_ONCE], out[start:start + _BLOCKS_AT_ONCE]
        d = part[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
        if kind == "Q8_0":
            np.copyto(values, part[:, 2:].view(np.int8), casting="unsafe")
        else:
            quants = part[:, 2 * scales:]
            np.bitwise_and(quants, 15, out=values[:, :16], casting="unsafe")
            np.right_shift(quants, 4, out=values[:, 16:], casting="unsafe")
            if kind == "Q4_0":
                values -= 8
        values *= d
        if kind == "Q4_1":
            values += part[:, 2:4].copy().view(np.float16).astype(np.float32)
    return out.reshape(rows, -1)


def _family(architecture: str, metadata: dict):
    """The family that reads a GGUF file: llama.cpp writes Mixtral as a llama with `expert_count` experts,
    so among the families of one architecture, the one whose metadata table reads an expert count
    exactly when the file has one."""
    families = gguf_families(architecture)
    experts = bool(metadata.get(f"{architecture}.expert_count"))
    return next((converter for converter in families if ("expert_count" in converter.gguf.metadata) == experts),
                families[0] if families else None)


def write_tokenizer(checkpoint: GGUFCheckpoint, directory: Path) -> bool:
    """Write tokenizer.json and tokenizer_config.json for the file's vocabulary, as transformers builds it.

    Byte-level BPE ("gpt2") and SentencePiece BPE ("llama") are built. Returns False (writing nothing)
    when the file holds no vocabulary or another kind (unigram "t5", WordPiece "bert", "rwkv").
    """
    from tokenizers import AddedToken

    kind = checkpoint.metadata.get("tokenizer.ggml.model")
    if kind not in _TOKENIZER_BUILDERS:
        return False
    tokens = checkpoint.field("tokenizer.ggml.tokens")
    token_types = checkpoint.field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    tokenizer = _TOKENIZER_BUILDERS[kind](checkpoint, tokens)
    named = {name: tokens[checkpoint.metadata[key]] for name, key in _SPECIAL_TOKEN_IDS.items()
             if key in checkpoint.metadata}
    # transformers makes the tokens the file names (bos, eos, unk, pad) special whatever their type
    special = [token for token, token_type in zip(tokens, token_types) if token_type == _CONTROL]
    special += [token for token in named.values() if token not in special]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, token_type in zip(tokens, token_types) if token_type == _USER_DEFINED])
    # llama.cpp starts a SentencePiece sequence with BOS unless the file says otherwise
    add_bos = bool(checkpoint.metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")) and "bos_token" in named
    add_eos = bool(checkpoint.metadata.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in named
    if add_bos or add_eos:
        tokenizer.post_processor = _bos_eos_template(named.get("bos_token") if add_bos else None,
                                                     named.get("eos_token") if add_eos else None, tokenizer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {**named, "add_bos_token": add_bos, "add_eos_token": add_eos}
    if "tokenizer.chat_template" in checkpoint.metadata:
        config["chat_template"] = checkpoint.metadata["tokenizer.chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    write_atomically(directory / _TOKENIZER_STAMP, _builder_stamp())  # last: the files above are whole
    return True


_TOKENIZER_STAMP = "dew-tokenizer-builder.txt"


def tokenizer_written(directory: Path) -> bool:
    """Whether `directory` holds the tokenizer files `write_tokenizer` wrote there with this very builder
    (this module's source and the tokenizers package's version): a GGUF file's tokenizer is built once
    (a real vocabulary takes half a second) and built again when Dew's way of building it changes. The
    directory itself is keyed by the GGUF file's path, size and modification time (`converted_directory`)."""
    stamp = directory / _TOKENIZER_STAMP
    return stamp.is_file() and stamp.read_text(encoding="utf-8") == _builder_stamp()


@functools.cache
def _builder_stamp() -> str:
    import tokenizers

    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return f"module {source}\ntokenizers {tokenizers.__version__}\n"


def _byte_level_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]):
    """GPT-2-style BPE over bytes spelled as characters, split first by the file's pre-tokenizer pattern."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers

    merges = checkpoint.field("tokenizer.ggml.merges") or []
    tokenizer = tokenizers.Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)},
                                                [tuple(merge.split(" ", 1)) for merge in merges]))
    split = _SPLITS.get(checkpoint.metadata.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]):
    """SentencePiece BPE (Llama 2, Mistral 7B, TinyLlama): spaces are "▁", text outside the vocabulary
    falls back to the `<0xNN>` byte tokens, and a space is put before the text unless the file's
    `add_space_prefix` is false."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    merges = checkpoint.field("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = checkpoint.field("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError(f"{checkpoint.path.name} holds a SentencePiece vocabulary with neither "
                             "tokenizer.ggml.merges nor tokenizer.ggml.scores, so its merges cannot be rebuilt: "
                             "put the model's tokenizer.json beside the file")
        pairs = _merges_from_scores(tokens, scores)
    unk_id = checkpoint.metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = tokenizers.Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, pairs,
                                                unk_token=None if unk_id is None else tokens[unk_id],
                                                fuse_unk=True, byte_fallback=True))
    space_prefix = bool(checkpoint.metadata.get("tokenizer.ggml.add_space_prefix", True))
    # "first": the space goes before the text's first piece only, not after each special token within it
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, split=False,
                                                       prepend_scheme="first" if space_prefix else "never")
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * space_prefix)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every cut of a piece into two pieces of the vocabulary,
    ranked by the whole piece's score, best first; ties go to the longer left part, then the longer right part,
    then file order (transformers' order, so its GGUF tokenizer and this one agree)."""
    vocab = set(tokens)
    ranked = []  # (sort key, merge)
    for token, score in dict(zip(tokens, scores)).items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append(((-score, -len(left), -len(right)), (left, right)))
    ranked.sort(key=lambda entry: entry[0])  # stable: equal keys keep file order
    return [merge for _, merge in ranked]


def _bos_eos_template(bos: str | None, eos: str | None, tokenizer):
    """The post-processor that puts BOS before and EOS after each sequence, as transformers' GGUF tokenizers do."""
    from tokenizers import processors

    def wrapped(sequence: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] * (bos is not None) + [f"${sequence}:{type_id}"]
                + [f"{eos}:{type_id}"] * (eos is not None))

    return processors.TemplateProcessing(single=wrapped("A", 0), pair=wrapped("A", 0) + wrapped("B", 1),
                                         special_tokens=[(token, tokenizer.token_to_id(token))
                                                         for token in (bos, eos) if token is not None])


_TOKENIZER_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
