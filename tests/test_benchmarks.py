"""Benchmarks' own references, held to what they stand in for (a benchmark is not run by the suite), and the
collectives benchmarks/collectives.py counts (it compiles, runs nothing), held to what each mesh must send."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import serve
from benchmarks.large_vocab import UnchunkedHead
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective
from tests.compile_flags import devices_environment

STEP = Step(jnp.zeros((), jnp.int32), jax.random.key(0))


def test_large_vocab_reference_scores_what_the_objective_scores(tiny_model, tiny_variables):
    """benchmarks/large_vocab.py times LMObjective's tiled head against `UnchunkedHead`, the whole
    `[N, V]` logits: both must score the same loss and accuracy, or the ratio compares different work."""
    rows = np.random.default_rng(0).integers(0, 64, (2, 9))
    # Row 0 greedy (each token its predecessor's argmax), so the accuracy compared is not 0 against 0.
    logits = jax.jit(lambda r: tiny_model.apply(tiny_variables, r, head=False).logits())
    for i in range(8):
        rows[0, i + 1] = int(jnp.argmax(logits(jnp.asarray(rows, jnp.int32))[0, i]))
    tokens = {"text": jnp.asarray(rows, jnp.int32)}
    whole = UnchunkedHead(tiny_model, seq_len=8).loss(tiny_variables, tokens, STEP)[0]
    tiled = LMObjective(tiny_model, seq_len=8, head_chunks=3).loss(tiny_variables, tokens, STEP)[0]
    assert float(whole.ce.count) == float(tiled.ce.count) == 16.0
    # Each token's log-sum-exp over 64 logits, in float32 both ways (one pass, or three tiles combined
    # online): the sums of exponentials differ by at most ~64 ulps (4e-6 relative), so each token's
    # cross entropy by ~4e-6; 16 of them summed, 2e-4 bounds the totals' difference. Observed
    # (Intel Xeon): equal.
    assert abs(float(whole.ce.total) - float(tiled.ce.total)) < 2e-4
    assert float(whole.token_accuracy.total) == float(tiled.token_accuracy.total) >= 8.0


def test_serve_starts_each_peer_its_flag_names():
    """benchmarks/serve.py runs a peer only when its flag names it, with the settings that keep the
    comparison fair: llama-cpp-python's server must not end a running stream for a new request, and vLLM
    must keep its internal queue on loopback."""
    args = serve.parse(["--llama-cpp-python", "venv/bin/python", "--llama-server", "bin/llama-server",
                        "--vllm-python", "vllm/bin/python", "--requests", "32"])
    chosen, skipped = serve.servers(args)
    assert [server.name for server in chosen] == ["dew serve", "llama-cpp-python server", "llama-server -np 32",
                                                   "vLLM CPU float32", "vLLM CPU bfloat16"]
    assert skipped == ["transformers generate (--transformers)"]
    dew, llama_python, llama_server, vllm, _ = chosen
    assert dew.command[dew.command.index("--capacity") + 1] == "320"
    assert llama_python.command[0] == "venv/bin/python"
    assert llama_python.command[llama_python.command.index("--interrupt_requests") + 1] == "False"
    assert llama_python.env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert llama_server.command[llama_server.command.index("--parallel") + 1] == "32"
    assert llama_server.command[llama_server.command.index("--ctx-size") + 1] == str(32 * 320)
    assert "--no-cache-prompt" in llama_server.command and "--no-enable-prefix-caching" in vllm.command
    assert "--no-reuse-prefixes" in dew.command
    # --prompt-cache: every engine's reuse of cached prompts on (llama-server's by its default), like for like
    cached = serve.servers(serve.parse(["--prompt-cache", "--llama-server", "bin/llama-server", "--vllm-python",
                                        "venv/bin/python", "--vllm-dtype", "bfloat16"]))[0]
    assert "--reuse-prefixes" in cached[0].command and "--enable-prefix-caching" in cached[2].command
    assert "--no-cache-prompt" not in cached[1].command and "--cache-ram" not in cached[1].command
    assert vllm.env["VLLM_HOST_IP"] == "127.0.0.1" and "--gpu-memory-utilization" in vllm.command
    assert all("{port}" in server.command for server in chosen)
    assert len(serve.servers(serve.parse([]))[1]) == 4  # every peer skipped, each with its line
    both = serve.servers(serve.parse(["--dew-dtype", "float32,bfloat16"]))[0]
    assert [(server.name, server.command[server.command.index("--dtype") + 1]) for server in both] == [
        ("dew serve", "float32"), ("dew serve bfloat16", "bfloat16")]
    blocks = serve.servers(serve.parse(["--dew-gguf"]))[0]
    assert [server.name for server in blocks] == ["dew serve", "dew serve gguf"]
    assert "--quantize" not in blocks[0].command and blocks[1].command[-2:] == ["--quantize", "gguf"]
    for wrong in (["--requests", "65"], ["--solo-requests", "9", "--requests", "8"], ["--vllm-dtype", "int8"],
                  ["--dew-dtype", "float16"]):
        with pytest.raises(SystemExit):
            serve.parse(wrong)
    assert serve.percentile([float(value) for value in range(10, 0, -1)], 0.9) == 9.0
    root = str(Path(__file__).parents[1])
    assert serve.parse(["--startup", "--rounds", "2", "--baseline", root]).baseline == root
    for wrong in (["--startup", "--baseline", root], ["--startup", "--rounds", "2", "--baseline", "tests"]):
        with pytest.raises(SystemExit):
            serve.parse(wrong)


def test_accelerator_reference_scores_what_dew_scores():
    """benchmarks/accelerator.py times Dew's train step against its plain JAX Llama: on the same weights both must
    score the same loss, or the ratio compares different models. float32 compute, XLA's attention on this
    backend: the two sum the same products in other orders, so the mean cross entropy over 2 x 16 tokens of a
    64-id vocabulary (about log 64 = 4.2) agrees to float32 rounding of a few hundred terms, 1e-5 relative."""
    from benchmarks import accelerator

    shape = dict(layers=2, width=64, heads=4, kv_heads=2, mlp=96, vocab=64, seq=16, batch=2)
    params = accelerator.reference_params(shape, jax.random.key(0))
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
    reference = accelerator.reference_loss(params, rows, shape, None, splash=False, dtype=jnp.float32)
    model = accelerator.dew_model(shape)
    model = type(model)(dataclasses.replace(model.config, dtype=jnp.float32))
    objective = LMObjective(model, seq_len=16, ema_decay=None, token_accuracy=False)
    stats = objective.loss(accelerator.dew_variables(params), {"text": rows}, STEP)[0]
    dew = float(stats.ce.total) / float(stats.ce.count)
    assert abs(dew - float(reference)) <= 1e-5 * abs(float(reference)), (dew, float(reference))


COLLECTIVES_SCRIPT = """
import json
from benchmarks import collectives
rows = collectives.main(["--shape", "layers=2,width=64,heads=4,kv_heads=2,mlp=256,vocab=256,seq=32,batch=2",
                         "--min-shard", "0"])
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_collectives_counts_the_gradients_all_reduce_and_the_weights_gathers():
    """benchmarks/collectives.py on a tiny shape (float32 parameters, 2 rows of 32 a device) over 8 emulated
    devices, held to what each mesh must send.

    Data parallel: one all-reduce of every gradient and of the step's statistics (a few dozen float32 scalars),
    nothing else. A ring of n devices reduce-scatters it, then all-gathers it, each pass sending n - 1 of its n
    shares: 2 (n - 1) / n of its bytes, 1.75x at n = 8.

    Fully sharded (every array split): each weight gathered for the forward and again for the backward's
    recompute, each device sending (n - 1) / n of the gathered bytes, but the embedding table, whose rows
    stay with their shard: the rows of activations go to the table's shards and back instead (an all-to-all
    each way of the device's [2, 32, 64] float32 rows); XLA may combine a norm's scale rather than gather it.
    The gradients all-reduced (the CPU's form of a reduce-scatter) but the table's, which each shard forms
    itself. Under 4x the parameters' bytes in all; with the activations following the fsdp-split table
    instead, every device gathered the whole batch (docs/performance.md, "Several chips")."""
    done = subprocess.run([sys.executable, "-c", COLLECTIVES_SCRIPT], env=devices_environment(8),
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data, fsdp = json.loads(done.stdout.strip().splitlines()[-1])
    assert (data["mesh"], fsdp["mesh"]) == ("data", "fsdp") and data["param_bytes"] == fsdp["param_bytes"]
    n, params, statistics = 8, data["param_bytes"], 64 * 4
    table, norms, rows = 256 * 64 * 4, (2 * 2 + 1) * 64 * 4, 2 * 32 * 64 * 4
    assert list(data["kinds"]) == ["all-reduce"]
    operands, sent = data["kinds"]["all-reduce"]
    assert params <= operands <= params + statistics
    assert sent == pytest.approx(2 * (n - 1) / n * operands, rel=1e-12)
    kinds = fsdp["kinds"]
    assert sorted(kinds) == ["all-gather", "all-reduce", "all-to-all"]
    gathered, sent = kinds["all-gather"]
    assert 2 * (params - table - norms) / n <= gathered <= 2 * (params - table) / n
    assert sent == pytest.approx((n - 1) * gathered, rel=1e-12)
    assert params - table <= kinds["all-reduce"][0] <= params - table + statistics
    assert kinds["all-to-all"][0] == 2 * rows
    assert sum(value[1] for value in kinds.values()) < 4 * params
