"""The parts every recipe's config shares: `ModelConfig`, `OptimConfig`, `TrainerConfig`, `DataSpec`.

They are frozen dataclasses, so tyro turns them into flags (`--model.config '{json}'`,
`--optim.learning-rate`, `--trainer.steps`, `data:token-windows --data.path ...`), and `to_json`
turns a config into the plain record a run directory keeps.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Annotated, Any, Literal

import jax
import numpy as np
import optax
import tyro
from tyro.constructors import PrimitiveConstructorSpec

from dew import models
from dew.data import PackedTokens, TokenWindows
from dew.sharding import Layout, MeshSpec


def _json_object(args: list[str]) -> dict[str, Any]:
    value = json.loads(args[0])
    if not isinstance(value, dict):
        raise ValueError(f"{args[0]} is not a JSON object: write the keywords as '{{\"name\": value, ...}}'")
    return value


JsonObject = Annotated[
    dict[str, Any],
    PrimitiveConstructorSpec(nargs=1, metavar="JSON", instance_from_str=_json_object,
                             is_instance=lambda value: isinstance(value, dict),
                             str_from_instance=lambda value: [json.dumps(value)]),
]
"""A dict read from one JSON object on the command line."""

DataSpec = (
    Annotated[TokenWindows, tyro.conf.subcommand("token-windows", description="Fixed windows of token files (TokenWindows).")]
    | Annotated[PackedTokens, tyro.conf.subcommand("packed-tokens", description="Documents packed into rows (PackedTokens).")]
)
"""What a run trains on: a subcommand on the command line, `data:token-windows` or `data:packed-tokens`."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A registered model and the keywords it is built with: `dew.models.build(name, **config)`."""

    name: str = "causal_transformer"
    """A name in the model registry (dew.models.names())."""
    config: JsonObject = dataclasses.field(default_factory=dict)
    """The model's keywords as one JSON object, e.g. '{"num_layers": 4, "dtype": "bfloat16"}'; vocab_size defaults to meta.json's."""

    def __post_init__(self):
        if not isinstance(self.config, dict):
            raise TypeError(f"ModelConfig.config is {self.config!r}; it must be a dict of keywords")
        if self.name not in models.names():
            raise ValueError(f"model {self.name!r} is not registered; registered models are {models.names()}")

    def build(self, **defaults):
        """The model, with `defaults` filling keywords this config leaves out."""
        return models.build(self.name, **{**defaults, **self.config})


