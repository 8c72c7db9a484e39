"""Writing a Dew decoder as a transformers checkpoint: `save_pretrained` for any model a family computes
(one trained from scratch included), and `write_export`, which `Pretrained.save` shares.

The weights go out through the family's tensor rules (`dew.interop.tensors`), each tensor cut from
its leaf (one layer of a stacked run, transposed) only when its shard is written; config.json comes
from the family converter (`Converter.to_hf_config`) or the loaded checkpoint's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from dew.interop import tensors
from dew.interop.families import Converter, family_for
from dew.interop.hub import CONFIG, GENERATION_CONFIG, PROCESSOR_FILES, TOKENIZER_FILES
from dew.interop.safetensors_files import write_atomically, write_checkpoint
from dew.nn.linear import QUANT_COLLECTION
from dew.nn.transformer import CausalTransformer
from dew.sampling import Sampling


def save_pretrained(model: CausalTransformer, variables, directory: str | Path, tokenizer_dir: str | Path | None = None,
                    generation: Sampling | Mapping[str, Any] | None = None, *, max_new_tokens: int | None = None,
                    max_shard_size: int | str = "5GB") -> Path:
    """Write `model` with `variables` (`{"params": ...}` or the params, stacked runs or per layer) as a
    transformers checkpoint in `directory`, which transformers' `AutoModelForCausalLM` loads.

    config.json is the plainest family that computes exactly this model (`family_for`; a model none
    computes is refused by name). `generation` is a `Sampling` (written as generation_config.json
    with `max_new_tokens`, its EOS and padding ids also in config.json) or generation_config.json's
    contents as they are; the tokenizer files in `tokenizer_dir` are copied. Weights are written as in
    `Pretrained.save`: in the parameters' dtype, sharded past `max_shard_size`, switched atomically.
    """
    converter = family_for(model.config)
    config = converter.to_hf_config(model.config)
    generation_file = None
    if isinstance(generation, Sampling):
        generation_file = generation_config(generation, max_new_tokens)
    elif generation is not None:
        generation_file = dict(generation)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        # the family's defaults (Llama's EOS 2) would name tokens of another vocabulary
        config[key] = None if generation_file is None else generation_file.get(key)
    return write_export(directory, model, converter, variables, config, generation_file,
                        None if tokenizer_dir is None else Path(tokenizer_dir), max_shard_size)


def generation_config(sampling: Sampling, max_new_tokens: int | None = None) -> dict[str, Any]:
    """generation_config.json for a `Sampling`: what `generation_defaults` reads back as the same policy."""
    written: dict[str, Any] = {"pad_token_id": sampling.pad_id}
    if sampling.eos_token_ids:
        eos = list(sampling.eos_token_ids)
        written["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if sampling.temperature == 0:
        written["do_sample"] = False
    else:
        # transformers' sampling keeps top_k 50 unless told otherwise; 0 keeps every token
        written.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                       top_p=1.0 if sampling.top_p is None else sampling.top_p)
        if sampling.min_p is not None:
            written["min_p"] = sampling.min_p
    if sampling.repetition_penalty is not None:
        written["repetition_penalty"] = sampling.repetition_penalty
    if max_new_tokens is not None:
        written["max_new_tokens"] = max_new_tokens
    return written


def write_export(directory: str | Path, model: CausalTransformer, converter: Converter, variables,
                 config: Mapping[str, Any], generation_file: Mapping[str, Any] | None, tokenizer_dir: Path | None,
                 max_shard_size: int | str, rules=None) -> Path:
    """Write `variables` through `converter`'s tensor rules (or `rules`, a layout the source used), with
    `config` (its `dtype` set to the parameters'), `generation_file` (None: none written) and the
    tokenizer and processor files of `tokenizer_dir`."""
    directory = Path(directory)
    params = checked_params(model, variables)
    rules = converter.tensor_rules(model.config) if rules is None else rules
    plan = tensors.plan(rules, params, converter.model_type)
    exported = tensors.export_tensors(plan, params)
    dtypes = {leaf.dtype.name for leaf in plan.leaves}
    config = {key: value for key, value in config.items() if key != "torch_dtype"}
    config["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    copied = [] if tokenizer_dir is None or tokenizer_dir.resolve() == directory.resolve() else [
        name for name in (*TOKENIZER_FILES, *PROCESSOR_FILES) if (tokenizer_dir / name).is_file()]

    def write_configs():
        write_atomically(directory / CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
        if generation_file is not None:
            text = json.dumps(generation_file, indent=2, sort_keys=True) + "\n"
            write_atomically(directory / GENERATION_CONFIG, text)
        for name in copied:
            write_atomically(directory / name, (tokenizer_dir / name).read_bytes())

    write_checkpoint(directory, exported, max_shard_size, before_switch=write_configs,
                     staged_names=(CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES, *PROCESSOR_FILES))
    return directory


def model_params(model: CausalTransformer):
    """Every weight a checkpoint of the model holds, as shapes, without allocating them: the parameters
    in the model's own form (scanned runs stacked), with the leaves of its other collections (a
    router's balancing bias, `moe`) merged in at their paths (`merge_collections`)."""
    return merge_collections(model_variables(model))


def model_variables(model: CausalTransformer):
    """The model's variables, every collection, as shapes."""
    return model.variable_shapes()


def merge_collections(variables: Mapping) -> dict:
    """One tree of every collection's leaves at their paths (`params` and `moe` never share a leaf);
    `split_collections` cuts it back."""
    merged: dict = {}

    def merge(into: dict, tree: Mapping):
        for key, value in tree.items():
            if isinstance(value, Mapping):
                merge(into.setdefault(key, {}), value)
            else:
                into[key] = value

    for collection in sorted(variables, key=lambda name: name != "params"):
        merge(merged, variables[collection])
    return merged


def split_collections(merged: Mapping, like: Mapping) -> dict:
    """`merged` cut into the collections of `like`, a variables tree whose collections hold its leaves."""

    def pick(tree: Mapping, shape: Mapping):
        return {key: pick(tree[key], value) if isinstance(value, Mapping) else tree[key] for key, value in shape.items()}

    return {collection: pick(merged, tree) for collection, tree in like.items()}


def checked_params(model: CausalTransformer, variables):
    """The weights of `variables` (collections merged, as `model_params` gives them), refused unless they
    are this model's tree in its own form or per layer."""
    if QUANT_COLLECTION in variables:
        raise ValueError("these variables hold int8 weights (dew.nn.quantize) or a GGUF file's blocks "
                         "(dew.interop.gguf_blocks), made for generation: save the float weights they came from (load "
                         "the checkpoint without quantize=)")
    if "params" not in variables:
        variables = {"params": variables}
    own = model_variables(model)
    missing = sorted(set(own) - set(variables))
    if missing:
        raise ValueError(f"the variables to save have no {missing} collection(s), which this model keeps weights in "
                         "(a router's balancing bias is in 'moe'): pass the whole variables tree")
    params = merge_collections({name: variables[name] for name in own})
    have = jax.tree_util.tree_structure(params)
    for expected in (merge_collections(own), merge_collections(jax.eval_shape(model.unstack_variables, own))):
        if have != jax.tree_util.tree_structure(expected):
            continue
        for (path, want), leaf in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree_util.tree_leaves(params)):
            if tuple(want.shape) != tuple(leaf.shape):
                raise ValueError(f"the variables to save hold {jax.tree_util.keystr(path)} with shape {leaf.shape}; "
                                 f"this model has {want.shape}")
        return params
    raise ValueError("the variables to save do not have this model's parameter tree: pass the loaded variables or a "
                     "training state's params for the same model")
