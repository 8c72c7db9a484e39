"""The kernel policy (dew.kernels.policy): choices read from the shipped table, never timed while tracing; the
same kernels and the same bits in two fresh processes; plain XLA products under `xla` and off the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer, kernels, models
from dew.kernels import matmul, policy
from dew.kernels.policy import MIN_FLOPS, choose_onednn, parse_key, product_key
from dew.objectives.lm import LMObjective
from dew.training.mesh import place_batch
from dew.training.state import Step
from tests.compile_flags import devices_environment

ROOT = Path(__file__).resolve().parents[2]
F32 = jnp.float32
# A measured class of two products, one won by each side.
STEP = Step(jnp.zeros((), jnp.int32), jax.random.key(0))
MEASURED = {
    "1x1024x128x512/float32/NN/float32": {"xla_s": 1e-3, "onednn_s": 5e-4, "onednn": True},
    "1x1024x512x128/float32/NT/float32": {"xla_s": 1e-3, "onednn_s": 2e-3, "onednn": False},
}


def test_auto_takes_the_nearest_measured_product_within_reach():
    choose = lambda *shape, ops=(False, False), dtype=F32: choose_onednn(  # noqa: E731
        *shape, dtype, *ops, F32, "auto", measured=MEASURED)
    assert choose(1, 1024, 128, 512) and choose(1, 1500, 100, 600)  # within a factor 2 of the winner
    assert not choose(1, 1024, 512, 128, ops=(False, True))  # the measured loser
    assert not choose(1, 8192, 128, 512)  # 8x the rows: no measured product near it, XLA's
    assert not choose(1, 1024, 128, 512, ops=(True, False))  # other transposes: not measured
    assert not choose(1, 1024, 128, 512, dtype=jnp.bfloat16)  # another dtype: not measured
    assert 2 * 32 * 32 * 32 < MIN_FLOPS and not choose_onednn(1, 32, 32, 32, F32, False, False, F32, "auto",
                                                               measured={"1x32x32x32/float32/NN/float32": {"onednn": True}})
    assert choose_onednn(1, 4, 4, 4, F32, False, False, F32, "native", measured={})  # native: every product


def test_a_class_the_table_does_not_name_keeps_xla():
    assert not choose_onednn(1, 1024, 128, 512, F32, False, False, F32, "auto", cpu="NoVendor/baseline")


def test_the_shipped_table_says_where_each_choice_came_from():
    """Every measured class names its CPU, date, command and library versions, and every choice follows
    from its two timings and the margin (so a re-measurement is the only way a choice changes)."""
    table = json.loads(policy.TABLE.read_text())
    assert table["format"] == 1
    for cpu, entry in table["classes"].items():
        measured = entry["measured"]
        assert {"cpu", "cores", "date", "command", "jax", "onednn", "margin", "rounds"} <= set(measured), cpu
        assert measured["command"].startswith("python -m benchmarks.kernel_table")
        for key, product in entry["products"].items():
            shape, kind = parse_key(key)
            assert len(shape) == 4 and kind.count("/") == 2, key
            assert product["onednn"] == (product["onednn_s"] <= measured["margin"] * product["xla_s"]), key


def _plain(text: str) -> bool:
    return "custom_call" not in text and "optimization_barrier" not in text


def _lowered_step(model) -> str:
    tokens = jnp.zeros((2, 129), jnp.int32)
    objective = LMObjective(model, seq_len=128, ema_decay=None)
    params = objective.init(jax.random.key(0))
    step = lambda p: jax.grad(lambda p: objective.reduce_loss(objective.loss(p, {"text": tokens}, STEP)[0])[0])(p)  # noqa: E731
    return jax.jit(step).lower(params).as_text()


def _model(policy_name: str):
    return models.build("causal_transformer", vocab_size=512, emb_features=128, num_layers=1, num_heads=2,
                        mlp_features=512, max_seq_len=128, kernels=policy_name)


def test_a_step_under_xla_lowers_to_plain_products(monkeypatch):
    """Under `xla` (the model's field) a whole train step holds no foreign call and no barrier; the same
    under `auto` when the backend is not the CPU."""
    monkeypatch.delenv("DEW_KERNELS", raising=False)
    assert _plain(_lowered_step(_model("xla")))
    if matmul.status(policy="native")[0]:
        assert not _plain(_lowered_step(_model("native")))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert policy.in_force("auto") == "xla" and policy.in_force("native") == "xla"
    assert _plain(_lowered_step(_model("auto")))


def test_the_environment_overrides_the_models_policy(monkeypatch):
    monkeypatch.setenv("DEW_KERNELS", "xla")
    assert policy.in_force("native") == "xla"
    assert _plain(_lowered_step(_model("native")))
    monkeypatch.setenv("DEW_KERNELS", "fastest")
    with pytest.raises(ValueError, match=r"DEW_KERNELS='fastest' is not a kernel policy: use one of auto, native, xla"):
        policy.in_force()
    monkeypatch.delenv("DEW_KERNELS")
    monkeypatch.setenv("DEW_FAST_MATMUL", "off")
    with pytest.raises(ValueError, match="DEW_FAST_MATMUL is no longer read: set DEW_KERNELS"):
        policy.in_force()
    monkeypatch.delenv("DEW_FAST_MATMUL")
    with pytest.raises(ValueError, match=r"kernels is 'fast'; it must be one of \['auto', 'native', 'xla', 'exact'\]"):
        _model("fast")


def test_the_trainer_records_the_kernels_its_step_took(monkeypatch):
    monkeypatch.delenv("DEW_KERNELS", raising=False)
    model = _model("auto")
    trainer = Trainer(LMObjective(model, seq_len=128, ema_decay=None), optax.sgd(0.1), key=jax.random.key(0))
    state = trainer.init_state()
    trainer.compile_step(state, place_batch(trainer.mesh, {"text": np.zeros((8, 129), np.int32)}))
    choices = trainer.kernel_choices
    products = {key: choice for key, choice in choices.items() if key[0].isdigit()}
    assert products and set(products.values()) <= {"onednn", "xla"}
    library = matmul.status(policy="auto")[0]
    for key, choice in products.items():
        (batch, m, k, n), kind = parse_key(key)
        dtype, ops, out = kind.split("/")
        wanted = library and choose_onednn(batch, m, k, n, dtype, ops[0] == "T", ops[1] == "T", out, "auto")
        assert choice == ("onednn" if wanted else "xla"), key
    assert kernels.summary(choices).startswith(f"kernels: {list(products.values()).count('onednn')} of "
                                                f"{len(products)} products in oneDNN")
    assert product_key(1, 1024, 128, 512, F32, False, False, F32) in MEASURED


FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from dew import Trainer, models
    from dew.objectives.lm import LMObjective
    from dew.training.mesh import place_batch

    model = models.build("causal_transformer", vocab_size=512, emb_features=128, num_layers=2, num_heads=2,
                         mlp_features=512, max_seq_len=128)
    trainer = Trainer(LMObjective(model, seq_len=128, ema_decay=None), optax.adamw(1e-3), key=jax.random.key(0))
    state = trainer.init_state()
    rows = np.random.default_rng(0).integers(0, 512, (8, 129)).astype(np.int32)
    batch = place_batch(trainer.mesh, {"text": rows})
    step = trainer.compile_step(state, batch)
    state, out = step(state, batch)
    leaves = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    print(json.dumps({"choices": trainer.kernel_choices, "loss": float(out["loss"]).hex(),
                      "params": [float(np.sum(x.astype(np.float64))).hex() for x in leaves]}))
""")


def test_two_fresh_processes_with_empty_caches_run_the_same_kernels_to_the_same_bits(tmp_path):
    """Nothing is measured while tracing: two processes with different, empty homes and caches choose the
    same kernels for the same step and end it with bit-identical losses and parameters."""
    results = []
    for name in ("first", "second"):
        home = tmp_path / name
        home.mkdir()
        environment = devices_environment(1, HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), PYTHONPATH=str(ROOT))
        environment.pop("DEW_KERNELS", None)
        environment.pop("JAX_COMPILATION_CACHE_DIR", None)  # nor the suite's compilation cache
        done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], env=environment, capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        assert not (home / "cache" / "dew" / "matmul").exists()
    first, second = results
    assert first["choices"] == second["choices"] and first["choices"]
    assert first["loss"] == second["loss"] and first["params"] == second["params"]
