"""`load_pretrained` and `Pretrained`: a transformers decoder checkpoint as a native Dew model, and back.

Weights go through the family's tensor rules (`dew.interop.families`, `dew.interop.tensors`) once at
load, straight into the model's own form (each scanned run's layers stacked on one leaf), read from
the memory-mapped files one tensor part at a time (on a device mesh, each device shard reads only its
layers and rows), and once at save (each tensor built when its shard is written).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dew.kernels import accelerator_attention
from dew.data.text_processor import TextProcessor
from dew.data.tokenizers import HFTokenizer
from dew.files import read_json
from dew.inference.block import from_checkpoint as block_task
from dew.inference.masked import from_checkpoint as masked_task
from dew.inference.text import TextGeneration
from dew.interop import gguf_files, hf_decoders, tensors, torchax_fallback, verify
from dew.interop.export import model_params, model_variables, split_collections, write_export
from dew.interop.families import FAMILIES, Converter, family_of, ported
from dew.interop.families import diffusion_gemma as block_diffusion
from dew.interop.gguf_blocks import stored_blocks, with_blocks, without_blocks
from dew.interop.gguf_files import GGUFCheckpoint
from dew.interop.gguf_out import write_gguf
from dew.interop.hub import (
    CONFIG, GENERATION_CONFIG, PROCESSOR_FILES, TOKENIZER_FILES, converted_directory, resolve, resolve_gguf,
)
from dew.interop.progress import byte_progress
from dew.interop.safetensors_files import SafetensorsReader, write_atomically, write_checkpoint
from dew.interop.processors import Processor, load_reference
from dew.nn.diffusion_gemma import DiffusionGemma, scalars_as
from dew.nn.multimodal import MultimodalConfig, MultimodalTransformer
from dew.nn.quantize import WEIGHT_FORMATS, quantize_int8
from dew.nn.transformer import CausalTransformer, DecoderConfig
from dew.sampling import Sampling
from dew.sharding import with_names
from dew.training.mesh import Layout, MeshSpec

# The attention kernels `attention_impl` names (`dew.kernels.accelerator_attention`): "auto" picks the backend's
# best; "splash" (TPU) and "cudnn" (GPU) are refused on a backend that cannot run them.
ATTENTION_IMPLS = accelerator_attention.IMPLS
_STORED_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# generation_config.json fields Dew's sampler does not apply, with the value that leaves output unchanged.
_UNAPPLIED_GENERATION = {
    "num_beams": 1, "no_repeat_ngram_size": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "penalty_alpha": None, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": None,
    "sequence_bias": None, "guidance_scale": None, "encoder_repetition_penalty": 1.0, "diversity_penalty": 0.0,
    "exponential_decay_length_penalty": None,
}
# The generation_config.json fields Dew reads, with the kinds transformers' GenerationConfig gives them.
_GENERATION_KINDS = {"do_sample": "bool?", "temperature": "number?", "top_k": "count?", "top_p": "number?",
                     "min_p": "number?", "repetition_penalty": "number?", "max_new_tokens": "size?",
                     "eos_token_id": "token ids?", "pad_token_id": "integer?", "bos_token_id": "integer?"}
# What transformers applies only with do_sample true, each with the value at which it does not say so
# (GenerationConfig.validate names the others, as Dew does).
_SAMPLING_ONLY = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None}
# JSON's names for what a file holds instead of an object.


@dataclasses.dataclass
class Pretrained:
    """A loaded checkpoint: `model` (a `CausalTransformer`), its `variables` (`{"params": ...}`), the
    checkpoint's `tokenizer` (an `HFTokenizer`, or None without tokenizer.json), the source `config`
    (config.json as a dict, or the one a GGUF file's metadata gives), the `generation` defaults (a
    `Sampling` from generation_config.json) and their `max_new_tokens` budget, and `revision`, the
    Hub commit (None for a local directory). `directory` holds the tokenizer files `save` copies;
    `generation_config` is generation_config.json as read (None when the source has none)."""

    model: CausalTransformer
    variables: dict
    tokenizer: HFTokenizer | None
    config: dict
    generation: Sampling
    max_new_tokens: int | None
    revision: str | None
    directory: Path
    generation_config: dict | None
    family: Converter | None = None  # the family that read `config`; None: config.json's own (`family_of`)

    @property
    def converter(self) -> Converter:
        """The family converter these weights load and save through: config.json's registered family, or
        the one a verified mapping (tier 2, `dew.interop.verify`) chose for an unregistered type."""
        return self.family if self.family is not None else family_of(self.config)

    def text_generation(self, sampling: Sampling | None = None):
        """The generation task over these weights that the checkpoint's family calls for: a
        `TextGeneration` with the checkpoint's sampling unless `sampling` is given; for a masked-diffusion
        family (LLaDA, Dream) native MDLM over its mask id (`MaskedGeneration`, which takes no
        autoregressive `sampling`); for DiffusionGemma a `BlockGeneration`."""
        if isinstance(self.model, torchax_fallback.TorchCausalLM):
            raise TypeError(f"text_generation() is not built for a tier-3 (fallback='torchax') load of "
                            f"{self.config.get('model_type')!r}: it has no cached generation; generate with "
                            "transformers, or load a model type Dew has a family for")
        family = self.converter
        if isinstance(self.model, DiffusionGemma):
            if sampling is not None:
                raise ValueError(f"sampling={sampling!r}: {family.model_type} generates by block diffusion, which "
                                 "takes no autoregressive sampling policy; pass process=BlockProcess(...) to the "
                                 "task's call")
            return block_task(self)
        if hasattr(family, "process"):
            if sampling is not None:
                raise ValueError(f"sampling={sampling!r}: {family.model_type} generates by masked diffusion, which "
                                 "takes no autoregressive sampling policy; call text_generation() without it (steps= "
                                 "on the call sets the sampler's evaluations)")
            return masked_task(self, family.process(self.config))
        return TextGeneration(self.model, self.variables, self.tokenizer, sampling or self.generation,
                              self.max_new_tokens)

    def block_generation(self):
        """DiffusionGemma's generation task over these weights (`dew.inference.block.BlockGeneration`), its
        `BlockProcess` from generation_config.json; other models are refused."""
        if not isinstance(self.model, DiffusionGemma):
            raise ValueError(f"block_generation() is DiffusionGemma's; this {self.config.get('model_type')} "
                             "checkpoint generates through text_generation()")
        return block_task(self)

    @property
    def processor(self):
        """The checkpoint's processor, strings (and, for a multimodal model, images) to `ModelInputs`: the
        checkpoint's own (`dew.interop.processors.Processor`) for a multimodal model and for a DiffusionGemma
        that ships processor_config.json, else the text processor (`dew.data.text_processor.TextProcessor`);
        None without a tokenizer."""
        if isinstance(self.model, MultimodalTransformer):
            return _multimodal_processor(self.directory, self.model.config)
        if isinstance(self.model, DiffusionGemma) and (self.directory / "processor_config.json").is_file():
            return block_diffusion.processor(self.directory, self.model.config)
        return None if self.tokenizer is None else TextProcessor(self.tokenizer, self.generation.pad_id)

    def save(self, directory: str | Path, variables=None, max_shard_size: int | str = "5GB", *,
             format: str = "safetensors", outtype: str = "f16") -> Path:
        """Write `variables` (default: the loaded ones; stacked runs or per layer) as a transformers
        checkpoint in `directory`, or with `format="gguf"` as the GGUF file `directory` names.

        Writes safetensors under the source tensor names in the parameters' own dtype (sharded past
        `max_shard_size`, with an index), config.json (its `dtype` set to that dtype),
        generation_config.json and the tokenizer files. Over an earlier export the switch is atomic;
        files the export does not write are left alone. A GGUF file (`dew.interop.gguf_out.write_gguf`)
        holds llama.cpp's names, the tokenizer and its chat template, its matrices in `outtype` ("f32",
        "f16" or "q8_0").
        """
        if isinstance(self.model, torchax_fallback.TorchCausalLM):
            raise NotImplementedError("save() is not built for a tier-3 (fallback='torchax') load yet: its params "
                                      "keep the torch names; write them with safetensors.numpy.save_file")
        if format not in ("safetensors", "gguf"):
            raise ValueError(f"format {format!r} is not one Dew writes: use 'safetensors' or 'gguf'")
        if format == "gguf":
            return write_gguf(directory, self.model, self.converter,
                              self.variables if variables is None else variables, self.directory, outtype)
        if isinstance(self.model, DiffusionGemma):
            return _save_block_diffusion(self, Path(directory), self.variables if variables is None else variables,
                                         max_shard_size)
        family = self.converter
        config, rules = self.config, None
        if isinstance(self.model, MultimodalTransformer):  # written back in the source's tensor layout
            config = family.written(self.model.config, self.config)
            rules = family.tensor_rules(self.model.config, _source_names(self.directory))
        return write_export(directory, self.model, family, self.variables if variables is None else variables,
                            config, self._generation_file(), self.directory, max_shard_size, rules=rules)

    def _generation_file(self) -> dict:
        if self.generation_config is not None:
            return self.generation_config
        # transformers writes the model config's special tokens when the source has no generation config
        return {key: self.config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                if self.config.get(key) is not None}


def load_pretrained(source: str | Path, *, dtype="float32", param_dtype="auto", max_seq_len: int | None = None,
                    attention_impl: str | None = None, gguf_file: str | None = None, mesh: MeshSpec | None = None,
                    layout: Layout | None = None, scan_layers: int | None = None, remat: str | None = None,
                    fallback: str | None = None, quantize: str | None = None, kernels: str | None = None) -> Pretrained:
    """Load a transformers decoder checkpoint, or one GGUF file, as a native Dew model.

    `source` is a local directory (config.json and model.safetensors, or shards with
    model.safetensors.index.json), a Hub id, or `repo@revision` (`hf://repo` when a local directory
    shares the owner's name); a path that does not exist is refused at once (`hub.locate` has the rule),
    and an unreachable Hub after one short attempt. With `gguf_file` (a file name in
    that directory or repository) the config comes from the file's metadata, every tensor is
    dequantized to float32, and the tokenizer comes from the file when the source has no
    tokenizer.json. `dtype` is the compute dtype; `param_dtype="auto"` stores parameters in the
    checkpoint's dtype (config.json's `dtype` or `torch_dtype`, else the first floating tensor's;
    float32 for GGUF). `max_seq_len` overrides the config's max_position_embeddings;
    `attention_impl` names the attention kernel (`ATTENTION_IMPLS`: "auto", the default, takes Pallas's splash on
    a TPU and cuDNN's on a GPU where they apply, Dew's own elsewhere; "xla" Dew's own everywhere; "splash" and
    "cudnn" are refused on a backend that cannot run them). `scan_layers` and `remat`
    (`DecoderConfig`'s; they change how the model compiles, not what it computes) default to
    `DecoderConfig`'s; so does `kernels`, the kernel policy of the model's products (`dew.kernels.policy`).

    With `mesh` or `layout` (the other defaults to `MeshSpec()` or `Layout()`), every parameter is a
    `jax.Array` split over `mesh.build()` the way `Layout.shardings` splits it for the `Trainer`:
    each device's shard reads only its own layers and rows from the memory-mapped file (a shard
    several devices share is read once), so the host never holds the whole translated model. Without
    either, parameters are uncommitted arrays on the default device, each leaf filled tensor by
    tensor. Either way `variables` are in the model's own form (scanned runs stacked).

    A `model_type` without a family loads through a verified mapping (tier 2, `dew.interop.verify`) or is
    refused with the measured difference. `fallback="torchax"` (tier 3, `dew.interop.torchax_fallback`)
    runs transformers' own PyTorch model through torchax instead: `model` is a `TorchCausalLM` whose
    variables are `{"params", "buffers"}` by torch name; it trains, but does not generate or save.

    `quantize="int8"` holds every linear kernel, the embedding and the output head as int8 with a
    float32 scale per output channel (`dew.nn.quantize`): a quarter of float32's bytes, so decoding,
    which streams every weight once a token, runs faster on a CPU. `quantize="gguf"` (with `gguf_file`)
    keeps the file's own quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K) for every linear, the embedding and the
    head stored in them, multiplied as they are (`dew.interop.gguf_blocks`): a 4-bit file moves a seventh of
    float32's bytes and computes what its dequantized float32 model does. Either way the variables are
    for generation (`generate`, `text_generation`, `dew serve`); training and `save` refuse them.
    """
    if quantize not in (None, *WEIGHT_FORMATS):
        raise ValueError(f"quantize={quantize!r} is not a weight format Dew builds: use one of {WEIGHT_FORMATS}, or "
                         "None for the checkpoint's own floats")
    if quantize == "gguf" and gguf_file is None:
        raise ValueError("quantize='gguf' keeps a GGUF file's quantized blocks, and no gguf_file is given: name the "
                         "file (gguf_file=...), or use quantize='int8' for a safetensors checkpoint")

    if fallback is not None:
        return _load_fallback(source, fallback, dtype=dtype, param_dtype=param_dtype, max_seq_len=max_seq_len,
                              attention_impl=attention_impl, gguf_file=gguf_file, mesh=mesh, layout=layout,
                              scan_layers=scan_layers, remat=remat, quantize=quantize, kernels=kernels)
    device_mesh = None if mesh is None and layout is None else (mesh or MeshSpec()).build()
    if quantize is not None and device_mesh is not None and device_mesh.devices.size > 1:
        raise NotImplementedError(f"quantize={quantize!r} over a mesh of {device_mesh.devices.size} devices (int8 "
                                  "weights split over several devices) is not built in Dew yet: quantize on one device")
    layout = layout or Layout()
    if attention_impl is not None:
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl {attention_impl!r} is not an attention kernel of Dew's: use one of "
                             f"{list(ATTENTION_IMPLS)}")
        refused = accelerator_attention.refused(attention_impl)
        if refused is not None and attention_impl != "auto":
            raise ValueError(f"attention_impl: {refused}")
    verified: list[verify.Verified] = []  # tier 2's check, for a model_type without a family
    if gguf_file is not None:
        snapshot = resolve_gguf(source, gguf_file)
        reader = GGUFCheckpoint(snapshot.weights[0])
        config, where = reader.config(), str(snapshot.weights[0])
        directory = snapshot.directory
        if not (directory / "tokenizer.json").is_file():
            converted = converted_directory(snapshot.weights[0])
            if gguf_files.tokenizer_written(converted) or gguf_files.write_tokenizer(reader, converted):
                directory = converted
            else:
                kind = reader.metadata.get("tokenizer.ggml.model")
                warnings.warn(f"{where}: Dew builds GGUF tokenizers of kinds 'gpt2' (byte-level BPE) and 'llama' "
                              f"(SentencePiece), not {kind!r}; the bundle has no tokenizer: put the model's "
                              "tokenizer.json beside the file", stacklevel=2)
    else:
        def read_config(path: Path) -> None:  # before any weights are fetched
            config = dict(ported(_read_json(path), str(path)))  # mamba_ssm's format: as transformers' port
            if config.get("model_type") is not None and config["model_type"] not in FAMILIES:
                verified.append(verify.verified_family(config, str(path), _load_probe))

        snapshot = resolve(source, read_config)
        reader = SafetensorsReader(snapshot.weights, snapshot.index)
        config_path = snapshot.directory / CONFIG
        config, where, directory = _read_json(config_path), str(config_path), snapshot.directory
        config = dict(ported(config, where))
    family = verified[0].family if verified else family_of(config, where)
    if verified:
        config = verified[0].config  # read with the type's own defaults, and saved with them
    if family.model_type == block_diffusion.MODEL_TYPE:
        # a one-device mesh places every parameter on the default device, which is where this load puts them
        if (gguf_file is not None or (device_mesh is not None and device_mesh.devices.size > 1)
                or scan_layers is not None or remat is not None or quantize is not None):
            raise NotImplementedError("DiffusionGemma loads from safetensors onto one device; gguf_file, a mesh of "
                                      "several devices, scan_layers, remat and quantize are not built for it yet")
        bundle = _load_block_diffusion(snapshot, reader, config, where, dtype, param_dtype, max_seq_len)
        runtime = {name: value for name, value in (("kernels", kernels), ("attention", attention_impl))
                   if value is not None}
        if not runtime:
            return bundle
        return dataclasses.replace(bundle, model=DiffusionGemma(dataclasses.replace(bundle.model.config, **runtime)))
    overrides = {name: value for name, value in (("max_seq_len", max_seq_len), ("scan_layers", scan_layers),
                                                 ("remat", remat), ("kernels", kernels), ("attention", attention_impl))
                 if value is not None}
    multimodal = getattr(family, "multimodal", False)
    if multimodal and (gguf_file is not None or quantize is not None):
        raise NotImplementedError(f"a {family.model_type} checkpoint loads from safetensors with float weights; "
                                  "gguf_file and quantize are not built for multimodal models yet")
    kwargs = {} if multimodal else {**family.decoder_kwargs(config, where=where), **overrides}
    generation_path = snapshot.directory / GENERATION_CONFIG
    generation_config = _read_json(generation_path) if generation_path.is_file() else None
    sampling, budget = generation_defaults(generation_config, config, where=str(generation_path),
                                           token_by_token=not hasattr(family, "process"))
    with reader:
        if param_dtype == "auto":
            param_dtype = hf_decoders.param_dtype_name(config) or _first_float_dtype(reader)
        if multimodal:
            model_config = family.model_config(config, where, **overrides, dtype=dtype, param_dtype=param_dtype)
            if hasattr(family, "fit_to_processor"):  # a tower whose image size only the processor's files say
                model_config = family.fit_to_processor(model_config, snapshot.directory)
            model = MultimodalTransformer(model_config)
        else:
            kwargs = family.fit_to_weights(kwargs, reader.names())
            model = CausalTransformer(DecoderConfig(**kwargs, dtype=dtype, param_dtype=param_dtype))
        if gguf_file is not None:
            rules, ignorable = family.gguf_rules(model.config), lambda name: False
        else:
            rules = family.tensor_rules(model.config, reader.names())
            ignorable = lambda name: family.ignorable(name, model.config)
        # the leaves kept as a GGUF file's blocks are found first, and never read as floats
        blocks = stored_blocks(model, reader, rules, family.model_type) if quantize == "gguf" else {}
        params = _read_params(reader, model, family.model_type, rules, ignorable, device_mesh, layout,
                              label=f"loading {source}", skip=blocks)
        variables = split_collections(params, without_blocks(model_variables(model), blocks))
        if blocks:
            variables = with_blocks(model, variables, blocks)
    tokenizer = HFTokenizer(directory) if (directory / "tokenizer.json").is_file() else None
    if quantize == "int8":
        variables = quantize_int8(model, variables)
    return Pretrained(model, variables, tokenizer, config, sampling, budget, snapshot.revision, directory,
                      generation_config, family)


def _load_fallback(source, fallback: str, *, dtype, param_dtype, **native_only) -> Pretrained:
    """Tier 3 (`dew.interop.torchax_fallback`): transformers' PyTorch model through torchax."""
    if fallback != "torchax":
        raise ValueError(f"fallback={fallback!r}: the one fallback is 'torchax' (transformers' PyTorch model run "
                         "through torchax)")
    given = sorted(name for name, value in native_only.items() if value is not None)
    if given:
        raise NotImplementedError(f"fallback='torchax' runs transformers' own model, so {given} (Dew's kernels, "
                                  "meshes, quantization and GGUF reading) are not built for it: leave them unset")
    snapshot = resolve(source)
    config_path = snapshot.directory / CONFIG
    config = _read_json(config_path)
    model, variables = torchax_fallback.load(snapshot.directory, config, str(config_path), dtype=dtype,
                                             param_dtype=param_dtype, source=source)
    generation_path = snapshot.directory / GENERATION_CONFIG
    generation_config = _read_json(generation_path) if generation_path.is_file() else None
    sampling, budget = generation_defaults(generation_config, config, where=str(generation_path))
    directory = snapshot.directory
    tokenizer = HFTokenizer(directory) if (directory / "tokenizer.json").is_file() else None
    return Pretrained(model, variables, tokenizer, config, sampling, budget, snapshot.revision, directory,
                      generation_config)


