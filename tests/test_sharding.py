"""dew.sharding: mesh sizes, logical axis rules, the size fallback, batches, start-up, and checkpoints across meshes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from dew import sharding
from dew.sharding import MESH_AXES, Layout, MeshSpec, Rules
from tests.compile_flags import devices_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh(data=1, fsdp=1, expert=1, tensor=1) -> AbstractMesh:
    """A mesh of the given sizes without devices: shardings are computed, nothing is placed."""
    return AbstractMesh((data, fsdp, expert, tensor), MESH_AXES)


# -- MeshSpec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, sizes", [
    (MeshSpec(), dict(data=8, fsdp=1, expert=1, tensor=1)),
    (MeshSpec(data=2, fsdp=4), dict(data=2, fsdp=4, expert=1, tensor=1)),
    (MeshSpec(data=1, fsdp=-1), dict(data=1, fsdp=8, expert=1, tensor=1)),
    (MeshSpec(data=-1, fsdp=2, tensor=2), dict(data=2, fsdp=2, expert=1, tensor=2)),
    (MeshSpec(data=1, expert=-1, tensor=2), dict(data=1, fsdp=1, expert=4, tensor=2)),
])
def test_mesh_sizes_fill_the_free_axis(spec, sizes):
    assert spec.sizes(8) == sizes


@pytest.mark.parametrize("spec, message", [
    (MeshSpec(data=-1, fsdp=-1), r"only one axis may be -1, here \['data', 'fsdp'\]"),
    (MeshSpec(data=3), "does not tile the 8 available devices: data \\* fsdp \\* expert \\* tensor must equal 8"),
    (MeshSpec(data=-1, fsdp=3), "does not tile the 8 available devices"),
    (MeshSpec(data=0), r"axis sizes \{'data': 0\} must be at least 1"),
])
def test_mesh_that_does_not_tile_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        spec.sizes(8)


def test_one_device_mesh_has_the_four_axes():
    mesh = MeshSpec().build(jax.devices()[:1])
    assert mesh.axis_names == MESH_AXES and mesh.devices.size == 1


def test_training_mesh_module_re_exports_the_same_objects():
    from dew.training import mesh

    for name in ("MeshSpec", "Layout", "Rules", "place_batch", "replicated", "batch_sharding", "BATCH_AXES"):
        assert getattr(mesh, name) is getattr(sharding, name)


# -- the fallback: today's largest-divisible-axis heuristic, unchanged --------------------------------
@pytest.mark.parametrize("shape, itemsize, fsdp, min_shard, expected", [
    ((64, 256), 4, 4, 0, P(None, "fsdp")),     # the largest axis
    ((256, 64), 4, 4, 0, P("fsdp", None)),
    ((64, 64), 4, 4, 0, P("fsdp", None)),      # a tie: the first of the largest
    ((6, 10), 4, 4, 0, P()),                   # no axis divisible
    ((10, 8), 4, 4, 0, P(None, "fsdp")),       # the largest divisible, not the largest
    ((64, 256), 4, 1, 0, P()),                 # fsdp 1: whole
    ((64, 256), 4, 4, 64 * 256 * 4 + 1, P()),  # under min_shard: whole
    ((64, 256), 4, 4, 64 * 256 * 4, P(None, "fsdp")),
    ((), 4, 4, 0, P()),
])
def test_fallback_splits_the_largest_divisible_axis_over_fsdp(shape, itemsize, fsdp, min_shard, expected):
    assert Layout(min_shard=min_shard).spec(shape, itemsize, fsdp) == expected


# -- logical names -----------------------------------------------------------------------------------
SIZES = dict(data=2, fsdp=2, expert=1, tensor=2)


@pytest.mark.parametrize("names, shape, expected", [
    (("embed", "mlp"), (32, 64), P("fsdp", "tensor")),
    (("mlp", "embed"), (64, 32), P("tensor", "fsdp")),
    (("vocab", "embed"), (64, 32), P("tensor", "fsdp")),
    (("embed", "heads", "head_dim"), (32, 4, 8), P("fsdp", "tensor", None)),
    (("embed", "kv", "head_dim"), (32, 1, 8), P("fsdp", None, None)),     # 2 does not divide one kv head
    (("layers", "embed", "mlp"), (3, 32, 64), P(None, "fsdp", "tensor")),
    (("expert", "embed", "mlp"), (4, 32, 64), P(None, "fsdp", "tensor")),  # expert axis of size 1: dropped
    (("heads", "mlp"), (4, 64), P("tensor", None)),                        # one mesh axis once per array
    (("norm",), (32,), P()),
    ((None, "embed"), (5, 32), P(None, "fsdp")),
    ((("embed", "mlp"), None), (32, 5), P(("fsdp", "tensor"), None)),      # an axis with two logical names
])
def test_logical_names_map_through_the_rules(names, shape, expected):
    assert Layout(min_shard=0).logical_spec(P(*names), shape, 4, SIZES) == expected


def test_a_rule_takes_its_mesh_axes_in_order_while_they_divide():
    layout = Layout(min_shard=0, rules=Rules(embed=("fsdp", "data")))
    assert layout.logical_spec(P("embed", "mlp"), (32, 64), 4, SIZES) == P(("fsdp", "data"), "tensor")
    assert layout.logical_spec(P("embed", "mlp"), (6, 64), 4, SIZES) == P("fsdp", "tensor")  # 4 does not divide 6
    assert layout.logical_spec(P("embed", "mlp"), (3, 64), 4, SIZES) == P(None, "tensor")


def test_small_named_arrays_stay_whole():
    assert Layout(min_shard=32 * 64 * 4 + 1).logical_spec(P("embed", "mlp"), (32, 64), 4, SIZES) == P()


def test_rules_are_checked_and_normalised():
    assert Rules(embed="fsdp", layers=None).embed == ("fsdp",)
    assert Rules(layers=None).layers == ()
    with pytest.raises(ValueError, match=r"Rules.mlp is \('model',\): name each of the mesh axes"):
        Rules(mlp=("model",))
    with pytest.raises(ValueError, match=r"Rules.embed is \('fsdp', 'fsdp'\)"):
        Rules(embed=("fsdp", "fsdp"))
    with pytest.raises(ValueError, match="logical axis name 'hidden' has no rule: the names are"):
        Layout(min_shard=0).logical_spec(P("hidden", None), (4, 4), 4, SIZES)


class _Block(nn.Module):
    """A kernel with logical names, one without (the fallback), a bias without."""

    @nn.compact
    def __call__(self, x):
        named = self.param("named", nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp")),
                           (x.shape[-1], 64))
        unnamed = self.param("unnamed", nn.initializers.normal(), (64, 8))
        bias = self.param("bias", nn.initializers.zeros, (6,))
        return (x @ named @ unnamed).sum() + bias.sum()


def _abstract_state():
    """Parameters and AdamW state as `jax.eval_shape` gives them: the boxes ride into the optimizer state."""

    def init():
        params = _Block().init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
        return {"params": params, "opt_state": optax.adamw(1e-3).init(params), "step": jnp.zeros((), jnp.int32)}

    return jax.eval_shape(init)


def test_boxed_names_reach_the_optimizer_state_and_unnamed_leaves_fall_back():
    mesh = _mesh(**SIZES)
    shardings = Layout(min_shard=0).shardings(mesh, _abstract_state())
    params, adam = shardings["params"], shardings["opt_state"][0]
    for tree in (params, adam.mu, adam.nu):
        assert tree["named"].spec == P("fsdp", "tensor")
        assert tree["unnamed"].spec == P("fsdp", None)  # the fallback: the largest axis fsdp divides
        assert tree["bias"].spec == P("fsdp")
    assert adam.count.spec == P() and shardings["step"].spec == P()
    plain, _ = sharding.logical_names(_abstract_state())
    assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(plain)


def test_a_names_tree_from_flax_gives_the_same_shardings():
    abstract = _abstract_state()
    names = nn.get_partition_spec(abstract)  # P() for every unboxed leaf: those take the fallback
    plain, _ = sharding.logical_names(abstract)
    mesh = _mesh(**SIZES)
    layout = Layout(min_shard=0)
    assert layout.shardings(mesh, plain, names) == layout.shardings(mesh, abstract)


def test_names_that_do_not_match_the_shape_are_refused():
    tree = {"kernel": jax.ShapeDtypeStruct((4, 8, 2), jnp.float32)}
    with pytest.raises(ValueError, match=r"\['kernel'\] has shape \(4, 8, 2\) but logical names \('embed', 'mlp'\)"):
        Layout(min_shard=0).shardings(_mesh(**SIZES), tree, {"kernel": P("embed", "mlp")})


def test_without_names_every_leaf_takes_the_fallback():
    tree = {"a": jax.ShapeDtypeStruct((64, 256), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    shardings = Layout(min_shard=0).shardings(_mesh(data=2, fsdp=4), tree)
    assert shardings["a"].spec == P(None, "fsdp") and shardings["b"].spec == P()


# -- initialize --------------------------------------------------------------------------------------
@pytest.fixture
def no_cluster(monkeypatch):
    for name in (sharding.COORDINATOR, sharding.NUM_PROCESSES, sharding.PROCESS_ID, "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_single_process_starts_nothing(no_cluster):
    assert sharding.initialize() is False
    no_cluster.setenv(sharding.NUM_PROCESSES, "1")
    assert sharding.initialize() is False
    assert not jax.distributed.is_initialized() and jax.process_count() == 1


@pytest.mark.parametrize("settings, message", [
    (dict(DEW_NUM_PROCESSES="2"), "a multi-process run needs DEW_COORDINATOR, DEW_PROCESS_ID as well"),
    (dict(DEW_NUM_PROCESSES="2", DEW_PROCESS_ID="2", DEW_COORDINATOR="127.0.0.1:1"),
     r"DEW_PROCESS_ID=2 is outside 0..1"),
    (dict(DEW_NUM_PROCESSES="two"), "DEW_NUM_PROCESSES='two' is not a int"),
    (dict(DEW_NUM_PROCESSES="2", DEW_PROCESS_ID="1", DEW_COORDINATOR="localhost"),
     "DEW_COORDINATOR='localhost' is not host:port"),
])
def test_an_incomplete_description_is_refused(no_cluster, settings, message):
    for name, value in settings.items():
        no_cluster.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        sharding.initialize()


def test_an_unreachable_coordinator_is_one_clear_error(no_cluster):
    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectionError) as raised:
        sharding.initialize(f"127.0.0.1:{port}", 2, 1, timeout_s=0.5)
    message = str(raised.value)
    assert message.startswith(f"process 1 of 2 could not reach the coordinator at 127.0.0.1:{port} within 0.5 s")
    assert "start process 0 first" in message and "\n" not in message
    assert not jax.distributed.is_initialized()


UNREACHABLE_METADATA_SCRIPT = textwrap.dedent(
    """
    import os, socket, warnings

    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        os.environ["GCE_METADATA_IP"] = f"127.0.0.1:{probe.getsockname()[1]}"
    import jax._src.clusters.cloud_tpu_cluster as tpu_cluster

    # What a TPU machine outside Google's cloud looks like to JAX's detection: a TPU VM whose metadata
    # server does not answer (JAX sets TPU_SKIP_MDS_QUERY itself when it finds no TPU).
    tpu_cluster.running_in_cloud_tpu_vm = True
    os.environ.pop("TPU_SKIP_MDS_QUERY", None)
    from dew import sharding

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        joined = sharding.initialize()
    import jax

    assert joined is False and jax.process_count() == 1 and not jax.distributed.is_initialized()
    (message,) = [str(warning.message) for warning in caught]
    assert message.startswith("JAX's cluster detection got no answer from the cloud's metadata server"), message
    assert "running as a single process" in message and "DEW_NUM_PROCESSES" in message
    """
)


def test_a_machine_without_the_clouds_metadata_server_trains_as_one_process():
    """A TPU outside Google's cloud: JAX's Cloud TPU probe cannot reach metadata.google.internal; Dew runs one
    process and says why, rather than stopping before training (a fresh process: detection runs before JAX)."""
    env = {name: value for name, value in os.environ.items()
           if name not in (sharding.COORDINATOR, sharding.NUM_PROCESSES, sharding.PROCESS_ID,
                           "JAX_COORDINATOR_ADDRESS")}
    result = subprocess.run([sys.executable, "-c", UNREACHABLE_METADATA_SCRIPT], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


# -- eight devices: placement, batches, and a checkpoint restored under other meshes -------------------
EIGHT_DEVICE_SCRIPT = textwrap.dedent(
    """
    import tempfile

    import jax, numpy as np, optax
    from jax.sharding import PartitionSpec as P

    from dew import models, Trainer
    from dew.objectives.lm import LMObjective
    from dew.sharding import Layout, MeshSpec, place_batch
    from dew.training import Checkpoints
    from tests.test_sharding import _Block, _abstract_state

    assert jax.device_count() == 8
    # Today's device order: the two batch axes first, the new axes of size 1 after them.
    mesh = MeshSpec(data=2, fsdp=4).build()
    assert (mesh.devices.reshape(2, 4) == np.asarray(jax.devices()).reshape(2, 4)).all()

    # Placement with a tensor axis: the named kernel is split four ways, the unnamed one over fsdp.
    mesh = MeshSpec(data=2, fsdp=2, tensor=2).build()
    shardings = Layout(min_shard=0).shardings(mesh, _abstract_state())
    params = jax.jit(lambda: _Block().init(jax.random.key(0), np.zeros((1, 32), np.float32))["params"],
                     out_shardings=shardings["params"])()
    params = jax.tree_util.tree_map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                                    is_leaf=lambda x: hasattr(x, "unbox"))
    assert {shard.data.shape for shard in params["named"].addressable_shards} == {(16, 32)}
    assert {shard.data.shape for shard in params["unnamed"].addressable_shards} == {(32, 8)}

    # Rows split over data x fsdp (4 ways); the two tensor devices of a pair hold the same rows.
    rows = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    batch = place_batch(mesh, {"text": rows})["text"]
    held = {shard.device: shard.data for shard in batch.addressable_shards}
    for pair in mesh.devices.reshape(4, 2):
        assert np.array_equal(held[pair[0]], held[pair[1]]) and held[pair[0]].shape == (1, 3)
    np.testing.assert_array_equal(np.asarray(batch), rows)
    try:
        place_batch(mesh, {"text": rows[:3]})
        raise AssertionError("a batch of 3 rows was placed on 4 batch shards")
    except ValueError as error:
        assert "a batch of 3 rows does not split over 4 devices (data x fsdp)" in str(error), error

    # A checkpoint written under data=8 restores exactly under data=2 x fsdp=4 and on 4 devices.
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=1, num_heads=2,
                         max_seq_len=16)
    objective = LMObjective(model, 16)
    saved = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(0), mesh=MeshSpec(data=8)).init_state()
    # Moments that are not all zero, so their placement is tested too.
    rng = np.random.default_rng(0)
    saved = saved.replace(opt_state=jax.tree_util.tree_map(
        lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)
        if np.issubdtype(x.dtype, np.floating) else x, saved.opt_state))
    directory = tempfile.mkdtemp()
    checkpoints = Checkpoints(directory)
    checkpoints.save(saved, None)
    expected = [np.asarray(x) for x in jax.tree_util.tree_leaves(saved)]
    for devices, spec in ((None, MeshSpec(data=2, fsdp=4)), (jax.devices()[:4], MeshSpec(data=1, fsdp=4))):
        # The Trainer builds its mesh on every device; a 4-device one replaces it, as the trainer tests do.
        trainer = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(1), mesh=None if devices else spec,
                          layout=Layout(min_shard=0))
        if devices is not None:
            trainer.mesh = spec.build(devices)
        like = trainer.init_state()
        restored, _ = checkpoints.restore(like)
        for ours, theirs, target in zip(jax.tree_util.tree_leaves(restored), expected, jax.tree_util.tree_leaves(like)):
            assert ours.sharding == target.sharding, (ours.sharding, target.sharding)
            np.testing.assert_array_equal(np.asarray(ours), theirs)
        kernel = restored.params["params"]["layers_0"]["mlp"]["up_proj"]["kernel"]
        assert kernel.sharding.spec.count("fsdp") == 1
        assert len(kernel.sharding.device_set) == trainer.mesh.devices.size
    checkpoints.close()
    print("ok")
    """
)


@pytest.mark.slow
def test_eight_devices_place_split_and_restore_across_meshes():
    env = devices_environment(8)
    done = subprocess.run([sys.executable, "-c", EIGHT_DEVICE_SCRIPT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith("ok")
