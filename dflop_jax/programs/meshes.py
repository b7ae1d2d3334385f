"""Device layout: a `Layout` becomes one `("data", "model")` submesh per pipeline stage (DESIGN section 5).

Stages take disjoint devices in pipeline order (encoder stages first, then LLM stages). A stage's tensor-
parallel group (one row of its mesh, the "model" axis) is always taken from a single host
(`device.process_index`), so tp collectives never cross hosts; its data-parallel replicas may.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from dflop_jax.contracts.layout import Layout, StageSpec

AXES = ("data", "model")


class LayoutError(ValueError):
    """A layout that cannot be placed on the available devices."""


def stage_meshes(layout: Layout, devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """One Auto-axis mesh [dp, tp] per stage of `layout`, in pipeline order, on disjoint devices.

    Args:
      layout: the plan's layout.
      devices: the devices to use (default `jax.devices()`, all processes).

    Returns:
      meshes[i] for `layout.stages[i]`, each with axes ("data", "model") of shape (dp, tp).

    Raises:
      LayoutError: the layout needs more devices than exist, or a tp group cannot stay within a host.
    """
    devices = list(jax.devices() if devices is None else devices)
    if layout.num_devices > len(devices):
        raise LayoutError(
            f"layout needs {layout.num_devices} devices ({_describe(layout)}) but only "
            f"{len(devices)} exist; reduce tp/dp/stages or add devices"
        )
    free = _by_host(devices)
    meshes = []
    for i, spec in enumerate(layout.stages):
        rows = [_take_tp_group(free, spec, i) for _ in range(spec.dp)]
        grid = np.array(rows, dtype=object).reshape(spec.dp, spec.tp)
        meshes.append(Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto)))
    return meshes


def _by_host(devices: Sequence[jax.Device]) -> dict[int, list[jax.Device]]:
    """Free devices per host, each host's list in id order (pipeline neighbours stay close)."""
    hosts: dict[int, list[jax.Device]] = {}
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        hosts.setdefault(d.process_index, []).append(d)
    return hosts


def _take_tp_group(
    free: dict[int, list[jax.Device]], spec: StageSpec, index: int
) -> list[jax.Device]:
    """Pops `spec.tp` devices from the first host that still has that many free."""
    for host in sorted(free):
        if len(free[host]) >= spec.tp:
            group, free[host] = free[host][: spec.tp], free[host][spec.tp :]
            return group
    left = {h: len(v) for h, v in free.items() if v}
    raise LayoutError(
        f"stage {index} ({spec.module}, tp={spec.tp}, dp={spec.dp}) needs {spec.tp} free devices on one "
        f"host, but free devices per host are {left}; lower tp or reorder stages"
    )


def _describe(layout: Layout) -> str:
    return " + ".join(f"{s.module}[dp{s.dp} x tp{s.tp}]" for s in layout.stages)