_SCHEDULES = ("cosine", "linear", "constant")
# The settings --trainer.allow-changes may name: the optimizer's, which a checkpoint's optimizer
# state serves unchanged, and the data's contents (data.fingerprint, run.json's record of them) when
# their shape (meta.json) is the same, so the checkpoint's data position still points into them. The
# model, the data's shape and the run's length never change within a run.
RESUMABLE_CHANGES = (*(f"optim.{name}" for name in ("learning_rate", "schedule", "warmup_steps", "final_fraction",
                                                    "weight_decay", "clip_grads", "b1", "b2", "eps")),
                     "data.fingerprint")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with a linear warm-up and a decay, decoupled weight decay and global-norm clipping.

    Weight decay applies to matrices and embeddings (parameters of two or more axes), not to norm
    scales or biases. The schedule counts optimizer updates.
    """

    learning_rate: float = 1e-3
    """The peak learning rate."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """How the learning rate falls after the warm-up, over the rest of the run."""
    warmup_steps: int = 0
    """Updates over which the learning rate rises linearly from 0 to learning_rate."""
    final_fraction: float = 0.1
    """The last learning rate of a cosine or linear decay, as a fraction of the peak."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW's lambda)."""
    clip_grads: float | None = None
    """Clip the gradient to this global norm; None does not clip."""
    b1: float = 0.9
    """Adam's decay rate for the gradient's running mean, in [0, 1)."""
    b2: float = 0.95
    """Adam's decay rate for the squared gradient's running mean, in [0, 1)."""
    eps: float = 1e-8
    """Added to the root of the squared gradient's mean before dividing, so the step stays bounded."""

    def __post_init__(self):
        for name in ("learning_rate", "final_fraction", "weight_decay", "clip_grads", "b1", "b2", "eps"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"optim.{name} is {value}; it must be a finite number")
        if self.learning_rate <= 0:
            raise ValueError(f"optim.learning_rate is {self.learning_rate}; it must be positive")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} is {getattr(self, name)}; it must lie in [0, 1)")
        if self.eps < 0:
            raise ValueError(f"optim.eps is {self.eps}; use 0 or more (1e-8 is usual)")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"optim.schedule is {self.schedule!r}; use one of {_SCHEDULES}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps is {self.warmup_steps}; use 0 or more")
        if not 0.0 <= self.final_fraction <= 1.0:
            raise ValueError(f"optim.final_fraction is {self.final_fraction}; it must lie in [0, 1]")
        if self.schedule == "constant" and self.final_fraction != 0.1:
            raise ValueError(
                f"optim.final_fraction {self.final_fraction} has no effect with the constant schedule: "
                "use --optim.schedule cosine or linear, or leave final_fraction unset"
            )
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay is {self.weight_decay}; use 0 or more")
        if self.clip_grads is not None and self.clip_grads <= 0:
            raise ValueError(f"optim.clip_grads is {self.clip_grads}; use a positive norm, or None not to clip")

    def learning_rates(self, steps: int) -> optax.Schedule:
        """The learning rate per optimizer update over a run of `steps` updates."""
        if self.warmup_steps >= steps:
            raise ValueError(
                f"optim.warmup_steps {self.warmup_steps} leaves no step of the {steps} to decay over: "
                f"use fewer warm-up steps than trainer.steps"
            )
        peak, decay_steps = self.learning_rate, steps - self.warmup_steps
        decay = {
            "cosine": lambda: optax.cosine_decay_schedule(peak, decay_steps, alpha=self.final_fraction),
            "linear": lambda: optax.linear_schedule(peak, peak * self.final_fraction, decay_steps),
            "constant": lambda: optax.constant_schedule(peak),
        }[self.schedule]()
        if self.warmup_steps == 0:
            return decay
        return optax.join_schedules([optax.linear_schedule(0.0, peak, self.warmup_steps), decay],
                                    [self.warmup_steps])

    def build(self, steps: int) -> optax.GradientTransformation:
        """The optimizer for a run of `steps` updates."""
        decayed = lambda params: jax.tree_util.tree_map(lambda x: np.ndim(x) >= 2, params)
        adamw = optax.adamw(self.learning_rates(steps), b1=self.b1, b2=self.b2, eps=self.eps,
                            weight_decay=self.weight_decay, mask=decayed)
        if self.clip_grads is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.clip_grads), adamw)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """How long a run trains, on which devices, and what it leaves in its run directory."""

    run_dir: str = "runs/lm"
    """Where the run lives (run.json, checkpoints, metrics, events); the same command resumes it, another is refused."""
    steps: int = 1000
    """Batches to train on (one optimizer update each)."""
    batch: int = 32
    """Rows per global batch."""
    val_batch: int | None = None
    """Rows per validation batch, at most the validation rows; None uses batch (all the validation rows as one batch when they are fewer)."""
    log_every: int = 50
    """Steps between logged training lines."""
    eval_every: int | None = 500
    """Steps between validation passes (with a preview); None never evaluates."""
    checkpoint_every: int | None = None
    """Steps between checkpoints; None saves at each evaluation. The last step is always saved."""
    keep: int | None = 3
    """Checkpoints kept; None keeps all."""
    accumulation: int = 1
    """Micro-batches each batch is split into, summed before one update."""
    seed: int = 0
    """Seeds the initialization and every step's randomness (the data order has its own data.seed)."""
    mesh: MeshSpec = MeshSpec()
    layout: Layout = Layout()
    allow_changes: tuple[str, ...] = ()
    """Optimizer settings a rerun may change (e.g. optim.learning-rate), or data.fingerprint to go on with data whose contents changed: the run continues from its last checkpoint with the new values, and run.json records each change and the step it took effect at."""
    wandb: str | None = None
    """A Weights & Biases project to log to as well; None (the default) logs to none."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes W&B's files under the run directory for a later `wandb sync`."""

    def __post_init__(self):
        for name in ("steps", "batch", "log_every", "accumulation"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} is {getattr(self, name)}; it must be at least 1")
        for name in ("val_batch", "eval_every", "checkpoint_every", "keep"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"trainer.{name} is {value}; use at least 1, or None")
        names = tuple(name.removeprefix("--").replace("-", "_") for name in self.allow_changes)
        unknown = [name for name in names if name not in RESUMABLE_CHANGES]
        if unknown:
            raise ValueError(
                f"trainer.allow_changes names {unknown}; a run may change only its optimizer settings and its "
                f"data's contents ({', '.join(name.replace('_', '-') for name in RESUMABLE_CHANGES)}): a different "
                "model or data of another shape is a new run, in a new --trainer.run-dir"
            )
        object.__setattr__(self, "allow_changes", names)
        if self.wandb is None and self.wandb_mode != "offline":
            raise ValueError(
                f"trainer.wandb_mode is {self.wandb_mode!r} but no W&B project is set: pass --trainer.wandb PROJECT"
            )


def to_json(value) -> Any:
    """A config as plain JSON values: dataclasses become objects, tuples lists, dtypes names."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: to_json(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {str(key): to_json(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.dtype, type)):  # a dtype, or a scalar type such as jnp.bfloat16
        return np.dtype(value).name
    raise TypeError(f"{value!r} ({type(value).__name__}) has no JSON form in a run record")
