"""LoRA adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`.

`save_peft` writes a `LoRAModel`'s adapters so that `peft.PeftModel.from_pretrained` puts them on
the transformers model of the same base checkpoint; `load_peft` reads such a directory (written here
or by PEFT) onto a Dew decoder. The tensor names come from the family's own tensor rules
(`dew.interop.tensors`): a projection whose kernel is `model.layers.{layer}.self_attn.q_proj.weight`
has its adapters at `base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight` (`[rank,
in]`) and `lora_B.weight` (`[out, rank]`), both transposed from Dew's `[in, rank]` and `[rank, out]`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save

from dew import trees
from dew.files import write_atomically
from dew.interop import tensors
from dew.interop.families import family_for
from dew.interop.safetensors_files import SafetensorsReader
from dew.nn.lora import ADAPTER_LEAVES, LoRA, LoRAModel, adapters

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # where PEFT's wrapper puts the transformers model's own names
_STORED = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# adapter_config.json settings that change what the adapters compute, and the value Dew computes.
_PLAIN = {"use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False, "rank_pattern": {},
          "alpha_pattern": {}, "layers_to_transform": None, "modules_to_save": None, "lora_bias": False}


def _adapter_rules(model) -> tuple[tuple[tensors.Rule, ...], dict[str, str]]:
    """The family's kernel rules turned into adapter rules, and each adapted Dew module path
    (`layers/self_attn/q_proj`) with its transformers module name template."""
    family = family_for(model.config)
    rules, modules = [], {}
    for rule in family.tensor_rules(model.config):
        if not rule.dew[0].endswith("/kernel"):
            continue
        module = rule.dew[0].removesuffix("/kernel")
        if len(rule.dew) > 1 or len(rule.tensor) > 1 or rule.permute is not None or not rule.tensor[0].endswith(".weight"):
            modules[module] = None  # stored fused or split: PEFT's one A and B per module cannot hold it
            continue
        name = rule.tensor[0].removesuffix(".weight")
        modules[module] = name
        for leaf in ADAPTER_LEAVES:
            rules.append(tensors.Rule(f"{module}/{leaf}", f"{PREFIX}{name}.{leaf}.weight", transpose=(1, 0),
                                      stack=rule.stack))
    return tuple(rules), modules


def _target_modules(model: LoRAModel, planned: tensors.Plan) -> list[str]:
    """PEFT's `target_modules`: the adapted modules' last names when those pick exactly the adapted
    modules among the model's projections, else the adapted modules' full names."""
    adapted = sorted({name.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for name in planned.tensors})
    kernels = tensors.plan(family_for(model.config).tensor_rules(model.config),
                           jax.eval_shape(lambda: model.model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                                                                   head=False))["params"])
    every = {name.removesuffix(".weight") for name in kernels.tensors if name.endswith(".weight")}
    last = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    picked = {name for name in every if name.rsplit(".", 1)[-1] in last}
    return last if picked == set(adapted) else adapted


def save_peft(directory: str | Path, model: LoRAModel, variables, *, base_model: str | None = None) -> Path:
    """Write the adapters of `variables` (a `LoRAModel`'s, in its own form or per layer) as PEFT's
    `adapter_config.json` and `adapter_model.safetensors` in `directory`, each replaced atomically.
    `base_model` is recorded as `base_model_name_or_path` (the checkpoint the adapters go on)."""
    directory = Path(directory)
    found = adapters(model.stack_variables(variables))
    if not found:
        raise ValueError("these variables hold no LoRA adapters (lora_A, lora_B): pass a LoRAModel's variables")
    rules, _ = _adapter_rules(model.model)
    planned = _plan(rules, found["params"], model)
    arrays = {name: np.ascontiguousarray(build()) for name, _, build in tensors.export_tensors(planned, found["params"])}
    lora = model.lora
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": _target_modules(model, planned), "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": base_model, **_PLAIN,
    }
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / WEIGHTS, save(arrays, metadata={"format": "pt"}))
    write_atomically(directory / CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def check_peft(model: LoRAModel) -> None:
    """Refuse, before anything trains, adapters that `save_peft` could not write for `model`: one on a
    projection its checkpoint stores fused or split, names the projection."""
    _plan(_adapter_rules(model.model)[0], _expected_adapters(model), model)


def _expected_adapters(model: LoRAModel) -> dict:
    """The shapes and dtypes of `model`'s adapter leaves (a `params` tree), computed without running it."""
    return adapters(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                                                      head=False)))["params"]


