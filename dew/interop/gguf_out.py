"""Writing a Dew decoder as one GGUF file for llama.cpp and Ollama: `write_gguf`, which `dew export --format gguf`
and `Pretrained.save(..., format="gguf")` call.

The model goes out under the family's llama.cpp names (`Converter.gguf`: llama, Mixtral as llama with experts,
qwen2, qwen3, qwen2moe, qwen3moe, mamba2), through the same tensor rules Dew reads GGUF with (`Converter.gguf_rules`,
which put a llama's query and key rows in llama.cpp's per-head interleave), each tensor built when it is
written. The metadata is the family's table read backwards, with the tokenizer's vocabulary, merges or scores,
special tokens and chat template (`gguf.SpecialVocab` reads the last three from the tokenizer's files). The
file is written beside its final name and read back through Dew's own GGUF reader before it takes that name: a
model the file would compute differently (a sliding window, a rotary scaling llama.cpp keeps elsewhere) is
refused naming what differs, and nothing is left behind.

`outtype` "f32" writes every tensor as float32; "f16" writes matrices as float16; "q8_0" writes matrices whose
rows are whole blocks of 32 as Q8_0 (`gguf.quants`, bit-exact with ggml's), the others as float16. Vectors
(norms, biases), a mixture's router and Mamba2's convolution, `A` and `D` stay float32 in all three, as llama.cpp's
converter keeps them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from dew.interop import tensors
from dew.interop.export import checked_params
from dew.interop.families import FAMILIES, Converter
from dew.interop.gguf_files import SPLIT_NAMES, GGUFCheckpoint
from dew.nn.transformer import CausalTransformer

OUTTYPES = ("f32", "f16", "q8_0")
_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}  # gguf.LlamaFileType: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType
# Tensors llama.cpp's converter keeps in float32 whatever the output type (convert_hf_to_gguf.py): norms, routers,
# Mamba2's convolution, and every tensor whose name does not end in ".weight" (biases, Mamba2's ssm_a and ssm_d).
_KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
_ROW_VECTORS = ("ffn_gate_inp_shexp.weight",)  # a [1, D] row llama.cpp reads as a vector of D
_SPACE = "\u2581"


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("writing GGUF files needs the gguf package: pip install 'dew-ml[gguf]'") from None
    return gguf


def write_gguf(path: str | Path, model: CausalTransformer, converter: Converter, variables,
               tokenizer_dir: Path | None, outtype: str = "f16", name: str | None = None) -> Path:
    """Write `variables` of `model` (a model `converter`'s family computes) as the GGUF file `path`, with the
    tokenizer of `tokenizer_dir` (tokenizer.json, tokenizer_config.json, chat_template.jinja) in `outtype`."""
    gguf = _require_gguf()
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one Dew writes: use one of {', '.join(OUTTYPES)}")
    names = converter.gguf
    if names is None:
        writers = sorted(family.model_type for family in FAMILIES.values() if family.gguf is not None)
        raise ValueError(f"{converter.model_type} has no GGUF names in Dew (llama.cpp's names of the families "
                         f"{writers}): export it as a transformers checkpoint (the default format) and convert that "
                         "with llama.cpp's convert_hf_to_gguf.py")
    config = model.config
    if config.rope_scaling.kind not in ("default", "linear", "yarn"):
        raise ValueError(f"the model's {config.rope_scaling.kind!r} rotary scaling is not GGUF metadata (llama.cpp "
                         "keeps Llama 3's as a rope_freqs tensor, which Dew neither reads nor writes): export it as a "
                         "transformers checkpoint and convert that with llama.cpp's convert_hf_to_gguf.py")
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        raise ValueError("a GGUF file carries its tokenizer, and this model has no tokenizer.json to take it from: "
                         "pass the directory holding the model's tokenizer.json")
    path = Path(path)
    params = checked_params(model, variables)
    plan = tensors.plan(converter.gguf_rules(config), params, converter.model_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    writer = _writer(gguf, names.architecture)
    try:
        _write_metadata(writer, gguf, model, converter, tokenizer_dir, outtype, name or path.stem)
        built = []
        for tensor, _, build in tensors.export_tensors(plan, params):
            kind = _tensor_type(gguf, tensor, plan.tensors[tensor], outtype)
            shape = _stored_shape(tensor, plan.tensors[tensor])
            if kind == gguf.GGMLQuantizationType.Q8_0:
                byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
                writer.add_tensor_info(tensor, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)
            else:
                dtype = np.dtype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
                writer.add_tensor_info(tensor, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
            built.append((build, shape, kind))
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for build, shape, kind in built:
            array = np.asarray(build(), np.float32).reshape(shape)
            if kind == gguf.GGMLQuantizationType.Q8_0:
                array = gguf.quants.quantize(array, kind)
            elif kind == gguf.GGMLQuantizationType.F16:
                array = array.astype(np.float16)
            writer.write_tensor_data(np.ascontiguousarray(array))
        writer.close()
        _check_read_back(partial, model, converter)
        os.replace(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path


class _NoStrings(tuple):
    """An empty array of strings, as `_writer`'s writer packs it."""


def _writer(gguf, architecture: str):
    """A `gguf.GGUFWriter` that also packs an empty array of strings (`_NoStrings`): gguf takes an array's element
    type from its first element, so it packs no empty one, and llama.cpp requires tokenizer.ggml.merges of every
    byte-level BPE vocabulary, one without merges (Dew's bytes) included."""

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, *rest, **named):
            if vtype == gguf.GGUFValueType.ARRAY and isinstance(val, _NoStrings):
                kind = self._pack("I", vtype) if add_vtype else b""
                return kind + self._pack("I", gguf.GGUFValueType.STRING) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, *rest, **named)

    return Writer(None, architecture)


