"""The language-model recipe: an `LMRunConfig` in, a trained run directory out.

`prepare(config)` builds the data, model, objective and trainer and opens the run directory,
refusing a bad config before anything is written; `LMRun.fit()` trains, resuming the directory's
last checkpoint. `main` is `recipes/lm/train.py` and `dew train`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import tyro

from dew import kernels
from dew.data import Dataset, load_tokenizer
from dew.data.tokenizers import tokenizer_file
from dew.errors import describe, exit_status, one_line_warnings, report
from dew.interop import load_pretrained
from dew.interop.peft import check_peft, save_peft
from dew.nn.diffusion_gemma import DiffusionGemma
from dew.nn.lora import LoRA, adapters
from dew.nn.multimodal import MultimodalTransformer
from dew.objectives import Objective
from dew.objectives.lm import LMRunConfig
from dew.recipes.objectives import RecipeObjective, recipe_objective
from dew.run_config import to_json
from dew.runs.run_dir import PATH_SETTINGS, TOKENIZER, RunDirectory, resolve_path_setting
from dew.sharding import initialize
from dew.training.state import TrainState
from dew.training.trackers import JsonLines, TensorBoard, Tracker, WandB
from dew.training.trainer import Trainer, TrainingDiverged, TrainingInterrupted

RECIPE = "lm"
ADAPTER = "adapter"
"""RUN/adapter/: a LoRA run's adapters in PEFT's format, written when the run finishes."""
# The key a LoRA run draws its fresh adapters from: stream 3 of the seed's key (the trainer's streams
# fold into a key split from it, so none meets this one).
_ADAPTER_STREAM = 3


def _record(config: LMRunConfig, objective, meta: dict[str, Any], command: Sequence[str] | None,
            bundle=None) -> dict[str, Any]:
    """run.json's content (RunDirectory adds the versions and the time); `generation` and the tokens a step
    trains on are the objective's (`dew.recipes.objectives`), `bundle` the --pretrained checkpoint or None."""
    entry = recipe_objective(config.objective)
    settings = to_json(config)
    settings["data"] = {"type": type(config.data).__name__, **settings["data"]}
    # Paths as absolute ones: the run compares and finds the same files from any working directory.
    for name in PATH_SETTINGS:
        *parents, leaf = name.split(".")
        holder = functools.reduce(dict.get, parents, settings)
        if leaf in holder:
            holder[leaf] = resolve_path_setting(holder[leaf])
    return {
        "recipe": RECIPE,
        "settings": settings,
        "model": {"name": _model_name(config, objective.model), "config": to_json(objective.model.config)},
        # What decides each product's kernel (a pure function of these, the shape and the dtype).
        "kernels": kernels.describe(getattr(objective.model.config, "kernels", "auto")),
        "data": meta,
        "tokenizer": meta["tokenizer"],
        "generation": entry.generation(config, objective, bundle),
        "tokens_per_step": entry.tokens_per_step(config, objective),
        "command": list(command) if command is not None else None,
    }


@dataclasses.dataclass
class LMRun:
    """A prepared run: its pieces, its directory (held by this process) and its trackers. `fit()`
    trains it and lets the directory go when it returns; after it raises, or without it, `close()`
    does (as the process's end would)."""

    config: LMRunConfig
    data: Dataset
    objective: Objective
    trainer: Trainer
    directory: RunDirectory
    trackers: list[Tracker]
    notes: list[str]

    def fit(self, verbose: bool = True) -> TrainState:
        """Train to trainer.steps, resuming the last checkpoint; record the run's status as it ends."""
        settings = self.config.trainer
        self._status("running")
        try:
            state = self.trainer.fit(
                self.data, steps=settings.steps, log_every=settings.log_every, eval_every=settings.eval_every,
                checkpoint_dir=str(self.directory.checkpoints), checkpoint_every=settings.checkpoint_every,
                keep=settings.keep, accumulation=settings.accumulation, verbose=verbose, trackers=self.trackers,
            )
        except TrainingInterrupted as stop:
            self._status("interrupted", stop.step, str(stop))
            raise
        except KeyboardInterrupt as stop:
            self._status("interrupted", self._last_checkpoint(), f"stopped at once, without a final checkpoint ({stop})")
            raise
        except TrainingDiverged as error:
            diverged = Diverged(self, error)
            self._status("diverged", diverged.step, str(diverged))
            raise diverged from error
        except BaseException as error:
            known = exit_status(error) is not None
            self._status("failed", self._last_checkpoint(), describe(error) if known else f"{type(error).__name__}: {error}")
            raise
        finally:
            for tracker in self.trackers:
                try:
                    tracker.close()
                except OSError as error:  # a full disk: the error that ended the run is the one to show
                    print(f"warning: {type(tracker).__name__} could not close: {describe(error)}", file=sys.stderr)
        if self.config.lora is not None:
            self._write_adapter(state)
        self._status("finished", int(jax.device_get(state.step)))
        self.close()
        return state

    def _write_adapter(self, state: TrainState) -> None:
        """Write the run's adapters in PEFT's format to RUN/adapter/ (`dew.interop.peft.save_peft`): those
        generation and previews read (the averaged ones when the run keeps a moving average, the live
        ones when its EMA slot is a frozen reference), for `peft.PeftModel.from_pretrained` on the
        --pretrained checkpoint."""
        from jax.experimental import multihost_utils

        # Every process takes part in gathering the adapters; process 0 writes them.
        found = multihost_utils.process_allgather(adapters(self.objective.preview_variables(state)), tiled=True)
        if jax.process_index() == 0:
            save_peft(self.directory.path / ADAPTER, self.objective.model, found,
                      base_model=self.directory.record().get("pretrained"))

    def _last_checkpoint(self) -> int | None:
        saved = self.directory.checkpoint_steps()
        return saved[-1] if saved else None

    def _status(self, state: str, step: int | None = None, message: str | None = None, **details) -> None:
        """Record the state in status.json (process 0 only); a failure to write it is reported, not raised,
        so that the error that ended the run is the one the user sees."""
        if jax.process_index() != 0:
            return
        try:
            self.directory.set_status(state, step, message, checkpoint=self._last_checkpoint(), **details)
        except OSError as error:
            print(f"warning: could not record the run's state ({state}) in status.json: {describe(error)}",
                  file=sys.stderr)

    def close(self) -> None:
        """Let another process have the run directory."""
        self.directory.close()


