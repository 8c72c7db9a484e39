"""The recipe objectives registry: each `--objective` of `dew train`, by name.

An entry is the objective's flags side (`dew.objectives.lm.run_objectives`: the data it reads, the
flags only it reads, its checks, which `LMRunConfig` runs when it is made) with what the recipe needs
of it beyond those: how it loads its data, builds its model from scratch or takes a checkpoint, builds
the objective from the config, the model and the data's meta.json, what it records in run.json's
`generation`, and how many tokens a step trains on. Generation from a run directory (`dew.runs.pipeline`)
reads that record: an autoregressive `sampling` policy, or a diffusion `process`, and whether the EMA
slot holds averaged weights (`ema`) or, for dpo and grpo, a frozen reference (the live weights generate).

A new objective is an entry here and one in `RUN_OBJECTIVES`, under the same name.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax

from dew.data import Dataset, load_tokenizer
from dew.data.chat_data import ChatData
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts
from dew.data.tokenizers import tokenizer_name
from dew.diffusion.discrete import MDLM
from dew.inference.block import from_checkpoint as block_task
from dew.inference.text import printable
from dew.nn.diffusion_gemma import DiffusionGemma
from dew.nn.lora import LoRA
from dew.objectives.diffusion import BlockDiffusionObjective, MaskedDiffusionObjective
from dew.objectives.grpo import GRPOObjective
from dew.objectives.lm import LMObjective, LMRunConfig, Samples
from dew.objectives.lm.run_objectives import (
    BlockDiffusionFlags, DPOFlags, DPOSettings, GRPOFlags, GRPOSettings, LMFlags, MaskedDiffusionFlags,
    RunObjective, data_name,
)
from dew.objectives.preference import DPOObjective
from dew.objectives.rewards import READS_ANSWER, TextRewards
from dew.run_config import to_json
from dew.sampling import Sampling

# Data a run tokenizes itself, with the run's tokenizer, and what its records are called.
_TEXT_SOURCES = {ChatData: "conversations", PreferencePairs: "pairs", Prompts: "prompts"}


def load_data(config: LMRunConfig, **options) -> Dataset:
    """The train stream and validation pass `config.data` describes (text sources with `options`), refused
    unless the token files' meta.json names the run's tokenizer."""
    spec = config.data
    if spec.tokenizer is not None and tokenizer_name(spec.tokenizer) != tokenizer_name(config.tokenizer):
        raise ValueError(
            f"--data.tokenizer {spec.tokenizer!r} and --tokenizer {config.tokenizer!r} disagree: "
            "leave --data.tokenizer unset; --tokenizer names the run's tokenizer"
        )
    if type(spec) in _TEXT_SOURCES:
        if spec.val_path is None and config.trainer.eval_every is not None:
            raise ValueError(
                f"--trainer.eval-every {config.trainer.eval_every} asks for validation, and {data_name(spec)} has no "
                f"--data.val-path: pass a JSONL file of validation {_TEXT_SOURCES[type(spec)]}, or "
                "--trainer.eval-every None"
            )
        spec = dataclasses.replace(spec, tokenizer=config.tokenizer)
        return spec.load(batch=config.trainer.batch, val_batch=config.trainer.val_batch, **options)
    data = spec.load(batch=config.trainer.batch, val_batch=config.trainer.val_batch)
    if tokenizer_name(config.tokenizer) != data.meta["tokenizer"]:
        raise ValueError(
            f"--tokenizer {config.tokenizer!r} is not the tokenizer {data.meta['tokenizer']!r} that wrote "
            f"{spec.path} (its meta.json): pass --tokenizer {data.meta['tokenizer']}, or rewrite the token files "
            f"with `dew tokenize --input TEXT --out {spec.path} --tokenizer {config.tokenizer}`"
        )
    if data.val is None and config.trainer.eval_every is not None:
        raise ValueError(
            f"--trainer.eval-every {config.trainer.eval_every} asks for validation, and {spec.path} has no val.bin "
            "tokens: pass --trainer.eval-every None, or tokenize with a --val-fraction above 0"
        )
    return data


def previews(config: LMRunConfig, max_seq_len: int, sampling: Sampling) -> Samples | None:
    """The preview drawn at each evaluation with `sampling`, checked against the model's length up front."""
    if config.sample_tokens == 0:
        return None
    tokenizer = load_tokenizer(config.tokenizer)
    prompt = tokenizer.encode(config.sample_prompt or "\n")
    if len(prompt) + config.sample_tokens > max_seq_len:
        raise ValueError(
            f"the preview's prompt ({len(prompt)} tokens) plus --sample-tokens {config.sample_tokens} is "
            f"{len(prompt) + config.sample_tokens}, beyond the model's max_seq_len {max_seq_len}: pass a smaller "
            "--sample-tokens (0 for no previews), a shorter --sample-prompt, or a larger max_seq_len"
        )
    # Previews are printed to the terminal: control characters a model emits are escaped.
    return Samples(prompt=prompt, max_new_tokens=config.sample_tokens, sampling=sampling,
                   decode=lambda ids: printable(tokenizer.decode(ids)))


