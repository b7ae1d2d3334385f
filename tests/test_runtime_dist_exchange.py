"""Bounded waits of the multi-process exchanges, in one process: the owner-checkpoint barrier (files
in the shared directory) and the scalar exchange's timeout wrapper."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflop_jax.runtime.checkpoint import _wait_for_files
from dflop_jax.runtime.distributed import _bounded, host_scalars


def test_barrier_returns_once_every_file_appears(tmp_path):
    paths = [tmp_path / f"process_{i}.npz" for i in range(3)]
    paths[0].write_bytes(b"x")
    late = threading.Timer(0.2, lambda: [p.write_bytes(b"x") for p in paths[1:]])
    late.start()
    _wait_for_files(paths, timeout_s=30)
    late.join()
    assert all(p.exists() for p in paths)


def test_barrier_names_the_missing_process_after_the_timeout(tmp_path):
    (tmp_path / "process_0.npz").write_bytes(b"x")
    paths = [tmp_path / "process_0.npz", tmp_path / "process_1.npz"]
    with pytest.raises(TimeoutError, match=r"process_1\.npz not written .* within 0\.2s"):
        _wait_for_files(paths, timeout_s=0.2)


def test_bounded_exchange_times_out_with_its_tag():
    release = threading.Event()
    with pytest.raises(TimeoutError, match=r"exchange 'step3/loss' did not complete within 1s"):
        _bounded(lambda: release.wait(30), "step3/loss", timeout_s=1)
    release.set()


def test_bounded_exchange_passes_results_and_errors_through():
    np.testing.assert_array_equal(_bounded(lambda: np.arange(3), "t", 5), [0, 1, 2])
    with pytest.raises(ZeroDivisionError):
        _bounded(lambda: 1 / 0, "t", 5)


def test_host_scalars_single_process_reads_every_value():
    devs = jax.devices()
    vals = [jax.device_put(jnp.float32(x), devs[i]) for i, x in enumerate([1.5, -2.25, 3.0])]
    np.testing.assert_array_equal(host_scalars(vals, "t"), [1.5, -2.25, 3.0])
