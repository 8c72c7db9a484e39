"""What each recipe objective accepts of a run's flags: the data it reads, the flags only it reads, and its
own checks. `LMRunConfig` runs them when it is made (in Python as on the command line), so a config no
objective could train is refused before anything is built.

`RUN_OBJECTIVES` maps `--objective`'s names to these entries. The recipe's registry
(`dew.recipes.objectives`) extends each entry with what needs the floors above: how it loads its data,
builds its model and objective, and what generation from its runs reads. A flag that some objectives read
(`KNOBS`) is refused by every other one unless it keeps its neutral value, by the message of whoever
owns it; so no flag is ever silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from dew.data import PackedTokens, TokenWindows
from dew.data.chat_data import ChatData
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts
from dew.objectives.rewards import READS_ANSWER, REWARDS
from dew.sampling import Sampling

DEFAULT_SAMPLING = Sampling(temperature=0.8, top_k=40)
"""`LMRunConfig.sampling`'s default: the preview policy of a language-model run."""
DEFAULT_EMA = 0.999
"""`LMRunConfig.ema_decay`'s default."""

_DATA_NAMES = {TokenWindows: "data:token-windows", PackedTokens: "data:packed-tokens", ChatData: "data:chat",
               PreferencePairs: "data:preference-pairs", Prompts: "data:prompts"}


def data_name(data) -> str:
    """The subcommand that reads `data`, as the command line spells it."""
    return _DATA_NAMES.get(type(data), type(data).__name__)


# -- the knobs of DPO and GRPO ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """DPO's knobs (`dew.objectives.preference.DPOObjective`); the reference is the run's starting weights."""

    beta: float = 0.1
    """How far the policy may move from the reference: the scale of the log-likelihood ratios (TRL's beta)."""
    label_smoothing: float = 0.0
    """cDPO's assumed rate of flipped labels, in [0, 0.5) (TRL's label_smoothing)."""


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    """GRPO's knobs (`dew.objectives.grpo.GRPOObjective`), named as TRL's GRPOConfig's where they match."""

    rewards: tuple[str, ...] = ()
    """The rewards summed for each completion, by name (`dew.objectives.rewards`)."""
    group_size: int = 8
    """Completions drawn per prompt, whose rewards are normalised together (TRL's num_generations)."""
    max_new_tokens: int = 256
    """Tokens a completion may take (TRL's max_completion_length)."""
    clip: float = 0.2
    """PPO's epsilon: how far the likelihood ratio may move before it is clipped (TRL's epsilon)."""
    kl_weight: float = 0.0
    """The weight of the KL to the starting weights, kept frozen when above 0 (TRL's beta)."""
    answer_field: str = "answer"
    """The prompt record's field that exact_match compares a completion with."""

    def __post_init__(self):
        object.__setattr__(self, "rewards", tuple(self.rewards))
        unknown = [name for name in self.rewards if name not in REWARDS]
        if unknown:
            raise ValueError(f"--grpo.rewards names {unknown}; the rewards that ship with Dew are {sorted(REWARDS)}")


def dpo_flags(beta: float = 0.1, label_smoothing: float = 0.0) -> DPOSettings | None:
    """`LMRunConfig.dpo` from the command line's --dpo.* flags: None while both keep their defaults.

    Args:
        beta: How far the policy may move from the reference, the run's starting weights (TRL's beta).
        label_smoothing: cDPO's assumed rate of flipped labels, in [0, 0.5).
    """
    settings = DPOSettings(beta, label_smoothing)
    return None if settings == DPOSettings() else settings


RewardName = Literal[tuple(REWARDS)]


def grpo_flags(rewards: tuple[RewardName, ...] = (), group_size: int = 8, max_new_tokens: int = 256,
               clip: float = 0.2, kl_weight: float = 0.0, answer_field: str = "answer") -> GRPOSettings | None:
    """`LMRunConfig.grpo` from the command line's --grpo.* flags: None while all keep their defaults.

    Args:
        rewards: The rewards summed for each completion (--objective grpo needs one or more): exact_match
            (the completion is the record's answer field), think_format (<think>...</think> first),
            finished (the completion ended with an EOS token, within the budget).
        group_size: Completions drawn per prompt, their rewards normalised together (TRL's
            num_generations); --trainer.batch counts completions, so it is a multiple of this.
        max_new_tokens: Tokens a completion may take (TRL's max_completion_length).
        clip: PPO's epsilon on the likelihood ratio (TRL's epsilon).
        kl_weight: The weight of a KL term to the starting weights, kept frozen when above 0 (TRL's beta).
        answer_field: The prompt record's field exact_match compares the completion with.
    """
    settings = GRPOSettings(tuple(rewards), group_size, max_new_tokens, clip, kl_weight, answer_field)
    return None if settings == GRPOSettings() else settings


