"""`Trainer`: compiles an objective's loss into one sharded step and runs data, evaluation,
checkpoints and logging the same way for every objective."""

from __future__ import annotations

import functools
import math
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data.dataset import Dataset, Partition
from dew import kernels
from dew import trees as frozen
from dew.nn.head import tile_bytes
from dew.nn.stack import remat_in_force, resolved_remat
from dew.training import memory
from dew.training.checkpoints import Checkpoints
from dew.training.in_flight import InFlight
from dew.sharding import BATCH_AXES, in_mesh, logical_names, with_names
from dew.training.mesh import Layout, MeshSpec, replicated, shard_batch
from dew.training.progress import Reporter, format_values
from dew.training.state import Step, TrainState
from dew.training.statistics import add_statistics, empty_statistics, host_sum
from dew.training.trackers import Tracker
from dew.training.utilization import flops_per_position, peak_flops

# Each stream folds its own constant into the run key, so evaluation, previews and rollouts never reuse
# the keys training draws.
TRAIN_STREAM, EVAL_STREAM, PREVIEW_STREAM, ROLLOUT_STREAM = 0, 1, 2, 3
# How many dispatched steps (or validation batches) may be outstanding before the host waits.
STEPS_AHEAD = 2


def _key_data(key) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def _batch_signature(batch: dict) -> tuple:
    """What a compiled step is specialised to: the batch's pytree structure (an entry may be a
    `ModelInputs`) and each leaf's shape and dtype."""
    leaves, structure = jax.tree_util.tree_flatten(batch)
    return structure, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves)


def _first_path(params, prefix: str = "params") -> str:
    """The path of the first leaf of a parameter tree, as a `trainable` filter sees it."""
    name, value = next(iter(params.items()))
    return _first_path(value, f"{prefix}/{name}") if hasattr(value, "items") else f"{prefix}/{name}"