class Diverged(FloatingPointError):
    """A run stopped at a non-finite step: `step`, and `checkpoint`, the last good checkpoint's step
    (None when none was saved), with the command-line way to continue from it."""

    def __init__(self, run: LMRun, error: TrainingDiverged):
        self.step, self.checkpoint = error.step, error.last_checkpoint
        lower = f"--optim.learning-rate {run.config.optim.learning_rate / 2:g} --trainer.allow-changes optim.learning-rate"
        if self.checkpoint is None:
            advice = (f"no checkpoint was saved before it: rerun the command with {lower} to start the run again "
                      "with a lower learning rate")
        else:
            advice = (f"the last good checkpoint is step {self.checkpoint} ({run.directory.checkpoints / str(self.checkpoint)}): "
                      f"rerun the command with {lower} to continue from it with a lower learning rate")
        super().__init__(f"training diverged at step {error.step}: its loss ({error.loss:.6g}), gradient norm "
                         f"({error.grad_norm:.6g}) or update was not finite, and it was not applied; {advice}")


# What --model.config may still set when --pretrained decides the architecture.
_PRETRAINED_OVERRIDES = ("max_seq_len", "dtype", "attention_impl", "scan_layers", "remat", "kernels")


def _model(config: LMRunConfig, meta: dict[str, Any], entry: RecipeObjective):
    """(model, variables to start from or None, the source as recorded: a hub id pinned to its commit, notes
    for the user, the loaded checkpoint or None): the objective's fresh model, or --pretrained's."""
    if config.pretrained is None:
        return entry.fresh_model(config, meta), None, None, [], None
    fixed = sorted(set(config.model.config) - set(_PRETRAINED_OVERRIDES))
    if fixed:
        raise ValueError(
            f"--pretrained {config.pretrained} decides the architecture, so --model.config may set only "
            f"{list(_PRETRAINED_OVERRIDES)}, not {fixed}: drop them from --model.config"
        )
    bundle = load_pretrained(config.pretrained, **config.model.config)
    if isinstance(bundle.model, MultimodalTransformer):
        raise NotImplementedError(
            f"--pretrained {config.pretrained} is a multimodal checkpoint ({bundle.config.get('model_type')}), and the "
            "recipe's runs (token files, run.json, dew.pipeline of a run) are built for text decoders: continue "
            "training it in Python, LMObjective over {\"text\": processor outputs} with the Trainer "
            "(docs/multimodal.md, \"Images in, text out\")")
    source = config.pretrained if bundle.revision is None else f"{config.pretrained.split('@')[0]}@{bundle.revision}"
    entry.check_pretrained(config, bundle)
    model, variables = bundle.model, bundle.variables
    if config.lora is not None:
        model, variables = _adapted(config.lora, bundle, config.trainer.seed)
    return model, variables, source, _check_pretrained_tokenizer(config, bundle, meta), bundle


def _adapted(lora: LoRA, bundle, seed: int):
    """(the checkpoint's decoder with `lora`'s adapters, its variables with fresh adapters drawn from the
    run's seed); targets that match no linear, or adapters PEFT's format cannot hold, are refused."""
    model = lora.adapt(bundle.model)
    check_peft(model)
    return model, model.attach(jax.random.fold_in(jax.random.key(seed), _ADAPTER_STREAM), bundle.variables)


