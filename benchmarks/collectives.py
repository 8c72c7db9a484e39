"""What Dew's train step sends between chips: its collectives, read from the compiled program, against ICI bandwidth.

    python -m benchmarks.collectives [--shapes gpt2,medium,long,1b] [--meshes data,fsdp] [--devices 8]
                                     [--remat dots] [--shape layers=..,width=..,...]

For each shape of `benchmarks.accelerator` (or one given by `--shape`), the train step (bfloat16 compute, the
shape's parameters and AdamW, no moving average) is compiled, not run, for an emulated mesh of `--devices` CPU
devices: data parallel (`MeshSpec(data=n)`) and fully sharded (`MeshSpec(data=1, fsdp=n)`), each device keeping
the shape's rows, so the global batch is n times the shape's. The collectives of the partitioned program
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) are read from its HLO text, each counted
as often as it runs (a collective inside the scanned layers' loop once a layer). Printed per shape and mesh and
kind: the bytes one device's operands hold a step, the bytes a bandwidth-optimal ring makes each device send for
them, and that traffic's time at `ICI_BYTES_PER_S`, against the step time one v5e chip measured
(`ONE_CHIP_STEP_S`, docs/performance.md, "The TPU"). The CPU's program runs its collectives one at a time and in
its own forms (an all-reduce where a TPU's XLA would reduce-scatter; bfloat16 arrays in float32), so the counts
bound a TPU's from above (docs/performance.md, "Several chips").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.accelerator import SHAPES, dew_model, optimizer
from benchmarks.common import machine
from dew import Trainer
from dew.nn.stack import remat_in_force
from dew.objectives.lm import LMObjective
from dew.sharding import BATCH_AXES, Layout, MeshSpec, batch_sharding

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# A v5e chip's 400 GB/s of bidirectional ICI bandwidth (4 ports) sends 200 GB/s; the pod's 51.2 TB/s of
# all-reduce bandwidth is the same 200 GB/s for each of its 256 chips (cloud.google.com/tpu/docs/v5e).
ICI_BYTES_PER_S = 200e9
# Seconds of one train step on one v5e chip, for the shape's rows (docs/performance.md, "The TPU").
ONE_CHIP_STEP_S = {"gpt2": 0.420, "medium": 0.530, "long": 0.364, "1b": 0.983}
MESHES = {"data": lambda n: MeshSpec(data=n), "fsdp": lambda n: MeshSpec(data=1, fsdp=n)}

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (?P<shape>.+?) (?P<op>[a-z][a-z0-9-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>\S+) .*\{$")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_CALLED = re.compile(r"\b(?P<how>body|to_apply|calls|condition|branch_computations)=(?P<names>\{[^}]*\}|%[\w.-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\] \{(?P<names>[^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a partitioned program: its kind, the bytes of its result on one device, the devices in
    its group, and how many times a step runs it."""

    kind: str
    result_bytes: int
    group: int
    runs: int

    @property
    def operand_bytes(self) -> int:
        """The bytes of its operands on one device: a gather's operand is its result's 1/group share, a
        reduce-scatter's is group times its result, the others' are their results' size."""
        if self.kind == "all-gather":
            return self.result_bytes // self.group
        if self.kind == "reduce-scatter":
            return self.result_bytes * self.group
        return self.result_bytes

    @property
    def sent_bytes(self) -> float:
        """What each device sends for it once in a bandwidth-optimal ring of `group` devices: an all-reduce is a
        reduce-scatter then an all-gather, each passing (group - 1) of the group's shares of the operand; a
        gather passes (group - 1) shares of its result; a permute sends its operand once."""
        n, share = self.group, self.operand_bytes / self.group
        if self.kind == "all-reduce":
            return 2 * (n - 1) * share
        if self.kind == "all-gather":
            return (n - 1) * self.result_bytes / n
        if self.kind == "collective-permute":
            return float(self.operand_bytes)
        return (n - 1) * share


