"""`plan: auto` across processes: process 0 profiles on its own devices and plans for the whole job,
the other process receives the plan and the cost table (it profiles nothing) and both train the demo
model on that plan. Each process gets its own run directory here, so the test sees that the files
travelled (on a cluster without a shared file system they must)."""

import math

import pytest
from multiprocess_launch import launch, rows, tail

from dflop_jax.bench.multihost import TINY_LLAVA_OV

# The tiny LLaVA-OV model (not its explicit layout), profiled at one shape per part, planned from one
# sample: what is tested is who profiles and what travels, not the plan's quality.
TINY_MODEL = [a for a in TINY_LLAVA_OV if not a.startswith(("plan=", "layout.", "scheduler."))]
FAST_PROFILE = ["profile.runs=1", "profile.warmup=0", "profile.tps=[1]", "planner.tp=[1]",
                "profile.encoder_buckets=[16]", "profile.llm_buckets=[512]",
                "planner.microbatches=[2]", "planner.num_buckets=[1]", "planner.samples=1",
                "planner.screen_top=2", "planner.top_n=1"]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.slow
def test_auto_plan_made_once_and_shared(tmp_path):
    args = [*TINY_MODEL, "plan=auto", "steps=2", "data.synth_samples=64", f"data.synth_dir={tmp_path / 'synth'}",
            "checkpoint.every=0", "compilation_cache=", "num_cpu_devices=4",
            "distributed.timeout_s=60", *FAST_PROFILE]  # fmt: skip
    per_rank = {r: [f"run_dir={tmp_path / f'run{r}'}"] for r in (0, 1)}
    procs = launch(tmp_path, 2, args, per_rank, limit_s=500)
    for rank, (proc, log) in procs.items():
        assert proc.wait(timeout=520) == 0, f"process {rank} failed:\n{tail(log)}"
    made, received = tmp_path / "run0" / "auto_plan", tmp_path / "run1" / "auto_plan"
    for name in ("plan.yaml", "cost_table.json"):
        assert (received / name).read_bytes() == (made / name).read_bytes(), name
    assert (made / "timings.json").exists() and not (received / "timings.json").exists()
    losses = [r["loss"] for r in rows(tmp_path / "run0" / "metrics.jsonl")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert [r["loss"] for r in rows(tmp_path / "run1" / "metrics.process1.jsonl")] == losses
