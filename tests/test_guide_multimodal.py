"""The guide's examples on the tiny Gemma 3 fixture, as written: text generation through `dew.pipeline`, a
processor call with images, logits, cached generation, one training step on `{"text": inputs}` batches
and a save. They run from a directory whose `tests/fixtures/hf` holds the fixture, as the guide's paths say."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

pytest.importorskip("transformers")


@pytest.fixture
def guide_directory(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(FIXTURES, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_pipeline_example(guide_directory, capsys):
    import dew

    task = dew.pipeline("tests/fixtures/hf/gemma3-native-tiny", dtype="float32")
    print(task("token7 token9", 3, seed=1).text[0])
    assert capsys.readouterr().out.startswith("token7 token9 token")


def test_image_example_then_training(guide_directory, capsys):
    import jax
    import numpy as np
    from dew.interop import load_pretrained
    from dew.sampling import Sampling

    source = "tests/fixtures/hf/gemma3-native-tiny"
    bundle = load_pretrained(source, dtype="float32", max_seq_len=64)
    images = np.load(f"{source}/raw_images.npy")          # uint8 [3, 32, 32, 3]
    inputs = bundle.processor(["token7 <start_of_image> token9",
                               "token5 <start_of_image> token8 <start_of_image> token6"],
                              images=[[images[0]], [images[1], images[2]]])
    logits = bundle.model.apply(bundle.variables, inputs.tokens, **inputs.kwargs())
    task = bundle.text_generation(sampling=Sampling(temperature=0))
    for text in task(inputs, 3, seed=1).text:
        print(text)

    import optax
    from dew.data.dataset import Dataset
    from dew.objectives.lm import LMObjective
    from dew.training import Layout, MeshSpec, Trainer

    objective = LMObjective(bundle.model, inputs.tokens.shape[1] - 1,
                            pretrained=bundle.variables, ema_decay=None, pad_id=0)
    rows = 2 * jax.device_count()
    batch = inputs.take_rows(jax.numpy.arange(rows) % 2)
    data = Dataset(train=lambda partition: iter([{"text": batch}]), val=None, records=rows, batch=rows)
    trainer = Trainer(objective, optax.sgd(1e-4), key=jax.random.key(3),
                      mesh=MeshSpec(), layout=Layout(min_shard=2**30))
    state = trainer.fit(data, steps=1, log_every=1)
    bundle.save("gemma3-tiny-step1", variables=state.params)

    assert logits.shape == (2, inputs.tokens.shape[1], 256)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("token7 <start_of_image>") and printed[1].startswith("token5 <start_of_image>")
    saved = load_pretrained("gemma3-tiny-step1", dtype="float32", max_seq_len=64)
    assert type(saved.model).__name__ == "MultimodalTransformer"
    assert (guide_directory / "gemma3-tiny-step1" / "processor_config.json").is_file()
