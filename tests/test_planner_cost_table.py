"""`plan` reads a measured cost table and records what it read: the table changes the plan, and
plan.yaml names the table and the shapes by path and content hash (no jax: synthetic tables)."""

import hashlib

from dflop_jax import plan as plan_cli
from dflop_jax.config import load_config
from dflop_jax.contracts.cost_table import ENCODER_KINDS, LLM_KINDS, CostEntry, ProfiledCostTable
from dflop_jax.contracts.cost_table import save_table as save_cost_table
from dflop_jax.planner import load_plan
from dflop_jax.planner.run_config import PlanRunConfig

TILES, TOKENS = (1, 4, 16), (128, 512, 2048)


def cost_table(tp2_speedup: float) -> ProfiledCostTable:
    """Linear costs for the tiny arch at tp 1 and 2; tp 2 runs `tp2_speedup` times faster."""
    table = ProfiledCostTable("cpu", "cpu", 8, "h", "c", model="tiny")
    for tp in (1, 2):
        scale = 1.0 if tp == 1 else 1.0 / tp2_speedup
        for kind in ENCODER_KINDS + LLM_KINDS:
            for bucket in TILES if kind in ENCODER_KINDS else TOKENS:
                for layers in (1, 2) if kind.endswith("layers") else (0,):
                    fwd = scale * (1e-4 + 1e-6 * bucket * max(layers, 1))
                    table.add(CostEntry(kind, tp, bucket, layers, fwd_s=fwd, bwd_s=2 * fwd,
                                        param_bytes=1e3, input_bytes=10.0 * bucket,
                                        memory_bwd={"peak": 1e5 + 100.0 * bucket}))  # fmt: skip
    return table


def _plan(tmp_path, name: str, tp2_speedup: float):
    table = save_cost_table(cost_table(tp2_speedup), tmp_path / f"{name}.json")
    over = ["model=tiny", "device=cpu", "num_devices=4", "data.synth_samples=200",
            "planner.global_batch=16", "planner.microbatches=[2,4]", "planner.samples=1",
            "planner.screen_top=2", "planner.tp=[1,2]", f"cost_table={table}",
            f"out={tmp_path / name / 'plan.yaml'}"]  # fmt: skip
    cfg = load_config(PlanRunConfig, None, over)
    plan_cli.run(cfg)
    return load_plan(cfg.out), table


def test_the_cost_table_changes_the_plan_and_is_recorded(tmp_path):
    fast, fast_table = _plan(tmp_path, "tp2_fast", 8.0)
    slow, slow_table = _plan(tmp_path, "tp2_slow", 0.125)
    tps = lambda p: {s.tp for s in p.layout.stages}
    assert 2 in tps(fast) and tps(slow) == {1}, (tps(fast), tps(slow))
    assert "measured" in fast.cost_provider.lower()
    for plan, table in ((fast, fast_table), (slow, slow_table)):
        recorded = plan.inputs["cost_table"]
        assert recorded["path"] == str(table.resolve())
        assert recorded["sha256"] == hashlib.sha256(table.read_bytes()).hexdigest()
        assert plan.inputs["shapes"] == "llava-ov"


def test_without_a_table_the_plan_says_analytic(tmp_path):
    over = ["model=tiny", "device=cpu", "num_devices=2", "data.synth_samples=100",
            "planner.global_batch=8", "planner.microbatches=[2,4]", "planner.samples=1",
            "planner.screen_top=2", f"out={tmp_path / 'plan.yaml'}"]  # fmt: skip
    plan_cli.run(load_config(PlanRunConfig, None, over))
    assert load_plan(tmp_path / "plan.yaml").inputs == {
        "shapes": "llava-ov",
        "cost_table": "analytic",
    }