def _load_probe(directory: Path, family: Converter) -> tuple[CausalTransformer, dict]:
    """Tier 2's probe: the float32 checkpoint in `directory` through `family`'s mapping, as (model, variables)."""
    config = _read_json(directory / CONFIG)
    snapshot = resolve(directory)
    kwargs = family.decoder_kwargs(config, str(directory / CONFIG))
    with SafetensorsReader(snapshot.weights, snapshot.index) as reader:
        kwargs = family.fit_to_weights(kwargs, reader.names())
        model = CausalTransformer(DecoderConfig(**kwargs, dtype="float32", param_dtype="float32"))
        params = _read_params(reader, model, family.model_type, family.tensor_rules(model.config, reader.names()),
                              lambda name: family.ignorable(name, model.config), label="verifying")
    return model, split_collections(params, model_variables(model))


@functools.lru_cache(maxsize=8)
def _multimodal_processor(directory: Path, config: MultimodalConfig) -> Processor:
    """The processor of the multimodal checkpoint in `directory` (built once per directory and model)."""
    return Processor.of(load_reference(directory), config)


def _source_names(directory: Path):
    """The tensor names of the checkpoint in `directory` (the layout a save writes back), None without one."""
    try:
        snapshot = resolve(directory)
    except (OSError, ValueError):
        return None
    with SafetensorsReader(snapshot.weights, snapshot.index) as reader:
        return reader.names()


