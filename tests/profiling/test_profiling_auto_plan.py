"""ensure_plan: profile -> plan reused when fresh, redone when the model config changes; the plan's
cost sources are written; the `profile model` CLI runs a tiny grid. The model profiler is replaced by
a counting fake that writes a synthetic table (the real one is tested in test_profiling_engine.py)."""

import dataclasses
import itertools
import json
import types

import pytest

from dflop_jax.contracts.cost_table import CostEntry, ProfiledCostTable, save_table
from dflop_jax.contracts.profile_settings import ProfileSettings
from dflop_jax.costs import arch_of_model, get_device
from dflop_jax.planner import PlannerConfig
from dflop_jax.profiling import auto_plan, model_profiler
from dflop_jax.profiling.auto_plan import AutoPlanConfig, ensure_plan
from dflop_jax.programs.model_section import model_config_for_arch

CFG = model_config_for_arch("tiny", "float32")
CPU = get_device("cpu")  # what "auto" resolves to on these machines
PLANNER = PlannerConfig(global_batch=16, microbatches=(4,), samples=1, screen_top=2, top_n=1,
                        llm_pp=(1, 2), encoder_pp=(1,), tp=(1, 2))  # fmt: skip


def _fake_profiler(calls):
    def fake(model_cfg, devices, settings, out_path, **kwargs):
        calls.append(model_cfg)
        t = ProfiledCostTable("cpu", "cpu", 8, "fake", "fake", model="tiny")
        for b in settings.llm_buckets:
            for n in (1, 2):
                t.add(CostEntry("llm_layers", 1, b, n, fwd_s=1e-3 * n * b / 64, bwd_s=2e-3 * n * b / 64,
                                param_bytes=1e5 * n, input_bytes=b * 256.0,
                                memory_bwd={"peak": 3e5 * n}))  # fmt: skip
        save_table(t, out_path)
        return t

    return fake


