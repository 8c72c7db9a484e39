"""LoRA: low-rank adapters beside a decoder's linears, trained while the base weights stay frozen.

`LoRA(rank, alpha, targets, dropout)` describes the adapters; `lora.adapt(model)` gives a
`LoRAModel`, which computes each targeted linear as `y = x W + (alpha / rank) * drop(x) A B`, with
`A` `[in, rank]` and `B` `[rank, out]` stored beside the linear's kernel (`.../q_proj/lora_A`,
`.../q_proj/lora_B`; stacked on a leading layer axis inside a scanned run of layers, like the
kernel). `A` starts uniform in `[-1/sqrt(in), 1/sqrt(in)]` and `B` at zero, as PEFT starts them, so a
fresh adapter leaves the model's outputs unchanged. `lora.trainable` is the path filter an
objective's `trainable` takes: the trainer then differentiates, updates and averages the adapters
alone (`dew.training.frozen`). `LoRAModel.merge` folds trained adapters into the kernels, giving
the base model's own variables; `dew.interop.peft` writes and reads PEFT's adapter files.

The adapters ride on Flax's method interception: while a `LoRAModel` runs its base model, every call
of a targeted `dew.nn.linear.Linear` adds its adapter's term, so no layer of the decoder knows about
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew import trees
from dew.nn.linear import Linear, matmul, named
from dew.nn.transformer import boxed_shapes

ADAPTER_LEAVES = ("lora_A", "lora_B")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of every transformers decoder block."""


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters of `rank` on the linears `targets` names, scaled by `alpha / rank`.

    A target names a linear by the end of its path: `"q_proj"` is every layer's query projection,
    `"self_attn/o_proj"` the attention's output projection only. `dropout` is the rate at which the
    adapters' input is dropped in training: it applies where the model runs with a `dropout` rng
    (`rngs={"dropout": key}`, which a training loss passes), never in evaluation or generation.
    `within`, when given, keeps the adapters inside one module of the model (`"language_model"`: a
    multimodal model's decoder, not its vision tower, whose attention has projections of the same names).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    within: str | None = None

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ValueError(f"LoRA rank is {self.rank}; it must be at least 1 (8 or 16 are common)")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha is {self.alpha}; it must be above 0 (the adapters are scaled by "
                             "alpha / rank; 2 * rank is common)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout is {self.dropout}; it is a rate in [0, 1)")
        if not self.targets:
            raise ValueError(f"LoRA targets are empty; name linears such as {list(DEFAULT_TARGETS)}")

    @property
    def scale(self) -> float:
        """What the adapter's product is multiplied by: `alpha / rank`."""
        return self.alpha / self.rank

    @staticmethod
    def trainable(path: str) -> bool:
        """The path filter of the adapters (`.../lora_A`, `.../lora_B`): an objective's `trainable`."""
        return path.rsplit("/", 1)[-1] in ADAPTER_LEAVES

    def matches(self, path: Sequence[str]) -> bool:
        """Whether a linear at module `path` (`("layers_0to3", "self_attn", "q_proj")`) is a target."""
        if self.within is not None and tuple(path[:len(self._scope)]) != self._scope:
            return False
        return any(_ends_with(path, target) for target in self.targets)

    @property
    def _scope(self) -> tuple[str, ...]:
        return tuple(self.within.strip("/").split("/"))

    def adapt(self, model) -> "LoRAModel":
        """`model` with these adapters on its targeted linears; a target that matches no linear of the
        model is refused, naming the linears there are."""
        found = linears(model)
        if self.within is not None:
            inside = [path for path in found if tuple(path[:len(self._scope)]) == self._scope]
            if not inside:
                raise ValueError(f"LoRA within={self.within!r} names no module holding a linear of this model; its "
                                 f"top modules with linears are {sorted({path[0] for path in found})}")
            found = inside
        unmatched = [target for target in self.targets if not any(_ends_with(path, target) for path in found)]
        if unmatched:
            names = sorted({"/".join(path[1:]) if path[0].startswith("layers_") else "/".join(path) for path in found})
            raise ValueError(f"LoRA targets {unmatched} match no linear of this model; its linears are {names} "
                             "(name one by its last part, such as 'q_proj', or by more of its path)")
        return LoRAModel(model, self)


def _ends_with(path: Sequence[str], target: str) -> bool:
    parts = tuple(target.strip("/").split("/"))
    return tuple(path[-len(parts):]) == parts


def linears(model) -> list[tuple[str, ...]]:
    """The module paths of every `Linear` `model` calls (one per scanned run, not per layer)."""
    found = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, Linear) and context.method_name == "__call__":
            found.append(tuple(context.module.path))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32), head=False))
    return list(dict.fromkeys(found))


def _uniform_a(key, shape, dtype=jnp.float32):
    """PEFT's start for `A`: Kaiming-uniform with `a = sqrt(5)`, i.e. uniform in +-1/sqrt(in)."""
    bound = shape[-2] ** -0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


