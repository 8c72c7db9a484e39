"""One process of tests/test_multiprocess.py: train a tiny decoder for a few steps and report.

Run as `python -m tests.multiprocess_worker RESULT_JSON RUN_DIR [RESTORE_FROM]` from the repository
root. With DEW_COORDINATOR / DEW_NUM_PROCESSES / DEW_PROCESS_ID set it is one process of a
multi-process run, which trains on `MESH`; else a single process, which trains on one of its devices.
Either trains with a checkpoint in RUN_DIR, then process 0 writes the run (`tests.mesh_parity.outcome`:
losses, first gradient, parameters, gathered to the host) to RESULT_JSON's .npz sibling, and to RESULT_JSON
what became of a missing attention_mask (`masks`) and the rounding a mesh may add (`ulps`). With
RESTORE_FROM (a run directory another run wrote), it also restores that checkpoint under `RESTORE_MESH`
and writes its parameters to RESULT_JSON's .restored.npz sibling.
"""

from __future__ import annotations

import json
import sys
import time

from dew import sharding

started = time.perf_counter()
joined = sharding.initialize(timeout_s=120)  # before anything starts JAX's backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from dew import models  # noqa: E402
from dew.data.dataset import Dataset  # noqa: E402
from dew.data.inputs import ModelInputs, agree_on_mask  # noqa: E402
from dew.objectives.lm import LMObjective  # noqa: E402
from dew.training import Checkpoints, Trainer, shard_batch  # noqa: E402
from tests import mesh_parity  # noqa: E402

SEQ, VOCAB, BATCH, STEPS, RATE = 16, 64, 8, 3, 0.1
# Rows over data x fsdp, parameters split over fsdp: across two processes the gradient's reduction
# over `data` crosses the process boundary, the parameter gathers over `fsdp` stay inside one.
MESH, LAYOUT = sharding.MeshSpec(data=2, fsdp=2), sharding.Layout(min_shard=0)
RESTORE_MESH = sharding.MeshSpec(data=1, fsdp=4)


def global_rows(step: int) -> np.ndarray:
    """The whole batch of `step`, the same in every process and every run."""
    return np.random.default_rng(step).integers(1, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)


def train(partition):
    share = BATCH // partition.count
    step = 0
    while True:
        yield {"text": global_rows(step)[partition.index * share:(partition.index + 1) * share]}
        step += 1


def to_host(leaf) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))


def masks(mesh) -> dict:
    """What becomes of a missing attention_mask: process 0's 4 rows are padded (a mask), the others' are
    not; each request and batch is reported per process (gathered), the placed masks as global rows."""
    tokens = np.arange(1, 21, dtype=np.int32).reshape(4, 5)
    padding = np.ones((4, 5), bool)
    padding[0, :2] = False
    mine = ModelInputs.of(tokens, attention_mask=padding if jax.process_index() == 0 else None)
    bare = ModelInputs.of(tokens)
    each = lambda flag: multihost_utils.process_allgather(np.asarray([flag])).reshape(-1).tolist()
    agreed, neither = agree_on_mask(mine), agree_on_mask(bare)
    placed = shard_batch(mesh, {"text": mine, "bare": bare})
    return {
        "request": each("attention_mask" in agreed.token_fields),
        "request_all_true": each(bool(np.asarray(agreed.token_fields.get("attention_mask", padding)).all())),
        "request_none": each("attention_mask" in neither.token_fields),
        "batch": multihost_utils.process_allgather(placed["text"].token_fields["attention_mask"], tiled=True).tolist()
        if "attention_mask" in placed["text"].token_fields else None,
        "batch_bare": each("attention_mask" in placed["bare"].token_fields),
    }


def main(result_path: str, run_dir: str, restore_from: str | None = None) -> None:
    assert jax.device_count() == 4, jax.devices()
    model = models.build("causal_transformer", vocab_size=VOCAB, emb_features=32, num_layers=1, num_heads=2,
                         max_seq_len=SEQ)
    objective = LMObjective(model, SEQ, ema_decay=None)
    optimizer = mesh_parity.recording(optax.sgd(RATE))
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), mesh=MESH, layout=LAYOUT)
    if not joined:  # the reference: one device
        trainer.mesh = sharding.MeshSpec().build(jax.devices()[:1])
    data = Dataset(train=train, val=None, records=10**6, batch=BATCH)
    fit_started = time.perf_counter()
    state = trainer.fit(data, steps=STEPS, log_every=1, checkpoint_dir=run_dir, verbose=False)
    fit_seconds = time.perf_counter() - fit_started
    run = mesh_parity.outcome(trainer.history, state, to_host)
    agreement = masks(MESH.build())
    restored = None
    if restore_from is not None:
        other = Trainer(objective, optimizer, key=jax.random.key(1), mesh=RESTORE_MESH, layout=LAYOUT)
        checkpoints = Checkpoints(restore_from)
        state, _ = checkpoints.restore(other.init_state())
        checkpoints.close()
        kernel = state.params["params"]["layers_0"]["mlp"]["up_proj"]["kernel"]
        assert kernel.sharding.mesh.shape["fsdp"] == 4 and kernel.sharding.spec != jax.sharding.PartitionSpec()
        restored = mesh_parity.outcome([], state, to_host)["params"]
    if jax.process_index() == 0:
        mesh_parity.save(result_path.removesuffix(".json") + ".npz", run)
        if restored is not None:
            np.savez(result_path.removesuffix(".json") + ".restored.npz", **restored)
        with open(result_path, "w") as result:
            json.dump({
                "joined": joined, "processes": jax.process_count(), "devices": jax.device_count(),
                "fit_s": fit_seconds, "total_s": time.perf_counter() - started,
                "compile_s": trainer.compile_seconds, "masks": agreement, "rate": RATE,
                "ulps": mesh_parity.step_ulps(model.config, SEQ, BATCH),
            }, result)


if __name__ == "__main__":
    main(*sys.argv[1:])