class RecipeObjective(RunObjective, abc.ABC):
    """What the recipe needs of an objective beyond its flags (see the module)."""

    def load_data(self, config: LMRunConfig) -> Dataset:
        return load_data(config)

    def fresh_model(self, config: LMRunConfig, meta: dict[str, Any]):
        """The model a run without --pretrained trains from scratch."""
        return config.model.build(vocab_size=meta["vocab_size"])

    def check_pretrained(self, config: LMRunConfig, bundle) -> None:
        """Refuse a --pretrained checkpoint (`dew.interop.Pretrained`) this objective cannot continue."""

    @abc.abstractmethod
    def build(self, config: LMRunConfig, model, held, meta: dict[str, Any], bundle):
        """The objective over `model`, starting from `held` (the checkpoint's variables, or None for fresh
        ones); `bundle` is the loaded --pretrained checkpoint, or None."""

    @abc.abstractmethod
    def generation(self, config: LMRunConfig, objective, bundle) -> dict[str, Any]:
        """run.json's `generation`: what generation from the run reads (`bundle`: the loaded --pretrained
        checkpoint, or None)."""

    def tokens_per_step(self, config: LMRunConfig, objective) -> int:
        return config.trainer.batch * objective.seq_len


def _budget(config: LMRunConfig, ema: bool) -> dict[str, Any]:
    return {"max_new_tokens": config.sample_tokens, "ema": ema}


class LanguageModel(RecipeObjective, LMFlags):
    """Next-token cross entropy (`LMObjective`), on token files or chat rows."""

    def build(self, config, model, held, meta, bundle) -> LMObjective:
        return LMObjective(
            model, config.data.seq_len, ema_decay=config.ema_decay,
            samples=previews(config, model.config.max_seq_len, config.sampling),
            balance_rate=config.balance_rate, aux_loss_alpha=config.aux_loss_alpha, seq_aux=config.seq_aux,
            router_z_loss=config.router_z_loss, mtp_weight=config.mtp_weight, indexer=config.indexer,
            token_accuracy=config.token_accuracy, pretrained=held, loss_role=config.loss_role,
            trainable=None if config.lora is None else LoRA.trainable,
        )

    def generation(self, config, objective, bundle) -> dict[str, Any]:
        return {"sampling": to_json(config.sampling), **_budget(config, config.ema_decay is not None)}


