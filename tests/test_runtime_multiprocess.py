"""Two jax processes on one machine (4 simulated CPU devices each) train with one pipeline stage per
process (cross-process stage transfers), save an orbax checkpoint, resume from it in a second
launch, and match a straight single-process run; a missing peer fails within the bounded wait."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from models_fixtures import TINY_TRAIN_DECODER

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "run_training.sh"


def _args(tmp_path, run_dir):
    return [
        "plan=explicit",  # the layout below (the demo config profiles and plans, single-process only)
        "model.kind=decoder",
        "layout.encoder_layers=[]",
        *TINY_TRAIN_DECODER,
        f"data.synth_dir={tmp_path / 'synth'}",
        "data.synth_mix=text",
        "data.synth_samples=64",
        "data.max_tokens=256",
        "data.cache_dir=",
        "layout.llm_layers=[1, 1]",
        "layout.llm_tp=[2]",
        "layout.llm_dp=2",
        "layout.lengths=[256]",
        "layout.microbatches=[2, 3]",
        "scheduler.solver=greedy",
        "global_batch=8",
        "steps=4",
        "compute_dtype=float32",
        "compilation_cache=",
        f"run_dir={run_dir}",
        "checkpoint.every=2",
        "num_cpu_devices=4",
        "peak_flops=1000000000.0",
        "distributed.timeout_s=60",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair() -> int:
    """A port p with p and p + 1 both free now: a coordinator and its watchdog hub."""
    for _ in range(100):
        base = _free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _env():
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)  # each process asks for its own 4 devices
    return env


def _start(tmp_path, run_dir, steps, extra=(), output=subprocess.PIPE):
    """Starts both processes (each in its own session, so a test can kill its whole group);
    `extra` overrides come last."""
    # The watchdog hub listens next to the coordinator: both ports free.
    port = _free_port_pair()
    return [
        subprocess.Popen(
            ["timeout", "-k", "10", "400", str(SCRIPT), "2", str(rank), f"127.0.0.1:{port}"]
            + _args(tmp_path, run_dir)
            + [f"steps={steps}", *extra],
            env=_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]


def _launch(tmp_path, run_dir, steps, extra=()):
    """Runs both processes to `steps` (then exit); returns their outputs."""
    procs = _start(tmp_path, run_dir, steps, extra)
    outs = [p.communicate(timeout=420)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {rank} failed:\n{out[-3000:]}"
    return outs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_train_checkpoint_resume_like_one(tmp_path):
    run_dir = tmp_path / "mp"
    _launch(tmp_path, run_dir, steps=2)
    # One orbax manager per process (each stage lives on one process), each committed step 2.
    groups = run_dir / "checkpoints"
    assert sorted(p.name for p in groups.iterdir()) == ["procs_0", "procs_1"]
    assert [sorted(p.name for p in (groups / g).iterdir()) for g in ("procs_0", "procs_1")] == [
        ["2"],
        ["2"],
    ]
    outs = _launch(tmp_path, run_dir, steps=4)
    assert "resumed from step 2" in outs[0]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    # The same 4 steps straight in this single process (8 devices: same layout and data).
    cfg = load_config(
        TrainConfig,
        REPO / "configs" / "demo.yaml",
        _args(tmp_path, tmp_path / "sp") + ["checkpoint.every=0"],
    )
    single = run(cfg)
    np.testing.assert_allclose([r["loss"] for r in rows], single.losses, rtol=1e-5)


@pytest.mark.multiprocess
def test_missing_peer_fails_with_clear_message(tmp_path):
    port = _free_port()
    args = _args(tmp_path, tmp_path / "lonely")[:-1] + ["distributed.timeout_s=3"]
    p = subprocess.run(
        ["timeout", "-k", "10", "120", str(SCRIPT), "2", "0", f"127.0.0.1:{port}"] + args,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    # The runtime aborts the process from C++ after the bounded wait; our line gives the context.
    assert p.returncode != 0
    assert "waiting at most 3s for every peer" in p.stderr
