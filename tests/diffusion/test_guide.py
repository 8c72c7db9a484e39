"""The guide's masked-diffusion example ("Diffusion language models") as written, at test sizes.

It continues the quick start's set-up: the shipped corpus stands in for TinyStories and a BPE trained
on it for GPT-2's; the calls, their arguments and their order are the guide's, with smaller numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_guide import prepared  # noqa: F401  (the fixture: the quick start's token files and BPE)


@pytest.mark.slow
def test_the_masked_example_runs_as_written(prepared, capsys):  # noqa: F811
    tokenizer_path, data_path = str(prepared / "bpe"), str(prepared / "kjv")

    import jax
    import jax.numpy as jnp
    import optax

    from dew import Trainer, metrics, models
    from dew.data import HFTokenizer, Loading, TokenWindows

    tokenizer = HFTokenizer(tokenizer_path)

    from dew.diffusion.discrete import MDLM
    from dew.objectives.diffusion import MaskedDiffusionObjective

    masked_data = TokenWindows(path=data_path, seq_len=31,
                               loading=Loading(workers=0)).load(batch=8)
    mask_id = tokenizer.vocab_size
    process = MDLM(mask_id=mask_id)()
    masked_model = models.build(
        "causal_transformer",
        vocab_size=mask_id + 1,
        emb_features=32,
        num_layers=2,
        num_heads=4,
        max_seq_len=32,
        causal=False,
        dtype=jnp.bfloat16,
    )
    masked_objective = MaskedDiffusionObjective(masked_model, process, seq_len=32)
    trainer = Trainer(
        masked_objective,
        optax.adamw(1e-3),
        key=jax.random.key(4),
    )
    masked_state = trainer.fit(masked_data, steps=60, log_every=20, eval_every=30,
                               metrics=(metrics.perplexity(),))
    drawn = process.generate(masked_model, masked_state.averaged,
                             [tokenizer.encode("And God said")], 12, key=jax.random.key(5))
    print(tokenizer.decode(drawn.tokens[0]))

    printed = capsys.readouterr().out
    decoded = tokenizer.decode(drawn.tokens[0])  # a drawn newline may split the printed text over lines
    assert decoded.startswith("And God said") and printed.endswith(decoded + "\n")
    assert drawn.tokens.shape == (1, len(tokenizer.encode("And God said")) + 12)
    assert not (np.asarray(drawn.tokens) == mask_id).any() and list(drawn.refinements) == [64]
    train = [row["train/loss"] for row in trainer.history if "train/loss" in row]
    assert len(train) == 3 and train[-1] < train[0]
    # Validation estimates the ELBO with one draw of times and masks a pass, so two passes of a model this
    # young differ by the draw more than by the 30 steps between them: what holds is the bound's form.
    evaluations = [row for row in trainer.history if "val/perplexity" in row]
    assert len(evaluations) == 2 and all(0.3 < row["val/masked_fraction"] < 0.7 for row in evaluations)
    np.testing.assert_allclose([row["val/perplexity"] for row in evaluations],
                               [np.exp(row["val/loss"]) for row in evaluations], rtol=1e-12)
    assert int(masked_state.step) == 60