class MaskedDiffusion(RecipeObjective, MaskedDiffusionFlags):
    """MDLM's negative ELBO on a bidirectional decoder over whole rows of --data.seq-len + 1 ids: native
    MDLM over the id after the tokenizer's last from scratch, or a masked-diffusion checkpoint's process."""

    def fresh_model(self, config, meta):
        # The mask takes the id after the tokenizer's last, and reads both ways.
        return config.model.build(vocab_size=meta["vocab_size"] + 1, causal=False)

    def check_pretrained(self, config, bundle) -> None:
        family = bundle.converter
        if not hasattr(family, "process"):
            raise ValueError(
                f"--pretrained {config.pretrained} is a {family.model_type} checkpoint, a causal decoder: "
                "--objective masked_diffusion continues a masked-diffusion checkpoint (LLaDA, Dream), or trains a "
                "model from scratch without --pretrained"
            )

    def build(self, config, model, held, meta, bundle) -> MaskedDiffusionObjective:
        if bundle is None:
            process = MDLM(mask_id=meta["vocab_size"])()
            if model.config.vocab_size <= process.mask_id:
                raise ValueError(
                    f"--model.config vocab_size {model.config.vocab_size} leaves no id for the mask: masked diffusion "
                    f"masks with id {process.mask_id}, the one after the {meta['vocab_size']} ids of {config.data.path} "
                    "(meta.json); leave vocab_size out of --model.config to take one more than the files' vocab_size"
                )
        else:
            process = bundle.converter.process(bundle.config)
        # Previews unmask with the process's own sampler, so they carry no sampling policy.
        return MaskedDiffusionObjective(model, process, config.data.seq_len + 1, ema_decay=config.ema_decay,
                                        samples=previews(config, model.config.max_seq_len, Sampling()),
                                        token_accuracy=config.token_accuracy, pretrained=held)

    def generation(self, config, objective, bundle) -> dict[str, Any]:
        """The mask id (and a checkpoint's logits shift) native MDLM is rebuilt with (its default sampler,
        64 steps), and the budget."""
        process = objective.process
        shift = {"logits_shift": process.logits_shift} if process.logits_shift else {}
        return {"process": "mdlm", "mask_id": process.mask_id, **shift, **_budget(config, config.ema_decay is not None)}


class BlockDiffusion(RecipeObjective, BlockDiffusionFlags):
    """DiffusionGemma's block loss, fine-tuning its checkpoint on rows of --block-prompt-tokens plus whole
    canvases of --block-canvas-size (default the checkpoint's canvas length)."""

    def check_pretrained(self, config, bundle) -> None:
        if not isinstance(bundle.model, DiffusionGemma):
            raise ValueError(f"--pretrained {config.pretrained} is a {bundle.config.get('model_type')} checkpoint: "
                             "--objective block_diffusion fine-tunes a DiffusionGemma (model_type diffusion_gemma)")

    def build(self, config, model, held, meta, bundle) -> BlockDiffusionObjective:
        row, prompt = config.data.seq_len + 1, config.block_prompt_tokens
        canvas = config.block_canvas_size or model.config.canvas_length
        if row <= prompt or (row - prompt) % canvas:
            raise ValueError(
                f"--data.seq-len {config.data.seq_len} gives rows of {row} ids, which must be --block-prompt-tokens "
                f"{prompt} plus a whole number (at least 1) of canvases of {canvas}: use --data.seq-len "
                f"{prompt + canvas * max(1, -(-(row - prompt) // canvas)) - 1}, or change the prompt or canvas size"
            )
        return BlockDiffusionObjective(model, prompt, (row - prompt) // canvas, canvas, ema_decay=config.ema_decay,
                                       pretrained=held)

    def generation(self, config, objective, bundle) -> dict[str, Any]:
        """The checkpoint's block sampler (from its generation_config.json), EOS and padding ids and
        budget, which `dew.pipeline` of the run generates with (the run draws no previews)."""
        task = block_task(bundle)
        return {"process": "block", "block_process": dataclasses.asdict(task.process),
                "eos_token_ids": list(task.eos_token_ids), "pad_id": task.pad_id,
                **_budget(config, config.ema_decay is not None), "max_new_tokens": task.max_new_tokens}


