"""The guide's quick start ("Train a decoder on TinyStories") as written, at test sizes.

The shipped corpus stands in for TinyStories and a BPE trained here on it for the hub's GPT-2; the
calls, their arguments and their order are the guide's, with smaller numbers.
"""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models as bpe_models, pre_tokenizers, trainers

CORPUS = Path(__file__).resolve().parents[1] / "data" / "kjv.txt.xz"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("guide")
    with lzma.open(CORPUS, "rt") as stream:
        text = stream.read(120_000)
    text = text[: text.rindex("\n") + 1]
    (root / "kjv.txt").write_text(text)
    tokenizer = tokenizers.Tokenizer(bpe_models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, show_progress=False, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    (root / "bpe").mkdir()
    tokenizer.save(str(root / "bpe" / "tokenizer.json"))

    from dew.data.tokenize import tokenize_text

    tokenize_text(str(root / "kjv.txt"), str(root / "kjv"), str(root / "bpe"), val_fraction=0.05, workers=1)
    return root


def test_quick_start_runs_as_written(prepared, capsys):
    tokenizer_path, data_path = str(prepared / "bpe"), str(prepared / "kjv")

    import jax
    import jax.numpy as jnp
    import optax

    from dew import Trainer, metrics, models
    from dew.data import HFTokenizer, Loading, TokenWindows
    from dew.objectives.lm import LMObjective
    from dew.sampling import Sampling, generate

    tokenizer = HFTokenizer(tokenizer_path)
    data = TokenWindows(path=data_path, seq_len=32,
                        loading=Loading(workers=0)).load(batch=8)
    model = models.build("causal_transformer", vocab_size=tokenizer.vocab_size,
                         emb_features=32, num_layers=2, num_heads=4, max_seq_len=32,
                         dtype=jnp.bfloat16)
    objective = LMObjective(model, seq_len=32)
    trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0))
    lm_state = trainer.fit(data, steps=60, log_every=20, eval_every=30, metrics=(metrics.perplexity(),))
    continuation = generate(model, lm_state.params, [tokenizer.encode("And God said")],
                            max_new_tokens=10, key=jax.random.key(1),
                            sampling=Sampling(temperature=0.0))
    print(tokenizer.decode(continuation.tokens[0]))

    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].startswith("And God said")
    train = [row["train/loss"] for row in trainer.history if "train/loss" in row]
    assert len(train) == 3 and train[-1] < train[0]
    evaluations = [row["val/perplexity"] for row in trainer.history if "val/perplexity" in row]
    assert len(evaluations) == 2 and evaluations[-1] < evaluations[0]
    assert int(lm_state.step) == 60 and lm_state.averaged is lm_state.ema