def _plan(rules, params, model) -> tensors.Plan:
    try:
        return tensors.plan(rules, params, family_for(model.config).model_type)
    except ValueError as error:
        if "has no tensor rule" not in str(error):
            raise
        raise ValueError(f"{error}: its checkpoint stores that projection fused or split, and PEFT keeps one "
                         "lora_A and lora_B per module, so these adapters cannot be written in PEFT's format; "
                         "target other projections") from None


def load_peft(directory: str | Path, model, variables, *, dtype=None) -> tuple[LoRAModel, dict]:
    """PEFT's LoRA adapter files in `directory` on the decoder `model` (a `CausalTransformer`) with its
    `variables`: the adapted model and its variables with the adapters (in `dtype`, default the
    stored one). An adapter made for another base (other widths or more layers) is refused, naming the
    tensor, its shape and what this model takes; so is a setting Dew does not compute (DoRA, rsLoRA,
    per-module ranks, trained biases)."""
    directory = Path(directory)
    for name in (CONFIG, WEIGHTS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory} has no {name}: a PEFT LoRA adapter directory holds {CONFIG} and "
                                    f"{WEIGHTS}")
    config = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory / CONFIG} has peft_type {config.get('peft_type')!r}; Dew reads LoRA adapters "
                         "(peft_type 'LORA')")
    for name, plain in _PLAIN.items():
        value = config.get(name)
        if value is not None and value != plain and not (plain in ({}, None) and not value):
            raise ValueError(f"{directory / CONFIG} sets {name} to {config[name]!r}, which Dew's LoRA does not "
                             f"compute (it computes {name} {plain!r}): merge the adapter with PEFT first "
                             "(merge_and_unload) and load the merged checkpoint")
    rules, modules = _adapter_rules(model)
    with SafetensorsReader([directory / WEIGHTS]) as reader:
        names = set(reader.names())
        adapted = sorted({module for module, template in modules.items() if template is not None
                          for name in names if _is_instance(template, name)})
        if not adapted:
            raise ValueError(f"{directory / WEIGHTS} holds no adapter of this model's projections "
                             f"({sorted(m.rsplit('/', 1)[-1] for m in modules)}); it holds {sorted(names)[:4]}")
        lora = LoRA(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                    targets=tuple(module.removeprefix("layers/") for module in adapted),
                    dropout=float(config.get("lora_dropout") or 0.0))
        adapted_model = lora.adapt(model)
        expected = _expected_adapters(adapted_model)
        planned = _plan(rules, expected, adapted_model)
        _check_tensors(planned, reader, directory / WEIGHTS)
        stored = {_STORED.get(reader.dtype(name), "float32") for name in planned.tensors}
        target = jnp.dtype(dtype or (stored.pop() if len(stored) == 1 else "float32"))
        read = {leaf.path: jnp.asarray(tensors.read_region(reader, leaf, None, target)) for leaf in planned.leaves}
    found = jax.tree_util.tree_map_with_path(lambda path, _: read[tuple(entry.key for entry in path)], expected)
    stacked = adapted_model.stack_variables(variables)
    return adapted_model, {**stacked, "params": trees.join(found, stacked["params"])}


def _is_instance(template: str, name: str) -> bool:
    """Whether tensor `name` is an adapter of the module `template` (`model.layers.{layer}.self_attn.q_proj`)."""
    head, _, tail = template.partition("{layer}")
    for leaf in ADAPTER_LEAVES:
        full = f"{PREFIX}{head}"
        suffix = f"{tail}.{leaf}.weight"
        if name.startswith(full) and name.endswith(suffix):
            middle = name[len(full):len(name) - len(suffix)]
            if (not tail and not middle) or middle.isdigit():
                return True
    return False


def _check_tensors(planned: tensors.Plan, reader, path: Path) -> None:
    """Refuse an adapter file whose tensors are not this model's: missing, extra, or shaped for another base."""
    names = set(reader.names())
    missing = [name for name in planned.tensors if name not in names]
    extra = sorted(names - set(planned.tensors))
    if extra:
        raise ValueError(f"{path} holds {len(extra)} adapter tensor(s) this model has no place for, such as "
                         f"{extra[0]!r}: the adapter was made for another base (a deeper model, or other "
                         "projections); load it onto the checkpoint it was trained on")
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} adapter tensor(s) of the modules it adapts, such as "
                         f"{missing[0]!r}: the file is incomplete, or made for a shallower base")
    for name, shape in planned.tensors.items():
        if tuple(reader.shape(name)) != tuple(shape):
            raise ValueError(f"adapter tensor {name!r} in {path} has shape {list(reader.shape(name))}; on this model "
                             f"it is {list(shape)} (rank, in) / (out, rank): the adapter was made for another base "
                             "(other widths or rank); load it onto the checkpoint it was trained on")