def _check_pretrained_tokenizer(config: LMRunConfig, bundle, meta: dict[str, Any]) -> list[str]:
    """Refuse token files whose ids mean other tokens than the checkpoint's: its vocabulary (token ->
    id, added tokens included) must be the one of the tokenizer meta.json names."""
    files = f"{config.data.path} (meta.json: {meta['tokenizer']!r})"
    if bundle.tokenizer is None:
        return [f"--pretrained {config.pretrained} has no tokenizer.json, so the tokenizer of {files} could not be "
                "checked against it: the token ids must be the checkpoint's"]
    theirs = bundle.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    path = tokenizer_file(meta["tokenizer"])
    ours = None if path is None else load_tokenizer(meta["tokenizer"]).tokenizer.get_vocab(with_added_tokens=True)
    if ours != theirs:
        raise ValueError(
            f"the token files {files}, {meta['vocab_size']} ids, were written with another tokenizer than "
            f"--pretrained {config.pretrained}'s ({bundle.directory / TOKENIZER}, {len(theirs)} tokens): tokenize the text "
            f"again with `dew tokenize --input TEXT --out DIR --tokenizer {bundle.directory}` and train on DIR"
        )
    return []


def _model_name(config: LMRunConfig, model) -> str:
    """The registry name that rebuilds `model` from its recorded config: a DiffusionGemma checkpoint's
    model is not the --model one."""
    return "diffusion_gemma" if isinstance(model, DiffusionGemma) else config.model.name


def prepare(config: LMRunConfig, command: Sequence[str] | None = None) -> LMRun:
    """Build everything `config` describes and open its run directory; refuse before writing anything."""
    entry = recipe_objective(config.objective)
    data = entry.load_data(config)
    meta = data.meta
    model, held, source, pretrained_notes, bundle = _model(config, meta, entry)
    if model.config.vocab_size < meta["vocab_size"]:
        raise ValueError(
            f"--model.config vocab_size {model.config.vocab_size} is below the vocab_size {meta['vocab_size']} "
            f"of {config.data.path} (meta.json): leave vocab_size out of --model.config to take the files' one"
        )
    objective = entry.build(config, model, held, meta, bundle)
    settings = config.trainer
    trainer = Trainer(objective, config.optim.build(settings.steps), key=jax.random.key(settings.seed),
                      mesh=settings.mesh, layout=settings.layout)
    _check_batches(settings, trainer.mesh.devices.size)
    directory = RunDirectory(settings.run_dir)
    trackers: list[Tracker] = []
    notes: list[str] = []
    if jax.process_index() == 0:
        trackers = [JsonLines(directory.path), TensorBoard(directory.path)]
        if settings.wandb is not None:
            run_id = "dew-" + hashlib.sha1(str(directory.path.resolve()).encode()).hexdigest()[:16]
            trackers.append(WandB(directory.path, settings.wandb, run_id=run_id, mode=settings.wandb_mode,
                                  config=to_json(config)))
        # Everything above only reads; this is the first write (and it takes the directory's lock).
        notes = directory.open({**_record(config, objective, meta, command, bundle), "pretrained": resolve_path_setting(source)},
                               allow_changes=settings.allow_changes, keep=_tokenizer_files(config.tokenizer))
        notes += pretrained_notes
    return LMRun(config, data, objective, trainer, directory, trackers, notes)


def _tokenizer_files(name: str) -> dict[str, Path]:
    """The files a run keeps a copy of so that it needs nothing outside its directory: the tokenizer's
    tokenizer.json and, beside it, the tokenizer_config.json that names its EOS token and the
    chat_template.jinja transformers writes a chat template to (none for bytes)."""
    path = tokenizer_file(name)
    if path is None:
        return {}
    beside = (path.parent / "tokenizer_config.json", path.parent / "chat_template.jinja")
    return {TOKENIZER: path, **{file.name: file for file in beside if file.is_file()}}


def _check_batches(settings, devices: int) -> None:
    """Refuse batches the trainer cannot split, before the run directory is written."""
    if settings.batch % (settings.accumulation * devices):
        raise ValueError(
            f"--trainer.batch {settings.batch} does not split into --trainer.accumulation {settings.accumulation} "
            f"micro-batches over {devices} device(s): use a batch that is a multiple of {settings.accumulation * devices}"
        )


def train(config: LMRunConfig, *, verbose: bool = True) -> TrainState:
    """Prepare and fit the run `config` describes."""
    return prepare(config).fit(verbose)


