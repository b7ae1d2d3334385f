"""The executable store (what a process JAX's persistent cache does not write from keeps of its
programs): a second store on the same folder loads what the first compiled, and the loaded program
computes what the jit computes, also where JAX's cache held the program (compiled afresh); the key
tells devices apart; a file that does not load is compiled again; the owners of programs of one
signature and of initializations call what a store gave. A pipeline whose stage programs came from
the store runs them (its stages' jits are never called) and gives the jit-run pipeline's loss and
gradients. Across real processes: tests/multiprocess/test_runtime_multihost.py."""

import concurrent.futures
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_fixtures import separate_batch, separate_stages

from dflop_jax.programs.executable_store import ExecutableStore, call_once, hand_over
from dflop_jax.programs.leaf_program import LeafProgram
from dflop_jax.programs.lowering import KeptProgram
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.precompile import CompileCounter, precompile

_SALTS = itertools.count(1)


def _salt() -> int:
    """A constant no other test's or process's program holds: a program built with it is compiled
    by XLA in this test first, not served by the suite's JAX cache (which the store leaves such
    programs to)."""
    return os.getpid() % 100_000 * 100 + next(_SALTS)  # under 2**24: exact in float32


def _scaled(ws, x, k):
    return [w * jnp.sum(x) * k for w in ws]


def _lowered(devices, k):
    mesh = Mesh(np.array(devices), ("data",))
    s = NamedSharding(mesh, P("data"))
    ws = [jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=s) for _ in range(2)]
    x = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=s)
    jit = jax.jit(_scaled, static_argnums=2, donate_argnums=0)
    return jit, jit.lower(ws, x, k), s


def test_a_second_store_loads_what_the_first_compiled(tmp_path):
    k = _salt()
    jit, lowered, s = _lowered(jax.devices()[:2], k)
    first = ExecutableStore(tmp_path)
    assert first.compile(lowered, (0, 1))[1] == "compiled"
    assert first.compile(lowered, (0, 1))[1] == "held"
    assert first.saved == 1
    second = ExecutableStore(tmp_path)
    compiled, source = second.compile(lowered, (0, 1))
    assert (source, second.loaded, second.saved) == ("loaded", 1, 0)

    def args():
        w = np.arange(12, dtype=np.float32).reshape(4, 3)
        return [jax.device_put(w, s), jax.device_put(w + 1, s)], jax.device_put(
            np.ones(4, np.float32), s
        )

    ws, x = args()
    got = compiled(ws, x)  # the static argument is part of the program, not an argument
    assert ws[0].is_deleted()  # donated, as the jit's are
    want = jit(*args(), k)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert g.sharding == s


