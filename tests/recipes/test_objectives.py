"""The recipe objectives registry: one entry per --objective on both floors, each flag refused by every
objective that does not read it, and the command line's help naming them."""

from __future__ import annotations

import dataclasses

import pytest

from dew.data import PackedTokens, TokenWindows
from dew.data.chat_data import ChatData
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts
from dew.objectives.lm import LMRunConfig
from dew.objectives.lm.run_objectives import KNOBS, RUN_OBJECTIVES, DPOSettings, GRPOSettings
from dew.recipes.lm import main
from dew.recipes.objectives import OBJECTIVES
from dew.sampling import Sampling


def test_every_objective_has_one_entry_on_each_floor():
    assert sorted(OBJECTIVES) == sorted(RUN_OBJECTIVES) == ["block_diffusion", "dpo", "grpo", "lm", "masked_diffusion"]
    for name, entry in OBJECTIVES.items():
        assert isinstance(entry, type(RUN_OBJECTIVES[name])) and entry.name == name
        assert entry.knobs <= set(KNOBS)


# A value other than the neutral one for each knob, and a config of each objective that is otherwise valid.
_GIVEN = {"balance_rate": 0.001, "aux_loss_alpha": 0.01, "seq_aux": False, "router_z_loss": 0.1, "mtp_weight": 0.3,
          "loss_role": "assistant", "sampling": Sampling(temperature=0.8, top_k=5),
          "token_accuracy": False, "block_prompt_tokens": 8, "block_canvas_size": 4, "dpo": DPOSettings(beta=0.3),
          "grpo": GRPOSettings(rewards=("finished",)), "ema_decay": 0.9}
_VALID = {"lm": {}, "masked_diffusion": {}, "block_diffusion": {"pretrained": "unused", "sample_tokens": 0},
          "dpo": {"data": PreferencePairs()}, "grpo": {"data": Prompts(), "grpo": GRPOSettings(rewards=("finished",)),
                                                       "trainer": dataclasses.replace(LMRunConfig().trainer, batch=8)}}


@pytest.mark.parametrize("name", sorted(RUN_OBJECTIVES))
def test_each_objective_refuses_the_knobs_it_does_not_read(name):
    LMRunConfig(objective=name, **_VALID[name])  # valid as it stands
    entry = RUN_OBJECTIVES[name]
    for knob, value in _GIVEN.items():
        settings = {**_VALID[name], knob: value}
        if knob == "aux_loss_alpha" or knob == "seq_aux":
            settings.update(aux_loss_alpha=0.01)  # --no-seq-aux needs a balance loss to shape
        if knob == "loss_role" and name == "lm":
            settings.update(data=ChatData())
        if knob in entry.knobs:
            if knob != "grpo":
                LMRunConfig(objective=name, **settings)
            continue
        with pytest.raises(ValueError, match=f"--objective {name}|objective is {name}"):
            LMRunConfig(objective=name, **settings)


@pytest.mark.parametrize("name, reads", [
    ("lm", (TokenWindows, PackedTokens, ChatData)), ("masked_diffusion", (TokenWindows, PackedTokens)),
    ("block_diffusion", (TokenWindows,)), ("dpo", (PreferencePairs,)), ("grpo", (Prompts,))])
def test_each_objective_reads_its_data_and_refuses_the_rest(name, reads):
    settings = {key: value for key, value in _VALID[name].items() if key != "data"}
    for kind in (TokenWindows, PackedTokens, ChatData, PreferencePairs, Prompts):
        if kind in reads:
            LMRunConfig(objective=name, data=kind(), **settings)
        else:
            with pytest.raises(ValueError, match=f"--objective {name}"):
                LMRunConfig(objective=name, data=kind(), **settings)


def test_knobs_at_their_defaults_are_recorded_as_unset():
    assert LMRunConfig(dpo=DPOSettings()).dpo is None and LMRunConfig(grpo=GRPOSettings()).grpo is None


def test_help_lists_the_objectives_their_data_and_flags(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    for flag in ("data:preference-pairs", "data:prompts", "--dpo.beta", "--dpo.label-smoothing", "--grpo.rewards",
                 "--grpo.group-size", "--grpo.kl-weight", "dpo (DPO's sigmoid loss", "grpo (GRPO on"):
        assert flag in text, flag
