"""The serving engine in process: each request draws what a one-row `generate` draws, whatever else is in
flight; nothing compiles after warm-up; EOS, budgets, stop requests, cancellation and the queue bound."""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.sampling import Sampling
from dew.serve import Engine, QueueFull, Request, TooLong
from dew.serve.engine import BATCHED_WIDTH, _share_padding, _widths
from dew.serve.slots import empty_slots
from dew.training.mesh import Layout, MeshSpec
from tests.serve.conftest import generated_alone

pytestmark = pytest.mark.slow  # one warm-up compiles 3 admissions, a chunk and 3 steps (about 10 s on 2 cores)

EOS = 7
SLOTS, CAPACITY, CHUNK = 4, 48, 16


class Collect:
    """A consumer that keeps the tokens; `stop_after` ends the request itself after that many."""

    def __init__(self, stop_after: int | None = None):
        self.tokens, self.reason, self.count = [], None, None
        self.stop_after = stop_after
        self.done = threading.Event()
        self.entries = []  # log-probabilities, for a request that asks for them

    def scores(self, entries) -> None:
        self.entries.extend(entries)

    def token(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return self.stop_after is not None and len(self.tokens) >= self.stop_after

    def finish(self, reason: str, completion_tokens: int) -> None:
        self.reason, self.count = reason, completion_tokens
        self.done.set()


class CompileCounter(logging.Handler):
    """Counts every XLA compilation jax logs (jitted functions and eager operations alike)."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        if record.getMessage().startswith("Compiling"):
            self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def model_and_variables():
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=64)
    # Larger weights make the argmax depend on the context, so a row reading another's cache would show.
    variables = jax.tree_util.tree_map(lambda x: x * 6.0, model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    # placed on the mesh as dew.pipeline places weights: no placement may compile anything anew
    return model, jax.device_put(variables, Layout().shardings(MeshSpec().build(), variables))


@pytest.fixture(scope="module")
def engine(model_and_variables):
    model, variables = model_and_variables
    # prompts past 16 tokens go on in chunks of 16 after their head (all but the first test's shortest)
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), pad_id=0, queue_limit=16,
                    prefill_rows=4, prefill_chunk=CHUNK)
    engine.warm_up()
    engine.start()
    yield engine
    engine.close()


def _solo(model, variables, request: Request) -> tuple[list[int], int, bool]:
    """(tokens before any EOS, tokens drawn, whether EOS ended it) of a one-row `generate`, two continuations
    long so that both rows' requests share its program (`generated_alone`)."""
    s = request.sampling
    policy = Sampling(s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, eos_token_ids=(EOS,))
    assert request.continuation < 2
    rows, ended = generated_alone(model, variables, request.prompt, request.max_tokens, seed=request.seed,
                                  sampling=policy, n=2)
    drawn = rows[request.continuation]
    return [t for t in drawn if t != EOS], len(drawn), ended[request.continuation]


def _draw_alone(model, variables, requests: list[Request]) -> None:
    """Each finished request drew what a one-row `generate` draws, and ended as it ends."""
    for request in requests:
        tokens, drawn, ended_by_eos = _solo(model, variables, request)
        got = request.consumer
        assert (got.tokens, got.count, got.reason) == (tokens, drawn, "stop" if ended_by_eos else "length")


POLICIES = [Sampling(temperature=0.0), Sampling(temperature=0.9), Sampling(temperature=1.0, top_k=5),
            Sampling(temperature=0.8, top_p=0.9, repetition_penalty=1.3), Sampling(temperature=0.0, min_p=0.1)]


def test_every_request_draws_what_a_one_row_generate_draws_and_nothing_compiles(engine, model_and_variables):
    model, variables = model_and_variables
    rng = np.random.default_rng(0)
    requests = []
    for i in range(14):  # more than the slots: they join as others end, prefilled 1, 2 or 4 at a time
        prompt = [int(t) for t in rng.integers(8, 64, int(rng.integers(1, 40)))]
        budget = int(rng.integers(1, CAPACITY - len(prompt) + 1))
        requests.append(Request(prompt, budget, POLICIES[i % len(POLICIES)], seed=int(rng.integers(0, 2**40)),
                                consumer=Collect(), continuation=i % 2))
    counter = CompileCounter()
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    extend = engine._programs["extend", CHUNK]
    chunks = []  # (slot, whether last) of each chunk prefilled after a head

    def counted(params, state, tokens, valid, slot, last):
        chunks.append((int(slot[0]), bool(last[0])))
        return extend(params, state, tokens, valid, slot, last)

    engine._programs["extend", CHUNK] = counted
    try:
        for start in range(0, len(requests), 5):  # three arrivals while others run
            engine.submit(requests[start: start + 5])
        for request in requests:
            assert request.consumer.done.wait(60), "a request did not finish"
    finally:
        engine._programs["extend", CHUNK] = extend
        jax.config.update("jax_log_compiles", False)
        jax_logger.removeHandler(counter)
    assert counter.messages == []
    long = sum(len(request.prompt) > CHUNK for request in requests)
    assert long >= 5 and sum(last for _, last in chunks) == long  # each long prompt ended its chunks once
    assert len(chunks) == sum((len(request.prompt) - 1) // CHUNK for request in requests)
    _draw_alone(model, variables, requests)
    assert engine.load()["busy"] == 0


def test_prompt_widths_grow_by_at_most_half_and_rows_batch_up_to_the_chunk(engine, model_and_variables):
    assert engine.widths == (16, 32, 48) and engine.plain_widths == (16,) and engine.chunk == CHUNK
    assert _widths(1024) == (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    assert _widths(100) == (16, 32, 64, 96, 100)
    assert engine._rows_at(BATCHED_WIDTH) == (1, 2, 4) and engine._rows_at(BATCHED_WIDTH + 1) == (1,)
    with pytest.raises(ValueError, match="prefill_chunk 8 is below the narrowest prompt width 16"):
        Engine(*model_and_variables, slots=SLOTS, capacity=CAPACITY, prefill_chunk=8)


def _ladder_batches(width: int, count: int) -> list[int]:
    """Admissions of 4 rows, then the fewest of 1, 2 or 4 that hold the rest: the engine's at prefill_rows=4."""
    rest = count % 4
    return [4] * (count // 4) + ([next(r for r in (1, 2, 4) if r >= rest)] if rest else [])


def test_a_narrow_widths_last_rows_fill_a_wider_admissions_padding():
    # the 32 prompts of SmolLM2 in serve_profile: 4, 3, 4, 5, 15 and 1 at widths 32 to 256; the 128s' last
    # row fills the padding row of the 192s' last admission (3 prompts in 4 rows): 10 admissions become 9
    counts = {32: 4, 64: 3, 96: 4, 128: 5, 192: 15, 256: 1}
    assert _share_padding(counts, _ladder_batches) == {128: (192, 1)}
    assert _share_padding({16: 1, 32: 3}, _ladder_batches) == {16: (32, 1)}  # a whole width moves up
    assert _share_padding({16: 1, 32: 7}, _ladder_batches) == {16: (32, 1)}
    assert _share_padding({16: 2, 32: 3, 64: 3}, _ladder_batches) == {}  # two rows never fit one padding row
    assert _share_padding({16: 1, 32: 2, 64: 3}, _ladder_batches) == {}  # a batch of 2 pads nothing
    assert _share_padding({16: 1, 64: 3}, _ladder_batches) == {16: (64, 1)}  # the next width with prompts


def _started(engine: Engine, programs: list[tuple]) -> list[tuple]:
    """Start `engine` with only `programs` (a step first), once ready; the list it returns records the
    key of each admission program called after."""
    engine.first_programs, engine.later_programs = programs, []
    engine.start()
    assert engine.ready.wait(120)
    calls = []
    for key in programs[1:]:
        program = engine._programs[key]
        engine._programs[key] = lambda *args, key=key, program=program: calls.append(key) or program(*args)
    return calls


def test_prompts_moved_into_a_wider_admission_draw_what_a_one_row_generate_draws(model_and_variables):
    """Three prompts at width 32 take an admission of 4 rows; a prompt of width 16 arriving with them is
    prefilled in its padding row (no admission at 16 runs), and each request draws what it draws alone."""
    model, variables = model_and_variables
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), pad_id=0,
                    prefill_rows=4, prefill_chunk=32)
    calls = _started(engine, [("step", SLOTS), ("admit", 1, 16), ("admit", 1, 32), ("admit", 4, 32)])
    try:
        rng = np.random.default_rng(1)
        requests = [Request([int(t) for t in rng.integers(8, 64, length)], 12, POLICIES[i], seed=i, consumer=Collect())
                    for i, length in enumerate((20, 5, 27, 31))]
        engine.submit(requests)  # taken together, in one admission
        for request in requests:
            assert request.consumer.done.wait(60), "a request did not finish"
        assert calls == [("admit", 4, 32)]
        _draw_alone(model, variables, requests)
    finally:
        engine.close()


def test_eos_ends_a_request_and_frees_its_slot(engine, model_and_variables):
    model, variables = model_and_variables
    probe = Request([9, 10, 11], 40, Sampling(temperature=0.0), seed=0, consumer=Collect())
    engine.submit([probe])
    assert probe.consumer.done.wait(30)
    # find a prompt whose greedy continuation reaches EOS (the model is random; some do within 40 tokens)
    for first in range(8, 64):
        request = Request([first, 12], 40, Sampling(temperature=0.0), seed=0, consumer=Collect())
        tokens, drawn, ended = _solo(model, variables, request)
        if ended:
            break
    else:
        pytest.skip("no greedy continuation of this random model reaches EOS")
    engine.submit([request])
    assert request.consumer.done.wait(30)
    assert (request.consumer.reason, request.consumer.tokens, request.consumer.count) == ("stop", tokens, drawn)
    assert EOS not in request.consumer.tokens and engine.load()["busy"] == 0


def test_a_consumer_stop_or_a_cancel_frees_the_slot_and_the_others_go_on(engine, model_and_variables):
    model, variables = model_and_variables
    stopping = Request([20, 21, 22], 40, Sampling(temperature=0.0), seed=1, consumer=Collect(stop_after=3))
    others = [Request([30 + i], 30, Sampling(temperature=0.7), seed=i, consumer=Collect()) for i in range(3)]
    engine.submit([stopping, *others])
    assert stopping.consumer.done.wait(30)
    assert stopping.consumer.reason == "stop" and len(stopping.consumer.tokens) == 3
    for request in others:
        assert request.consumer.done.wait(30)
        assert request.consumer.tokens == _solo(model, variables, request)[0]
    long = Request([40], CAPACITY - 1, Sampling(temperature=0.0), seed=0, consumer=Collect())
    engine.submit([long])
    engine.cancel(long)
    assert long.consumer.done.wait(30) and long.consumer.reason == "cancelled"
    assert engine.load()["busy"] == 0


def test_a_head_then_chunks_whose_last_is_short_beside_a_cancelled_long_prompt(engine, model_and_variables,
                                                                              monkeypatch):
    # as while wider admissions compile: the head is what the widest compiled holds (here 5 tokens), so
    # the last chunk is shorter than the rest (left-padded)
    monkeypatch.setattr(engine, "_head", lambda length: min(length, 5))
    model, variables = model_and_variables
    rng = np.random.default_rng(1)
    requests = [Request([int(t) for t in rng.integers(8, 64, length)], 6, POLICIES[i % 2], seed=i, consumer=Collect())
                for i, length in enumerate((23, 40, 5, 31))]
    cancelled = Request([int(t) for t in rng.integers(8, 64, 40)], 6, Sampling(), seed=0, consumer=Collect())
    engine.submit([cancelled, *requests])
    engine.cancel(cancelled)
    for request in requests:
        assert request.consumer.done.wait(30)
        assert request.consumer.tokens == _solo(model, variables, request)[0]
    assert cancelled.consumer.done.wait(30) and cancelled.consumer.reason == "cancelled"
    assert engine.load()["busy"] == 0


def test_slots_beyond_the_memory_are_refused_before_any_is_allocated(model_and_variables):
    model, variables = model_and_variables
    with pytest.raises(ValueError, match=r"10000000000 slots of 48 positions would hold .* GiB .*serve at most \d+ "
                                         r"slots \(dew serve --slots\)"):
        Engine(model, variables, slots=10**10, capacity=CAPACITY)


def test_the_slots_state_is_made_on_a_thread_as_its_shapes_say_holding_zeros(model_and_variables):
    """The state made beside the programs has the shapes, dtypes and placements they were compiled for, and
    the values `empty_slots` makes eagerly: a cache of zeros, every slot done."""
    model, variables = model_and_variables
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY)
    state = engine._state_made.result(60)
    _, abstract = engine._abstract
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(abstract)
    for made, shape in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(abstract)):
        assert (made.shape, made.dtype, made.sharding, getattr(made, "weak_type", False)) == \
            (shape.shape, shape.dtype, shape.sharding, getattr(shape, "weak_type", False))
    eager = empty_slots(model, SLOTS, CAPACITY, engine._top_k_bound)
    data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    for made, expected in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(data(made), data(expected))
    assert not np.any(state.decode.cache.runs[0].keys) and np.all(state.decode.done_B)