class Preference(RecipeObjective, DPOFlags):
    """DPO on preference pairs against the run's starting weights, frozen in the EMA slot."""

    def build(self, config, model, held, meta, bundle) -> DPOObjective:
        settings = config.dpo or DPOSettings()
        return DPOObjective(model, config.data.seq_len, beta=settings.beta, label_smoothing=settings.label_smoothing,
                            pretrained=held, samples=previews(config, model.config.max_seq_len, config.sampling))

    def generation(self, config, objective, bundle) -> dict[str, Any]:
        # The EMA slot holds the reference: the live weights are the trained policy.
        return {"sampling": to_json(config.sampling), **_budget(config, False)}

    def tokens_per_step(self, config, objective) -> int:
        return 2 * config.trainer.batch * objective.seq_len  # a pair is two rows


class Reinforcement(RecipeObjective, GRPOFlags):
    """GRPO on the policy's own completions of prompts, scored by rewards that ship with Dew."""

    def load_data(self, config) -> Dataset:
        settings = config.grpo
        fields = (settings.answer_field,) if set(settings.rewards) & set(READS_ANSWER) else ()
        return load_data(config, completions=settings.group_size, fields=fields)

    def build(self, config, model, held, meta, bundle) -> GRPOObjective:
        settings: GRPOSettings = config.grpo
        if jax.process_count() > 1:
            raise NotImplementedError(f"--objective grpo over {jax.process_count()} processes: rollouts from weights "
                                      "split across processes are not built in Dew yet; train it in one process")
        sampling = config.sampling
        if meta["eos_id"] is not None and meta["eos_id"] not in sampling.eos_token_ids:
            sampling = dataclasses.replace(sampling, eos_token_ids=(*sampling.eos_token_ids, meta["eos_id"]))
        if "finished" in settings.rewards and not sampling.eos_token_ids:
            raise ValueError(f"--grpo.rewards finished rewards a completion that ends with an EOS token, and tokenizer "
                             f"{config.tokenizer!r} has none: name the ids that end one with --sampling.eos-token-ids")
        width = config.data.seq_len + 1
        if meta["longest_prompt"] + settings.max_new_tokens > width:
            raise ValueError(
                f"the longest prompt of {config.data.path} (or its --data.val-path) is {meta['longest_prompt']} tokens, "
                f"and with --grpo.max-new-tokens {settings.max_new_tokens} it is beyond a row of --data.seq-len + 1 = "
                f"{width}: use --data.seq-len {meta['longest_prompt'] + settings.max_new_tokens - 1} or more, or fewer "
                "new tokens"
            )
        rewards = TextRewards(settings.rewards, load_tokenizer(config.tokenizer), sampling.eos_token_ids,
                              settings.answer_field)
        return GRPOObjective(model, config.data.seq_len, rewards, group_size=settings.group_size,
                             max_new_tokens=settings.max_new_tokens, clip=settings.clip, kl_weight=settings.kl_weight,
                             sampling=sampling, pretrained=held,
                             samples=previews(config, model.config.max_seq_len, sampling))

    def generation(self, config, objective, bundle) -> dict[str, Any]:
        # The policy as its completions were drawn (with the tokenizer's EOS), over the completions'
        # budget; the live weights are the trained policy (the EMA slot, if any, is the reference).
        return {"sampling": to_json(objective.sampling), "max_new_tokens": objective.max_new_tokens, "ema": False}


OBJECTIVES: dict[str, RecipeObjective] = {entry.name: entry for entry in (
    LanguageModel(), MaskedDiffusion(), BlockDiffusion(), Preference(), Reinforcement())}
"""Each `--objective` of the recipe by name (the names of `RUN_OBJECTIVES`)."""


def recipe_objective(name: str) -> RecipeObjective:
    """The entry of `--objective name` (a name `LMRunConfig` has already checked)."""
    return OBJECTIVES[name]