def _tensor_type(gguf, name: str, shape: tuple[int, ...], outtype: str):
    """The ggml type a tensor is written in (see the module)."""
    types = gguf.GGMLQuantizationType
    if outtype == "f32" or len(shape) <= 1 or name.endswith(_KEEP_F32) or not name.endswith(".weight"):
        return types.F32
    if outtype == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0] == 0:
        return types.Q8_0
    return types.F16


def _stored_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[1:] if name.endswith(_ROW_VECTORS) and len(shape) == 2 and shape[0] == 1 else shape


def _check_read_back(path: Path, model: CausalTransformer, converter: Converter) -> None:
    """Refuse the file unless Dew's GGUF reader builds this model from it. The norms' epsilon is compared as
    the float32 GGUF holds it, which is the value a float32 norm adds either way."""
    config = dataclasses.replace(model.config, norm_eps=float(np.float32(model.config.norm_eps)))
    with GGUFCheckpoint(path) as reader:
        family = reader.family
        differences = family.read_differences(config, reader.config(), reader.names(), str(path))
    if family.model_type != converter.model_type:
        differences.insert(0, f"family {converter.model_type} (it reads {family.model_type})")
    if differences:
        raise ValueError(f"a GGUF file of this model would compute another one: {'; '.join(differences)} (read back "
                         f"from its {converter.gguf.architecture} metadata and tensors by Dew's GGUF loader): export it "
                         "as a transformers checkpoint (the default format)")


# ---- metadata ---------------------------------------------------------------------------------------------


def _write_metadata(writer, gguf, model: CausalTransformer, converter: Converter, tokenizer_dir: Path, outtype: str,
                    name: str) -> None:
    config, names = model.config, converter.gguf
    arch = names.architecture
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPES[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fields = converter.gguf_fields(config)
    for key, field in names.metadata.items():
        value = fields.get(field)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        else:
            writer.add_float32(f"{arch}.{key}", float(value))
    for key, value in names.constants.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if names.attends:
        _write_rotary(writer, gguf, config)
    _write_tokenizer(writer, gguf, tokenizer_dir, config.vocab_size)


def _write_rotary(writer, gguf, config) -> None:
    """An attending model's head width and rotary scaling, as llama.cpp's keys."""
    arch = writer.arch
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    scaling = config.rope_scaling
    if scaling.kind != "default":
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling.kind))
        writer.add_rope_scaling_factor(scaling.factor)
        if scaling.original_max_seq_len is not None:
            writer.add_rope_scaling_orig_ctx_len(scaling.original_max_seq_len)
        if scaling.kind == "yarn":
            writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", scaling.beta_fast)
            writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", scaling.beta_slow)


