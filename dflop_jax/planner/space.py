"""The planner's search space fitted to the devices a run has, checked before any profiling.

A config's search space (`PlannerConfig`) is written once and run on 1, 2, 3, ... devices: pipeline
depths and tp degrees beyond the device count are lowered to it, and where a separate encoder cannot
sit beside the LLM stages the encoder is colocated on LLM stage 0. What nothing satisfies even then is
one config error, raised before the profiler or the search starts.
"""

from __future__ import annotations

import dataclasses
import logging

from dflop_jax.config import ConfigError
from dflop_jax.planner.candidates import enumerate_candidates
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.explain import explain_no_candidates

log = logging.getLogger(__name__)


def fit_search_space(arch, num_devices: int, device, config: PlannerConfig) -> PlannerConfig:
    """`config` with its pipeline depths and tp degrees fitted to `num_devices` (logged when changed).

    LLM depths above the device count become the count; the encoder's depths shrink to the devices left
    beside the shallowest LLM pipeline, and with none left the encoder is colocated (a single stage on
    one device). tp degrees above the count are dropped (1 if none is left).

    Raises:
      ConfigError: no layout of the fitted space exists (its one-line reason).
    """
    n = num_devices
    llm_pp = _capped(config.llm_pp, n)
    room = n - min(llm_pp)  # devices beside the shallowest LLM pipeline
    fitted = dataclasses.replace(
        config,
        llm_pp=llm_pp,
        encoder_pp=_capped(config.encoder_pp, max(room, 1)),
        colocate=config.colocate or room < 1,
        tp=tuple(t for t in config.tp if t <= n) or (1,),
        encoder_tp=tuple(t for t in config.encoder_tp if t <= n)
        or (() if not config.encoder_tp else (1,)),
    )
    changed = [
        f"planner.{f.name}={getattr(config, f.name)} -> {getattr(fitted, f.name)}"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(fitted, f.name)
    ]
    if changed:
        log.warning("search space fitted to %d device(s): %s", n, "; ".join(changed))
    if not enumerate_candidates(arch, n, device.devices_per_host, fitted):
        raise ConfigError(explain_no_candidates(arch, n, device, fitted, "dflop"))
    return fitted


def _capped(values: tuple[int, ...], limit: int) -> tuple[int, ...]:
    return tuple(sorted({min(v, limit) for v in values}))
