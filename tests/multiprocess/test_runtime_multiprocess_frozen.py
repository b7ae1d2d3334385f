"""Training recipes across real processes: 2 jax processes x 4 CPU devices run one pipelined step of the
tiny LLaVA-OV (tests/frozen_worker.py: encoder stages on process 0, LLM stages on process 1) under
the projector-only recipe; the loss, the global gradient norm and every updated parameter equal one
single-device step of the unsplit model with `stop_gradient` on the frozen parts
(`pipeline_reference.stop_gradient_reference`, as in tests/runtime/test_runtime_frozen.py; float32),
and the frozen parameters come out bit-identical.

What crosses processes here and nowhere else: projector-only, the frozen LLM on process 1 runs a
dx-only backward whose dL/dx goes back to the projector's stage on process 0, and only process 0's
stages have a gradient norm to send to the last stage (process 1). The worker also runs the
vision-frozen recipe when asked (`frozen_worker.py ... vision_frozen`)."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from multiprocess_launch import REPO, env, free_ports
from pipeline_fixtures import mllm_loss_sum, separate_batch, separate_model
from pipeline_reference import TRAINABLE_BY_RECIPE, stop_gradient_reference

WORKER = REPO / "tests" / "frozen_worker.py"


def _flat(tree) -> dict:
    from dflop_jax.programs.param_paths import key_name

    return {"/".join(key_name(k) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}  # fmt: skip


# Projector-only alone: it is the recipe whose dx-only backward (the frozen LLM) crosses processes; the
# vision-frozen step differs only inside a process (tests/runtime/test_runtime_frozen.py) and would double the
# launch's compile time.
RECIPES = ("projector_only",)


def _prefixed(arrays: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The recipes in one 2-process launch; {recipe: [rank 0's npz, rank 1's npz]}."""
    out = tmp_path_factory.mktemp("frozen_mp")
    port = free_ports(2)  # the coordinator and the watchdog hub (port + 1)
    procs = [
        subprocess.Popen(
            [
                "timeout",
                "-k",
                "10",
                "240",
                sys.executable,
                str(WORKER),
                "2",
                str(rank),
                f"127.0.0.1:{port}",
                str(out),
                *RECIPES,
            ],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=260)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {rank} exited {p.returncode}:\n{log[-3000:]}"
    return {r: [dict(np.load(out / f"{r}_rank{k}.npz")) for k in range(2)] for r in RECIPES}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_process_recipe_step_matches_single_device_with_stop_gradient(workers, recipe):
    trainable = TRAINABLE_BY_RECIPE[recipe]
    ranks = workers[recipe]
    for rank in ranks:  # every process read the same step numbers
        np.testing.assert_array_equal(
            [rank["loss"], rank["norm"]], [ranks[0]["loss"], ranks[0]["norm"]]
        )
    ref_loss, ref_norm, ref = stop_gradient_reference(
        separate_model(), separate_batch(), mllm_loss_sum, trainable
    )
    np.testing.assert_allclose(float(ranks[0]["loss"]), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(float(ranks[0]["norm"]), ref_norm, rtol=1e-5)

    got, initial = {}, {}
    for rank, arrays in enumerate(ranks):
        params = _prefixed(arrays, "param:")
        assert {k.split("/")[0] for k in params} == {("encoder", "llm")[rank]}  # its own stages
        got.update(params)
        initial.update(_prefixed(arrays, "init:"))
    want = _flat(ref)
    assert got.keys() == want.keys()
    changed = set()
    for name, value in got.items():
        part = name.split("/")[2] if name.startswith("encoder/") else "llm"
        if part in trainable:
            np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
            changed |= {part} if not np.array_equal(value, initial[name]) else set()
        else:  # frozen: bit-identical to the stage's initial parameter
            np.testing.assert_array_equal(value, initial[name], err_msg=name)
    assert changed == set(trainable)