def test_an_engine_whose_state_cannot_be_made_fails_and_is_never_ready(model_and_variables):
    model, variables = model_and_variables
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY)
    engine._state_made.result(60)
    engine._state_made = concurrent.futures.Future()
    engine._state_made.set_exception(MemoryError("no room for the KV cache"))
    engine.first_programs, engine.later_programs = [], []  # nothing to compile: the state is what fails
    failed = []
    engine.start(on_failure=failed.append)
    engine._thread.join(30)
    assert isinstance(engine.failure, MemoryError) and failed == [engine.failure] and not engine.ready.is_set()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([Request([1, 2], 3, Sampling(), seed=0, consumer=Collect())])


def test_refusals_and_the_queue_bound(engine):
    with pytest.raises(TooLong, match="prompt's 40 tokens plus max_tokens 9 make 49, beyond this server's context of 48"):
        engine.submit([Request([1] * 40, 9, Sampling(), seed=0, consumer=Collect())])
    with pytest.raises(ValueError, match="top_k is 65; this server keeps at most the 64"):
        engine.submit([Request([1], 2, Sampling(top_k=65), seed=0, consumer=Collect())])
    with pytest.raises(ValueError, match=f"seed is {2**63}; a seed is an integer from -2\\*\\*63 to 2\\*\\*63 - 1"):
        engine.submit([Request([1], 2, Sampling(), seed=2**63, consumer=Collect())])
    # 4 slots and 16 places in the queue never take 21 rows at once
    too_many = [Request([1], 2, Sampling(), seed=0, consumer=Collect()) for _ in range(SLOTS + 16 + 1)]
    with pytest.raises(ValueError, match="21 requests submitted together can never all be taken"):
        engine.submit(too_many)
    assert engine.load()["waiting"] == 0
    # all or nothing: with every slot and place taken, one more row waits for none of them
    long = [Request([1], CAPACITY - 1, Sampling(), seed=0, consumer=Collect()) for _ in range(SLOTS + 16)]
    with engine._lock:  # holds the engine's thread off, so that no row ends (EOS) between the two submits
        engine.submit(long)
        with pytest.raises(QueueFull, match="the queue holds 16"):
            engine.submit([Request([1], 2, Sampling(), seed=0, consumer=Collect())])
    for request in long:
        engine.cancel(request)
    assert all(request.consumer.done.wait(30) for request in long)
    assert engine.load()["busy"] == engine.load()["waiting"] == 0 and engine.load()["running"]