def test_threads_asking_for_one_program_at_once_build_it_once(tmp_path, monkeypatch):
    """`precompile` compiles in a pool of threads, and two stages' initializations can lower to
    one program: the first thread builds it and the others get it "held", so each program is
    compiled (or loaded) once and the runs' counts do not depend on which thread came first."""
    from dflop_jax.programs import executable_store

    _, lowered, _ = _lowered(jax.devices()[:2], _salt())
    compile_fresh, entered = executable_store._compile_fresh_or_served, threading.Event()

    def slow(lw):  # the first thread is still compiling when the second asks
        entered.set()
        time.sleep(0.5)
        return compile_fresh(lw)

    monkeypatch.setattr(executable_store, "_compile_fresh_or_served", slow)
    store = ExecutableStore(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(store.compile, lowered, (0, 1))
        entered.wait(10)
        second = pool.submit(store.compile, lowered, (0, 1))
        sources = [first.result()[1], second.result()[1]]
    assert sources == ["compiled", "held"]
    assert first.result()[0] is second.result()[0]
    assert store.saved == 1


def test_the_key_tells_devices_apart_and_a_bad_file_is_compiled_again(tmp_path, caplog):
    k = _salt()
    _, on_01, _ = _lowered(jax.devices()[:2], k)
    _, on_23, _ = _lowered(jax.devices()[2:4], k)
    store = ExecutableStore(tmp_path)
    assert on_01.as_text() == on_23.as_text()  # the module alone does not say where it runs
    assert store.key(on_01, (0, 1)) != store.key(on_23, (2, 3))
    store.compile(on_01, (0, 1))
    path = tmp_path / f"{store.key(on_01, (0, 1))}.pkl"
    path.write_bytes(path.read_bytes()[:100])  # cut short
    again = ExecutableStore(tmp_path)
    assert again.compile(on_01, (0, 1))[1] == "compiled"
    assert (again.failed, again.saved) == (1, 1)
    assert "did not load" in caplog.text
    assert ExecutableStore(tmp_path).compile(on_01, (0, 1))[1] == "loaded"  # rewritten whole


def test_programs_of_one_signature_and_initializations_run_what_a_store_gave(tmp_path):
    """A program of one signature (a transfer's: `KeptProgram`; an optimizer's, trees as leaves:
    `LeafProgram`) calls the program a store loaded once `precompile` hands it over (`keep`), and
    an initialization (`call_once`) runs the store's program; each gives the jit's values, and
    each load counts as a program built and found in a cache."""
    salt = float(_salt())
    devices = jax.devices()[:2]
    s = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
    x = jax.device_put(np.arange(8, dtype=np.float32), s)
    counter = CompileCounter()

    def loaded(lw, folder):
        ExecutableStore(tmp_path / folder).compile(lw.lowered, lw.devices)  # a first run's
        built, hits = counter.count, counter.cache_hits
        compiled, source = ExecutableStore(tmp_path / folder).compile(lw.lowered, lw.devices)
        assert source == "loaded" and (counter.count, counter.cache_hits) == (built + 1, hits + 1)
        lw.keep(compiled)
        return compiled

    kept = KeptProgram(jax.jit(lambda v: v * salt, out_shardings=s), devices)
    assert loaded(kept.lowering("transfer", x), "kept") is kept.run
    want = np.arange(8, dtype=np.float32) * np.float32(salt)
    np.testing.assert_array_equal(np.asarray(kept.run(x)), want)

    tree = {"a": x, "b": x + 1}
    leaf = LeafProgram(lambda t: {"sum": t["a"] + t["b"] + salt}, (jax.tree.structure(tree),),
                       jax.tree.structure({"sum": 0}))  # fmt: skip
    assert loaded(leaf.lowering("step", (0, 1), tree), "leaf") is leaf.run
    (total,) = leaf.run(jax.tree.leaves(tree))  # leaves in, leaves out, as the jit's
    want = np.arange(8, dtype=np.float32) * 2 + 1 + np.float32(salt)
    np.testing.assert_array_equal(np.asarray(total), want)

    init = jax.jit(lambda k: jax.random.normal(k, (8,)) + salt, out_shardings=s)
    key = jax.random.key(3)
    call_once(init, (key,), devices, ExecutableStore(tmp_path / "init"))  # a first run's
    store = ExecutableStore(tmp_path / "init")
    got = call_once(init, (key,), devices, store)
    assert (store.loaded, store.saved) == (1, 0) and got.sharding == s
    np.testing.assert_array_equal(np.asarray(got), np.asarray(init(key)))  # the jit's, after


def test_hand_over_gives_each_owner_the_program_the_store_loads(tmp_path):
    """`hand_over` (the start-up's transfers, which run before `precompile`): the owner of a
    lowering calls the program a second run's store loaded; without a store it keeps its jit."""
    salt = float(_salt())
    devices = jax.devices()[:2]
    s = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))
    x = jax.device_put(np.arange(8, dtype=np.float32), s)

    def owner():
        return KeptProgram(jax.jit(lambda v: v - salt, out_shardings=s), devices)

    hand_over([owner().lowering("transfer", x)], ExecutableStore(tmp_path))  # a first run's
    second, store = owner(), ExecutableStore(tmp_path)
    hand_over([second.lowering("transfer", x)], store)
    assert (store.loaded, store.saved) == (1, 0) and second.run is not second.jit
    np.testing.assert_array_equal(np.asarray(second.run(x)), np.asarray(second.jit(x)))
    alone = owner()
    hand_over([alone.lowering("transfer", x)], None)
    assert alone.run is alone.jit


def test_a_program_jax_cache_serves_is_left_to_it(tmp_path):
    """A program JAX's persistent cache serves (the suite's cache is on, as a process other than
    0 reads process 0's) is not written to the store: on XLA:CPU an executable JAX loaded from its
    cache serializes into a file that loads but fails to run ("Function ... not found"), so the
    store leaves it to that cache, and the program runs and gives the jit's values."""
    salt = float(_salt())

    def program():  # a new function each time: a new jit, which JAX's in-memory caches do not know
        return jax.jit(lambda w, x: jnp.tanh(w @ x) * salt + jnp.exp(-x))

    w, x = np.ones((16, 16), np.float32) / 16, np.linspace(0, 1, 16, dtype=np.float32)
    want = np.asarray(program()(w, x))  # XLA compiles it, and JAX writes it to its cache
    counter = CompileCounter()
    hits = counter.cache_hits
    device = (jax.devices()[0].id,)
    for _ in range(2):  # a first run's store, then a second's
        store = ExecutableStore(tmp_path)
        compiled, source = store.compile(program().lower(w, x), device)
        assert (source, store.saved, store.failed) == ("compiled", 0, 0)
        np.testing.assert_array_equal(np.asarray(compiled(w, x)), want)
    assert counter.cache_hits == hits + 2  # both from JAX's cache
    assert not list(tmp_path.glob("*.pkl"))


