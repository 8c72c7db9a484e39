"""`LMRunConfig`: a run of the language-model recipe (`recipes/lm/train.py`, `dew train`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import tyro

from dew.data import PackedTokens, TokenWindows
from dew.data.chat import MESSAGE_ROLES
from dew.data.chat_data import ChatData
from dew.nn.lora import DEFAULT_TARGETS, LoRA
from dew.objectives.lm.indexer import IndexerTraining
from dew.run_config import DataSpec, ModelConfig, OptimConfig, TrainerConfig
from dew.sampling import Sampling

LMDataSpec = DataSpec | Annotated[ChatData, tyro.conf.subcommand(
    "chat", description="Chat conversations (JSONL) rendered with the tokenizer's chat template, a role per token "
                        "(ChatData).")]
"""What a language-model run trains on: token files (`DataSpec`), or `data:chat` conversations."""

# Each objective, and None where it is built or what is not built yet.
_OBJECTIVES = {"lm": None, "masked_diffusion": None, "block_diffusion": None}
_DEFAULT_SAMPLING = Sampling(temperature=0.8, top_k=40)
# Knobs of the autoregressive loss alone, with the value that asks for nothing.
_LM_ONLY = {"balance_rate": None, "aux_loss_alpha": None, "seq_aux": True, "router_z_loss": 0.0, "mtp_weight": None,
            "indexer": None, "loss_role": None}


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
    """A run, plus the language model's own knobs."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig("causal_transformer"))
    data: LMDataSpec = TokenWindows()
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(learning_rate=0.0006, weight_decay=0.1, clip_grads=1.0))
    trainer: TrainerConfig = TrainerConfig()
    objective: str = "lm"
    """Loss convention: lm (next-token cross entropy over rows of --data.seq-len + 1 ids), or masked_diffusion (MDLM's negative ELBO on a bidirectional decoder, over the same rows whole: --data.seq-len 127 trains on 128 ids; the mask takes the id after the tokenizer's last), or block_diffusion (DiffusionGemma's block loss, fine-tuning --pretrained on rows of --block-prompt-tokens plus whole canvases: --data.seq-len + 1 ids)."""
    lora: Annotated[LoRA | None, tyro.conf.arg(constructor=lora_flags)] = None
    """LoRA adapters (dew.nn.lora.LoRA) on --pretrained's linears, on with --lora.rank N: only they train, the checkpoint's weights stay frozen. When the run finishes it writes them in PEFT's format to RUN/adapter/ (adapter_config.json, adapter_model.safetensors, for peft.PeftModel.from_pretrained on the checkpoint); dew generate and dew export read the run with them merged into the kernels. Unset trains the whole model."""
    tokenizer: str = "byte"
    """What the ids were written with: 'byte', or an HF tokenizer name."""
    ema_decay: float | None = 0.999
    """None disables EMA; 1.0 retains a frozen copy."""
    sample_prompt: str = ""
    """Prompt the validation samples continue; empty continues a newline."""
    sample_tokens: int = 128
    """Tokens generated per validation sample; 0 logs no text."""
    sampling: Annotated[Sampling, tyro.conf.arg(help=(
        "The preview policy, recorded with the run for inference (objective lm; masked_diffusion unmasks with "
        "MDLM's sampler instead)."))] = dataclasses.field(default_factory=lambda: _DEFAULT_SAMPLING)
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

    def __post_init__(self):
        if self.objective not in _OBJECTIVES:
            raise ValueError(f"objective is {self.objective!r}; use one of {sorted(_OBJECTIVES)}")
        if _OBJECTIVES[self.objective] is not None:
            raise NotImplementedError(
                f"--objective {self.objective}: {_OBJECTIVES[self.objective]} is not built in Dew yet; "
                "leave --objective at lm"
            )
        if self.objective in ("masked_diffusion", "block_diffusion"):
            self._check_diffusion()
        if self.objective == "block_diffusion":
            self._check_block_diffusion()
        if self.lora is not None:
            self._check_lora()
        block = {"block_prompt_tokens": (self.block_prompt_tokens, 256),
                 "block_canvas_size": (self.block_canvas_size, None)}
        for name, (value, default) in block.items():
            if value != default and self.objective != "block_diffusion":
                raise ValueError(
                    f"{name} is {value}, but it shapes only --objective block_diffusion rows and this run's "
                    f"objective is {self.objective}: leave {name} unset"
                )
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
            raise ValueError(f"--loss-role {self.loss_role} keeps the targets of one role, and {_data_name(self.data)} "
                             "rows carry no roles: train on data:chat conversations, or drop --loss-role")

    def _check_lora(self):
        if not isinstance(self.lora, LoRA):
            raise TypeError(f"lora is {self.lora!r}; give a dew.nn.lora.LoRA (--lora.rank N on the command line)")
        if self.pretrained is None:
            raise ValueError(f"--lora.rank {self.lora.rank} adapts a published checkpoint's linears and freezes the rest, "
                             "and --pretrained is unset, so the frozen weights would be random ones: add --pretrained "
                             "DIR, or drop the --lora flags to train a model from scratch")
        if self.objective != "lm":
            raise NotImplementedError(f"--lora.rank {self.lora.rank} with --objective {self.objective}: LoRA runs of "
                                      "the recipe are built for --objective lm only; drop the --lora flags")

    def _check_diffusion(self):
        """Refuse settings a diffusion objective has no use for, rather than ignore them."""
        if isinstance(self.data, ChatData):
            rows = ("data:token-windows or data:packed-tokens" if self.objective == "masked_diffusion"
                    else "data:token-windows")
            raise ValueError(f"--objective {self.objective} reads token rows whole, without their roles or "
                             f"conversation boundaries: train it on {rows}")
        for name, neutral in _LM_ONLY.items():
            if getattr(self, name) != neutral:
                flag = "--no-seq-aux" if name == "seq_aux" else f"--{name.replace('_', '-')} {getattr(self, name)}"
                raise ValueError(f"{flag} shapes the autoregressive objective, and --objective {self.objective} does "
                                 f"not read it: drop {flag.split()[0]}")
        if self.sampling != _DEFAULT_SAMPLING:
            how = ("previews and generates by unmasking with MDLM's sampler" if self.objective == "masked_diffusion"
                   else "generates canvas by canvas with the checkpoint's BlockProcess")
            raise ValueError(f"--sampling sets an autoregressive policy ({self.sampling}), and --objective "
                             f"{self.objective} {how}: drop the --sampling flags")

    def _check_block_diffusion(self):
        """Block diffusion fine-tunes a DiffusionGemma checkpoint on unpacked rows, without previews."""
        if self.pretrained is None:
            raise ValueError("--objective block_diffusion fine-tunes a DiffusionGemma checkpoint: pass --pretrained "
                             "(and --tokenizer, the checkpoint's)")
        if isinstance(self.data, PackedTokens):
            raise ValueError("--objective block_diffusion reads each row as one prompt and its response canvases, and "
                             "packed documents' context boundaries differ: use data:token-windows")
        if self.sample_tokens:
            raise ValueError(f"--sample-tokens {self.sample_tokens}: --objective block_diffusion has no "
                             "autoregressive preview; pass --sample-tokens 0 and generate through load_pretrained of "
                             "the exported checkpoint")
        if self.block_prompt_tokens < 1:
            raise ValueError(f"--block-prompt-tokens is {self.block_prompt_tokens}; a row needs a clean prompt of at "
                             "least 1 token")
        if self.block_canvas_size is not None and self.block_canvas_size < 1:
            raise ValueError(f"--block-canvas-size is {self.block_canvas_size}; a canvas holds at least 1 token")


def _data_name(data) -> str:
    """The subcommand that reads `data`, as the command line spells it."""
    return {"TokenWindows": "data:token-windows", "PackedTokens": "data:packed-tokens"}.get(type(data).__name__,
                                                                                          type(data).__name__)