@dataclasses.dataclass(frozen=True)
class LoRAModel:
    """A decoder (`model`, a `CausalTransformer`) with `lora`'s adapters: it is called, initialised and
    placed as the decoder is (`init`, `apply`, `logical_names`, `init_cache`, ...), its variables the
    decoder's plus the adapters."""

    model: object
    lora: LoRA

    @property
    def config(self):
        return self.model.config

    def _adapter(self, next_fun, args, kwargs, context):
        module = context.module
        if not (isinstance(module, Linear) and context.method_name == "__call__" and self.lora.matches(module.path)):
            return next_fun(*args, **kwargs)
        y = next_fun(*args, **kwargs)
        x = args[0] if args else kwargs["x"]
        lora, dtype = self.lora, module.dtype
        in_name, out_name = module.names or (None, None)
        a_DR = module.param("lora_A", named(_uniform_a, module.names and (in_name, None)), (x.shape[-1], lora.rank),
                            module.param_dtype)
        b_RF = module.param("lora_B", named(nn.initializers.zeros_init(), module.names and (None, out_name)),
                            (lora.rank, module.features), module.param_dtype)
        x_ND = x.reshape(-1, x.shape[-1]).astype(dtype)
        if lora.dropout > 0 and module.has_rng("dropout"):
            kept_ND = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - lora.dropout, x_ND.shape)
            x_ND = jnp.where(kept_ND, x_ND / (1.0 - lora.dropout), 0).astype(dtype)
        h_NR = matmul(x_ND, a_DR.astype(dtype)).astype(dtype)
        delta_NF = matmul(h_NR, b_RF.astype(dtype)) * lora.scale
        return (y.astype(jnp.float32) + delta_NF.reshape(y.shape)).astype(y.dtype)

    def init(self, rngs, *args, boxed: bool = False, **kwargs):
        """Fresh variables: the decoder's, with fresh adapters beside each targeted kernel."""
        with nn.intercept_methods(self._adapter):
            return self.model.init(rngs, *args, boxed=boxed, **kwargs)

    def apply(self, variables, *args, **kwargs):
        """Run the decoder with its adapters (variables in the model's own form or per layer)."""
        with nn.intercept_methods(self._adapter):
            return self.model.apply(variables, *args, **kwargs)

    def logical_names(self):
        """The axis names of the decoder's variables and the adapters' (the decoder's own cache of its
        shapes holds no adapters, so the adapted model's are traced and kept apart)."""
        return nn.get_partition_spec(boxed_shapes(self))

    def variable_shapes(self):
        """`init`'s variables, adapters included, as shapes."""
        return nn.meta.unbox(boxed_shapes(self))

    def stack_variables(self, variables):
        return self.model.stack_variables(variables)

    def unstack_variables(self, variables):
        return self.model.unstack_variables(variables)

    def init_cache(self, rows: int, capacity: int):
        return self.model.init_cache(rows, capacity)

    # -- variables -------------------------------------------------------------------------------
    def attach(self, key, variables):
        """The decoder's `variables` (a pretrained checkpoint's) with fresh adapters drawn from `key`,
        in the model's own form: what an objective's `pretrained` takes."""
        variables = self.model.stack_variables(variables)
        if adapters(variables):
            raise ValueError("these variables already hold LoRA adapters (lora_A, lora_B): pass them as they are, "
                             "or merge them first (LoRAModel.merge)")
        tokens = jnp.zeros((1, 1), jnp.int32)
        # Compiled, so the decoder's own initialisers, whose results are dropped, never run.
        fresh = jax.jit(lambda key: adapters(self.init(key, tokens, head=False)))(key)
        return {**variables, "params": trees.join(fresh["params"], variables["params"])}

    def merge(self, variables):
        """The decoder's own variables with each adapter folded into its kernel,
        `W + (alpha / rank) A B` (in float32, stored in the kernel's dtype): what the base model, a
        transformers export or generation without adapters reads."""
        return {name: _merged(tree, self.lora.scale) if name == "params" else tree
                for name, tree in variables.items()}


def adapters(variables: Mapping) -> dict:
    """The adapter leaves of `variables` alone (`{"params": {...: {"lora_A", "lora_B"}}}`; `{}` when
    it holds none)."""
    found, _ = trees.split(variables.get("params", {}), LoRA.trainable)
    return {"params": found} if found else {}


def _merged(tree: Mapping, scale: float) -> dict:
    if "lora_A" in tree and "lora_B" in tree:
        kernel, a, b = tree["kernel"], tree["lora_A"], tree["lora_B"]
        delta = jnp.einsum("...dr,...rf->...df", a.astype(jnp.float32), b.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
        folded = (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)
        return {**{k: v for k, v in tree.items() if k not in ADAPTER_LEAVES}, "kernel": folded}
    return {name: _merged(value, scale) if isinstance(value, Mapping) else value for name, value in tree.items()}
