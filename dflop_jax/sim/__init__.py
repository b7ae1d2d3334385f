"""Discrete-event pipeline simulator (1F1B, GPipe) and timeline plots. Pure Python/NumPy."""

from dflop_jax.sim.pipeline import (
    SCHEDULES,
    Event,
    SimResult,
    simulate,
    stage_order,
    uniform_step_time,
)
from dflop_jax.sim.timeline import plot_timeline

__all__ = [
    "SCHEDULES",
    "Event",
    "SimResult",
    "plot_timeline",
    "simulate",
    "stage_order",
    "uniform_step_time",
]