def test_log_probabilities_are_the_models_float32_log_softmax_whatever_the_sampling(engine, model_and_variables):
    """The prompt's (scored at admission) and the drawn tokens' (scored by the step that draws them)
    log-probabilities and top alternatives equal a full forward pass over prompt and continuation,
    with the tempered, filtered sampler beside a plain request in flight. Both sides are float32 over
    the same weights; they differ only in summation order (cached decode against one pass): a few
    float32 ulps (1.2e-7 relative) of logits up to 13.3 in magnitude, through two layers and a log-sum-exp;
    atol 1e-4 (observed 3.6e-6)."""
    model, variables = model_and_variables
    prompt = [9, 30, 11, 52, 17]
    asking = Request(prompt, 12, Sampling(temperature=0.9, top_k=5, repetition_penalty=1.3), seed=4,
                     consumer=Collect(), log_probs=3, prompt_log_probs=2)
    plain = Request([12, 13], 20, Sampling(temperature=0.7), seed=5, consumer=Collect())
    engine.submit([asking, plain])
    assert asking.consumer.done.wait(60) and plain.consumer.done.wait(60)
    entries = asking.consumer.entries
    assert plain.consumer.entries == [] and plain.consumer.tokens == _solo(model, variables, plain)[0]
    assert len(entries) == len(prompt) + asking.consumer.count
    assert entries[0].log_prob is None and [e.token for e in entries[: len(prompt)]] == prompt
    drawn = [e.token for e in entries[len(prompt):]]
    assert [t for t in drawn if t != EOS] == asking.consumer.tokens == _solo(model, variables, asking)[0]
    ids = jnp.asarray([prompt + drawn])
    expected = np.asarray(jax.nn.log_softmax(model.apply(variables, ids)[0].astype(jnp.float32), axis=-1))
    for position, entry in enumerate(entries[1:], start=1):
        row = expected[position - 1]
        wanted = 2 if position < len(prompt) else 3
        top_ids = [token for token, _ in entry.top]
        assert top_ids == list(np.argsort(-row)[:wanted]), position
        np.testing.assert_allclose([entry.log_prob, *(value for _, value in entry.top)],
                                   [row[entry.token], *row[top_ids]], atol=1e-4, rtol=0)
        if entry.token == top_ids[0]:  # the same value, bit for bit, as a harness's greedy check needs
            assert entry.log_prob == entry.top[0][1]


