"""Corrections one step late: batch b is scheduled with exactly the observations of steps <= b - lag,
whenever they arrive (a loader thread ahead waits, never sees a later one); a checkpoint's state
resumes the same sequence."""

import threading
import time

import numpy as np
import pytest

from dflop_jax.contracts import Schedule, ScheduledMicrobatch
from dflop_jax.runtime.lagged_schedule import LaggedSchedule, Observation


class _FakeScheduler:
    """Records the observations (by their first time value = the step) seen by each batch."""

    def __init__(self):
        self.seen: list[float] = []
        self.batches: dict[int, tuple[float, ...]] = {}

    def observe(self, schedule, measured):
        self.seen.append(float(np.asarray(measured)[0, 0, 0]))

    def schedule(self, shapes, index):
        self.batches[index] = tuple(self.seen)
        return Schedule((ScheduledMicrobatch(1, 8, ((0,),)),), 1.0, 1.0, "fake", 0.0, {})

    def prediction_error(self):
        return {"observations": len(self.seen)}

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, d):
        self.seen = list(d["seen"])


def _obs(step: int) -> Observation:
    return Observation(((1, 8),), ([[float(step), 0.0]],))


def _run(lagged, steps, measured, post_delay=0.0):
    """Posts steps 1..steps from the 'trainer' (measured ones resolve after post_delay) while the
    'loader' schedules batches 0..steps-1 in its own thread."""
    done = threading.Event()

    def loader():
        for b in range(steps):
            lagged([], b)
        done.set()

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    for k in range(1, steps + 1):
        if k in measured:
            lagged.post(k, lambda k=k: (time.sleep(post_delay), _obs(k))[1])
        else:
            lagged.post(k, lambda: None)
    assert done.wait(30)


@pytest.mark.parametrize("delay", [0.0, 0.01])
def test_batch_b_sees_exactly_the_steps_up_to_b_minus_lag(delay):
    fake = _FakeScheduler()
    lagged = LaggedSchedule(fake, lag=2)
    measured = {1, 2, 4, 5, 7}
    _run(lagged, 9, measured, delay)
    for b, seen in fake.batches.items():
        assert seen == tuple(float(k) for k in sorted(measured) if k <= b - 2), b


def test_checkpoint_state_resumes_the_same_schedules():
    measured = {1, 2, 3, 5, 6}
    straight = _FakeScheduler()
    _run(LaggedSchedule(straight, lag=2), 9, measured)

    first = _FakeScheduler()
    lagged = LaggedSchedule(first, lag=2)
    _run(lagged, 5, measured)  # the loader got to batch 4 (step 5) and step 5 ran
    state = lagged.state(5)
    assert state["through"] == 2 and sorted(state["observations"]) == ["3", "5"]

    resumed = _FakeScheduler()
    again = LaggedSchedule(resumed, lag=2)
    again.load(state)
    for k in range(6, 10):
        again.post(k, (lambda k=k: _obs(k)) if k in measured else (lambda: None))
    for b in range(5, 9):
        again([], b)
    assert {b: resumed.batches[b] for b in range(5, 9)} == {
        b: straight.batches[b] for b in range(5, 9)
    }


def test_close_wakes_a_loader_waiting_for_a_step_that_never_comes():
    lagged = LaggedSchedule(_FakeScheduler(), lag=1)
    errors = []

    def loader():
        try:
            lagged([], 3)  # needs step 2, never posted
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    time.sleep(0.05)
    lagged.close()
    thread.join(5)
    assert errors == ["the schedule function was closed (the run ended)"]