def _array_bytes(shape_text: str) -> int:
    """The bytes of an HLO shape (`f32[768,2048]{1,0}`, or a tuple of them), each element of `pred` one byte."""
    total = 0
    for match in _ARRAY.finditer(shape_text):
        dims = [int(d) for d in match["dims"].split(",") if d]
        bits = 8 if match["dtype"] == "pred" else int(re.match(r"[a-z]+(\d+)", match["dtype"])[1])
        total += int(np.prod(dims, dtype=np.int64)) * bits // 8
    return total


def _group_size(line: str, devices: int) -> int:
    """The devices in each of the collective's groups: named mesh axes (`mesh['axis_0'=1,'axis_1'=8] {'axis_1'}`),
    an iota list (`[2,4]<=[8]`: 2 groups of 4) or explicit groups (`{{0,1},{2,3}}`)."""
    if named := _GROUPS_MESH.search(line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", named["axes"]))
        return int(np.prod([int(sizes[axis]) for axis in re.findall(r"'([^']+)'", named["names"])]))
    if iota := _GROUPS_IOTA.search(line):
        return int(iota[2])
    if listed := _GROUPS_LIST.search(line):
        return len([d for d in listed[1].split(",") if d])
    return devices  # no groups: every device of the program


def collectives(hlo: str, devices: int) -> list[Collective]:
    """Every collective of an optimized, partitioned HLO module's text, with how often one run of its entry
    computation runs it: a while loop's body counts its known trip count, other called computations once."""
    own: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, current = None, None
    for line in hlo.splitlines():
        if (header := _COMPUTATION.match(line)) and not line.startswith(" "):
            current = header["name"]
            if line.startswith("ENTRY"):
                entry = current
            continue
        instruction = _INSTRUCTION.match(line)
        if current is None or instruction is None:
            continue
        if instruction["op"] in KINDS:
            own[current].append((instruction["op"], _array_bytes(instruction["shape"]), _group_size(line, devices)))
        for called in _CALLED.finditer(line):
            trips = 1
            if called["how"] == "body":
                counted = _TRIPS.search(line)
                if counted is None:
                    raise ValueError(f"a while loop in {current} has no known trip count: {line.strip()[:200]}")
                trips = int(counted[1])
            for name in re.findall(r"%([\w.-]+)", called["names"]):
                calls[current].append((name, trips))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    found: list[Collective] = []

    def visit(name: str, runs: int) -> None:
        found.extend(Collective(kind, size, group, runs) for kind, size, group in own[name])
        for callee, trips in calls[name]:
            visit(callee, runs * trips)

    visit(entry, 1)
    return found


def shape_step_hlo(shape: dict, mesh: str, devices: list, remat: str, min_shard: int = Layout.min_shard
                   ) -> tuple[str, int]:
    """(the compiled train step's HLO text for `shape` on `mesh` ("data" or "fsdp") over `devices`, the bytes of
    its trainable parameters), each device keeping `shape["batch"]` rows; nothing is allocated. Attention is
    XLA's, as in any process that sees several devices (`dew.kernels.accelerator_attention`)."""
    model = dew_model(shape)
    model = type(model)(dataclasses.replace(model.config, remat=remat, attention="xla"))
    objective = LMObjective(model, shape["seq"], ema_decay=None, token_accuracy=False)
    trainer = Trainer(objective, optimizer(shape), key=jax.random.key(0), mesh=MeshSpec(),
                      layout=Layout(min_shard=min_shard))
    trainer.mesh = MESHES[mesh](len(devices)).build(devices)
    abstract, shardings = trainer.state_shardings(objective.held_variables())
    state = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
                                   shardings)
    shards = int(np.prod([trainer.mesh.shape[axis] for axis in BATCH_AXES]))
    rows = jax.ShapeDtypeStruct((shape["batch"] * shards, shape["seq"] + 1), jnp.int32,
                                sharding=batch_sharding(trainer.mesh))
    with remat_in_force(remat):
        step = trainer.compile_step(state, {"text": rows})
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(abstract.params))
    return step.as_text(), param_bytes


