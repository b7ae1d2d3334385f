"""Bounded waits of the multi-process exchanges, in one process: the scalar exchange's timeout
wrapper."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflop_jax.programs.processes import _bounded, host_scalars


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
