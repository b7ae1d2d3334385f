"""`plan` reads a measured cost table and records what it read: the table changes the plan, and
plan.yaml names the table and the shapes by path and content hash (no jax: synthetic tables)."""

import hashlib

from dflop_jax import plan as plan_cli
from dflop_jax.contracts.cost_table import ENCODER_KINDS, LLM_KINDS, CostEntry, ProfiledCostTable
from dflop_jax.contracts.cost_table import save_table as save_cost_table
from dflop_jax.planner import load_plan

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


# The run config a user writes (`plan` alone reads it here; no data: a synthetic shape mix).
RUN = """
model: tiny
device: cpu
num_devices: 4
global_batch: 16
profile: {data_source: llava-ov, data_samples: 200}
planner: {microbatches: [2, 4], samples: 1, screen_top: 2, tp: [1, 2]}
"""


def _plan(run_dir, *over: str):
    """`python -m dflop_jax.plan --config run.yaml` (in process): run_dir/plan.yaml."""
    config = run_dir / "run.yaml"
    config.write_text(RUN)
    args = ["--no-progress", "--config", str(config), *over, f"run_dir={run_dir}"]
    assert plan_cli.main(args) == 0
    return load_plan(run_dir / "plan.yaml")


def test_editing_the_cost_table_changes_the_plan_and_is_recorded(tmp_path):
    """`plan` reads the cost table `profile model` writes (run_dir/auto_plan/cost_table.json): the
    same file edited (tp 2 made 64x slower relative to tp 1) gives another plan, each recording the
    table's path and the hash of the bytes it read."""
    table = tmp_path / "auto_plan" / "cost_table.json"
    plans, hashes = [], []
    for tp2_speedup in (8.0, 0.125):
        save_cost_table(cost_table(tp2_speedup), table)
        plans.append(_plan(tmp_path))
        hashes.append(hashlib.sha256(table.read_bytes()).hexdigest())
    fast, slow = plans
    tps = lambda p: {s.tp for s in p.layout.stages}
    assert 2 in tps(fast) and tps(slow) == {1}, (tps(fast), tps(slow))
    assert "measured" in fast.cost_provider.lower()
    for plan, digest in zip(plans, hashes):
        assert plan.inputs["cost_table"] == {"path": str(table.resolve()), "sha256": digest}
        assert plan.inputs["shapes"] == "llava-ov"


def test_without_a_table_the_plan_says_analytic(tmp_path, caplog):
    plan = _plan(tmp_path, "num_devices=2", "global_batch=8")
    assert plan.inputs == {"shapes": "llava-ov", "cost_table": "analytic"}
    assert any("no cost table at" in r.getMessage() for r in caplog.records)


def test_plan_reads_the_data_profile_or_says_it_uses_the_data(tmp_path, caplog):
    """profile.data_source=dataset: the shape file `profile data` writes, by path and hash; absent,
    one line says so and the data's own shapes (metadata of the synthetic data) stand in."""
    from dflop_jax.contracts import SampleShape
    from dflop_jax.contracts.shape_distribution import save_shape_distribution

    data = ["profile.data_source=dataset", "data.synth_samples=24", f"data.synth_dir={tmp_path / 's'}",
            "num_devices=2", "global_batch=8"]  # fmt: skip
    plan = _plan(tmp_path, *data)
    assert plan.inputs["shapes"] == "dataset"
    assert any("no shape distribution at" in r.getMessage() for r in caplog.records)
    shapes = tmp_path / "auto_plan" / "data" / "shape_distribution.json"
    shapes.parent.mkdir(parents=True)
    save_shape_distribution(
        [SampleShape(str(i), i % 3, 200 + 10 * i) for i in range(30)], shapes, "t", {}
    )
    plan = _plan(tmp_path, *data)
    digest = hashlib.sha256(shapes.read_bytes()).hexdigest()
    assert plan.inputs["shapes"] == {"path": str(shapes.resolve()), "sha256": digest}
