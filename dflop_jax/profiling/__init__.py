"""Profiling engine (DESIGN section 6): model profiler, cost-table files, profile -> plan pipeline.

from dflop_jax.profiling import ProfiledCostTable, load_table, profile_model, ensure_plan

The cost-table format (`dflop_jax.contracts.cost_table`, re-exported by `table.py`) is pure Python and imported eagerly (the planner's measured cost
provider reads it without jax); the profiler and the pipeline import jax, so they load on first use.
"""

from dflop_jax.profiling.table import (
    STAGE_KINDS,
    CostEntry,
    ProfiledCostTable,
    code_version,
    config_hash,
    load_table,
    save_table,
)

_LAZY = {
    "profile_model": "dflop_jax.profiling.model_profiler",
    "ProfileSettings": "dflop_jax.contracts.profile_settings",
    "ensure_plan": "dflop_jax.profiling.auto_plan",
    "AutoPlanConfig": "dflop_jax.profiling.auto_plan",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dflop_jax.profiling' has no attribute {name!r}")


__all__ = [
    "STAGE_KINDS",
    "AutoPlanConfig",
    "CostEntry",
    "ProfiledCostTable",
    "ProfileSettings",
    "code_version",
    "config_hash",
    "ensure_plan",
    "load_table",
    "profile_model",
    "save_table",
]
