"""The executable store (what a process JAX's persistent cache does not write from keeps of its stage
programs): a second store on the same folder loads what the first compiled, and the loaded program
computes what the jit computes; the key tells devices apart; a file that does not load is compiled
again. A pipeline whose stage programs came from the store runs them (its stages' jits are never
called) and gives the jit-run pipeline's loss and gradients. Across real processes:
tests/multiprocess/test_runtime_multihost.py."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_fixtures import separate_batch, separate_stages

from dflop_jax.programs.executable_store import ExecutableStore
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.precompile import CompileCounter, precompile


def _scaled(ws, x, k):
    return [w * jnp.sum(x) * k for w in ws]


def _lowered(devices):
    mesh = Mesh(np.array(devices), ("data",))
    s = NamedSharding(mesh, P("data"))
    ws = [jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=s) for _ in range(2)]
    x = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=s)
    jit = jax.jit(_scaled, static_argnums=2, donate_argnums=0)
    return jit, jit.lower(ws, x, 3), s


def test_a_second_store_loads_what_the_first_compiled(tmp_path):
    jit, lowered, s = _lowered(jax.devices()[:2])
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
    want = jit(*args(), 3)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert g.sharding == s


def test_the_key_tells_devices_apart_and_a_bad_file_is_compiled_again(tmp_path, caplog):
    _, on_01, _ = _lowered(jax.devices()[:2])
    _, on_23, _ = _lowered(jax.devices()[2:4])
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


def test_one_process_has_no_store(tmp_path):
    assert ExecutableStore.for_this_process(tmp_path) is None
    assert ExecutableStore.for_this_process("") is None


# A first run's process: precompiles `separate_stages("all")` into the store at argv[1], as a
# run's own process does.
_FIRST_RUN = """
import sys
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


@pytest.mark.slow  # 15-30 s: two processes compile the pipeline
def test_a_pipeline_runs_the_stage_programs_the_store_loaded(tmp_path, monkeypatch):
    """Two microbatches of one bucket shape over 2 encoder and 2 LLM stages (dp 2, tp 2) that keep
    residuals: the forward with residuals, the backward from them and the last stage's fused step,
    written by a first run's process and loaded here."""
    tests = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])
    )
    first = subprocess.run([sys.executable, "-c", _FIRST_RUN, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.split()[-2:] == ["saved", "7"]  # 3 stages x 2 programs + the last's 1
    mbs = separate_batch()[::2]
    # Without JAX's cache here: the first process filled it with these very programs, and XLA:CPU
    # fails to run an executable deserialized twice in one process; and only the store's loads
    # are then cache hits.
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        want_loss, want_grads = _step(separate_stages("all"), mbs)  # the jits
        stages, store, counter = separate_stages("all"), ExecutableStore(tmp_path), CompileCounter()
        hits = counter.cache_hits
        precompile(stages, mbs, store=store)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    assert (store.loaded, store.saved, counter.cache_hits - hits) == (7, 0, 7)

    def not_called(*_):
        raise AssertionError("a stage called its jit instead of the loaded program")

    for stage in stages:
        for name in ("forward", "forward_residuals", "backward", "backward_residuals", "last"):
            program = getattr(stage.jits, name)
            if program is not None:
                monkeypatch.setattr(program, "jit", not_called)
    loss, grads = _step(stages, mbs)
    assert loss == want_loss
    jax.tree.map(np.testing.assert_array_equal, grads, want_grads)


def test_a_folder_it_cannot_write_is_logged_and_the_program_still_runs(tmp_path, caplog):
    jit, lowered, s = _lowered(jax.devices()[:2])
    store = ExecutableStore(tmp_path / "store")
    (tmp_path / "store").rmdir()
    (tmp_path / "store").write_text("")  # its folder gone: a file in its place
    compiled, source = store.compile(lowered, (0, 1))
    assert (source, store.saved, store.failed) == ("compiled", 0, 1)
    assert "not stored" in caplog.text
    x = jax.device_put(np.ones(4, np.float32), s)
    w = [jax.device_put(np.ones((4, 3), np.float32), s) for _ in range(2)]
    np.testing.assert_array_equal(np.asarray(compiled(w, x)[0]), np.full((4, 3), 12.0))
