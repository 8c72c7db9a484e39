"""Tier 2, the verified mapping: a `model_type` Dew has no family for loads natively through a registered
family's mapping once transformers' own class for the type, shrunk and random, computes the same logits.

Before any weights are read, `verified_family` completes the config as transformers reads it (its class's
defaults), shrinks it (`shrink`: the layer count and every per-layer field kept, widths, heads and the
vocabulary made small), builds transformers' model from it with random weights of order one, and loads
that model through each candidate: a Llama mapping that also reads windows and layer types, then every
registered causal family. A candidate reads the fields it knows; the rest must prove inert. The first
candidate whose float32 logits land within a bound counted from the arithmetic (`probe_bound`) is the
family the real checkpoint loads through, with one `VerifiedMappingWarning`. Otherwise the load is
refused with each candidate's reason or measured difference. torch and transformers are imported
here, on use: they are the `dew-ml[torch]` extra, never core dependencies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.interop.families import FAMILIES
from dew.interop.families.converter import Converter
from dew.interop.families.llama import LLAMA
from dew.interop.hf_decoders import foreign_fields
from dew.interop.roundings import transformers_decoder_ulps
from dew.nn.transformer import FULL, SLIDING

PROBE_TOKENS = (2, 12)  # rows and tokens of the probe's ids
PROBE_VOCAB = 256
PROBE_HEAD_DIM = 16
PROBE_WINDOW = 4  # shorter than the probe, so a window acts
TORCH_EXTRA = "pip install 'dew-ml[torch]'"
TORCHAX_HINT = ("to run transformers' own forward instead, load it with load_pretrained(..., fallback=\"torchax\") "
                "(tier 3, pip install 'dew-ml[torchax]')")
# Fields of the probe's config that stay out: quantization, remote code and the stored dtype.
_DROPPED = ("quantization_config", "auto_map", "dtype", "torch_dtype", "_name_or_path", "transformers_version",
            "model_type", "architectures", "id2label", "label2id")
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Llama's mapping with windows: Llama's fields, tensor names and numbers, and, per layer, a sliding window
# (layer_types; without it every layer slides, as Mistral's do) - what many Llama-block types add.
WINDOWED_LLAMA = dataclasses.replace(
    LLAMA, fields={**LLAMA.fields, "sliding_window": None, "layer_types": None}, window="layer_types",
    default_pattern=lambda source, layers: [SLIDING if source.get("sliding_window") else FULL] * layers)


class VerifiedMappingWarning(UserWarning):
    """A model type loaded through a registered family's mapping after tier 2's check (see the module)."""


@dataclasses.dataclass(frozen=True)
class Verified:
    """A verified mapping: the registered `family` (reading the real config with `inert` fields set aside)
    that computes `model_type` as transformers' `reference` does, to `error` within `bound` on the probe.
    `config` is the source config as transformers completes it, which the family reads."""

    model_type: str
    family: Converter
    config: dict[str, Any]
    reference: str
    error: float
    bound: float
    inert: tuple[str, ...]

    def message(self) -> str:
        inert = f", with the config fields {list(self.inert)} shown inert" if self.inert else ""
        return (f"tier 2: verified mapping: model_type {self.model_type!r} loads as the registered "
                f"{self.family.model_type!r} family; {self.reference} agrees with it on a shrunk random instance to "
                f"max |dlogits| {self.error:.3g} in float32 (bound {self.bound:.3g}){inert}")


def candidates() -> list[Converter]:
    """The mappings tier 2 tries, in order: Llama with windows, then every registered causal decoder family."""
    registered = [family for family in FAMILIES.values()
                  if family.writes_decoders and not getattr(family, "multimodal", False)
                  and not hasattr(family, "process") and family.model_type != "mamba2"]
    return [WINDOWED_LLAMA, *registered]


def reading(family: Converter, config: Mapping[str, Any]) -> Converter:
    """`family` reading `config` with the fields it does not read set aside (tier 2 shows them inert)."""
    return dataclasses.replace(family, legacy_fields=family.legacy_fields | set(foreign_fields(config, family)))


def shrink(config: Mapping[str, Any]) -> dict[str, Any]:
    """A transformers config's fields at the probe's sizes: the layer count and every per-layer field kept,
    the query to key/value head ratio kept with at most 2 key/value heads of 16 features, the width that of
    the heads (twice it where the source's width differs from its heads'), the MLP twice the width, 256 ids
    (token ids clamped below), a window of 4; mixtures at 4 experts, 2 per token."""
    fields = {name: value for name, value in config.items() if name not in _DROPPED}
    heads = fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    groups = max(heads // kv_heads, 1)
    head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
    small_kv = min(kv_heads, 2)
    fields.update(num_attention_heads=small_kv * groups, num_key_value_heads=small_kv, vocab_size=PROBE_VOCAB)
    width = small_kv * groups * PROBE_HEAD_DIM
    fields["hidden_size"] = width if fields["hidden_size"] == heads * head_dim else 2 * width
    if fields.get("head_dim") is not None:
        fields["head_dim"] = PROBE_HEAD_DIM
    fields["intermediate_size"] = 2 * fields["hidden_size"]
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if fields.get(name):
            fields[name] = fields["hidden_size"]
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if fields.get(name):
            fields[name] = 4
    if (fields.get("num_experts_per_tok") or 0) > 2:
        fields["num_experts_per_tok"] = 2
    if fields.get("sliding_window"):
        fields["sliding_window"] = min(fields["sliding_window"], PROBE_WINDOW)
    for name in _TOKEN_FIELDS:
        value = fields.get(name)
        if isinstance(value, list):
            fields[name] = [min(token, PROBE_VOCAB - 1) for token in value]
        elif isinstance(value, int):
            fields[name] = min(value, PROBE_VOCAB - 1)
    return fields


def probe_bound(reference_config, reference_logits: np.ndarray) -> float:
    """How far apart Dew's and transformers' float32 logits of the probe may land when both compute the same
    model: the roundings and library ulps `dew.interop.roundings.decoder_ulps` counts for its sizes, twice
    over (a mapping adds scalings a plain decoder lacks), in ulps of the largest reference logit."""
    ulps = transformers_decoder_ulps(reference_config, PROBE_TOKENS[1])
    return 2 * ulps * float(np.finfo(np.float32).eps) * float(np.abs(reference_logits).max())


def verified_family(config: Mapping[str, Any], where: str,
                    load_probe: Callable[[Path, Converter], tuple[Any, Any]]) -> Verified:
    """Verify that a registered family computes `config`'s model type (see the module); `load_probe(directory,
    family)` loads the probe's checkpoint as `(model, variables)` through a family. Refused without torch
    and transformers (naming the extra) and where no candidate computes the type (naming each one's
    reason or measured difference)."""
    model_type = config.get("model_type")
    native = f"native families are {sorted(FAMILIES)}"
    torch, transformers = _oracles(model_type, where, native)
    try:
        reference_config = transformers.AutoConfig.for_model(model_type, **_class_fields(config))
    except (ValueError, KeyError) as error:
        raise ValueError(f"{where} names model_type {model_type!r}, which is neither a Dew family ({native}) nor a "
                         f"type transformers {transformers.__version__} builds ({error}); {TORCHAX_HINT} once "
                         "transformers knows it") from None
    completed = {**reference_config.to_dict(), "model_type": model_type}
    differences, reasons, verified = [], [], None
    with tempfile.TemporaryDirectory(prefix="dew-verify-") as scratch, _quiet(transformers):
        try:
            probe_config, reference, logits = _probe(torch, transformers, model_type, completed, Path(scratch))
        except Exception as error:  # transformers' own refusal of a shrunk config, whatever its class
            raise ValueError(f"{where} names model_type {model_type!r}, which is not a Dew family ({native}); tier 2 "
                             f"could not build transformers' class for it at the probe's sizes ({type(error).__name__}: "
                             f"{error}); {TORCHAX_HINT}") from None
        bound = probe_bound(probe_config, logits)
        measured: dict[str, float] = {}
        for candidate in candidates():
            family = reading(candidate, completed)
            try:
                kwargs = repr(sorted(family.decoder_kwargs(completed, where).items()))
                model, variables = load_probe(Path(scratch), family)
            except ValueError as error:
                reasons.append(f"{_name(candidate)}: {_short(str(error).removeprefix(where + ' '))}")
                continue
            if kwargs not in measured:  # families that read the config alike compute it alike
                with jax.default_matmul_precision("highest"):
                    ours = model.apply(variables, jnp.asarray(_probe_ids(), jnp.int32))
                measured[kwargs] = float(np.abs(np.asarray(ours, np.float32) - logits).max())
            error = measured[kwargs]
            if error <= bound:
                inert = tuple(sorted(set(foreign_fields(completed, candidate)) - set(_DROPPED)))
                verified = Verified(model_type, family, completed, reference, error, bound, inert)
                break
            differences.append(f"{_name(candidate)}: max |dlogits| {error:.3g} against the bound {bound:.3g} "
                               f"(largest logit {np.abs(logits).max():.3g})")
    if verified is not None:  # warned outside the probe, whose warnings are silenced
        warnings.warn(verified.message(), VerifiedMappingWarning, stacklevel=5)  # at the load_pretrained call
        return verified
    raise ValueError(f"{where} names model_type {model_type!r}, which is not a Dew family ({native}), and no "
                     f"registered family computes what {reference} computes (tier 2, verified mapping, on a shrunk "
                     f"random instance in float32): " + "; ".join(differences + reasons) + f". {TORCHAX_HINT}")


def _oracles(model_type, where: str, native: str):
    """torch and transformers, or the refusal naming the extra that installs them."""
    try:
        return importlib.import_module("torch"), importlib.import_module("transformers")
    except ImportError:
        raise ValueError(f"{where} names model_type {model_type!r}, which is not a Dew family ({native}); loading it "
                         "through a verified mapping (tier 2) first runs transformers' own class for it on a shrunk "
                         f"random copy, which needs torch and transformers: {TORCH_EXTRA}") from None


def _name(candidate: Converter) -> str:
    return "llama with windows" if candidate is WINDOWED_LLAMA else candidate.model_type


def _short(reason: str, limit: int = 240) -> str:
    """A dismissed candidate's reason, cut to `limit` characters."""
    return reason if len(reason) <= limit else reason[:limit - 3] + "..."


def _class_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in config.items()
            if name not in ("model_type", "transformers_version", "quantization_config", "auto_map")}


def _probe_ids() -> np.ndarray:
    return np.random.RandomState(7).randint(0, PROBE_VOCAB, PROBE_TOKENS)


def _probe(torch, transformers, model_type: str, completed: dict, directory: Path):
    """Build transformers' model for the shrunk config with random weights (norm scales 1 + 0.1 N(0, 1),
    every other tensor 0.2 N(0, 1)), save it in `directory` and run the probe's ids in float32 with eager
    attention: (its config, its class in words, its logits)."""
    small = transformers.AutoConfig.for_model(model_type, **shrink(completed))
    small._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.2)
        logits = model(torch.from_numpy(_probe_ids()), use_cache=False).logits.float().numpy()
    model.save_pretrained(directory)
    return small, f"transformers {transformers.__version__}'s {type(model).__name__}", logits


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' logging and warnings silenced during the probe, restored after."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
