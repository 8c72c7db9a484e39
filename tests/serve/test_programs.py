"""Serving programs kept between processes (`dew.serve.programs`): an engine that loads them draws the
tokens the one that compiled them drew, and the key changes with the model, the shapes, the versions,
the CPU and Dew's code."""

from __future__ import annotations

import json
import os
import stat
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import compilation_cache, models
from dew.sampling import Sampling
from dew.serve import Engine, Request
from dew.serve import programs
from dew.serve.programs import ProgramCache
from tests.serve.test_engine import Collect

pytestmark = pytest.mark.slow  # engines compile three programs several times (6 to 17 s on 2 shared cores)

SLOTS, CAPACITY, EOS = 2, 16, 7  # three programs: steps over 1 and 2 slots, one-row admissions at width 16


@pytest.fixture(scope="module")
def model_and_variables():
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=CAPACITY)
    variables = jax.tree_util.tree_map(lambda x: x * 6.0, model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    return model, variables


def _served(model, variables, directory) -> tuple[ProgramCache, list]:
    """(the engine's cache, each request's tokens and reason) after warming up from `directory` and serving
    a greedy and a sampled request together."""
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), prefill_rows=1)
    engine.program_cache = ProgramCache.of(engine, directory)
    engine.warm_up()
    engine.start()
    try:
        requests = [Request([9, 12, 30], 10, Sampling(temperature=0.0), seed=1, consumer=Collect()),
                    Request([40, 41], 12, Sampling(temperature=0.9, top_k=8), seed=5, consumer=Collect())]
        engine.submit(requests)
        for request in requests:
            assert request.consumer.done.wait(60)
    finally:
        engine.close()
    engine.program_cache.wait()  # a program JAX's cache gave (where a test before turned it on) is kept after ready
    return engine.program_cache, [(request.consumer.tokens, request.consumer.reason) for request in requests]


def test_loaded_programs_draw_what_compiled_ones_drew(model_and_variables, tmp_path, caplog):
    model, variables = model_and_variables
    first, drawn = _served(model, variables, tmp_path)
    assert (first.stored, first.loaded) == (3, 0) and len(list(tmp_path.iterdir())) == 3
    assert sum(len(tokens) for tokens, _ in drawn) > 10
    again, drawn_again = _served(model, variables, tmp_path)
    assert (again.stored, again.loaded) == (0, 3)
    assert drawn_again == drawn
    damaged = sorted(tmp_path.iterdir())[0]
    damaged.write_bytes(damaged.read_bytes()[:100])  # cut short: compiled again, and kept whole
    third, drawn_third = _served(model, variables, tmp_path)
    assert (third.stored, third.loaded) == (1, 2) and drawn_third == drawn
    assert "did not load the compiled program" in caplog.text


def test_entries_of_other_keys_are_compiled_again_not_run(model_and_variables, tmp_path, caplog):
    """Entries swapped in pairs (each under the other's name) once ran: a step called with an admission's
    arguments stopped the engine (XLA: "Argument types differ"), and a step over 1 row run as the step over 2
    would have drawn other tokens. Each is compiled again and rewritten under its own name."""
    model, variables = model_and_variables
    _, drawn = _served(model, variables, tmp_path)
    entries = {path.name.rsplit("-", 1)[0]: path for path in tmp_path.iterdir()}
    assert sorted(entries) == ["admit-1-16", "step-1", "step-2"]
    steps = entries["step-1"].read_bytes(), entries["step-2"].read_bytes()
    entries["step-1"].write_bytes(steps[1])  # same arguments, another program
    entries["step-2"].write_bytes(entries["admit-1-16"].read_bytes())  # other arguments
    entries["admit-1-16"].write_bytes(steps[0])
    again, drawn_again = _served(model, variables, tmp_path)
    assert (again.stored, again.loaded) == (3, 0) and drawn_again == drawn
    assert caplog.text.count("of another key (an entry renamed or copied over this one's name)") == 3
    third, drawn_third = _served(model, variables, tmp_path)  # rewritten whole
    assert (third.stored, third.loaded) == (0, 3) and drawn_third == drawn


