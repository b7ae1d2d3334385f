"""End-to-end trainer: the loss decreases; N steps straight == N/2, stop, resume to N (losses, params),
with stage times measured every step and adaptive correction on (a deterministic op timer, so both
runs observe the same times; one sampled microbatch per measured step; batch k sees the observations
of steps <= k - prefetch); the embedded
demo (LLaVA-OV-style, 2 encoder + 2 LLM stages) trains and its loss decreases."""

import json
import logging
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from trainer_fixtures import decoder_train_config, millisecond_clock

from dflop_jax.config import ConfigError, load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run

REPO = Path(__file__).resolve().parents[2]


def test_demo_config_loads():
    cfg = load_config(TrainConfig, REPO / "configs" / "demo.yaml")
    # profile -> plan -> train, with the planner pinned to separate encoder and LLM pipelines
    assert cfg.plan == "auto" and cfg.num_cpu_devices == 8
    assert min(cfg.planner.encoder_pp) >= 2 and min(cfg.planner.llm_pp) >= 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("plan=magic", "plan='magic': use explicit, auto, analytic or a plan.yaml path"),
        ("device=tpu", "device.preset='tpu': use one of"),
    ],
)
def test_plan_settings_are_validated(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(TrainConfig, REPO / "configs" / "demo.yaml", [override])


def test_train_loss_decreases_and_resume_is_exact(tmp_path, caplog):
    straight = run(decoder_train_config(tmp_path, "a", steps=6), clock=millisecond_clock())
    assert np.mean(straight.losses[-2:]) < straight.losses[0] - 0.3
    assert (tmp_path / "a" / "config.yaml").is_file()
    rows = [json.loads(r) for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and straight.summary["programs_after_precompile"] == 0
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["stage_times_measured"] and not r["update_skipped"] for r in rows)
    assert all(r["stage_padding_ratio"] == [r["llm_padding_ratio"]] * 2 for r in rows)
    # Batch k (step k + 1) is scheduled with the observations of steps <= k - 2 (prefetch 2). A
    # measured step times one microbatch (step % M). Every stage program was compiled before step 1,
    # so no timed op compiles and each step, the first included, adds one observation.
    observed = [1] * len(rows)
    for r in rows:
        seen = observed[: max(r["step"] - 3, 0)]
        assert r["correction_observations"] == sum(seen)
        assert r["new_observations"] == (seen[-1] if seen else 0)
    last = rows[-1]
    assert last["correction_active"] and last["pred_raw_mape"] > 0.5  # analytic CPU costs != 1 ms
    # One bucket pair and a clock that gives every program exactly 1 ms: every observation carries the
    # same raw error, and the first one sets the factors to measured / raw exactly. The corrected
    # prediction is taken before each update, so the first observation (factors still 1) carries the
    # raw error and every later one is exact: over the n observations so far (all inside the 64-wide
    # window), corrected MAPE = raw MAPE / n.
    for r in rows:
        n = r["correction_observations"]
        if n == 0:
            assert r["pred_raw_mape"] is None
            continue
        assert n <= 64
        assert r["pred_corrected_mape"] == pytest.approx(r["pred_raw_mape"] / n, rel=1e-9)

    half = run(
        decoder_train_config(tmp_path, "b", steps=3, **{"checkpoint.every": 3}),
        clock=millisecond_clock(),
    )
    caplog.clear()
    resumed = run(
        decoder_train_config(tmp_path, "b", steps=6, **{"checkpoint.every": 3}),
        clock=millisecond_clock(),
    )
    assert resumed.first_step == 3
    # orbax (its logs go through absl) warns of nothing on a restore: its step metadata lives
    # beside the items, not in them
    assert not [r.getMessage() for r in caplog.records
                if r.name == "absl" and r.levelno >= logging.WARNING]  # fmt: skip
    assert half.losses + resumed.losses == straight.losses
    for s_a, s_b in zip(straight.stages, resumed.stages):
        jax.tree.map(
            np.testing.assert_array_equal, jax.device_get(s_a.params), jax.device_get(s_b.params)
        )


@pytest.mark.slow
def test_demo_trains_and_loss_decreases(demo_run):
    """The demo config itself at its least (the session's shared demo run, `DEMO_RUN`: profile,
    plan and train on 8 devices), with more steps and a larger learning rate."""
    import yaml

    plan = yaml.safe_load((demo_run / "auto_plan" / "plan.yaml").read_text())
    modules = [s["module"] for s in plan["layout"]]
    assert modules.count("encoder") >= 2 and modules.count("llm") >= 2
    rows = [json.loads(r) for r in (demo_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert np.mean(losses[-2:]) < losses[0] - 0.2
    assert (demo_run / "config.yaml").is_file()
    assert len(rows) == 6
    # Real timing (one sampled microbatch) on every step; batch k sees steps <= k - 2 (prefetch 2),
    # so steps 1-3 are scheduled from predictions alone and step 6 has seen steps 1-3.
    assert all(r["stage_times_measured"] for r in rows)
    assert [r["correction_observations"] for r in rows[:3]] == [0, 0, 0]
    assert rows[5]["correction_observations"] >= 1 and rows[5]["pred_raw_mape"] > 0


def test_steps_are_issued_without_host_reads_and_read_after_the_next(tmp_path, monkeypatch):
    """log_every=2: a step is issued with every device-to-host transfer forbidden; its numbers are
    read only at log steps (and the first), after the next step was dispatched."""
    from dflop_jax.runtime import trainer as trainer_mod

    events = []
    dispatch, read = trainer_mod._Trainer.dispatch, trainer_mod._Trainer.read

    def guarded(self, step):
        with jax.transfer_guard_device_to_host("disallow_explicit"):
            dispatch(self, step)
        events.append(f"D{step}")

    def logged(self, through):
        rows = read(self, through)
        events.append("R" + ",".join(str(r.step) for r in rows))
        return rows

    monkeypatch.setattr(trainer_mod._Trainer, "dispatch", guarded)
    monkeypatch.setattr(trainer_mod._Trainer, "read", logged)
    report = run(
        decoder_train_config(tmp_path, "c", steps=5, log_every=2, measure_stage_times_every=2),
        clock=millisecond_clock(),
    )
    assert events == ["D1", "D2", "R1", "D3", "R2", "D4", "D5", "R3,4", "R5"]
    assert len(report.losses) == 5 and all(np.isfinite(report.losses))


def test_the_compilation_cache_turns_on_after_the_plan(tmp_path, monkeypatch):
    """The run's persistent compilation cache turns on once its plan is resolved, not before: a
    model profile (`plan: auto`) times cold compiles, by which the planner prices the run's
    compilation, whatever the cache holds from an earlier run."""
    import dflop_jax.resolve as resolve_mod
    from dflop_jax.runtime import trainer as trainer_mod

    events, resolve_plan = [], resolve_mod.resolve_plan

    def resolved(*args, **kwargs):
        events.append("plan")
        return resolve_plan(*args, **kwargs)

    monkeypatch.setattr(resolve_mod, "resolve_plan", resolved)
    monkeypatch.setattr(trainer_mod, "enable_compilation_cache", lambda d: events.append(str(d)))
    cache = str(tmp_path / "jax_cache")
    run(decoder_train_config(tmp_path, "cache", steps=1, compilation_cache=cache))
    assert events == ["plan", cache]


def test_every_bucket_compiles_before_step_1(tmp_path, monkeypatch, capsys):
    """An explicit layout with a length bucket that step 1 does not use (samples of at most 256
    tokens, 4 per data shard): every stage and transfer program of every bucket compiles before
    step 1, and 8 steps (stage times measured, microbatch counts varying) build no executable,
    step 1 included; side inputs arrive on the devices from the loader's thread. The precompile
    line names its programs' kinds: the plan's estimate (stage, transfer and per-step programs),
    a checkpoint's (none here) and two initializations per stage (parameters, optimizer state)."""
    from dflop_jax.runtime import trainer as trainer_mod

    used, pipeline = [], trainer_mod.run_pipeline

    def recorded(stages, microbatches, *args, placed=None, **kw):
        assert all(isinstance(a, jax.Array) for p in placed for d in p for a in d.values())
        used.append({mb.tokens.shape[1] for mb in microbatches})
        return pipeline(stages, microbatches, *args, placed=placed, **kw)

    monkeypatch.setattr(trainer_mod, "run_pipeline", recorded)
    report = run(
        decoder_train_config(tmp_path, "aot", steps=8, **{"layout.lengths": "[256, 2048]"}),
        clock=millisecond_clock(),
    )
    out = capsys.readouterr().out
    estimate = int(re.search(r"compile: (\d+) stage, transfer and per-step programs", out)[1])
    line = re.search(r"compiled (\d+) programs \((\d+) stage and transfer programs for \d+ bucket "
                     r"pairs, (\d+) per-step, (?:(\d+) for checkpoints, )?(\d+) at start-up", out)  # fmt: skip
    total, stage, step, saves, before = (int(n or 0) for n in line.groups())
    assert stage + step == estimate and before == 2 * len(report.stages)
    # equal in a fresh process; one that already holds some of the run's small programs (an
    # earlier test's transfers, under xdist) builds fewer than it lowers
    assert total <= stage + step + saves + before and report.summary["programs"] == total
    rows = [json.loads(r) for r in (tmp_path / "aot" / "metrics.jsonl").read_text().splitlines()]
    assert used[0] != {256, 2048}  # step 1 leaves a bucket to the ahead-of-time compile
    assert len(rows) == 8
    assert [r["recompiles"] for r in rows] == [0] * 8  # the update's small programs too
    assert report.summary["programs_after_precompile"] == 0
    assert all(r["compiles"] == report.summary["programs"] for r in rows)  # one count
    for stage in report.stages:  # both buckets' programs were compiled ahead
        lengths = {dict((k, shape) for k, shape, _ in sig[2])["segment_ids"][1]
                   for sig in stage.signatures if sig[0] != "count"}  # fmt: skip
        assert lengths == {256, 2048}
