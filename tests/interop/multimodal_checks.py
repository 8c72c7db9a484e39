"""What the multimodal families' tests against transformers share: transformers' processor built without its
video processor, the targets `LMObjective` scores, the cached greedy continuation against transformers' `generate`,
logits after one SGD step, and save -> reload."""

from __future__ import annotations

import numpy as np

from dew.interop import load_pretrained
from dew.sampling import Sampling
from tests.tolerances import assert_within


def without_videos(processor_class, **parts):
    """transformers' `processor_class` over `parts` (its image processor, tokenizer, ...) and no video processor,
    which needs torchvision (its PyPI wheels are CUDA builds that do not load beside a CPU torch): the check of that
    one argument's class is lifted while it is made."""
    from unittest import mock

    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lifted(self, name, argument):
        return None if name == "video_processor" and argument is None else check(self, name, argument)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lifted):
        return processor_class(**parts, video_processor=None)


def targets(inputs):
    """(token ids, the rows' target weights `[B, S - 1]` as LMObjective counts them: real, not padding id 0,
    not a soft token)."""
    tokens = np.asarray(inputs.tokens)
    valid = np.asarray(inputs.token_fields["attention_mask"])
    soft = np.asarray(inputs.token_fields["image_indices"]) >= 0
    return tokens, valid[:, :-1] & valid[:, 1:] & ~soft[:, 1:] & (tokens[:, 1:] != 0)


def check_greedy_matches_generate(bundle, inputs, reference, their_rows, new_tokens: int = 6,
                                  continuations=None) -> None:
    """Dew's cached greedy continuation of each row of `inputs` (`continuations`, where the caller drew them
    already) equals transformers' `generate` from that row's own processor outputs (`their_rows`, unpadded),
    neither stopping at an EOS."""
    import torch

    if continuations is None:
        continuations = bundle.text_generation(sampling=Sampling(temperature=0))(inputs, new_tokens,
                                                                                  seed=1).continuations()
    for row, theirs in enumerate(their_rows):
        with torch.no_grad():
            generated = reference.generate(**theirs, do_sample=False, max_new_tokens=new_tokens,
                                           min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        assert continuations[row] == generated[0, theirs["input_ids"].shape[1]:].tolist()


def check_stepped_logits(stepped, ours, before, inputs, their_rows, bound, gradient_rounding: float = 0.0) -> None:
    """After one SGD step of rate 1e-2 on transformers' model `stepped` (its gradients in place), its logits on
    each row's own outputs (`their_rows`) equal Dew's stepped logits `ours` on that row's real slots, within
    `bound(magnitude, seq_len)` plus `gradient_rounding` times the most the step moved a logit: to first order, a
    step whose gradients differ by a fraction r of themselves moves the logits by r times the step's own move."""
    import torch

    with torch.no_grad():
        for parameter in stepped.parameters():
            if parameter.grad is not None:
                parameter -= 1e-2 * parameter.grad
    mask = np.asarray(inputs.token_fields["attention_mask"])
    for row, theirs_row in enumerate(their_rows):
        with torch.no_grad():
            theirs = stepped(**theirs_row).logits[0].numpy()
        move = np.abs(ours[row][mask[row]] - before[row][mask[row]]).max()
        assert move > 1e-3  # the step moved the logits
        limit = bound(np.abs(theirs).max(), inputs.shape[1]) + gradient_rounding * move
        assert_within(ours[row][mask[row]], theirs, limit, f"row {row}")


def check_save_reloads(bundle, model_class, reference, their_row, fixture, directory) -> None:
    """A save of `bundle` reloads in transformers' `model_class` with the logits of `reference` bit for bit, and
    in Dew as the model `fixture` holds."""
    import torch

    from tests.interop.conftest import in_torch_memory

    saved = bundle.save(directory)
    again = in_torch_memory(model_class.from_pretrained(saved, dtype=torch.float32, attn_implementation="eager"))
    in_torch_memory(reference)
    with torch.no_grad():
        np.testing.assert_array_equal(again(**their_row).logits.numpy(), reference(**their_row).logits.numpy())
    assert load_pretrained(saved).model.config == load_pretrained(fixture).model.config


def check_row_logits(ours, inputs, reference, their_rows, bound, floor: float) -> None:
    """Dew's logits `ours` `[B, S, V]` on each row's real slots equal transformers' `reference` on that row's own
    outputs (`their_rows`) within `bound(magnitude, seq_len)`; transformers' logits exceed `floor` somewhere."""
    import torch

    mask = inputs.token_fields.get("attention_mask", np.ones(inputs.shape, bool))
    for row, theirs_row in enumerate(their_rows):
        with torch.no_grad():
            theirs = reference(**theirs_row).logits[0].numpy()
        assert np.abs(theirs).max() > floor
        assert_within(ours[row][mask[row]], theirs, bound(np.abs(theirs).max(), inputs.shape[1]), f"row {row}")