def test_a_program_whose_arguments_differ_is_not_run(model_and_variables, tmp_path, monkeypatch, caplog):
    """Past the header, the loaded program's own arguments are checked against the caller's."""
    model, variables = model_and_variables
    _served(model, variables, tmp_path)
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), prefill_rows=1)
    cache = ProgramCache.of(engine, tmp_path)
    arguments = engine._abstract + (jax.ShapeDtypeStruct((SLOTS,), bool),)
    admission = next(path for path in tmp_path.iterdir() if path.name.startswith("admit-1-16-"))
    layout, header, payload = admission.read_bytes().split(b"\n", 2)
    header = json.loads(header) | {"key": cache._digest(("step", 2), arguments)}  # a header that says "step 2"
    (tmp_path / cache.key(("step", 2), arguments)).write_bytes(b"\n".join([layout, json.dumps(header).encode(),
                                                                            payload]))
    assert cache.load(("step", 2), arguments) is None
    assert "its program takes" in caplog.text and "compiling it again" in caplog.text


@pytest.mark.parametrize("change, words", [
    (lambda path, patch: path.chmod(0o620), "other users may write it (mode -rw--w----)"),
    (lambda path, patch: patch.setattr(os, "geteuid", lambda user=os.geteuid() + 1: user),
     "not to this process's user"),
])
def test_an_entry_another_user_could_write_is_not_read(model_and_variables, tmp_path, monkeypatch, caplog, change,
                                                       words):
    """Reading an entry runs what it holds (JAX's serialization is a pickle, the program machine code): one
    another user owns or may write is compiled again instead, and the entries written are this user's alone."""
    model, variables = model_and_variables
    _served(model, variables, tmp_path)
    assert {stat.S_IMODE(path.stat().st_mode) for path in tmp_path.iterdir()} == {0o600}
    unpickled = []
    monkeypatch.setattr(programs.pickle, "loads", lambda payload: unpickled.append(payload))
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), prefill_rows=1)
    cache = ProgramCache.of(engine, tmp_path)
    arguments = engine._abstract + (jax.ShapeDtypeStruct((SLOTS,), bool),)
    with monkeypatch.context() as patch:
        change(cache.directory / cache.key(("step", 2), arguments), patch)
        assert cache.load(("step", 2), arguments) is None
    assert not unpickled and words in caplog.text and "reading it would run what it holds" in caplog.text


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX's")
def test_a_pipe_under_an_entrys_name_is_not_waited_on(model_and_variables, tmp_path, caplog):
    """Opening a named pipe waits for a writer: whoever can write the directory could stop the engine's thread
    at its first program with one under an entry's name. It is refused as not a regular file instead."""
    model, variables = model_and_variables
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), prefill_rows=1)
    cache = ProgramCache.of(engine, tmp_path)
    arguments = engine._abstract + (jax.ShapeDtypeStruct((SLOTS,), bool),)
    pipe = cache.directory / cache.key(("step", 2), arguments)
    os.mkfifo(pipe, 0o600)
    loaded = []
    reader = threading.Thread(target=lambda: loaded.append(cache.load(("step", 2), arguments)), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # release the reader: a writer opens the pipe and closes it at once
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    assert loaded == [None], "the load waited on the pipe"
    assert f"did not load the compiled program {pipe} (it is not a regular file)" in caplog.text


def test_a_file_where_the_programs_directory_goes_serves_without_it(model_and_variables, tmp_path, recwarn):
    """`dew-programs` (or the cache itself) a file: warned about once, and the engine compiles each program."""
    model, variables = model_and_variables
    (tmp_path / "dew-programs").write_text("not a directory")
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), prefill_rows=1)
    assert ProgramCache.of(engine, tmp_path / "dew-programs") is None
    assert ProgramCache.of(engine, tmp_path / "dew-programs" / "inner") is None
    messages = [str(warning.message) for warning in recwarn]
    assert any(f"{tmp_path / 'dew-programs'} is a file, not a directory: Dew keeps no serving programs there" in m
               for m in messages), messages
    assert any(f"lies under the file {tmp_path / 'dew-programs'}" in m for m in messages), messages


