"""Discrete-event pipeline simulator (1F1B, GPipe, interleaved 1F1B) and timeline plots. Pure Python/NumPy."""

from dflop_jax.sim.pipeline import (
    SCHEDULES,
    Event,
    SimResult,
    StepUpdate,
    device_order,
    simulate,
    stage_order,
    uniform_step_time,
)
from dflop_jax.sim.timeline import plot_timeline

__all__ = [
    "SCHEDULES",
    "Event",
    "SimResult",
    "StepUpdate",
    "device_order",
    "plot_timeline",
    "simulate",
    "stage_order",
    "uniform_step_time",
]