def _save_block_diffusion(bundle: Pretrained, directory: Path, variables, max_shard_size) -> Path:
    """Write a DiffusionGemma bundle as a transformers checkpoint: its tensors (the vision tower's among them)
    under their checkpoint names, config.json and generation_config.json."""
    # the checkpoint keeps the per-layer scalars as frozen buffers, whichever way the model trained them
    variables = scalars_as({**bundle.variables, **(variables if "params" in variables else {"params": variables})},
                           trainable=False)
    model = DiffusionGemma(dataclasses.replace(bundle.model.config, trainable_scalars=False))
    block_diffusion.check_shapes(model, variables, str(directory))
    dtypes = {np.asarray(leaf).dtype.name for leaf in jax.tree_util.tree_leaves(variables["params"])}
    written = block_diffusion.write_tensors(variables, model.config)
    config_text = block_diffusion.config_text(bundle.config, dtypes.pop() if len(dtypes) == 1 else "float32")
    copied = [] if bundle.directory.resolve() == directory.resolve() else [
        name for name in (*TOKENIZER_FILES, *PROCESSOR_FILES) if (bundle.directory / name).is_file()]

    def write_configs():
        write_atomically(directory / CONFIG, config_text)
        write_atomically(directory / GENERATION_CONFIG,
                         json.dumps(bundle._generation_file(), indent=2, sort_keys=True) + "\n")
        for name in copied:
            write_atomically(directory / name, (bundle.directory / name).read_bytes())

    write_checkpoint(directory, written, max_shard_size, before_switch=write_configs,
                     staged_names=(CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES, *PROCESSOR_FILES))
    return directory


