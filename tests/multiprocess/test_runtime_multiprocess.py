"""Two jax processes on one machine (4 simulated CPU devices each) train with one pipeline stage per
process (cross-process stage transfers), save an orbax checkpoint, resume from it in a second
launch, and match a straight single-process run; a missing peer fails within the bounded wait."""

import json
import subprocess

import numpy as np
import pytest
from multiprocess_launch import (
    REPO,
    SCRIPT,
    checkpointed_decoder_args,
    env,
    free_ports,
    run_checkpointed_decoder,
)

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_train_checkpoint_resume_like_one(tmp_path):
    run_dir = tmp_path / "mp"
    run_checkpointed_decoder(tmp_path, run_dir, steps=2)
    # One orbax manager per process (each stage lives on one process), each committed step 2.
    groups = run_dir / "checkpoints"
    assert sorted(p.name for p in groups.iterdir()) == ["procs_0", "procs_1"]
    assert [sorted(p.name for p in (groups / g).iterdir()) for g in ("procs_0", "procs_1")] == [
        ["2"],
        ["2"],
    ]
    outs = run_checkpointed_decoder(tmp_path, run_dir, steps=4)
    assert "resumed from step 2" in outs[0]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    # The same 4 steps straight in this single process (8 devices: same layout and data).
    cfg = load_config(
        TrainConfig,
        REPO / "configs" / "demo.yaml",
        checkpointed_decoder_args(tmp_path, tmp_path / "sp") + ["checkpoint.every=0"],
    )
    single = run(cfg)
    np.testing.assert_allclose([r["loss"] for r in rows], single.losses, rtol=1e-5)


@pytest.mark.multiprocess
def test_missing_peer_fails_with_clear_message(tmp_path):
    port = free_ports(1)
    args = checkpointed_decoder_args(tmp_path, tmp_path / "lonely") + ["distributed.timeout_s=3"]
    p = subprocess.run(
        ["timeout", "-k", "10", "120", str(SCRIPT), "2", "0", f"127.0.0.1:{port}"] + args,
        env=env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    # The runtime aborts the process from C++ after the bounded wait; our line gives the context.
    assert p.returncode != 0
    assert "waiting at most 3s for every peer" in p.stderr