_DESCRIPTION = """Train a language model and keep the run in --trainer.run-dir: --objective lm (the default),
masked_diffusion or block_diffusion on token files, lm on data:chat conversations, dpo on
data:preference-pairs, grpo on data:prompts (docs/recipes.md, "Objectives").

Rerunning the same command resumes the run from its last checkpoint, reading the same next batch;
SIGINT or SIGTERM saves a checkpoint first. A command whose settings differ from the run's run.json
is refused: start a new run with another --trainer.run-dir (or, for an optimizer setting, continue
this one with --trainer.allow-changes). One process trains a run directory at a time.

  dew tokenize --input data/kjv.txt.xz --out data/kjv-byte --tokenizer byte
  dew train data:token-windows --data.path data/kjv-byte --data.seq-len 256 \\
      --model.config '{"emb_features": 256, "num_layers": 4, "num_heads": 4, "max_seq_len": 256}' \\
      --trainer.steps 2000 --trainer.batch 32 --trainer.run-dir runs/kjv

(`python recipes/lm/train.py` is `dew train`. `make quickstart` tokenizes the same text with a BPE
tokenizer trained on it, into data/kjv-bpe: train on those with --tokenizer kjv-bpe.)
"""


def parse(argv: Sequence[str], prog: str = "python recipes/lm/train.py") -> LMRunConfig:
    """The `LMRunConfig` a command line describes; flags may come before or after the data subcommand,
    and a flag given more than once takes its last value."""
    # tyro retires a flag once the level that read it ends, so a copy after the data subcommand of a flag
    # read before it is refused as misplaced. Each earlier copy (the flag and the values up to the next flag
    # or subcommand) is dropped instead; `--no-X` is `--X`'s other spelling.
    groups = {field.name for field in dataclasses.fields(LMRunConfig)}

    def flag(token: str) -> str | None:
        if not (token.startswith("--") and token[2:3].isalpha()):
            return None
        name = token[2:].partition("=")[0].replace("_", "-")
        return name.removeprefix("no-")

    def ends_values(token: str) -> bool:
        return flag(token) is not None or token.partition(":")[0] in groups and ":" in token

    tokens, kept = list(argv), []
    position = 0
    while position < len(tokens):
        end = position + 1
        name = flag(tokens[position])
        if name is not None and "=" not in tokens[position]:
            while end < len(tokens) and not ends_values(tokens[end]):
                end += 1
        later = {flag(token) for token in tokens[end:]}
        if name is None or name not in later:
            kept += tokens[position:end]
        position = end
    return tyro.cli(LMRunConfig, args=kept, prog=prog, description=_DESCRIPTION,
                    config=(tyro.conf.CascadeSubcommandArgs,))


def main(argv: Sequence[str] | None = None, prog: str = "python recipes/lm/train.py") -> int:
    """Parse `argv` into an `LMRunConfig` and train it. The exit status is `dew.errors`': 0 finished,
    1 the environment failed or the run diverged, 2 refused (before anything was written), 128 + the
    signal's number when SIGINT or SIGTERM stopped it; each but 0 with one line on stderr."""
    argv = sys.argv[1:] if argv is None else list(argv)
    one_line_warnings()
    try:
        config = parse(argv, prog)
        # Several processes (DEW_COORDINATOR, DEW_NUM_PROCESSES, DEW_PROCESS_ID) join before any
        # JAX computation; a single process starts nothing.
        initialize()
        run = prepare(config, command=[*prog.split(), *argv])
    except Exception as error:  # noqa: BLE001 - `report` re-raises what is not a refusal or a fault
        return report(error)
    try:
        for note in run.notes:
            print(f"note: {note}")
        saved = run.directory.checkpoint_steps()
        if saved and saved[-1] >= run.config.trainer.steps:
            print(f"{run.directory.path} finished at step {saved[-1]}: nothing left to train")
            return 0
        print(f"run directory {run.directory.path}" + ("" if saved else " (a new run)"))
        run.fit()
    except TrainingInterrupted as stop:
        print(f"{stop}: rerun the same command to resume", file=sys.stderr)
        return 128 + stop.signal_number
    except KeyboardInterrupt as stop:  # a second signal while saving, or Ctrl-C before training began
        return _stopped_at_once(run, stop)
    except Exception as error:  # noqa: BLE001
        return report(error)
    finally:
        run.close()
    return 0


def _stopped_at_once(run: LMRun, stop: KeyboardInterrupt) -> int:
    """One line for a run stopped without its final checkpoint, and 128 + the signal's number."""
    number = getattr(stop, "signal_number", signal.SIGINT)
    saved = run.directory.checkpoint_steps()
    resume = f"the last checkpoint is step {saved[-1]}" if saved else "no checkpoint was saved"
    print(f"error: {signal.Signals(number).name} stopped training at once ({stop or 'interrupted'}); {resume}: "
          "rerun the same command to resume", file=sys.stderr)
    return 128 + number
