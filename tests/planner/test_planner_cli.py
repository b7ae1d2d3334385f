"""plan.yaml round trip, the plan/simulate CLIs on tiny inputs, and every planner config in configs/."""

import json
from pathlib import Path

import pytest
import yaml

from dflop_jax import plan as plan_cli
from dflop_jax import simulate as simulate_cli
from dflop_jax.config import load_config
from dflop_jax.planner import PlannerConfig, load_plan, make_plan, save_plan
from dflop_jax.planner.replay import read_samples_jsonl, replay
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.scheduler import llava_ov_mix

ROOT = Path(__file__).resolve().parents[2]
PLAN_CONFIGS = ["plan_llava_ov_7b_h100x64.yaml", "internvl_h100x32.yaml", "plan_tiny_cpu.yaml",
                "llava_ov_7b_h100x64.yaml"]  # fmt: skip
TINY = ["model=tiny", "device=cpu", "num_devices=4", "profile.data_source=llava-ov",
        "profile.data_samples=200", "global_batch=8", "planner.microbatches=[2,4]", "planner.samples=1",
        "planner.screen_top=2", "planner.llm_pp=[1,2]"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_plan():
    cfg = PlannerConfig(
        global_batch=8, microbatches=(2, 4), samples=2, screen_top=2, llm_pp=(1, 2), top_n=2
    )
    return make_plan("tiny", "cpu", 4, llava_ov_mix(200, 0), cfg)


def test_plan_yaml_round_trip(tiny_plan, tmp_path):
    path = save_plan(tiny_plan, tmp_path / "p" / "plan.yaml")
    assert load_plan(path) == tiny_plan
    text = path.read_text()
    d = yaml.safe_load(text)
    assert d["layout"][0]["devices"] == tiny_plan.layout.stages[0].num_devices
    assert "lost_because" in text and "memory_gib" in text and "step_time_p90_s" in text
    assert f"tiles: {list(tiny_plan.buckets.tiles)}" in text  # short lists stay on one line


def test_load_plan_rejects_other_files(tmp_path):
    (tmp_path / "x.yaml").write_text("a: 1\n")
    with pytest.raises(ValueError, match="not a dflop plan"):
        load_plan(tmp_path / "x.yaml")
    with pytest.raises(ValueError, match="not found"):
        load_plan(tmp_path / "missing.yaml")


def test_plan_cli_writes_plan_and_config(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert plan_cli.main(["--no-progress", "--json", *TINY, f"run_dir={tmp_path}"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny" and report["num_devices"] == 4
    assert report["planner_config"]["global_batch"] == 8  # the run's global batch
    assert load_plan(out).num_devices == 4
    resolved = load_config(TrainConfig, tmp_path / "plan.config.yaml")
    assert resolved.global_batch == 8 and resolved.model.arch == "tiny"


def test_plan_cli_uniform_mode_plans_the_baseline(tmp_path, capsys):
    args = ["--no-progress", "--json", *TINY, "planner.mode=uniform", f"run_dir={tmp_path}"]
    assert plan_cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "uniform" and load_plan(tmp_path / "plan.yaml").mode == "uniform"


def test_plan_cli_infeasible_is_one_line(tmp_path, capsys):
    assert plan_cli.main(["--no-progress", *TINY, "planner.tp=[3]", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: no tensor-parallel degree fits") and "\n" not in err
    assert plan_cli.main(["--no-progress", "planner.bogus=1"]) == 2
    assert "planner.bogus: unknown key" in capsys.readouterr().err


def test_simulate_cli_samples_and_mix(tiny_plan, tmp_path, capsys):
    path = save_plan(tiny_plan, tmp_path / "plan.yaml")
    samples = tmp_path / "batch.jsonl"
    samples.write_text(
        "".join(
            json.dumps({"id": i, "tiles": i % 3, "tokens": 100 + 50 * i}) + "\n" for i in range(8)
        )
    )
    png = tmp_path / "t.png"
    assert simulate_cli.main([f"plan={path}", f"samples={samples}", f"png={png}", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["batches"][0]["samples"] == 8
    # The CLI's default scheduler for a searched plan is greedy: the library replay of the same batch.
    assert tiny_plan.mode != "uniform"
    ref = replay(tiny_plan, [read_samples_jsonl(samples)], "greedy", "1f1b")
    assert rep["step_time_mean_s"] == ref["step_time_mean_s"] == ref["batches"][0]["step_time_s"]
    assert 0 <= rep["idle_fraction_mean"] < 1 and png.read_bytes()[:4] == b"\x89PNG"
    args = [f"plan={path}", "mix=llava-ov", "batches=2", "scheduler=data_blind", "pipeline=gpipe"]
    assert simulate_cli.main(args) == 0
    assert "mean: step" in capsys.readouterr().out
    samples.write_text('{"id": 1}\n')
    assert simulate_cli.main([f"plan={path}", f"samples={samples}"]) == 2
    assert "batch.jsonl:1" in capsys.readouterr().err


@pytest.mark.parametrize("name", PLAN_CONFIGS)
def test_planner_configs_load(name):
    cfg = load_config(TrainConfig, ROOT / "configs" / name)
    assert cfg.num_devices >= 1 and cfg.global_batch >= 1


def test_plan_check_plans_only_what_the_runtime_trains(tmp_path, monkeypatch):
    """`--check` compiles the runtime's programs, which run a colocated encoder at its stage's tp:
    the planner is kept from an encoder at its own tp (the 7B config's planner picks one otherwise)."""
    compiled = []
    from dflop_jax.planner import load_plan

    check = lambda c, path, progress=None: compiled.append(load_plan(path)) or ()  # noqa: E731
    monkeypatch.setattr(plan_cli, "check_compiled", check)
    cfg = load_config(TrainConfig, None, [*TINY, f"run_dir={tmp_path}"])
    assert cfg.planner.colocate_own_tp
    plan = plan_cli.run(cfg, check=True)
    assert [p.layout for p in compiled] == [plan.layout]
    own = plan.layout.colocated_encoder_tp
    assert own is None or own == plan.layout.llm_stages[0].tp
    assert not plan.planner_config["colocate_own_tp"]


@pytest.mark.parametrize("policy", ["auto", "recompute"])
def test_plan_check_compiles_the_residual_policy_the_run_trains(policy, tmp_path):
    """`--check` compiles each stage as `train plan=...` would train it: under "auto" the tiny model
    keeps every residual (it fits), and an inner stage's compiled memory then holds them; each stage
    is compared with the memory model's figure for that policy."""
    cfg = load_config(TrainConfig, None, [*TINY, f"run_dir={tmp_path}", f"residuals={policy}"])
    plan_cli.run(cfg, check=True)
    stages = yaml.safe_load((tmp_path / "plan.yaml").read_text())["layout"]
    want = "all" if policy == "auto" else "recompute"
    assert [s["residuals"] for s in stages] == [want] * len(stages)
    terms = ("params", "grads", "optimizer", "inputs", "residuals", "transient")
    for s in stages:
        c, inner = s["compiled"], s["stage"] < len(stages) - 1
        assert (c["residuals"] > 0) == (want == "all" and inner), s
        # compared with the memory model's figure for the programs compiled, not the planner's
        assert s["checked_memory_gib"] == round(c["predicted"] / 2**30, 2)
        total = sum(c[k] for k in terms)
        assert s["compiled_vs_predicted"] == round(total / c["predicted"] - 1, 3)


def test_a_plan_is_evaluated_under_the_residual_policies_it_records(tiny_plan):
    """What a plan is evaluated on after planning (`plan_costs`: `bench cluster`; `replay`: the
    simulate CLI) prices each stage's recorded residual policy, as the planner scored it: a stage
    that runs its forward again in its backward ("recompute") costs that forward."""
    import dataclasses

    from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
    from dflop_jax.planner.variants import plan_costs

    n = tiny_plan.layout.num_stages
    base = AnalyticCostProvider(get_arch("tiny"), get_device("cpu"))
    t, s = tiny_plan.buckets.tiles[-1], tiny_plan.buckets.lengths[-1]
    saving, again = (
        dataclasses.replace(tiny_plan, residuals=(r,) * n) for r in ("all", "recompute")
    )
    fast, slow = (plan_costs(p, base).stage(t, s) for p in (saving, again))
    assert (slow[:, 1] > fast[:, 1]).any() and (slow[:, 0] == fast[:, 0]).all()
    batch = [_sample(i) for i in range(8)]
    steps = [replay(p, [batch], "greedy", "1f1b")["step_time_mean_s"] for p in (saving, again)]
    assert steps[1] > steps[0]


def _sample(i: int):
    from dflop_jax.contracts import SampleShape

    return SampleShape(i, i % 3, 100 + 50 * i, "image" if i % 3 else "text")