def test_prompts_that_begin_alike_are_prefilled_after_a_copy_and_draw_what_a_one_row_generate_draws(
        model_and_variables):
    """A conversation that goes on begins with what its slot's cache holds (its prompt and the tokens it
    drew); prompts arriving together that begin alike are prefilled after a copy of the first's beginning,
    in a later wave where they begin with more of it than of anything held; each draws what it draws alone
    (sampled, with a repetition penalty reading the copied tokens too)."""
    model, variables = model_and_variables
    engine = Engine(model, variables, slots=8, capacity=64, eos_token_ids=(EOS,), pad_id=0, prefill_rows=4,
                    prefill_chunk=32)
    assert engine.plain_widths == (16, 32)
    calls = _started(engine, [("step", 8), ("admit", 1, 16), ("admit", 1, 32), ("reuse", 1, 16), ("reuse", 4, 16),
                              ("extend", 32), ("resume", 1, 32)])
    try:
        rng = np.random.default_rng(2)
        tokens = lambda count: [int(t) for t in rng.integers(8, 64, count)]  # noqa: E731
        system, notes = tokens(12), tokens(14)
        first = Request(system + tokens(4), 6, Sampling(temperature=0.0), seed=0, consumer=Collect())
        engine.submit([first])
        assert first.consumer.done.wait(60)
        assert calls == [("admit", 1, 16)]
        drawn = first.consumer.tokens + ([EOS] if first.consumer.reason == "stop" else [])
        going_on = Request(first.prompt + drawn + tokens(3), 6, POLICIES[3], seed=1, consumer=Collect())
        same_system = Request(system + tokens(10), 6, POLICIES[1], seed=2, consumer=Collect())
        notes_a = Request(notes + tokens(10), 6, POLICIES[3], seed=3, consumer=Collect())
        notes_b = Request(notes + tokens(9), 6, POLICIES[2], seed=4, consumer=Collect())
        notes_c = Request(notes + tokens(8), 6, POLICIES[0], seed=5, consumer=Collect())
        requests = [same_system, going_on, notes_a, notes_b, notes_c]
        assert len(going_on.prompt) <= 32 and all(len(r.prompt) > 16 for r in requests)
        calls.clear()
        engine.submit(requests)
        for request in requests:
            assert request.consumer.done.wait(60), "a request did not finish"
        # going_on takes back its slot (0) and copies its 16 + drawn tokens; notes_a is prefilled whole at 32,
        # then notes_b and notes_c copy its 14 notes, beside going_on in an admission of 4 rows whose padding
        # row takes slot 0 as it was and puts it back before going_on's row goes in; same_system waits a
        # wave for going_on's 12 system tokens
        assert calls == [("admit", 1, 32), ("reuse", 4, 16), ("reuse", 1, 16)]
        assert engine.reused == (16 + len(drawn)) + 14 + 14 + 12
        assert engine._owners == [None] * 8
        _draw_alone(model, variables, requests)
        # a prompt longer than the chunk (32) goes on after the 40 tokens of another's that a slot holds
        long = Request(tokens(45), 4, POLICIES[3], seed=6, consumer=Collect())
        engine.submit([long])
        assert long.consumer.done.wait(60)
        longer = Request(long.prompt[:40] + tokens(12), 6, POLICIES[1], seed=7, consumer=Collect())
        calls.clear()
        engine.submit([longer])
        assert longer.consumer.done.wait(60)
        assert calls == [("resume", 1, 32)] and engine.reused == (16 + len(drawn)) + 14 + 14 + 12 + 40
        load = engine.load()
        assert load["reused_prompt_tokens"] == engine.reused
        assert load["prompt_tokens"] == sum(len(r.prompt) for r in [first, *requests, long, longer])
        _draw_alone(model, variables, [long, longer])
    finally:
        engine.close()
