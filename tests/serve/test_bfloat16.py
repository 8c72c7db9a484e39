"""Generation and serving in bfloat16 (`dew.pipeline(..., dtype="bfloat16")`, `dew serve --dtype bfloat16`)
against transformers' same tiny checkpoint loaded with `torch_dtype=torch.bfloat16`, and the serving engine
against the bfloat16 `generate` path it must match."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dew
from dew.sampling import Sampling, generate
from dew.serve import Request
from tests.serve.conftest import Tokens, assert_served_as_generated, write_checkpoint

PROMPT = [5, 17, 42, 99, 3, 250, 61, 8, 120, 33, 7, 201]
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-bf16")
    write_checkpoint(directory)  # a 2-layer Llama (width 32) saved in float32, weights of order one
    return directory


@pytest.fixture(scope="module")
def task(checkpoint):
    return dew.pipeline(checkpoint, dtype="bfloat16")


@pytest.fixture(scope="module")
def torch_logits(checkpoint):
    """transformers' logits of PROMPT in bfloat16 and in float32, and its bfloat16 greedy continuation."""
    import torch
    import transformers

    ids = torch.tensor([PROMPT])
    found = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=dtype).eval()
        with torch.no_grad():
            found[name] = model(ids).logits[0].float().numpy()
            if name == "bfloat16":
                out = model.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                                     eos_token_id=None, pad_token_id=0)
                found["greedy"] = out[0, len(PROMPT):].tolist()
    return found


def test_weights_and_cache_are_bfloat16_and_products_run_in_bfloat16(task):
    kinds = {leaf.dtype.name for leaf in jax.tree_util.tree_leaves(task.params)}
    # linear kernels are held as their uint16 bits (dew.nn.quantize.bfloat16_bits); everything else bfloat16
    assert kinds == {"bfloat16", "uint16"}
    cache = task.model.init_cache(1, 16)
    assert {run.keys.dtype.name for run in cache.runs} == {"uint16"}  # bfloat16 bits (dew.nn.kv_cache)
    with dew.kernels.policy.recording() as choices:
        jax.eval_shape(lambda p: task.model.apply(p, jnp.zeros((1, 4), jnp.int32)), task.params)
    products = {key for key in choices if key[0].isdigit()}
    assert products and all("/bfloat16/" in key for key in products), products


def test_logits_and_greedy_tokens_match_transformers_bfloat16(task, torch_logits):
    logits = task.model.apply(task.params, jnp.asarray([PROMPT], jnp.int32))
    assert logits.dtype == jnp.float32
    ours = np.asarray(logits[0])
    theirs, exact = torch_logits["bfloat16"], torch_logits["float32"]
    # Both are the same network computed with bfloat16 operands (8 significant bits, relative rounding
    # 2^-9) and float32 sums, rounding in slightly different places (transformers also rounds the logits to
    # bfloat16; Dew keeps them float32), so each lies within bfloat16's error of the float32 result and
    # they differ by at most about the sum of the two: twice transformers' own distance from float32,
    # plus one bfloat16 rounding of the largest logit. Observed: 0.139 against a bound of 0.278 (transformers'
    # bfloat16 is 0.126 from its float32; logits up to 6.5).
    bound = 2 * np.max(np.abs(theirs - exact)) + 2.0**-8 * np.max(np.abs(exact))
    assert np.max(np.abs(ours - theirs)) <= bound, (np.max(np.abs(ours - theirs)), bound)
    greedy = generate(task.model, task.params, [PROMPT], NEW, key=jax.random.key(0),
                      sampling=Sampling(temperature=0.0))
    assert greedy.continuations()[0] == torch_logits["greedy"]


def test_the_engine_serves_what_bfloat16_generate_draws(task):
    policies = [Sampling(temperature=0.0), Sampling(temperature=0.9, top_k=20)]
    assert_served_as_generated(task, [Request(PROMPT[index:index + 6 + index], NEW, policies[index % 2], seed=index,
                                              consumer=Tokens()) for index in range(4)])


def test_a_prompt_after_a_copied_bfloat16_beginning_draws_what_generate_draws(task):
    """The bfloat16 cache holds its values' bits: a beginning copied from one slot to another (and back,
    for the padding row a 2-row admission would carry) goes over as they are."""
    from dew.serve import Engine

    engine = Engine(task.model, task.params, slots=2, capacity=32, prefill_rows=1)
    engine.first_programs, engine.later_programs = [("step", 2), ("admit", 1, 32), ("reuse", 1, 16)], []
    engine.start()
    try:
        assert engine.ready.wait(120)
        first = Request(PROMPT + PROMPT[:8], NEW, Sampling(temperature=0.0), seed=0, consumer=Tokens())
        engine.submit([first])
        assert first.consumer.done.wait(60)
        second = Request(PROMPT + PROMPT[:6] + [77, 78], NEW, Sampling(temperature=0.0), seed=1, consumer=Tokens())
        engine.submit([second])
        assert second.consumer.done.wait(60)
        assert engine.reused == len(PROMPT) + 6
    finally:
        engine.close()
    for request in (first, second):
        solo = generate(task.model, task.params, [list(request.prompt)], NEW, key=jax.random.key(request.seed),
                        sampling=Sampling(temperature=0.0))
        assert request.consumer.tokens == solo.continuations()[0]


class Stop(Exception):
    """Raised by a stand-in loader once it has seen its arguments."""


@pytest.mark.parametrize("argv", [["generate", "SOURCE", "--prompt", "a", "--dtype", "bfloat16"],
                                  ["serve", "SOURCE", "--port", "0", "--dtype", "bfloat16"]])
def test_dew_generate_and_dew_serve_hand_dtype_to_the_loader(monkeypatch, argv):
    from dew import cli, runs

    seen = []

    def loader(source, **options):
        seen.append(options["dtype"])
        raise Stop

    # The service module first: imported while `runs.pipeline` is the stand-in, it would bind the stand-in
    # for good (monkeypatch would then restore the stand-in).
    monkeypatch.setattr("dew.serve.service.pipeline", loader)
    monkeypatch.setattr(runs, "pipeline", loader)
    with pytest.raises(Stop):
        cli.COMMANDS[argv[0]][1](argv[1:])
    assert seen == ["bfloat16"]
