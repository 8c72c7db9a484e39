"""bfloat16 with quantized weights (`dew.pipeline(..., dtype="bfloat16", quantize="int8" | "gguf")`, `dew serve
--dtype bfloat16 --quantize ...`): the quantized kernels stay as they are, everything else is held and computed
in bfloat16, the logits move from the float32 model's only by bfloat16's rounding, and the serving engine
draws what `generate` draws."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.runs import pipeline
from dew.sampling import Sampling
from dew.serve import Request
from tests.compiled import compiled
from tests.interop.conftest import torch_model
from tests.serve.conftest import Tokens, assert_served_as_generated

gguf = pytest.importorskip("gguf")
from tests.interop.test_gguf import write_gguf  # noqa: E402
from tests.interop.test_gguf_blocks import mixed_tensors  # noqa: E402

PROMPT = [1, 5, 9, 3, 7, 2, 11, 4]
NEW = 6
QUANTIZED = {"int8": {"int8"}, "gguf": {"uint8"}}  # the dtype each format's weights are held in


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """A 2-layer Llama as a GGUF file, its projections in Q4_0, Q4_1 and Q8_0 blocks (float32 elsewhere)."""
    model = torch_model("llama", intermediate_size=64)
    return write_gguf(model, tmp_path_factory.mktemp("bf16-quantized") / "tiny.gguf",
                      tensors=list(mixed_tensors(model)))


@pytest.fixture(scope="module")
def logits(tiny_file):
    """The logits of PROMPT (every position) for each (dtype, quantize) pair, and the bfloat16 tasks."""
    found, tasks = {}, {}
    for quantize in (None, "int8", "gguf"):
        for dtype in ("float32", "bfloat16"):
            task = pipeline(tiny_file, dtype=dtype, quantize=quantize)
            found[dtype, quantize] = np.asarray(compiled(task.model.apply, task.params, jnp.asarray([PROMPT]))[0])
            if dtype == "bfloat16" and quantize is not None:
                tasks[quantize] = task
    return found, tasks


@pytest.mark.parametrize("quantize", ["int8", "gguf"])
def test_quantized_kernels_stay_and_the_rest_is_bfloat16(logits, quantize):
    task = logits[1][quantize]
    kinds = {leaf.dtype.name for leaf in jax.tree_util.tree_leaves(task.params)}
    # bfloat16 (embedding, norms) and its uint16 bits (a float linear left in the file), the quantized
    # weights in their own dtype, and int8's float32 scales: never a float32 copy of a weight.
    assert QUANTIZED[quantize] <= kinds <= {"bfloat16", "uint16", "float32"} | QUANTIZED[quantize], kinds
    assert "bfloat16" in kinds
    float32 = [path for path, leaf in jax.tree_util.tree_leaves_with_path(task.params)
               if leaf.dtype == jnp.float32 and "scale" not in jax.tree_util.keystr(path)]
    assert not float32, float32


@pytest.mark.parametrize("quantize", ["int8", "gguf"])
def test_bfloat16_moves_quantized_logits_as_far_as_it_moves_the_float_model(logits, quantize):
    found = logits[0]
    # The same weights (the file's, dequantized or kept quantized) computed with bfloat16 operands and
    # float32 sums: bfloat16's rounding (2^-9 relative per operand) moves the quantized model's logits about
    # as far as it moves the dequantized one's. Bound: twice that distance, plus one bfloat16 rounding of the
    # largest logit, as tests/serve/test_bfloat16.py bounds bfloat16 against transformers. Observed over
    # the prompt's 8 positions: int8 0.276, gguf 0.110, against a bound of 0.410 (the dequantized model
    # moves 0.194; logits up to 5.6).
    plain = np.max(np.abs(found["bfloat16", None] - found["float32", None]))
    bound = 2 * plain + 2.0**-8 * np.max(np.abs(found["float32", quantize]))
    moved = np.max(np.abs(found["bfloat16", quantize] - found["float32", quantize]))
    assert moved <= bound, (moved, bound)


@pytest.mark.parametrize("quantize", ["int8", "gguf"])
def test_the_engine_serves_what_generate_draws(logits, quantize):
    policies = [Sampling(temperature=0.0), Sampling(temperature=0.9, top_k=20)]
    assert_served_as_generated(logits[1][quantize], [Request(PROMPT[index:], NEW, policies[index % 2], seed=index,
                                                             consumer=Tokens()) for index in range(3)])
