"""tools/reference_runs: the torch reference run at each precision and the first step per attention kernel, each
tool's main path on a tiny Qwen3-shaped model; the rounding points `--precision autocast-bf16-residual` puts into
transformers' model."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOOLS = pathlib.Path(__file__).parents[2] / "tools" / "reference_runs"
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--intermediate", "64", "--vocab", "128", "--batch", "2", "--seq-len", "16"]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_lm_prints_each_step_against_float32(capsys):
    tool = load_tool("torch_lm")
    float32 = tool.main(["--precision", "float32", "--steps", "2", *TINY])
    assert [row["loss_delta"] for row in float32] == [0.0, 0.0]
    rows = tool.main(["--precision", "autocast-bf16-residual", "--steps", "2", *TINY])
    printed = capsys.readouterr().out
    assert "| step | loss | loss - float32 | grad norm | grad norm - float32 |" in printed
    assert printed.count("\n| 1 |") == 2 and "precision autocast-bf16-residual" in printed
    # the same weights and batches: the runs differ by bfloat16's roundings alone (a relative 2**-8 each): the mean
    # loss by less than one rounding of itself, the gradient norm by less than eight (observed 2e-5 and 2e-4 of it)
    for ours, theirs in zip(rows, float32):
        assert ours["loss"] - theirs["loss"] == pytest.approx(ours["loss_delta"])
        assert 0 < abs(ours["loss_delta"]) < 2**-8 * theirs["loss"]
        assert 0 < abs(ours["grad_norm_delta"]) < 8 * 2**-8 * theirs["grad_norm"]


def _dtypes(tool, model, precision: str) -> dict:
    """The dtypes of the embedding output, each decoder layer's output (the residual stream), each RMSNorm's
    output, the rotary table and the head's output, over one forward at `precision`."""
    seen: dict = {}
    record = lambda key: lambda module, inputs, output: seen.setdefault(key, set()).add(  # noqa: E731
        output[0].dtype if isinstance(output, tuple) else output.dtype)
    with torch.no_grad(), tool.precision(model, precision):
        # registered after the precision's own hooks, so they see what the model reads on
        hooks = [model.model.embed_tokens.register_forward_hook(record("embedding")),
                 model.model.rotary_emb.register_forward_hook(record("rotary")),
                 model.lm_head.register_forward_hook(record("head"))]
        hooks += [layer.register_forward_hook(record("residual")) for layer in model.model.layers]
        hooks += [module.register_forward_hook(record("norms")) for module in model.modules()
                  if type(module).__name__.endswith("RMSNorm")]
        tool.forward(model, np.arange(17)[None] % 128)
    for hook in hooks:
        hook.remove()
    return seen


def test_dews_rounding_points_in_torch():
    """autocast-bf16-residual: the embedding, the residual stream and every RMSNorm in bfloat16, the rotary table in
    float32; plain autocast keeps the residual stream and the norms in float32; the hooks leave with the block."""
    tool = load_tool("torch_lm")
    args = tool.argparse.Namespace(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=128,
                                   seq_len=16, init_std=0.02, seed=0, batch=1)
    model = tool.build_model(args).eval()
    bf16, f32 = {torch.bfloat16}, {torch.float32}
    ours = _dtypes(tool, model, "autocast-bf16-residual")
    assert (ours["embedding"], ours["residual"], ours["norms"], ours["rotary"], ours["head"]) == (bf16, bf16, bf16, f32,
                                                                                                  bf16)
    plain = _dtypes(tool, model, "autocast")
    assert (plain["embedding"], plain["residual"], plain["norms"], plain["rotary"], plain["head"]) == (f32, f32, f32,
                                                                                                      f32, bf16)
    assert set().union(*_dtypes(tool, model, "float32").values()) == f32  # no hook was left behind


@pytest.mark.parametrize("backend, interpret, expected", [
    ("cpu", False, ["xla"]), ("cpu", True, ["xla", "splash (Pallas interpreter)"]), ("tpu", False, ["xla", "splash"]),
    ("tpu", True, ["xla", "splash"]), ("gpu", False, ["xla", "cudnn"])])
def test_step0_attention_runs_dews_kernels_per_backend(backend, interpret, expected):
    """xla everywhere, splash on a TPU (off one only through the interpreter, labelled so), cuDNN on a GPU; each
    kernel left out is a line naming its backend."""
    runs, skipped = load_tool("step0_attention").dew_kernels(backend, interpret)
    assert [label for label, _, _ in runs] == expected
    assert [through for _, _, through in runs] == [label.endswith("(Pallas interpreter)") for label in expected]
    assert len(runs) + len(skipped) == 3
    assert all(line.startswith("Dew ") and f"backend is {backend}" in line for line in skipped)


def test_step0_attention_rows_and_skipped_kernels(monkeypatch, capsys):
    """torch's flash and math kernels run on a CPU, Dew's xla and (with --interpret) splash in bfloat16 and float32,
    each recording the kernel it ran; a Dew kernel `load_pretrained` refuses (a ValueError) is a line saying why,
    and the rest still run. Dew's float32 loss equals torch's to float32's roundings over a 128-way log-softmax
    (observed 0 and 1e-6 against 1e-5), its hidden states within a few hundred float32 roundings (observed 2e-7
    against 1e-5); every bfloat16 row's hidden states lie within a few bfloat16 roundings (2**-8 each) of the
    reference run's and of float32's."""
    tool = load_tool("step0_attention")
    kernels, step = tool.dew_kernels, tool.dew_step

    def dew_step(directory, tokens, kernel, dtype, interpret=False):
        if kernel == "absent":
            raise ValueError("attention_impl 'absent' needs a backend this machine lacks")
        return step(directory, tokens, kernel, dtype, interpret)

    def dew_kernels(backend, interpret):
        runs, skipped = kernels(backend, interpret)
        return [*runs, ("absent", "absent", False)], skipped

    monkeypatch.setattr(tool, "dew_kernels", dew_kernels)
    monkeypatch.setattr(tool, "dew_step", dew_step)
    result = tool.main(["--interpret", *TINY])
    rows = {(row["run"], row["precision"], row["kernel"]): row for row in result["rows"]}
    reference = rows[("torch", "autocast-bf16-residual", "flash")]
    assert reference["distance"] == 0.0 and ("torch", "autocast-bf16-residual", "math") in rows
    for kernel, ran in (("xla", {"dew", "xla"}), ("splash (Pallas interpreter)", {"splash"})):
        assert rows[("Dew", "bfloat16 compute", kernel)]["ran_in"] in ran
        assert abs(rows[("Dew", "float32", kernel)]["loss_delta"]) < 1e-5
        assert rows[("Dew", "float32", kernel)]["distance_float32"] < 1e-5
    for key, row in rows.items():
        assert row["distance"] < 8 * 2**-8 and row["distance_float32"] < 8 * 2**-8, key
        assert abs(row["loss_delta"]) < 5e-3, key
    assert "Dew absent: attention_impl 'absent' needs a backend this machine lacks" in result["skipped"]
    assert any(line.startswith("Dew cudnn: runs on a GPU") for line in result["skipped"])
    printed = capsys.readouterr().out
    assert "| Dew | bfloat16 compute | splash (Pallas interpreter) | splash |" in printed
    assert "skipped: Dew absent:" in printed