class TrainingDiverged(FloatingPointError):
    """A step's loss, gradient norm or update was not finite: it was not applied and `Trainer.fit` stopped.

    `step` is the diverged step (batches consumed, counting it), `loss` and `grad_norm` its values,
    `last_checkpoint` the step of the newest complete checkpoint in `directory` (None when none was
    written, or no `checkpoint_dir` was given). Up to `STEPS_AHEAD` steps after it may have run
    before it was read; no checkpoint holds them.
    """

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None,
                 directory: str | None):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.last_checkpoint, self.directory = last_checkpoint, directory
        if directory is None:
            where = "no checkpoint was written (fit had no checkpoint_dir)"
        elif last_checkpoint is None:
            where = f"no checkpoint was written to {directory}"
        else:
            where = f"the last complete checkpoint is step {last_checkpoint} in {directory}"
        super().__init__(
            f"step {step} is not finite (loss {loss:.6g}, gradient norm {grad_norm:.6g}, or its update): it was "
            f"not applied and training stopped; {where}. Non-finite steps come from a learning rate too large for "
            "the model, unclipped gradients, or data the model cannot score."
        )


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped `Trainer.fit` after it checkpointed `state` at `step`."""

    def __init__(self, signal_number: int, step: int, state: TrainState):
        self.signal_number, self.step, self.state = signal_number, step, state
        super().__init__(f"{signal.Signals(signal_number).name} stopped training at step {step}; "
                         "the checkpoint there resumes it")


class _StopSignals:
    """While entered, SIGINT and SIGTERM ask the loop to checkpoint and stop; a second one stops at once.

    Signal handlers belong to the main thread, so elsewhere this installs nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, reporter: Reporter):
        self.reporter = reporter
        self.received: int | None = None
        self.previous: dict = {}

    def _handle(self, number, frame):
        if self.received is not None:
            stop = KeyboardInterrupt(f"a second {signal.Signals(number).name} while saving: stopped without it")
            stop.signal_number = number  # the command exits with 128 + it, as the signal itself would
            raise stop
        self.received = number
        self.reporter.line(f"{signal.Signals(number).name} received: saving a checkpoint after this step, "
                           "then stopping (send it again to stop at once)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for number, handler in self.previous.items():
            signal.signal(number, handler)


class Trainer:
    """Fit `objective` with an optax `optimizer` on a device mesh.

    `mesh` (default: every device on the data axis) and `layout` say how batches and parameters are
    split; see `dew.training.mesh`. `key` seeds initialization and every step's randomness.
    """

    def __init__(self, objective, optimizer: optax.GradientTransformation, *, key, mesh: MeshSpec | None = None,
                 layout: Layout | None = None):
        self.objective = objective
        self.mesh = (mesh or MeshSpec()).build()
        self.layout = layout or Layout()
        self.key = _key_data(key)
        # The optimizer sees only the trainable part of the parameters (dew.trees).
        self.optimizer = optimizer
        self.trainable = getattr(objective, "trainable", None)
        self._check_reference()
        self.history: list[dict[str, float]] = []
        self._compiled: dict[tuple, Any] = {}
        self._boxed = None  # `_boxed_init`'s (key bytes, (objective, optimizer, filter), jitted function)
        # What the last compiled train step runs each product and kernel with (`dew.kernels.recording`), and
        # the remat and micro-batches it fits the device's memory with (None where nothing was planned).
        self.kernel_choices: dict[str, str] = {}
        self.memory_plan: memory.MemoryPlan | None = None

    # -- state -----------------------------------------------------------------------------------
    @property
    def _reads_reference(self) -> bool:
        """Whether the objective's loss reads the frozen reference the EMA slot holds at decay 1.0
        (`reference=`, as DPO's and GRPO's KL do)."""
        return bool(getattr(self.objective, "reads_reference", False))

    def _check_reference(self) -> None:
        if self._reads_reference and self.objective.ema_decay != 1.0:
            raise ValueError(
                f"{type(self.objective).__name__} reads a frozen reference, which the EMA slot holds at ema_decay "
                f"1.0, and its ema_decay is {self.objective.ema_decay}: build it with ema_decay=1.0"
            )

    def _init(self, held, boxed: bool = False):
        """The fresh state; with `boxed`, each parameter (and what mirrors it: the EMA, the optimizer's
        moments) wrapped in its logical axis names, for `state_shardings` to read.

        Only the trainable parameters (`objective.trainable`, a path filter; all without one) get
        optimizer state and an EMA copy (`dew.trees`)."""
        base = jax.random.wrap_key_data(self.key)
        init_key, run_key = jax.random.split(base)
        variables = self.objective.init(init_key, held)
        names = getattr(self.objective, "logical_names", None)
        if boxed and names is not None:
            variables = with_names(variables, names())
        trained, _ = frozen.split(variables["params"], self.trainable)
        if not trained:
            raise ValueError(f"{type(self.objective).__name__}.trainable accepts no parameter of the model, so "
                             "nothing would train: its filter sees paths such as "
                             f"{_first_path(variables['params'])!r}; widen it, or leave trainable unset")
        ema = None if self.objective.ema_decay is None else {**variables, "params": trained}
        return TrainState(
            params=variables, ema=ema, opt_state=self.optimizer.init(trained),
            step=jnp.zeros((), jnp.int32), updates=jnp.zeros((), jnp.int32), key=jax.random.key_data(run_key),
        )

    def _boxed_init(self):
        """`_init(held, boxed=True)` as one jitted function: `state_shardings` reads its shapes and
        `init_state` runs it, both from one trace of the objective's init. It is made again when the
        trainer's key, objective, optimizer or filter is no longer the one it was traced with (a trace
        reads them as constants)."""
        key, made = np.asarray(self.key).tobytes(), (self.objective, self.optimizer, self.trainable)
        if (self._boxed is None or self._boxed[0] != key
                or any(old is not new for old, new in zip(self._boxed[1], made))):
            self._boxed = key, made, jax.jit(functools.partial(self._init, boxed=True))
        return self._boxed[2]

    def state_shardings(self, held=None):
        """The state's shapes and its shardings: parameters placed by their logical names through the
        layout's rules (`dew.sharding`), anything unnamed by the layout's size rule."""
        abstract = jax.eval_shape(self._boxed_init(), held)
        return logical_names(abstract)[0], self.layout.shardings(self.mesh, abstract)

    def init_state(self) -> TrainState:
        """A fresh state, each leaf created directly on its devices."""
        held = self.objective.held_variables()
        _, shardings = self.state_shardings(held)
        boxed = self._boxed_init()
        # The pretrained variables enter as an argument: read inside a nullary trace they would be
        # compiled into the executable as constants.
        return jax.jit(lambda held: logical_names(boxed(held))[0], out_shardings=shardings)(held)

    # -- the compiled step -----------------------------------------------------------------------
    def _train_step(self, accumulation: int):
        objective, optimizer = self.objective, self.optimizer
        decay = objective.ema_decay
        # An objective whose terms are normalised by different window totals (dew.objectives.base,
        # "Window normalisation") scales each micro-batch's loss by the window's totals; any other is
        # one numerator over one denominator, divided once after the window.
        windowed = callable(getattr(objective, "window_loss", None))

        keep = self.trainable
        reads_reference = self._reads_reference

        def step_fn(state: TrainState, batch):
            step_key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.key), TRAIN_STREAM),
                                          state.step)
            micro_step = lambda index: Step(state.step, jax.random.fold_in(step_key, index))
            # Only the trainable part is differentiated: frozen leaves enter as constants, so no
            # gradient is formed for them.
            trained, held = frozen.split(state.params["params"], keep)
            # The frozen reference (the EMA slot at decay 1.0) for an objective that reads one.
            extra = {"reference": jax.lax.stop_gradient(state.averaged)} if reads_reference else {}

            def share(trained, micro_batch, index, totals):
                """The micro-batch's part of the window's loss (a numerator, when not windowed)."""
                variables = {**state.params, "params": frozen.join(trained, held)}
                stats, effects = objective.loss(variables, micro_batch, micro_step(index), **extra)
                if not windowed:
                    return objective.reduce_loss(stats)[0], (stats, effects)
                if totals is None:  # a window of one micro-batch is its own total
                    totals = jax.lax.stop_gradient(objective.totals_of(stats))
                return objective.window_loss(stats, totals)[0], (stats, effects)

            grad_fn = jax.value_and_grad(share, has_aux=True)
            totals = None
            if accumulation == 1:
                (_, (stats, effects)), grads = grad_fn(trained, batch, 0, None)
            else:
                # Micro-batch j takes rows j, j + k, ...: each device keeps its own rows.
                micro = jax.tree_util.tree_map(
                    lambda x: x.reshape(x.shape[0] // accumulation, accumulation, *x.shape[1:]).swapaxes(0, 1), batch
                )
                first = jax.tree_util.tree_map(lambda x: x[0], micro)
                zeros = lambda tree: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), tree)
                if windowed:
                    # The window's totals first (no gradient), so each micro-batch's share is scaled by them.
                    def add_totals(carry, inputs):
                        micro_batch, index = inputs
                        return jax.tree_util.tree_map(
                            jnp.add, carry, objective.window_totals(state.params, micro_batch, micro_step(index))), None

                    totals_shape = jax.eval_shape(lambda: objective.window_totals(state.params, first, micro_step(0)))
                    totals, _ = jax.lax.scan(add_totals, zeros(totals_shape), (micro, jnp.arange(accumulation)))
                    totals = jax.lax.stop_gradient(totals)
                (_, (stats_shape, effects_shape)) = jax.eval_shape(lambda: grad_fn(trained, first, 0, totals)[0])

                # Gradients, statistics and effects all add over the window (a statistic's `Maximum` keeps
                # the largest); effects are applied once, after the update, so every micro-batch sees the
                # same variables.
                def body(carry, inputs):
                    (_, (stats, effects)), grads = grad_fn(trained, *inputs, totals)
                    grads_carry, stats_carry, effects_carry = carry
                    return (jax.tree_util.tree_map(jnp.add, grads_carry, grads), add_statistics(stats_carry, stats),
                            jax.tree_util.tree_map(jnp.add, effects_carry, effects)), None

                start = (zeros(trained), empty_statistics(stats_shape), zeros(effects_shape))
                (grads, stats, effects), _ = jax.lax.scan(body, start, (micro, jnp.arange(accumulation)))
            if windowed:
                loss, counted = objective.window_loss(stats, objective.totals_of(stats) if totals is None else totals)
            else:
                numer, denom = objective.reduce_loss(stats)
                scale = 1.0 / jnp.maximum(denom, 1.0)
                loss, counted = numer * scale, denom > 0
                grads = jax.tree_util.tree_map(lambda g: (g * scale).astype(g.dtype), grads)
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, trained)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))
            apply = finite & counted
            new_trained = optax.apply_updates(trained, updates)
            new_params = objective.apply_effects(
                {**state.params, "params": frozen.join(new_trained, held)}, effects)
            pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(apply, a, b), new, old)
            ema = state.ema
            # At decay 1.0 the slot is a frozen reference: it is never moved.
            if decay is not None and decay != 1.0:
                moved = jax.tree_util.tree_map(
                    lambda e, p: (decay * e.astype(jnp.float32) + (1.0 - decay) * p.astype(jnp.float32)).astype(e.dtype),
                    state.ema["params"], new_trained,
                )
                ema = {**new_params, "params": pick(moved, state.ema["params"])}
            new_state = TrainState(
                params=pick(new_params, state.params), ema=ema, opt_state=pick(opt_state, state.opt_state),
                step=state.step + 1, updates=state.updates + apply.astype(jnp.int32), key=state.key,
            )
            return new_state, {"stats": stats, "loss": loss, "grad_norm": grad_norm, "finite": finite}

        return in_mesh(self.mesh, step_fn)

    def compile_step(self, state: TrainState, batch: dict, accumulation: int = 1):
        """The train step compiled ahead of time for these shapes (cached). On a device that reports its memory,
        a model whose remat is "auto" takes the cheapest remat (then micro-batches) whose step fits, and any step
        that cannot fit is refused with `DoesNotFit` (`dew.training.memory`; the plan is `memory_plan`)."""
        signature = (accumulation, *_batch_signature(batch))
        if signature not in self._compiled:
            started = time.perf_counter()
            with kernels.recording() as choices:
                self._compiled[signature], self.memory_plan = self._compile_fitting(state, batch, accumulation)
            self.compile_seconds = time.perf_counter() - started
            self.kernel_choices = choices
        return self._compiled[signature]

    def _compile(self, state: TrainState, batch: dict, micro: int, remat: str):
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
        batch_shardings = jax.tree_util.tree_map(lambda x: x.sharding, batch)
        jitted = jax.jit(self._train_step(micro), in_shardings=(shardings, batch_shardings),
                         out_shardings=(shardings, replicated(self.mesh)), donate_argnums=0)
        with remat_in_force(remat):
            lowered = jitted.lower(state, batch)
        return lowered.compile()

    def _compile_fitting(self, state: TrainState, batch: dict, accumulation: int):
        """(the compiled step, its `MemoryPlan` or None where the device reports no memory or the model has no
        remat): the first candidate (`memory.candidates`) whose estimate and compiled step fit."""
        config = getattr(getattr(self.objective, "model", None), "config", None)
        asked = getattr(config, "remat", None)
        device = memory.device_memory()
        if asked is None or device is None:
            return self._compile(state, batch, accumulation, resolved_remat(asked or "none")), None
        available, kind = device
        shards = math.prod(self.mesh.shape[axis] for axis in BATCH_AXES)
        rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
        trained = frozen.split(state.params["params"], self.trainable)[0]
        fixed = memory.shard_bytes(state) + memory.shard_bytes(trained)  # the state, and a gradient per weight
        if fixed > available:
            raise memory.refusal(fixed, available, kind, "the parameters, their optimizer state, EMA and gradients, "
                                 "before any activation")
        tried = []
        # each (micro-batches, policy) traced once: a trace of the loss's backward costs seconds at a real shape
        residuals = functools.cache(lambda micro, remat: self._residual_bytes(state, batch, micro, remat))
        # The backward's working set beside what it keeps: about one layer's activations, all kept ("none"), and
        # two of the head's float32 logit tiles (a micro-batch's logits where they are fewer).
        layer = functools.cache(lambda: residuals(accumulation, "none") // max(getattr(config, "num_layers", 1), 1))

        def estimate(remat: str, micro: int) -> int:
            logits = rows // micro * getattr(self.objective, "seq_len", 0) * getattr(config, "vocab_size", 0) * 4
            work = layer() * accumulation // micro + 2 * min(tile_bytes(), logits)
            return fixed + (residuals(micro, remat) + work) // shards

        for remat, micro in memory.candidates(asked, rows, accumulation, shards):
            needed = None
            if asked == "auto":
                needed = estimate(remat, micro)
                if needed > memory.ESTIMATE_SHARE * available:
                    tried.append((remat, micro, needed))
                    continue
            try:
                compiled = self._compile(state, batch, micro, remat)
            except jax.errors.JaxRuntimeError as error:
                if not memory.out_of_memory(error):
                    raise
                tried.append((remat, micro, estimate(remat, micro) if needed is None else needed))
                continue
            needed = memory.compiled_bytes(compiled)
            if needed > available:
                tried.append((remat, micro, needed))
                continue
            return compiled, memory.MemoryPlan(remat, micro, needed, available, kind, asked == "auto", tuple(tried))
        remat, micro, needed = tried[-1]
        raise memory.refusal(needed, available, kind, f"remat {remat!r} with {micro} micro-batches" + (
            "" if asked == "auto" else "; remat 'auto' tries the others"))

    def _residual_bytes(self, state: TrainState, batch: dict, micro: int, remat: str) -> int:
        """What the backward pass of one micro-batch's loss keeps, over all devices, under `remat` (traced)."""
        objective, windowed = self.objective, callable(getattr(self.objective, "window_loss", None))
        trained, held = frozen.split(state.params["params"], self.trainable)
        extra = {"reference": state.averaged} if self._reads_reference else {}
        shape = lambda x: jax.ShapeDtypeStruct((x.shape[0] // micro, *x.shape[1:]), x.dtype)  # noqa: E731

        def loss(trained, micro_batch):
            step = Step(jnp.zeros((), jnp.int32), jax.random.key(0))
            stats, _ = objective.loss({**state.params, "params": frozen.join(trained, held)}, micro_batch, step,
                                      **extra)
            if windowed:
                return objective.window_loss(stats, objective.totals_of(stats))[0]
            return objective.reduce_loss(stats)[0]

        with remat_in_force(remat):
            return memory.residual_bytes(loss, trained, jax.tree_util.tree_map(shape, batch))

    def _eval_step(self, batch: dict):
        signature = ("eval", *_batch_signature(batch))
        if signature not in self._compiled:

            def eval_fn(state, batch, index, batch_index, key_data):
                # Each batch of a pass draws its own key (an objective that samples, such as MDLM's times
                # and masks, would otherwise score every batch with the same draw).
                key = jax.random.fold_in(jax.random.wrap_key_data(key_data), EVAL_STREAM)
                key = jax.random.fold_in(jax.random.fold_in(key, index), batch_index)
                if self._reads_reference:  # the live policy, scored against the frozen reference
                    return self.objective.evaluate(state.params, batch, Step(index, key), reference=state.averaged)
                return self.objective.evaluate(state.evaluated, batch, Step(index, key))

            self._compiled[signature] = jax.jit(in_mesh(self.mesh, eval_fn), out_shardings=replicated(self.mesh))
        return self._compiled[signature]

    # -- the loop --------------------------------------------------------------------------------
    @property
    def _on_policy(self) -> bool:
        """Whether the objective draws the batches it trains on from the live policy (GRPO):
        `on_policy_batch(params, batch, key)` turns each batch of the data (prompts) into that batch."""
        return callable(getattr(self.objective, "on_policy_batch", None))

    def _drawn(self, params, host_batch: dict, key_data, step: int, batch_index: int) -> dict:
        """What an on-policy objective draws from `params` for `host_batch`, with a key of its own for
        the step and the batch (0 for training, 1 + the index for a validation batch)."""
        key = jax.random.fold_in(jax.random.wrap_key_data(jax.device_get(key_data)), ROLLOUT_STREAM)
        return self.objective.on_policy_batch(params, host_batch,
                                              jax.random.fold_in(jax.random.fold_in(key, step), batch_index))

    def evaluate(self, state: TrainState, data: Dataset, metrics: Sequence = (), *,
                 reporter: Reporter | None = None) -> dict[str, float]:
        """Score one whole validation pass on the evaluated weights (EMA when kept; for an objective
        that reads a frozen reference, the live weights against it). An on-policy objective scores
        what it draws from those weights for each validation batch.

        `reporter` (fit's) shows the batches scored while the pass runs."""
        if data.val is None:
            raise ValueError("this dataset has no validation split; build it with val data to evaluate")
        stats_list = []

        def read(index, stats):
            stats_list.append(stats)
            if reporter is not None:
                reporter.pass_advance(len(stats_list))

        unread = InFlight(STEPS_AHEAD, read)
        if reporter is not None:
            reporter.pass_begin("val")
        try:
            for index, host_batch in enumerate(data.val(self._partition())):
                if self._on_policy:
                    weights = state.params if self._reads_reference else state.evaluated
                    host_batch = self._drawn(weights, host_batch, state.key, int(jax.device_get(state.step)), index + 1)
                self.objective.check_batch(host_batch)
                batch = shard_batch(self.mesh, host_batch)
                run = self._eval_step(batch)
                unread.push(index, run(state, batch, state.step, index, state.key))
            unread.drain()
        finally:
            if reporter is not None:
                reporter.pass_end()
        if not stats_list:
            raise ValueError("the validation split produced no batch")
        values = {f"val/{name}": value for name, value in self.objective.summarize(host_sum(stats_list)).items()}
        for metric in metrics:
            accumulated = metric.initial()
            for stats in stats_list:
                accumulated = metric.merge(accumulated, metric.contribution(stats))
            values[f"val/{metric.name}"] = metric.finalize(accumulated)
        return values

    @staticmethod
    def _partition() -> Partition:
        return Partition(jax.process_index(), jax.process_count())

    def fit(
        self,
        data: Dataset,
        *,
        steps: int,
        log_every: int = 100,
        eval_every: int | None = None,
        metrics: Sequence = (),
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        keep: int | None = 3,
        accumulation: int = 1,
        verbose: bool = True,
        trackers: Sequence[Tracker] = (),
    ) -> TrainState:
        """Train until `steps` batches have been consumed and return the final `TrainState`.

        With `checkpoint_dir`, a run resumes from its latest checkpoint (same next batch, same keys)
        and saves every `checkpoint_every` steps (default: at each evaluation) and at the end; and
        SIGINT or SIGTERM saves a checkpoint after the current step and raises `TrainingInterrupted`.
        Every `accumulation` micro-batches of a batch add their loss numerators and target counts
        before one division and one update. Each tracker is started at the first step this call
        trains and receives every logged and evaluated value and every preview; the caller closes it.
        A step that is not finite is not applied, and fit raises `TrainingDiverged` naming it.

        Every `log_every` steps fit logs the training statistics of the steps since the last log and
        their speed: `step_s` is the wall time per step between two log lines less the time spent
        evaluating, previewing and writing checkpoints (`tokens_per_s` is the counted targets over the
        same time), and `checkpoint_s` the seconds spent writing checkpoints in that span, when any
        were; `mfu`, for a decoder Dew counts, is the model's training FLOPs over those seconds as a
        fraction of the machine's peak in the compute dtype (`dew.training.utilization`). An
        evaluation record carries `eval_s`, the seconds of its validation pass.
        """
        for name, value in (("steps", steps), ("log_every", log_every), ("accumulation", accumulation)):
            if value < 1:
                raise ValueError(f"{name} is {value}; it must be at least 1")
        shards = math.prod(self.mesh.shape[axis] for axis in BATCH_AXES)  # the tensor and expert axes share rows
        if data.batch % (accumulation * shards):
            raise ValueError(
                f"batch {data.batch} does not split into {accumulation} micro-batches over {shards} batch shards "
                f"(data x fsdp): use a batch that is a multiple of {accumulation * shards}"
            )
        checkpoints = None if checkpoint_dir is None else Checkpoints(checkpoint_dir, keep)
        checkpoint_every = checkpoint_every or eval_every
        reporter = Reporter(steps, 0, verbose)
        try:
            if checkpoints is None:
                return self._fit(data, steps, log_every, eval_every, metrics, checkpoints, checkpoint_every,
                                 accumulation, reporter, trackers, None)
            with _StopSignals(reporter) as stop:
                return self._fit(data, steps, log_every, eval_every, metrics, checkpoints, checkpoint_every,
                                 accumulation, reporter, trackers, stop)
        finally:
            reporter.close()
            if checkpoints is not None:
                checkpoints.close()

    def _fit(self, data, steps, log_every, eval_every, metrics, checkpoints, checkpoint_every, accumulation, reporter,
             trackers, stop):
        state = self.init_state()
        iterator = data.train(self._partition())
        position = None
        if checkpoints is not None and checkpoints.latest() is not None:
            state, position = checkpoints.restore(state)
            if position is not None:
                iterator.set_state(position)
            else:
                for _ in range(int(state.step)):  # a plain iterator: replay to the same next batch
                    next(iterator)
            reporter.line(f"resumed from {checkpoints.directory} at step {int(state.step)}")
        start = int(jax.device_get(state.step))
        if start >= steps:
            return state
        reporter.advance(start)
        for tracker in trackers:
            tracker.start(start)

        self._step_flops = self._flops_per_step(data.batch)
        window: list = []  # host outputs of the steps since the last log line
        window_started = time.perf_counter()
        aside = {"checkpoint": 0.0, "evaluation": 0.0}  # seconds of the window spent outside the steps

        def read(index, out):
            if not out["finite"]:
                raise self._diverged(index + 1, out, checkpoints)
            window.append(out)

        # Steps run ahead of the host by at most STEPS_AHEAD: reading each output only once computed
        # keeps the devices busy while the host reads, validates and places the next batch.
        unread = InFlight(STEPS_AHEAD, read)

        def save():
            unread.drain()  # a diverged step raises here, before it could be saved
            started = time.perf_counter()
            checkpoints.save(state, iterator.get_state() if hasattr(iterator, "get_state") else None)
            aside["checkpoint"] += time.perf_counter() - started

        first = True
        for index in range(start, steps):
            host_batch = next(iterator)
            if self._on_policy:
                host_batch = self._drawn(state.params, host_batch, state.key, index, 0)
            self.objective.check_batch(host_batch)
            batch = shard_batch(self.mesh, host_batch)
            # One executable per batch signature: an on-policy batch may change shape between steps.
            compiled = len(self._compiled)
            step_fn = self.compile_step(state, batch, accumulation)
            if len(self._compiled) > compiled:
                reporter.line(f"compiled the train step in {self.compile_seconds:.2f} s "
                              f"({kernels.summary(self.kernel_choices)})")
                if self.memory_plan is not None:
                    reporter.line(self.memory_plan.line())
                    if checkpoints is not None:
                        checkpoints.write_note("memory.json", self.memory_plan.record())
            if first:
                first, window_started = False, time.perf_counter()
            state, out = step_fn(state, batch)
            unread.push(index, out)
            done = index + 1
            reporter.advance(done)
            # The checkpoint comes first, so the log line of the same step reports its time.
            if checkpoints is not None and ((checkpoint_every and done % checkpoint_every == 0) or done == steps):
                save()
            if done % log_every == 0 or done == steps:
                unread.drain()
                elapsed = time.perf_counter() - window_started
                self._log(done, window, elapsed - aside["checkpoint"] - aside["evaluation"], aside["checkpoint"],
                          reporter, trackers)
                window, window_started = [], time.perf_counter()
                aside.update(checkpoint=0.0, evaluation=0.0)
            if eval_every and (done % eval_every == 0 or done == steps) and data.val is not None:
                unread.drain()
                started = time.perf_counter()
                values = self.evaluate(state, data, metrics, reporter=reporter)
                values["eval_s"] = time.perf_counter() - started
                self._record(done, values, reporter, trackers, label=self._evaluated_label(state))
                self._preview(state, done, reporter, trackers)
                aside["evaluation"] += time.perf_counter() - started
            if stop is not None and stop.received is not None and done < steps:
                save()
                raise TrainingInterrupted(stop.received, done, state)
        unread.drain()
        return state

    def _flops_per_step(self, batch: int) -> tuple[float, float] | None:
        """(the model's training FLOPs a step of `batch` rows, the machine's peak FLOP/s in the model's
        compute dtype), for `mfu`; None when the objective's model or row length is not one Dew counts
        (`dew.training.utilization`)."""
        model, seq_len = getattr(self.objective, "model", None), getattr(self.objective, "seq_len", None)
        per_position = None if model is None or seq_len is None else flops_per_position(model, seq_len)
        if per_position is None:
            return None
        return per_position * seq_len * batch, peak_flops(model.config.dtype)

    def _diverged(self, step: int, out, checkpoints: Checkpoints | None) -> TrainingDiverged:
        return TrainingDiverged(step, float(out["loss"]), float(out["grad_norm"]),
                                None if checkpoints is None else checkpoints.latest(),
                                None if checkpoints is None else checkpoints.directory)

    def _evaluated_label(self, state: TrainState) -> str:
        """How a validation line names the weights it scored (its metric keys stay `val/...`)."""
        if state.ema is None:
            return "val"
        if self._reads_reference:
            return "val (the live policy against the frozen EMA reference, ema_decay 1.0)"
        if self.objective.ema_decay == 1.0:
            return "val (the frozen EMA reference, ema_decay 1.0)"
        return f"val (EMA weights, decay {self.objective.ema_decay})"

    def _log(self, done: int, window: list, seconds: float, checkpoint_seconds: float, reporter: Reporter,
             trackers: Sequence[Tracker]) -> None:
        """Log the window's statistics; `seconds` is its time in steps, `checkpoint_seconds` in saving."""
        if not window:
            return
        stats = host_sum([out["stats"] for out in window])
        values = {f"train/{k}": v for k, v in self.objective.summarize(stats).items()}
        values["train/grad_norm"] = float(np.mean([out["grad_norm"] for out in window]))
        tokens = float(sum(float(self.objective.reduce_loss(out["stats"])[1]) for out in window))
        values["step_s"] = seconds / len(window)
        values["tokens_per_s"] = tokens / seconds if seconds > 0 else math.nan
        if self._step_flops is not None and seconds > 0:
            values["mfu"] = self._step_flops[0] * len(window) / seconds / self._step_flops[1]
        if checkpoint_seconds:
            values["checkpoint_s"] = checkpoint_seconds
        reporter.advance(done, values["train/loss"])
        self._record(done, values, reporter, trackers)

    def _record(self, done: int, values: dict[str, float], reporter: Reporter, trackers: Sequence[Tracker],
                label: str | None = None) -> None:
        self.history.append({"step": done, **values})
        reporter.line(f"step {done} | " + ("" if label is None else f"{label} | ") + format_values(values))
        for tracker in trackers:
            tracker.scalars(done, values)

    def _preview(self, state: TrainState, done: int, reporter: Reporter, trackers: Sequence[Tracker]) -> None:
        preview = getattr(self.objective, "preview", None)
        if preview is None:
            return
        base = jax.random.wrap_key_data(jax.device_get(state.key))
        key = jax.random.fold_in(jax.random.fold_in(base, PREVIEW_STREAM), done)
        # The objective says which weights its previews draw from (an EMA slot holding a frozen
        # reference is not the policy being trained); evaluation reads state.evaluated regardless.
        chooser = getattr(self.objective, "preview_variables", None)
        texts = preview(state.evaluated if chooser is None else chooser(state), None, Step(jnp.asarray(done), key))
        for text in texts or ():
            reporter.line(f"sample @ {done}: {text}")
        for tracker in trackers if texts else ():
            tracker.texts(done, "samples", texts)
