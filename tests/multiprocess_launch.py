"""Real jax processes on 127.0.0.1 for the multi-process tests: free ports, the decoder layout (one LLM
stage of 4 devices per process), one process group per rank (a test can kill a rank, and check that no
process of a rank is left once it exited), output in files (a full pipe would block a process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from models_fixtures import TINY_TRAIN_DECODER

from dflop_jax import host_devices

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "run_training.sh"
T = TypeVar("T")


def decoder_args(tmp_path: Path, run_dir: Path) -> list[str]:
    """Train args of the tiny decoder on 2 processes x 4 devices: stage 0 on process 0, stage 1 on 1."""
    return [
        "plan=explicit",
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
        "global_batch=8",
        "compute_dtype=float32",
        "compilation_cache=",
        f"run_dir={run_dir}",
        "checkpoint.every=0",
        "num_cpu_devices=4",
        "device.peak_flops=1000000000.0",
        "distributed.timeout_s=60",
    ]


# The tiny decoder's two LLM stages, one per process (`decoder_args`); checkpoints at steps 2 and 4.
CHECKPOINTED = ["scheduler.solver=greedy", "steps=4", "checkpoint.every=2"]


def checkpointed_decoder_args(tmp_path: Path, run_dir: Path) -> list[str]:
    """`decoder_args` of a 4-step run that checkpoints every 2 steps (greedy scheduler)."""
    return decoder_args(tmp_path, run_dir) + CHECKPOINTED


def run_checkpointed_decoder(tmp_path: Path, run_dir: Path, steps: int, extra=(), name="run"):
    """Runs both processes of `checkpointed_decoder_args` to `steps` (then exit); returns their
    outputs."""
    logs = tmp_path / f"{name}_logs"
    logs.mkdir(exist_ok=True)
    return finish(
        launch(logs, 2, checkpointed_decoder_args(tmp_path, run_dir) + [f"steps={steps}", *extra])
    )


def free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 all free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = [socket.socket() for _ in range(count)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def launch(
    tmp_path: Path, num: int, args: list[str], per_rank: dict[int, list[str]] | None = None,
    ranks: list[int] | None = None, limit_s: int = 400,
) -> dict[int, tuple[subprocess.Popen, Path]]:  # fmt: skip
    """Starts `ranks` (default all) of a `num`-process job; returns rank -> (process, its log file).

    Coordinator and watchdog hub get explicit free ports.
    """
    base = free_ports(2)
    ports = [f"distributed.watchdog_port={base + 1}"]
    out = {}
    for rank in range(num) if ranks is None else ranks:
        log = tmp_path / f"rank{rank}.log"
        cmd = ["timeout", "-k", "10", str(limit_s), str(SCRIPT), str(num), str(rank),
               f"127.0.0.1:{base}", *args, *ports, *(per_rank or {}).get(rank, [])]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        out[rank] = (proc, log)
    return out


def env() -> dict[str, str]:
    """The environment of a test's jax processes: this Python and repository, own device counts."""
    return dict(own_devices_env(), PYTHON=sys.executable)


def own_devices_env() -> dict[str, str]:
    """The environment of one jax process a test starts that takes its simulated device count from
    its own config (`num_cpu_devices`, `num_devices`): the suite's XLA flags (its CPU compile
    settings) without its 8-device count, no CPU client pool size, this repository's code."""
    return dict(host_devices.own_devices_env(os.environ), PYTHONPATH=str(REPO))


def finish(procs: dict[int, tuple[subprocess.Popen, Path]], limit_s: int = 420) -> list[str]:
    """Waits for every process of `launch`; asserts each exited 0; returns their outputs by rank."""
    outs = []
    for rank, (proc, log) in sorted(procs.items()):
        proc.wait(limit_s)
        assert proc.returncode == 0, f"process {rank} exited {proc.returncode}:\n{tail(log)}"
        outs.append(log.read_text())
    return outs


def finish_beside(
    procs: dict[int, tuple[subprocess.Popen, Path]], reference: Callable[[], T], limit_s: int = 420
) -> tuple[list[str], T]:
    """`reference()` (the single-process run a test compares with) run in this process while the
    processes of `launch` run, then `finish(procs, limit_s)`: their outputs and its result. Why: two
    processes of a pipeline leave about a fifth of 2 cores idle (each waits on the other's stages),
    and the reference fills it instead of running after them. If the reference raises, the processes
    are stopped first."""
    try:
        result = reference()
    except BaseException:
        stop(procs)
        raise
    return finish(procs, limit_s), result


def stop(procs: dict[int, tuple[subprocess.Popen, Path]]) -> None:
    """SIGKILLs every process group of `launch` still alive and reaps its process."""
    for proc, _ in procs.values():
        if not group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for_rows(path: Path, rows: int, timeout_s: float, procs) -> None:
    """Waits until `path` (a metrics.jsonl) has `rows` lines; fails early if a process exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            return
        for proc, log in procs.values():
            if proc.poll() is not None:
                raise AssertionError(f"a process exited early ({proc.returncode}):\n{tail(log)}")
        time.sleep(0.5)
    raise AssertionError(f"{path} did not reach {rows} rows within {timeout_s}s")


def group_gone(pgid: int) -> bool:
    """True when no process of the process group `pgid` is left (no orphans)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text()[-chars:]


CHECKPOINT_WORKER = REPO / "tests" / "checkpoint_worker.py"


def checkpoint_workers(*args, processes=2) -> list[str]:
    """Runs tests/checkpoint_worker.py in `processes` jax processes; returns their outputs."""
    port = free_ports(1)
    procs = [
        subprocess.Popen(
            ["timeout", "-k", "10", "300", sys.executable, str(CHECKPOINT_WORKER), *args]
            + [str(processes), str(rank), f"127.0.0.1:{port}"],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(processes)
    ]
    outs = [p.communicate(timeout=320)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {rank} failed:\n{out[-3000:]}"
    return outs