@pytest.mark.slow
def test_fresh_outputs_are_reused_and_stale_ones_redone(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(model_profiler, "profile_model", _fake_profiler(calls))
    # The pipeline's clock advances 1 s per read: a step that runs records exactly 1 s, a reused one 0.
    ticks = itertools.count()
    monkeypatch.setattr(auto_plan, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    cfg = AutoPlanConfig(CPU, data_source="llava-ov", data_samples=200, planner=PLANNER,
                         profile=ProfileSettings(tps=(1,), llm_buckets=(64, 512)))  # fmt: skip
    plan = ensure_plan(cfg, CFG, tmp_path, arch=arch_of_model(CFG, "tiny"))
    assert len(calls) == 1 and plan.layout.num_devices <= 8
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings == {"model profile": 1.0, "plan": 1.0}
    sources = json.loads((tmp_path / "cost_sources.json").read_text())
    from_table = {k: v for k, v in sources["llm_layers"].items() if k != "fallback"}
    assert sum(from_table.values()) > 0  # the fake table's llm layers at tp 1
    assert sources["encoder_layers"]["fallback"] > 0  # not in the fake table: analytic

    again = ensure_plan(cfg, CFG, tmp_path, arch=arch_of_model(CFG, "tiny"))  # everything fresh
    assert len(calls) == 1 and again == plan
    assert json.loads((tmp_path / "timings.json").read_text()) == {
        "model profile": 0.0,
        "plan": 0.0,
    }

    changed = dataclasses.replace(CFG, text=CFG.text.replace(intermediate_size=256))
    # stale model profile -> profiled and re-planned
    ensure_plan(cfg, changed, tmp_path, arch=arch_of_model(changed, "tiny"))
    assert len(calls) == 2 and calls[-1] is changed
    assert json.loads((tmp_path / "timings.json").read_text()) == {
        "model profile": 1.0,
        "plan": 1.0,
    }

    other = dataclasses.replace(cfg, planner=dataclasses.replace(PLANNER, microbatches=(2,)))
    ensure_plan(
        other, changed, tmp_path, arch=arch_of_model(changed, "tiny")
    )  # only the plan is stale
    assert len(calls) == 2
    assert json.loads((tmp_path / "timings.json").read_text()) == {
        "model profile": 0.0,
        "plan": 1.0,
    }


def test_missing_shape_file_is_a_clear_error(tmp_path):
    cfg = AutoPlanConfig(CPU, data_source=str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        ensure_plan(cfg, CFG, tmp_path, arch=arch_of_model(CFG))


def test_profile_model_cli(tmp_path, capsys):
    from dflop_jax import profile as profile_cli

    out = tmp_path / "auto_plan" / "cost_table.json"  # where `plan` and `train plan=auto` read it
    rc = profile_cli.main(["model", "--no-progress", "model=tiny", "device=cpu", "num_devices=2",
                           f"run_dir={tmp_path}", "profile.tps=[1]", "profile.kinds=[encoder_head]",
                           "profile.encoder_buckets=[1]", "profile.runs=1",
                           "profile.warmup=0"])  # fmt: skip
    assert rc == 0 and out.is_file() and out.with_suffix(".png").is_file()
    assert "1 entries" in capsys.readouterr().out
    assert profile_cli.main(["model", "model=nope"]) == 2


def test_auto_plan_entry_profile_only_then_plan(tmp_path, monkeypatch, capsys):
    from dflop_jax.profile import main as profile_main

    def main(argv):
        return profile_main(["auto", *argv])

    calls = []
    monkeypatch.setattr(model_profiler, "profile_model", _fake_profiler(calls))
    args = [f"run_dir={tmp_path}", "model=tiny", "device=cpu", "num_devices=8",
            "profile.data_source=llava-ov", "profile.data_samples=100", "global_batch=16",
            "planner.microbatches=[4]", "planner.samples=1", "planner.llm_pp=[1,2]",
            "planner.encoder_pp=[1]", "planner.tp=[1]", "profile.tps=[1]"]  # fmt: skip
    cache = tmp_path / "auto_plan"
    assert main(["--profile-only", *args]) == 0
    assert len(calls) == 1 and not (cache / "plan.yaml").exists()
    assert main(args) == 0  # the optimization step reuses the fresh profile
    assert len(calls) == 1 and (cache / "plan.yaml").is_file()
    assert "plan.yaml" in capsys.readouterr().out
    assert main([*args, "profile.data_source=no/such.json"]) == 2  # one config error line


def test_plan_auto_reuses_what_the_profile_commands_wrote(tmp_path, monkeypatch):
    """`profile data` and `profile model` on a run config, then that run's `plan: auto`: both
    profiles are fresh for it (same settings, same stamps), so neither runs again."""
    from dflop_jax.config import load_config
    from dflop_jax.profile import main as profile_main
    from dflop_jax.resolve import RunContext, resolve_plan
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import DEMO_CONFIG

    calls = []
    monkeypatch.setattr(model_profiler, "profile_model", _fake_profiler(calls))
    run = [f"run_dir={tmp_path}", "model=tiny", "device=cpu", "num_devices=8", "plan=auto",
           f"data.synth_dir={tmp_path / 'synth'}", "data.synth_samples=24", "data.cache_dir=",
           "profile.data_samples=24", "global_batch=16", "planner.microbatches=[4]",
           "planner.samples=1", "planner.llm_pp=[1,2]", "planner.encoder_pp=[1]", "planner.tp=[1]",
           "profile.tps=[1]", "profile.llm_buckets=[64,512]"]  # fmt: skip
    assert profile_main(["data", *run]) == 0
    assert profile_main(["model", "--no-progress", *run]) == 0
    assert len(calls) == 1
    cfg = load_config(TrainConfig, DEMO_CONFIG, run)  # the commands' default config, as train's
    resolve_plan(RunContext.build(cfg))
    assert len(calls) == 1
    timings = json.loads((tmp_path / "auto_plan" / "timings.json").read_text())
    assert timings["data profile"] == 0.0 and timings["model profile"] == 0.0