def test_a_program_jaxs_cache_gave_back_is_compiled_again_to_be_kept(model_and_variables, tmp_path, monkeypatch):
    """An executable from JAX's own cache cannot be written out (its copy fails when called): it serves, and
    a compile JAX's cache cannot answer is kept instead, which the next engine loads."""
    model, variables = model_and_variables
    _, drawn = _served(model, variables, tmp_path / "compiled")
    hits = iter(range(1000))
    with monkeypatch.context() as patch:
        patch.setattr(programs, "_hits", lambda: next(hits))  # as if JAX's cache answered every compile
        cache, drawn_from_jax_cache = _served(model, variables, tmp_path / "kept")
    assert drawn_from_jax_cache == drawn and (cache.stored, cache.loaded) == (3, 0)
    again, drawn_again = _served(model, variables, tmp_path / "kept")
    assert (again.stored, again.loaded) == (0, 3) and drawn_again == drawn


def test_the_key_changes_with_what_the_program_is_made_of(model_and_variables, tmp_path, monkeypatch):
    model, variables = model_and_variables
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), prefill_rows=1)
    cache = ProgramCache.of(engine, tmp_path)
    arguments = (jax.ShapeDtypeStruct((SLOTS, 8), jnp.float32), np.zeros(SLOTS, np.int32))
    key = cache.key(("step", 2), arguments)
    assert cache.key(("step", 2), arguments) == key
    assert cache.key(("step", 1), arguments) != key
    assert cache.key(("step", 2), (jax.ShapeDtypeStruct((SLOTS, 9), jnp.float32), arguments[1])) != key
    assert cache.key(("step", 2), (jax.ShapeDtypeStruct((SLOTS, 8), jnp.bfloat16), arguments[1])) != key
    other_model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                               num_kv_heads=2, mlp_features=64, max_seq_len=CAPACITY)
    assert ProgramCache.of(Engine(other_model, other_model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)),
                                  slots=SLOTS, capacity=CAPACITY), tmp_path).key(("step", 2), arguments) != key
    assert ProgramCache.of(Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS, 3)),
                           tmp_path).key(("step", 2), arguments) != key
    # The machine and the software, each: what `environment` says changes, and with it every key.
    described = compilation_cache.environment()
    assert f"jax {jax.__version__}" in described and compilation_cache.dew_digest() in described
    changes = {"_version": lambda name: "0.0.0", "cpu_description": lambda: "another CPU; flags: sse2",
               "dew_digest": lambda: "another Dew"}
    for name, replacement in changes.items():
        with monkeypatch.context() as patch:
            patch.setattr(compilation_cache, name, replacement)
            changed = compilation_cache.environment.__wrapped__()
            assert changed != described, name
            patch.setattr(programs, "environment", lambda: changed)
            assert cache.key(("step", 2), arguments) != key, name
    with monkeypatch.context() as patch:
        patch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")
        assert compilation_cache.environment.__wrapped__() != described
    logging_compiles = jax.config.jax_log_compiles  # a JAX setting: any of them
    jax.config.update("jax_log_compiles", not logging_compiles)
    try:
        assert compilation_cache.environment.__wrapped__() != described
    finally:
        jax.config.update("jax_log_compiles", logging_compiles)


def test_the_load_counts_the_programs_still_to_keep(model_and_variables, tmp_path, monkeypatch):
    """`/health`'s `keeping`: programs JAX's cache gave, still to be compiled once more beside the serving (a
    benchmark waits for none, so that it times serving alone)."""
    model, variables = model_and_variables
    hits = iter(range(1000))
    monkeypatch.setattr(programs, "_hits", lambda: next(hits))  # as if JAX's cache answered every compile
    engine = Engine(model, variables, slots=SLOTS, capacity=CAPACITY, eos_token_ids=(EOS,), prefill_rows=1)
    engine.program_cache = ProgramCache.of(engine, tmp_path)
    engine.warm_up()  # each program waits to be kept until the engine is ready
    load = engine.load()
    assert load["keeping"] == load["compiled"] == load["programs"] == 3
    engine.start()
    try:
        assert engine.ready.wait(60)
        engine.program_cache.wait()
        assert engine.load()["keeping"] == 0 and engine.program_cache.stored == 3
    finally:
        engine.close()