# -- the flags only some objectives read ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Knob:
    """A flag only some objectives read: its neutral value (the one that asks for nothing), and the
    refusal `refuse(objective, config)` an objective that does not read it gives a value other than that."""

    neutral: Any
    refuse: Callable[[RunObjective, Any], Exception]


def _flag(name: str, value) -> str:
    return "--no-seq-aux" if name == "seq_aux" else f"--{name.replace('_', '-')} {value}"


def _autoregressive(name: str) -> Knob:
    neutral = {"balance_rate": None, "aux_loss_alpha": None, "seq_aux": True, "router_z_loss": 0.0,
               "mtp_weight": None, "indexer": None, "loss_role": None}[name]

    def refuse(objective, config) -> Exception:
        flag = _flag(name, getattr(config, name))
        return ValueError(f"{flag} shapes the autoregressive objective (--objective lm), and --objective "
                          f"{objective.name} does not read it: drop {flag.split()[0]}")

    return Knob(neutral, refuse)


def _block(name: str, neutral) -> Knob:
    return Knob(neutral, lambda objective, config: ValueError(
        f"{name} is {getattr(config, name)}, but it shapes only --objective block_diffusion rows and this run's "
        f"objective is {objective.name}: leave {name} unset"))


def _group(name: str) -> Knob:
    return Knob(None, lambda objective, config: ValueError(
        f"the --{name}.* flags ({getattr(config, name)}) shape --objective {name}, and this run's objective is "
        f"{objective.name}: drop them, or pass --objective {name}"))


KNOBS: dict[str, Knob] = {
    **{name: _autoregressive(name) for name in ("balance_rate", "aux_loss_alpha", "seq_aux", "router_z_loss",
                                                "mtp_weight", "indexer", "loss_role")},
    "sampling": Knob(DEFAULT_SAMPLING, lambda objective, config: ValueError(
        f"--sampling sets an autoregressive policy ({config.sampling}), and --objective {objective.name} "
        f"{objective.generates}: drop the --sampling flags")),
    "token_accuracy": Knob(True, lambda objective, config: ValueError(
        f"--no-token-accuracy skips the token accuracy that --objective lm and masked_diffusion report, and "
        f"--objective {objective.name} reports none: drop --no-token-accuracy")),
    "block_prompt_tokens": _block("block_prompt_tokens", 256),
    "block_canvas_size": _block("block_canvas_size", None),
    "dpo": _group("dpo"),
    "grpo": _group("grpo"),
    "ema_decay": Knob(DEFAULT_EMA, lambda objective, config: ValueError(
        f"--ema-decay {config.ema_decay}: --objective {objective.name} {objective.ema_slot}, so no moving average "
        "is kept: drop --ema-decay")),
    "lora": Knob(None, lambda objective, config: NotImplementedError(
        f"--lora.rank {config.lora.rank} with --objective {objective.name}: LoRA runs of the recipe are built for "
        "--objective lm only; drop the --lora flags")),
}
"""Each flag only some objectives read, by `LMRunConfig` field."""


# -- the objectives ---------------------------------------------------------------------------------------

class RunObjective:
    """One `--objective`: the `data` specs it reads (with `refusals`, messages of its own for some others),
    the `knobs` (names in `KNOBS`) it reads, and `check_own(config)`, its own checks."""

    name: ClassVar[str]
    data: ClassVar[tuple[type, ...]]
    refusals: ClassVar[dict[type, str]] = {}
    knobs: ClassVar[frozenset[str]]
    generates: ClassVar[str] = "samples autoregressively"
    """How the objective generates, for refusing --sampling."""
    ema_slot: ClassVar[str] = ""
    """What the objective keeps where the EMA would be, for refusing --ema-decay."""

    def check(self, config) -> None:
        """Refuse data this objective does not read, another objective's knobs, then `check_own`."""
        if not isinstance(config.data, self.data):
            raise ValueError(self.refusals.get(type(config.data)) or self._foreign_data(config.data))
        for name, knob in KNOBS.items():
            if name not in self.knobs and getattr(config, name) != knob.neutral:
                raise knob.refuse(self, config)
        self.check_own(config)

    def check_own(self, config) -> None:
        """The objective's own checks of a config whose data and knobs are its own."""

    def _foreign_data(self, data) -> str:
        readers = [entry.name for entry in RUN_OBJECTIVES.values() if isinstance(data, entry.data)]
        accepted = " or ".join(_DATA_NAMES[kind] for kind in self.data)
        if not readers:
            return f"{data_name(data)} is no data a recipe objective reads: --objective {self.name} trains on {accepted}"
        return (f"--objective {self.name} trains on {accepted}, not {data_name(data)} (the data of --objective "
                f"{' or '.join(readers)}): give {accepted}, or pass --objective {readers[0]}")