def test_one_process_has_no_store(tmp_path):
    assert ExecutableStore.for_this_process(tmp_path) is None
    assert ExecutableStore.for_this_process("") is None


# A first run's process: precompiles `separate_stages("all")` into the store at argv[1], as a
# process other than 0 does (JAX's cache off before its first compile: JAX decides once per process
# whether it reads it; the suite's may hold these programs, which the store would leave to it).
_FIRST_RUN = """
import sys
import threading
import time
import jax
jax.config.update("jax_enable_compilation_cache", False)  # XLA compiles them: the store writes them
from pipeline_fixtures import separate_batch, separate_stages
from dflop_jax.programs.executable_store import ExecutableStore
from dflop_jax.runtime.precompile import precompile
store = ExecutableStore(sys.argv[1])
precompile(separate_stages("all"), separate_batch()[::2], store=store)
print("saved", store.saved)
"""


def _step(stages, mbs):
    out = run_pipeline(stages, mbs, sum(float(m["loss_mask"].sum()) for m in mbs), "1f1b")
    return [float(x) for x in out.loss], [jax.device_get(g) for g in out.grads]


@pytest.mark.slow  # 20-30 s: two processes compile the pipeline
def test_a_pipeline_runs_the_stage_programs_the_store_loaded(tmp_path, monkeypatch):
    """Two microbatches of one bucket shape over 2 encoder and 2 LLM stages (dp 2, tp 2) that keep
    residuals: the forward with residuals, the backward from them and the last stage's fused step,
    written by a first run's process (which may find them in the suite's JAX cache: the store
    compiles them afresh) and loaded here, where they give the jit-run pipeline's loss and
    gradients bit for bit, and the last stage's loss-token count its sum."""
    tests = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])
    )
    first = subprocess.run([sys.executable, "-c", _FIRST_RUN, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    # 3 stages x 2 programs + the last's fused step and its loss-token count
    assert first.stdout.split()[-2:] == ["saved", "8"]
    mbs = separate_batch()[::2]
    want_loss, want_grads = _step(separate_stages("all"), mbs)  # the jits
    stages, store, counter = separate_stages("all"), ExecutableStore(tmp_path), CompileCounter()
    hits = counter.cache_hits
    precompile(stages, mbs, store=store)
    assert (store.loaded, store.saved) == (8, 0)
    assert counter.cache_hits - hits >= 8  # the store's loads (JAX's cache may serve the rest)

    def not_called(*_):
        raise AssertionError("a stage called its jit instead of the loaded program")

    for stage in stages:
        for name in ("forward", "forward_residuals", "backward", "backward_residuals", "last"):
            program = getattr(stage.jits, name)
            if program is not None:
                monkeypatch.setattr(program, "jit", not_called)
    monkeypatch.setattr(stages[-1], "_count", not_called)  # `loss_tokens`' jit
    tokens = stages[-1].loss_tokens([m["loss_mask"] for m in mbs])
    assert float(tokens) == sum(float(m["loss_mask"].sum()) for m in mbs)
    loss, grads = _step(stages, mbs)
    assert loss == want_loss
    jax.tree.map(np.testing.assert_array_equal, grads, want_grads)


def test_a_folder_it_cannot_write_is_logged_and_the_program_still_runs(tmp_path, caplog):
    k = _salt()
    jit, lowered, s = _lowered(jax.devices()[:2], k)
    store = ExecutableStore(tmp_path / "store")
    (tmp_path / "store").rmdir()
    (tmp_path / "store").write_text("")  # its folder gone: a file in its place
    compiled, source = store.compile(lowered, (0, 1))
    assert (source, store.saved, store.failed) == ("compiled", 0, 1)
    assert "not stored" in caplog.text
    x = jax.device_put(np.ones(4, np.float32), s)
    w = [jax.device_put(np.ones((4, 3), np.float32), s) for _ in range(2)]
    want = np.full((4, 3), np.float32(4) * np.float32(k))  # w * sum(x) * k
    np.testing.assert_array_equal(np.asarray(compiled(w, x)[0]), want)