def _load_block_diffusion(snapshot, reader, config: dict, where: str, dtype, param_dtype,
                          max_seq_len: int | None) -> Pretrained:
    """A diffusion_gemma checkpoint as a `DiffusionGemma` (`dew.interop.families.diffusion_gemma`)."""
    generation_path = snapshot.directory / GENERATION_CONFIG
    generation_config = _read_json(generation_path) if generation_path.is_file() else None
    _check_generation(generation_config or {}, str(generation_path))
    with reader:
        if param_dtype == "auto":
            param_dtype = hf_decoders.param_dtype_name(config) or _first_float_dtype(reader)
        model_config = block_diffusion.model_config(config, where, max_seq_len=max_seq_len, dtype=dtype,
                                                    param_dtype=param_dtype)
        variables = block_diffusion.read_variables(reader, model_config, where)
    model = DiffusionGemma(model_config)
    block_diffusion.check_shapes(model, variables, where)
    variables = {name: (tree if name == "media" else jax.tree_util.tree_map(jnp.asarray, tree))
                 for name, tree in variables.items()}
    directory = snapshot.directory
    tokenizer = HFTokenizer(directory) if (directory / "tokenizer.json").is_file() else None
    eos = (generation_config or {}).get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    pad = (generation_config or {}).get("pad_token_id", config.get("text_config", {}).get("pad_token_id", 0))
    sampling = Sampling(temperature=0.0, eos_token_ids=eos_ids, pad_id=0 if pad is None else pad)
    return Pretrained(model, variables, tokenizer, config, sampling, (generation_config or {}).get("max_new_tokens"),
                      snapshot.revision, directory, generation_config)


