"""`LMRunConfig`: a run of the language-model recipe (`recipes/lm/train.py`, `dew train`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import tyro

from dew.data import TokenWindows
from dew.data.chat import MESSAGE_ROLES
from dew.data.chat_data import ChatData
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts
from dew.nn.lora import DEFAULT_TARGETS, LoRA
from dew.objectives.lm.indexer import IndexerTraining
from dew.objectives.lm.run_objectives import (
    DEFAULT_EMA, DEFAULT_SAMPLING, DPOSettings, GRPOSettings, data_name, dpo_flags, grpo_flags, run_objective,
)
from dew.run_config import DataSpec, ModelConfig, OptimConfig, TrainerConfig
from dew.sampling import Sampling

LMDataSpec = (
    DataSpec
    | Annotated[ChatData, tyro.conf.subcommand(
        "chat", description="Chat conversations (JSONL) rendered with the tokenizer's chat template, a role per "
                            "token (ChatData).")]
    | Annotated[PreferencePairs, tyro.conf.subcommand(
        "preference-pairs", description="Preference pairs (JSONL of prompt, chosen, rejected: TRL's DPO format) for "
                                        "--objective dpo (PreferencePairs).")]
    | Annotated[Prompts, tyro.conf.subcommand(
        "prompts", description="Prompts (JSONL of prompt and the fields its rewards read: TRL's GRPO format) for "
                               "--objective grpo (Prompts).")]
)
"""What a language-model run trains on: token files (`DataSpec`), `data:chat` conversations, `data:preference-pairs`
or `data:prompts`."""


def lora_flags(rank: int | None = None, alpha: float = 16.0, targets: tuple[str, ...] = DEFAULT_TARGETS,
               dropout: float = 0.0) -> LoRA | None:
    """`LMRunConfig.lora` from the command line's --lora.* flags: None without --lora.rank (and the
    other flags then refused by name, rather than ignored).

    Args:
        rank: The adapters' rank; unset trains the whole model, without adapters.
        alpha: The adapters' product is scaled by alpha / rank.
        targets: The linears to adapt, each by the end of its path (q_proj, self_attn/o_proj).
        dropout: The rate the adapters' input is dropped at in training.
    """
    if rank is None:
        given = {name: value for name, value, default in (("alpha", alpha, 16.0), ("targets", targets, DEFAULT_TARGETS),
                                                          ("dropout", dropout, 0.0)) if value != default}
        if given:
            flags = ", ".join(f"--lora.{name}" for name in given)
            raise ValueError(f"{flags} shape(s) LoRA adapters, and --lora.rank is unset, so there are none: add "
                             "--lora.rank N (8 or 16 are common), or drop them")
        return None
    return LoRA(rank, alpha, tuple(targets), dropout)


@dataclasses.dataclass(frozen=True)
class LMRunConfig:
    """A run, plus the language model's own knobs.

    Each objective reads some of the knobs (`dew.objectives.lm.run_objectives`); a knob another
    objective reads is refused unless it keeps its default.
    """

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig("causal_transformer"))
    data: LMDataSpec = TokenWindows()
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(learning_rate=0.0006, weight_decay=0.1, clip_grads=1.0))
    trainer: TrainerConfig = TrainerConfig()
    objective: str = "lm"
    """Loss convention: lm (next-token cross entropy over rows of --data.seq-len + 1 ids), or masked_diffusion (MDLM's negative ELBO on a bidirectional decoder, over the same rows whole: --data.seq-len 127 trains on 128 ids; the mask takes the id after the tokenizer's last), or block_diffusion (DiffusionGemma's block loss, fine-tuning --pretrained on rows of --block-prompt-tokens plus whole canvases: --data.seq-len + 1 ids), or dpo (DPO's sigmoid loss on data:preference-pairs against the frozen starting weights; --dpo.*), or grpo (GRPO on the policy's own completions of data:prompts, scored by --grpo.rewards; --grpo.*)."""
    lora: Annotated[LoRA | None, tyro.conf.arg(constructor=lora_flags)] = None
    """LoRA adapters (dew.nn.lora.LoRA) on --pretrained's linears, on with --lora.rank N: only they train, the checkpoint's weights stay frozen. When the run finishes it writes them in PEFT's format to RUN/adapter/ (adapter_config.json, adapter_model.safetensors, for peft.PeftModel.from_pretrained on the checkpoint); dew generate and dew export read the run with them merged into the kernels. Unset trains the whole model."""
    tokenizer: str = "byte"
    """What the ids were written with: 'byte', or an HF tokenizer name."""
    ema_decay: float | None = DEFAULT_EMA
    """None disables EMA; 1.0 retains a frozen copy (dpo and grpo keep their own: their frozen reference, or none)."""
    sample_prompt: str = ""
    """Prompt the validation samples continue; empty continues a newline."""
    sample_tokens: int = 128
    """Tokens generated per validation sample; 0 logs no text."""
    sampling: Annotated[Sampling, tyro.conf.arg(help=(
        "The preview policy, recorded with the run for inference (objectives lm and dpo; grpo draws its "
        "completions with it, stopping at the tokenizer's EOS as well; masked_diffusion unmasks with MDLM's "
        "sampler instead)."))] = dataclasses.field(default_factory=lambda: DEFAULT_SAMPLING)
    pretrained: Annotated[str | None, tyro.conf.arg(help=(
        "Hugging Face decoder to continue training: a hub repo id, repo@revision (a branch, tag or commit), or a "
        "local directory in that layout. A run records a hub repo as repo@commit, the commit it resolved to. The "
        "checkpoint decides the architecture, so --model.config may then carry only max_seq_len, dtype and "
        "attention_impl."))] = None
    balance_rate: float | None = None
    """How far a sparse run moves each router's balancing bias against its load every step (DeepSeek's aux-loss-free balancing): bias += rate * sign(mean load - load), from the window's expert counts, after the update. Needs a mixture with bias=True (--model.config '{"mixture": {"experts": 8, "bias": true}}'); unset leaves the bias where it is."""
    aux_loss_alpha: float | None = None
    """The expert balance loss's weight (LMObjective.aux_loss_alpha); with --no-seq-aux it is the Switch loss over the step's routed positions, lm-engine's router_aux_loss_coef. Unset adds no balance loss."""
    seq_aux: bool = True
    """Form the balance loss within each sequence (DeepSeek V2), averaged over rows, rather than over the whole step."""
    router_z_loss: float = 0.0
    """The routers' z-loss weight (LMObjective.router_z_loss): the mean squared log-sum-exp of the router logits over routed positions, summed over routers; lm-engine uses 0.1 times its aux coefficient. Zero adds nothing."""
    mtp_weight: float | None = None
    """DeepSeek's lambda on the multi-token-prediction term. Needs a model with num_nextn_predict_layers above zero; unset leaves the term out."""
    indexer: IndexerTraining | None = None
    """DeepSeek-V3.2's lightning-indexer phase: indexer:indexer-training --indexer.phase warmup freezes everything but the indexer of a model whose mla mixer names the indexer's heads and no top-k; sparse trains the whole model on its top-k with the KL beside the cross entropy. Unset trains no indexer term."""
    token_accuracy: bool = True
    """Report the argmax accuracy beside the loss; False skips the argmax over every logit it costs."""
    block_prompt_tokens: int = 256
    """Clean prompt prefix in a block-diffusion token row (objective block_diffusion only)."""
    block_canvas_size: int | None = None
    """Training canvas width of block diffusion (objective block_diffusion only)."""
    loss_role: Literal["system", "user", "assistant", "tool"] | None = None
    """Train only on the targets of this role (LMObjective.loss_role): assistant for supervised fine-tuning. Needs data:chat rows, which carry a role per token; unset trains on every target."""
    dpo: Annotated[DPOSettings | None, tyro.conf.arg(constructor=dpo_flags)] = None
    """DPO's knobs (objective dpo only): --dpo.beta (0.1), --dpo.label-smoothing (0). The reference is the run's starting weights (--pretrained's, or the fresh ones), frozen. Unset takes the defaults."""
    grpo: Annotated[GRPOSettings | None, tyro.conf.arg(constructor=grpo_flags)] = None
    """GRPO's knobs (objective grpo only): --grpo.rewards (needed), --grpo.group-size (8), --grpo.max-new-tokens (256), --grpo.clip (0.2), --grpo.kl-weight (0), --grpo.answer-field (answer). Each step draws --grpo.group-size completions of --trainer.batch / group-size prompts and takes one update on them."""

    def __post_init__(self):
        if self.lora is not None and not isinstance(self.lora, LoRA):
            raise TypeError(f"lora is {self.lora!r}; give a dew.nn.lora.LoRA (--lora.rank N on the command line)")
        # Knobs left at their defaults are recorded as None, so a run whose objective does not read them
        # records (and compares on resuming) none of them.
        for name, default in (("dpo", DPOSettings()), ("grpo", GRPOSettings())):
            if getattr(self, name) == default:
                object.__setattr__(self, name, None)
        run_objective(self.objective).check(self)
        if self.lora is not None and self.pretrained is None:
            raise ValueError(f"--lora.rank {self.lora.rank} adapts a published checkpoint's linears and freezes the rest, "
                             "and --pretrained is unset, so the frozen weights would be random ones: add --pretrained "
                             "DIR, or drop the --lora flags to train a model from scratch")
        if not self.seq_aux and self.aux_loss_alpha is None:
            raise ValueError(
                "--no-seq-aux shapes the expert balance loss, and aux_loss_alpha is unset, so there is none: "
                "drop --no-seq-aux"
            )
        if self.ema_decay is not None and not 0.0 <= self.ema_decay <= 1.0:
            raise ValueError(f"ema_decay is {self.ema_decay}; use a value in [0, 1], or None for no EMA")
        if self.sample_tokens < 0:
            raise ValueError(f"sample_tokens is {self.sample_tokens}; use 0 for no previews, or more")
        if self.loss_role is not None and self.loss_role not in MESSAGE_ROLES:
            raise ValueError(f"--loss-role {self.loss_role!r} is not a message role: use one of {MESSAGE_ROLES}")
        if self.loss_role is not None and not isinstance(self.data, ChatData):
            raise ValueError(f"--loss-role {self.loss_role} keeps the targets of one role, and {data_name(self.data)} "
                             "rows carry no roles: train on data:chat conversations, or drop --loss-role")
