"""Serving a recurrent model: a tiny Mamba2 checkpoint and a tiny hybrid one (Qwen3-Next: Gated DeltaNet
layers and an attention layer, two kinds of cache in one) through the engine in process (rows reset and
refilled while others decode, each request's tokens what a one-row `generate` draws) and through a real
`dew serve` process (the same text as `generate`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.sampling import Sampling, generate
from dew.serve import Engine, Request
from tests.serve.conftest import running, write_checkpoint
from tests.serve.test_engine import Collect

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow  # the engine compiles its admissions and step (about 15 s)

SLOTS, CAPACITY = 4, 48


def tiny_mamba2(vocab_size: int, eos: int):
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=vocab_size, hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=8, n_groups=2,
        chunk_size=8, num_hidden_layers=2, eos_token_id=eos, bos_token_id=None, pad_token_id=eos))


def tiny_qwen3_next(vocab_size: int, eos: int):
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, eos_token_id=eos, bos_token_id=None, pad_token_id=eos))


@pytest.fixture(scope="module", params=["mamba2", "qwen3_next"])
def recurrent_chat(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return directory, write_checkpoint(directory, {"mamba2": tiny_mamba2, "qwen3_next": tiny_qwen3_next}[request.param])


def test_engine_rows_reset_and_refill_with_each_requests_own_state(recurrent_chat):
    """Ten greedy and sampled requests through four slots: every slot serves several requests in turn, its
    state reset by each admission while the other slots decode."""
    directory, _ = recurrent_chat
    bundle = load_pretrained(directory)
    model, variables = bundle.model, bundle.variables
    eos = bundle.generation.eos_token_ids
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=eos, pad_id=0, prefill_rows=2)
    engine.start()
    try:
        rng = np.random.default_rng(1)
        requests = []
        for i in range(10):
            prompt = [int(t) for t in rng.integers(3, model.config.vocab_size, int(rng.integers(1, 20)))]
            policy = Sampling(temperature=0.0) if i % 2 else Sampling(temperature=0.9)
            requests.append(Request(prompt, int(rng.integers(2, 12)), policy, seed=i, consumer=Collect()))
        engine.submit(requests[:5])
        engine.submit(requests[5:])
        for request in requests:
            assert request.consumer.done.wait(120), "a request did not finish"
    finally:
        engine.close()

    # Each request against a one-row generate of the longest request's length, cut to its own: a row's
    # draws at step t come from fold_in(its key, t) whatever the length, and one length compiles one
    # program per prompt width instead of one per request (qwen3_next's take seconds each).
    longest = max(request.max_tokens for request in requests)
    for index, request in enumerate(requests):
        s = request.sampling
        policy = Sampling(s.temperature, eos_token_ids=tuple(eos))
        alone = generate(model, variables, [list(request.prompt)], longest, key=jax.random.key(request.seed),
                         sampling=policy)
        expected = [t for t in alone.continuations()[0][:request.max_tokens] if t not in eos]
        assert request.consumer.tokens == expected, index


def test_dew_serve_answers_a_recurrent_checkpoint_with_generates_text(recurrent_chat, tmp_path):
    directory, hf_tokenizer = recurrent_chat
    bundle = load_pretrained(directory)
    with running(directory, "--slots", "2", "--capacity", "48", "--name", "tiny-mamba2",
                 log=tmp_path / "serve.log") as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = "the quick brown fox"
        answer = client.completions.create(model="tiny-mamba2", prompt=prompt, max_tokens=10, temperature=0)

    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    policy = Sampling(temperature=0.0, eos_token_ids=bundle.generation.eos_token_ids)
    generation = generate(bundle.model, bundle.variables, [ids], 10, key=jax.random.key(0), sampling=policy)
    eos = set(policy.eos_token_ids)
    text = hf_tokenizer.decode([t for t in generation.continuations()[0] if t not in eos], skip_special_tokens=True)
    assert answer.choices[0].text == text