def generation_defaults(generation: Mapping[str, Any] | None, config: Mapping[str, Any],
                        where: str = GENERATION_CONFIG, token_by_token: bool = True) -> tuple[Sampling, int | None]:
    """The `Sampling` and `max_new_tokens` a checkpoint's generation_config.json asks for.

    As in transformers: without `do_sample` true decoding is greedy (temperature 0) and the sampling
    fields are not applied (a warning names those the file sets); sampling keeps transformers'
    defaults (top_k 50) for fields the file leaves out; EOS and padding fall back to config.json's,
    and padding to the first EOS id. A field of the wrong kind is refused, naming `where`. Without
    `token_by_token` (a masked-diffusion model, whose own task judges the sampling fields) nothing is said
    of fields the policy does not apply.
    """
    generation = dict(generation or {})
    _check_generation(generation, where)
    unapplied = {k: generation[k] for k, neutral in _UNAPPLIED_GENERATION.items()
                 if generation.get(k, neutral) != neutral}
    if unapplied and token_by_token:
        warnings.warn(f"{where} sets {unapplied}, which Dew's sampler does not apply; its default policy ignores "
                      "them (pass text_generation(sampling=...) to choose one)", stacklevel=3)
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    pad = generation.get("pad_token_id", config.get("pad_token_id"))
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    penalty = generation.get("repetition_penalty")
    policy = dict(eos_token_ids=eos_ids, pad_id=pad,
                  repetition_penalty=None if penalty in (None, 1.0) else penalty)
    if generation.get("do_sample"):
        top_k, top_p, min_p = generation.get("top_k", 50), generation.get("top_p", 1.0), generation.get("min_p")
        policy.update(temperature=generation.get("temperature", 1.0), top_k=top_k or None,
                      top_p=None if top_p in (None, 1.0) else top_p, min_p=min_p or None)
    else:
        policy["temperature"] = 0.0
        ignored = {name: generation[name] for name, quiet in _SAMPLING_ONLY.items()
                   if generation.get(name, quiet) not in (None, quiet)}
        if ignored and token_by_token:
            listed = ", ".join(f"{name} {value!r}" for name, value in ignored.items())
            warnings.warn(f"{where} sets {listed} but not do_sample true, so, as in transformers, generation is greedy "
                          "and they are not applied: set do_sample to true there to sample with them (or choose a "
                          "policy with text_generation(sampling=...), or dew generate's --temperature)", stacklevel=3)
    try:
        return Sampling(**policy), generation.get("max_new_tokens")
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _check_generation(generation: Mapping[str, Any], where: str) -> None:
    """Refuse a generation_config.json field Dew reads whose value is not of the kind transformers gives it."""
    for name, kind in _GENERATION_KINDS.items():
        if name in generation:
            hf_decoders.check_field(where, name, generation[name], kind, "transformers' GenerationConfig")


