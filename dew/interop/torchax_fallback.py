"""Tier 3, the generic fallback: transformers' own PyTorch model of any causal-LM checkpoint, run through
torchax, so it compiles, differentiates and trains in JAX (`load_pretrained(source, fallback="torchax")`).

The variables keep the checkpoint's torch names and come in two collections: `params`, the parameters
torch would train (which the optimizer updates), and `buffers` (rotary frequencies and the like, never
updated). `TorchCausalLM` applies them as `LMObjective` and `Trainer` call a Dew decoder: hidden states
and a `Head` over the output projection, so the loss scores the vocabulary in tiles as for a native
model. No Dew kernels, no cached generation, float weights only. torch, transformers and torchax are
the `dew-ml[torchax]` extra, imported here on use; torchax is pinned to the release that imports with
Dew's torch (`TORCHAX_VERSION`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec

from dew.nn.head import Head
from dew.nn.transformer import ModelOutput
from dew.sharding import Layout

# torchax releases 0.0.5 to 0.0.13 fail to import with torch 2.13 (their amp table names
# aten.prod.dim_Dimname, which torch 2.13 removed); 0.0.4 imports, lowers and differentiates transformers' decoders.
TORCHAX_VERSION = "0.0.4"
TORCHAX_EXTRA = "pip install 'dew-ml[torchax]'"
_FLOATS = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

# Logical axes of transformers' tensors by name, in torch's [out, in] orientation (`TorchLayout`).
TORCH_AXES = (
    ("*.q_proj.weight", ("heads", "embed")), ("*.k_proj.weight", ("kv_heads", "embed")),
    ("*.v_proj.weight", ("kv_heads", "embed")), ("*.o_proj.weight", ("embed", "heads")),
    ("*.qkv_proj.weight", ("heads", "embed")), ("*.query_key_value.weight", ("heads", "embed")),
    ("*.gate_proj.weight", ("mlp", "embed")), ("*.up_proj.weight", ("mlp", "embed")),
    ("*.gate_up_proj.weight", ("mlp", "embed")), ("*.down_proj.weight", ("embed", "mlp")),
    ("*embed_tokens.weight", ("vocab", "embed")), ("*embed_in.weight", ("vocab", "embed")),
    ("lm_head.weight", ("vocab", "embed")), ("embed_out.weight", ("vocab", "embed")),
)


class TorchaxFallbackWarning(UserWarning):
    """A checkpoint loaded as tier 3: transformers' PyTorch forward through torchax (see the module)."""


@dataclasses.dataclass(frozen=True)
class TorchLayout(Layout):
    """A `Layout` for torch-named variables: `names` maps name globs to logical axes (torch's [out, in]
    orientation), which the layout's `rules` place on the mesh; a name no glob matches, and every buffer,
    takes the size rule."""

    names: tuple[tuple[str, tuple[str, ...]], ...] = TORCH_AXES

    def logical_names(self, variables: dict) -> dict:
        """A tree like `variables` (`params` and `buffers` by torch name) of each leaf's `PartitionSpec`."""
        def spec(name: str, leaf) -> PartitionSpec:
            for pattern, axes in self.names:
                if fnmatch.fnmatchcase(name, pattern) and len(axes) == np.ndim(leaf):
                    return PartitionSpec(*axes)
            return PartitionSpec()

        return {"params": {name: spec(name, leaf) for name, leaf in variables["params"].items()},
                "buffers": {name: PartitionSpec() for name in variables["buffers"]}}


@dataclasses.dataclass(frozen=True)
class TorchConfig:
    """What objectives read of a tier-3 model's config: the vocabulary, the longest sequence, the compute
    and storage dtypes; it applies no dropout (the torch model runs in eval mode)."""

    vocab_size: int
    max_seq_len: int
    dtype: Any
    param_dtype: Any
    attention_dropout: float = 0.0
    mtp_depths: int = 0


class TorchCausalLM:
    """transformers' causal LM as a function of `{"params": ..., "buffers": ...}` (torch names) and int32
    ids `[B, S]`: `apply` gives float32 logits `[B, S, V]`, or with `head=False` a `ModelOutput` (the
    states before the output projection and a `Head` over it), as a Dew decoder does. Floating parameters
    are cast to `config.dtype` for the computation; the stored dtype stays the master copy."""

    def __init__(self, module, config: TorchConfig, head: str, shapes: dict, layout: TorchLayout = TorchLayout()):
        self.module, self.config, self.head, self.layout = module, config, head, layout
        self._shapes = shapes

    def init(self, key, tokens, head: bool = False):
        """The loaded variables' shapes, for an objective's check (under `jax.eval_shape` only): tier 3 has no
        initializer, so a fresh start is refused."""
        if not isinstance(key, jax.core.Tracer):
            raise TypeError("a tier-3 (fallback='torchax') model has no initializer: its variables come from the "
                            "checkpoint; give them to the objective (LMObjective(model, seq_len, "
                            "pretrained=bundle.variables))")
        return jax.tree_util.tree_map(lambda shape: jnp.zeros(shape.shape, shape.dtype), self._shapes)

    def stack_variables(self, variables):
        return variables

    def logical_names(self) -> dict:
        return self.layout.logical_names(self._shapes)

    def apply(self, variables, tokens, head: bool = True, rngs=None, layers=(), **kwargs):
        if layers or kwargs:
            asked = [f"layers={tuple(layers)}"] * bool(layers) + sorted(kwargs)
            raise NotImplementedError(f"a tier-3 (fallback='torchax') model reads whole rows of token ids only; "
                                      f"{', '.join(asked)} (packed rows, padding masks, layer states) are not built "
                                      "for it")
        compute = jnp.dtype(self.config.dtype)
        cast = lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x
        params = {name: cast(value) for name, value in variables["params"].items()}
        hidden, logits = _forward(self.module, params, variables["buffers"], jnp.asarray(tokens, jnp.int32))
        if head:
            return logits.astype(jnp.float32)
        return ModelOutput(hidden=hidden, head=Head(params[self.head], transposed=True))