def totals(found: list[Collective]) -> dict[str, tuple[int, float]]:
    """Per kind: (operand bytes one device holds a step, bytes it sends a step)."""
    operands, sent = Counter(), Counter()
    for collective in found:
        operands[collective.kind] += collective.operand_bytes * collective.runs
        sent[collective.kind] += collective.sent_bytes * collective.runs
    return {kind: (operands[kind], sent[kind]) for kind in KINDS if operands[kind]}


def _parse_shape(text: str) -> dict:
    shape = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        shape[key.strip()] = value.strip() if key.strip() == "param_dtype" else int(value)
    missing = {"layers", "width", "heads", "kv_heads", "mlp", "vocab", "seq", "batch"} - set(shape)
    if missing:
        raise argparse.ArgumentTypeError(f"--shape needs {sorted(missing)} as well")
    return shape


def main(argv=None) -> list[dict]:
    """Print the table; returns its rows: per shape and mesh, `param_bytes` and `kinds` (`totals`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="gpt2,medium,long,1b", help=f"of {list(SHAPES)}")
    parser.add_argument("--shape", type=_parse_shape, help="another shape: layers=..,width=..,heads=..,kv_heads=..,"
                        "mlp=..,vocab=..,seq=..,batch=.. (rows a device) [,param_dtype=bfloat16]")
    parser.add_argument("--meshes", default="data,fsdp", help=f"of {list(MESHES)}")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--remat", default="dots", help="the layers' remat (the TPU's runs took dots)")
    parser.add_argument("--min-shard", type=int, default=Layout.min_shard,
                        help="bytes below which an array stays whole (dew.sharding.Layout.min_shard)")
    parser.add_argument("--hlo", help="a directory to write each compiled step's HLO text to")
    args = parser.parse_args(argv)
    try:  # an emulated mesh: CPU devices, as many as asked, which JAX takes before its backend starts
        jax.config.update("jax_num_cpu_devices", args.devices)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # it has started (a caller's process, or XLA_FLAGS): its devices must do
        pass
    if jax.device_count() < args.devices:
        raise SystemExit(f"this process has {jax.device_count()} devices and {args.devices} were asked: run the tool "
                         "in a fresh process, or set XLA_FLAGS=--xla_force_host_platform_device_count")
    devices, n = jax.devices()[:args.devices], args.devices
    print(machine())
    print(f"{n} emulated CPU devices, remat {args.remat!r}, ICI {ICI_BYTES_PER_S / 1e9:.0f} GB/s sent a chip")
    shapes = {"shape": args.shape} if args.shape else {name: SHAPES[name] for name in args.shapes.split(",")}
    rows = []
    for name, shape in shapes.items():
        for mesh in args.meshes.split(","):
            hlo, param_bytes = shape_step_hlo(shape, mesh, devices, args.remat, args.min_shard)
            if args.hlo:
                os.makedirs(args.hlo, exist_ok=True)
                with open(os.path.join(args.hlo, f"{name}-{mesh}{n}.hlo"), "w") as out:
                    out.write(hlo)
            per_kind = totals(collectives(hlo, n))
            rows.append({"shape": name, "mesh": mesh, "param_bytes": param_bytes, "kinds": per_kind})
            sent = sum(value[1] for value in per_kind.values())
            chip = ONE_CHIP_STEP_S.get(name)
            against = f"{sent / ICI_BYTES_PER_S / chip:6.1%} of one chip's {chip * 1e3:.0f} ms step" if chip else \
                "no one-chip step measured"
            print(f"{name} {mesh}={n}: parameters {param_bytes / 2**20:.1f} MiB; sent "
                  f"{sent / 2**20:.1f} MiB, {sent / ICI_BYTES_PER_S * 1e3:.2f} ms at ICI, {against}")
            for kind, (operand, kind_sent) in per_kind.items():
                print(f"  {kind:18s} operands {operand / 2**20:10.1f} MiB  sent {kind_sent / 2**20:10.1f} MiB  "
                      f"{kind_sent / ICI_BYTES_PER_S * 1e3:7.2f} ms")
    return rows


if __name__ == "__main__":
    main()