def _read_json(path: Path) -> dict:
    """A config file's object of fields, refusing one that is not UTF-8 JSON or does not hold an object."""
    value, problem = read_json(path, object_only=True)
    if problem is None:
        return value
    raise ValueError(f"{path} {problem}: it is damaged or not a transformers config; fetch or export it again")


def _first_float_dtype(reader: SafetensorsReader) -> str:
    for name in reader.names():
        if reader.dtype(name) in _STORED_DTYPES:
            return _STORED_DTYPES[reader.dtype(name)]
    return "float32"


def _read_params(reader, model: CausalTransformer, model_type: str, rules, ignorable: Callable[[str], bool],
                 mesh: Mesh | None = None, layout: Layout = Layout(), label: str = "loading",
                 skip: Collection[tuple[str, ...]] = ()) -> dict:
    """The model's parameters in its own form from the checkpoint's tensors through `rules`, checking
    names, shapes and dtypes first; tensors `ignorable` names may be present and are not read, and
    neither are the leaves at the paths in `skip` (left out of the tree: kept otherwise, as blocks).

    On a `mesh`, each leaf is placed shard by shard with the sharding `layout` gives it, each shard
    reading its own region; without one, each leaf is filled on the host tensor by tensor and handed
    to the default device (on the CPU backend without a copy), so a leaf is never held twice. On a terminal a bar labelled `label`
    counts the bytes read.
    """
    config = model.config
    shapes = model_params(model)
    # Placed by each parameter's logical names through the layout's rules, as the trainer places them.
    shardings = None if mesh is None else layout.shardings(mesh, with_names(shapes, model.logical_names()["params"]))
    plan = tensors.plan(rules, shapes, model_type)
    present = set(reader.names())
    missing = sorted(set(plan.tensors) - present)
    describe = (f"config.json's {model_type} decoder ({config.num_layers} layers, width {config.emb_features}, "
                f"tie_word_embeddings {config.tie_embeddings})")
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) {describe} needs, such as {missing[:4]}: "
                         "the weights and config.json come from different models, or a shard is missing")
    extra = sorted(name for name in present - set(plan.tensors) if not ignorable(name))
    if extra:
        raise ValueError(f"the checkpoint holds {len(extra)} tensor(s) that {describe} has no place for, such as "
                         f"{extra[:4]} (in {reader.location[extra[0]].name}): the weights and config.json come from "
                         "different models")
    for name, need in plan.tensors.items():
        stored = reader.shape(name)
        if tuple(stored) != tuple(need):
            raise ValueError(f"tensor {name!r} in {reader.location[name].name} has shape {stored}; {describe} "
                             f"needs {need}: the weights and config.json come from different models")
        if reader.dtype(name) not in _STORED_DTYPES:
            raise ValueError(f"tensor {name!r} in {reader.location[name].name} is stored as {reader.dtype(name)}: "
                             "Dew reads float16, bfloat16 and float32 weights; load the unquantized checkpoint")
    params: dict = {}
    leaves = [leaf for leaf in plan.leaves if leaf.path not in skip]
    read = {link.name.format(**leaf.values(position)) for leaf in leaves for position in leaf.positions()
            for link in leaf.links}
    total = sum(math.prod(reader.shape(name)) * jnp.dtype(_STORED_DTYPES[reader.dtype(name)]).itemsize
                for name in plan.tensors if name in read)
    with byte_progress(label, total) as advance:
        for leaf in leaves:
            if shardings is None:
                # on the CPU backend the aligned host leaf becomes the parameter itself: one copy, not two
                value = jax.device_put(tensors.read_region(reader, leaf, None, config.param_dtype, advance),
                                       may_alias=True)
            else:
                value = jax.make_array_from_callback(leaf.shape, _leaf(shardings, leaf.path),
                                                     _shard_reader(reader, leaf, config.param_dtype, advance))
            _set_leaf(params, leaf.path, value)
    return params


def _shard_reader(reader, leaf: tensors.LeafPlan, dtype, advance) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """The callback that reads one device's shard of `leaf`; devices holding the same shard (replicas
    along the data axis) share one read, kept until the leaf is placed."""
    shards: dict[tuple, np.ndarray] = {}

    def read_shard(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(bound.indices(n)[:2] for bound, n in zip(index, leaf.shape))
        if key not in shards:
            shards[key] = tensors.read_region(reader, leaf, index, dtype, advance)
        return shards[key]

    return read_shard


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set_leaf(tree: dict, path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