_WHOLE_ROWS = "reads token rows whole, without their roles or conversation boundaries: train it on"


class LMFlags(RunObjective):
    name = "lm"
    data = (TokenWindows, PackedTokens, ChatData)
    knobs = frozenset({"balance_rate", "aux_loss_alpha", "seq_aux", "router_z_loss", "mtp_weight", "indexer",
                       "loss_role", "sampling", "token_accuracy", "ema_decay", "lora"})


class MaskedDiffusionFlags(RunObjective):
    name = "masked_diffusion"
    data = (TokenWindows, PackedTokens)
    refusals = {ChatData: f"--objective masked_diffusion {_WHOLE_ROWS} data:token-windows or data:packed-tokens"}
    knobs = frozenset({"token_accuracy", "ema_decay"})
    generates = "previews and generates by unmasking with MDLM's sampler"


class BlockDiffusionFlags(RunObjective):
    name = "block_diffusion"
    data = (TokenWindows,)
    refusals = {ChatData: f"--objective block_diffusion {_WHOLE_ROWS} data:token-windows",
                PackedTokens: "--objective block_diffusion reads each row as one prompt and its response canvases, "
                              "and packed documents' context boundaries differ: use data:token-windows"}
    knobs = frozenset({"block_prompt_tokens", "block_canvas_size", "ema_decay"})
    generates = "generates canvas by canvas with the checkpoint's BlockProcess"

    def check_own(self, config) -> None:
        """Block diffusion fine-tunes a DiffusionGemma checkpoint on unpacked rows, without previews."""
        if config.pretrained is None:
            raise ValueError("--objective block_diffusion fine-tunes a DiffusionGemma checkpoint: pass --pretrained "
                             "(and --tokenizer, the checkpoint's)")
        if config.sample_tokens:
            raise ValueError(f"--sample-tokens {config.sample_tokens}: --objective block_diffusion has no "
                             "autoregressive preview; pass --sample-tokens 0 and generate through load_pretrained of "
                             "the exported checkpoint")
        if config.block_prompt_tokens < 1:
            raise ValueError(f"--block-prompt-tokens is {config.block_prompt_tokens}; a row needs a clean prompt of at "
                             "least 1 token")
        if config.block_canvas_size is not None and config.block_canvas_size < 1:
            raise ValueError(f"--block-canvas-size is {config.block_canvas_size}; a canvas holds at least 1 token")


class DPOFlags(RunObjective):
    name = "dpo"
    data = (PreferencePairs,)
    knobs = frozenset({"dpo", "sampling"})
    ema_slot = "keeps its frozen reference, the starting weights, where the EMA would be (ema_decay 1.0)"


class GRPOFlags(RunObjective):
    name = "grpo"
    data = (Prompts,)
    knobs = frozenset({"grpo", "sampling"})
    ema_slot = ("keeps no moving average (with --grpo.kl-weight above 0 it holds its frozen reference, the "
                "starting weights, where the EMA would be)")

    def check_own(self, config) -> None:
        """GRPO needs rewards; its batches are whole groups of completions."""
        settings = config.grpo or GRPOSettings()
        if not settings.rewards:
            raise ValueError(f"--objective grpo scores each completion with rewards chosen by name: add --grpo.rewards "
                             f"NAME [NAME ...], from {sorted(REWARDS)}")
        if settings.answer_field != "answer" and not set(settings.rewards) & set(READS_ANSWER):
            raise ValueError(f"--grpo.answer-field {settings.answer_field} names the field {list(READS_ANSWER)} "
                             f"compare with, and --grpo.rewards {' '.join(settings.rewards)} reads none: drop "
                             "--grpo.answer-field")
        for flag, rows in (("--trainer.batch", config.trainer.batch), ("--trainer.val-batch", config.trainer.val_batch)):
            # A group below 2 is GRPOObjective's to refuse.
            if rows is not None and settings.group_size >= 1 and rows % settings.group_size:
                raise ValueError(f"{flag} {rows} counts completions, {settings.group_size} per prompt "
                                 f"(--grpo.group-size): use a multiple of {settings.group_size}")


RUN_OBJECTIVES: dict[str, RunObjective] = {entry.name: entry for entry in (
    LMFlags(), MaskedDiffusionFlags(), BlockDiffusionFlags(), DPOFlags(), GRPOFlags())}
"""Each `--objective` by name."""


def run_objective(name: str) -> RunObjective:
    """The entry of `--objective name`, refused unless it is one."""
    if name not in RUN_OBJECTIVES:
        raise ValueError(f"objective is {name!r}; use one of {sorted(RUN_OBJECTIVES)}")
    return RUN_OBJECTIVES[name]