def _write_tokenizer(writer, gguf, directory: Path, vocab_size: int) -> None:
    """The vocabulary of `directory`'s tokenizer.json as llama.cpp reads it: byte-level BPE ("gpt2") with its
    pre-tokenizer's name and merges, or SentencePiece BPE ("llama") with scores; the special tokens, their
    add_bos/add_eos flags and the chat template from the tokenizer's files."""
    import tokenizers

    source = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    model = source.get("model", {})
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    by_id = {index: token for token, index in tokenizer.get_vocab(with_added_tokens=True).items()}
    if len(by_id) > vocab_size or max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer of {directory} holds ids up to {max(by_id)}, and the model's embedding has "
                         f"{vocab_size} rows: the tokenizer is not this model's")
    added = tokenizer.get_added_tokens_decoder()
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(_UNUSED)
            continue
        tokens.append(token)
        if token == model.get("unk_token"):
            types.append(_UNKNOWN)
        elif index in added:
            types.append(_CONTROL if added[index].special else _USER_DEFINED)
        elif model.get("byte_fallback") and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            types.append(_BYTE)
        else:
            types.append(_NORMAL)
    kind = _kind(source, directory)
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model.get("merges", [])]
    writer.add_tokenizer_model(kind)
    if kind == "gpt2":
        writer.add_tokenizer_pre(_pre_name(source, directory, bool(merges)))
    else:
        # llama.cpp's SentencePiece merges by score: each merged piece scores minus the rank of its merge
        rank = {}
        for position, merge in enumerate(merges):
            rank.setdefault(merge.replace(" ", "", 1), position)
        writer.add_token_scores([-float(rank[token]) if token in rank else 0.0 for token in tokens])
        writer.add_add_space_prefix(_space_prefix(source))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # gguf writes the merges it reads; without any it would warn of a non-functional file, where a vocabulary
    # of single pieces needs none but the key (written empty).
    special = gguf.SpecialVocab(directory, load_merges=bool(merges), n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    if kind == "gpt2" and not merges:
        writer.add_key_value(gguf.Keys.Tokenizer.MERGES, _NoStrings(), gguf.GGUFValueType.ARRAY)


def _kind(source: dict, directory: Path) -> str:
    model = source.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return "llama"
    if model.get("type") == "BPE" and "ByteLevel" in json.dumps([source.get("pre_tokenizer"), source.get("decoder")]):
        return "gpt2"
    raise ValueError(f"the tokenizer of {directory} is a {model.get('type')} model without byte-level pieces or byte "
                     "fallback: Dew writes GGUF vocabularies of byte-level BPE (gpt2) and SentencePiece BPE (llama); "
                     "convert the transformers export with llama.cpp's convert_hf_to_gguf.py")


def _pre_name(source: dict, directory: Path, merges: bool) -> str:
    """llama.cpp's name of the tokenizer's pre-tokenizer: "gpt-2" for byte-level BPE's own split (and for a
    vocabulary without merges, which any split encodes alike), else the name of its Split pattern."""
    pre = source.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    patterns = [step.get("pattern", {}).get("Regex") for step in steps if step.get("type") == "Split"]
    if not merges or (not patterns and any(step.get("type") == "ByteLevel" and step.get("use_regex", True)
                                           for step in steps)):
        return "gpt-2"
    if len(patterns) == 1 and patterns[0] in SPLIT_NAMES:
        return SPLIT_NAMES[patterns[0]]
    raise ValueError(f"the pre-tokenizer of {directory / 'tokenizer.json'} ({json.dumps(pre)[:200]}) is not one Dew "
                     "knows llama.cpp's name for (GPT-2's, Llama 3's, Qwen 2's split): convert the transformers export "
                     "with llama.cpp's convert_hf_to_gguf.py, which names more")


def _space_prefix(source: dict) -> bool:
    """Whether a SentencePiece tokenizer puts a space before the text (Metaspace's prepend, or a Prepend("▁"))."""
    text = json.dumps([source.get("pre_tokenizer"), source.get("normalizer")], ensure_ascii=False)
    return ('"prepend": "' + _SPACE) in text or any(f'"prepend_scheme": "{scheme}"' in text
                                                   for scheme in ("first", "always"))