def _forward(module, params, buffers, tokens):
    """transformers' forward through torchax: (the output projection's input, its logits)."""
    torchax, interop = importlib.import_module("torchax"), importlib.import_module("torchax.interop")
    torch = importlib.import_module("torch")
    captured = {}
    hook = module.get_output_embeddings().register_forward_pre_hook(
        lambda _, inputs: captured.__setitem__("hidden", inputs[0]))
    try:
        params_t, buffers_t, tokens_t = interop.torch_view((params, buffers, tokens))
        with torchax.default_env():
            logits = torch.func.functional_call(module, {**params_t, **buffers_t}, (tokens_t,),
                                                {"use_cache": False}).logits
    finally:
        hook.remove()
    return interop.jax_view(captured["hidden"]), interop.jax_view(logits)


def imports():
    """torch, transformers and torchax, or the refusal naming the extra and the versions it needs."""
    try:
        torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    except ImportError:
        raise ImportError(f"fallback='torchax' runs transformers' PyTorch model, and torch or transformers is not "
                          f"installed: {TORCHAX_EXTRA}") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchax's distributed backend warns on import
            torchax = importlib.import_module("torchax")
            importlib.import_module("torchax.interop")
    except ImportError:
        raise ImportError(f"fallback='torchax' needs torchax {TORCHAX_VERSION}: {TORCHAX_EXTRA}") from None
    except AttributeError as error:  # a torchax release whose op tables name ops this torch removed
        raise ImportError(f"torchax {getattr(torchax, '__version__', '?')} does not import with torch "
                          f"{torch.__version__} ({error}); releases 0.0.5 to 0.0.13 fail so with torch 2.13: install "
                          f"the pinned one ({TORCHAX_EXTRA}, torchax=={TORCHAX_VERSION})") from None
    return torch, transformers, torchax


def load(directory: Path, config: dict, where: str, *, dtype, param_dtype, source) -> tuple[TorchCausalLM, dict]:
    """transformers' model of the checkpoint in `directory` as `(TorchCausalLM, variables)`, warning once."""
    torch, transformers, torchax = imports()
    if "quantization_config" in config or "quantization" in config:
        raise ValueError(f"{where} describes quantized weights; fallback='torchax' reads float weights only: load the "
                         "float checkpoint")
    stored = param_dtype if param_dtype != "auto" else (config.get("dtype") or config.get("torch_dtype") or "float32")
    stored = str(stored).removeprefix("torch.")
    if stored not in _FLOATS:
        raise ValueError(f"param_dtype {stored!r}: fallback='torchax' stores float32, float16 or bfloat16")
    module = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=getattr(torch, stored), local_files_only=True, attn_implementation="eager").eval()
    head = module.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise NotImplementedError(f"{type(module).__name__}'s output projection is {type(head).__name__} with a "
                                  "bias or of another kind; fallback='torchax' is built for a plain product")
    params = {name: _host(torch, tensor) for name, tensor in module.named_parameters() if tensor.requires_grad}
    buffers = {name: _host(torch, tensor) for name, tensor in module.named_buffers()}
    buffers.update({name: _host(torch, tensor) for name, tensor in module.named_parameters()
                    if not tensor.requires_grad})
    head_name = next(name for name, tensor in module.named_parameters() if tensor is head.weight)
    variables = {"params": params, "buffers": buffers}
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), variables)
    model = TorchCausalLM(module, TorchConfig(module.config.vocab_size,
                                              getattr(module.config, "max_position_embeddings", 2048),
                                              dtype, _FLOATS[stored]), head_name, shapes)
    warnings.warn(f"{source} loads as tier 3 (fallback='torchax'): transformers {transformers.__version__}'s PyTorch "
                  f"{type(module).__name__} lowered by torchax {torchax.__version__} with torch {torch.__version__}; "
                  "no Dew kernels, no sharding rules beyond TorchLayout's name table, no cached generation, and the "
                  "torch model stays in host memory (plan for twice the checkpoint)", TorchaxFallbackWarning,
                  stacklevel=3)
    return model, jax.tree_util.tree_map(jnp.asarray, variables)


def _host(torch, tensor) -> np.ndarray:
    """A torch tensor's values on the host, as numpy (bfloat16 through its bits)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(dtype=torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy().copy()
