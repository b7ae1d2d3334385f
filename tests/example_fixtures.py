"""Running a command's `--help` example as a user runs it: in a scratch directory that sees the
repository's `configs/` (where the examples' inputs live), so its outputs land there, with the test
run's one compilation cache as the runs' default `runs/jax_cache` (tests/conftest.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from dflop_jax.config.cli import Command

ROOT = Path(__file__).resolve().parent.parent


def env() -> dict[str, str]:
    """The test process's environment with the repository first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def example_argv(command: Command) -> list[str]:
    """`command`'s example (what its `--help` ends with) as an argv for this interpreter."""
    argv = shlex.split(command.example)
    assert argv[:2] == ["python", "-m"], argv
    return [sys.executable, *argv[1:]]


def run_example(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Runs an example's argv in `cwd` (a scratch directory); asserts it exited 0."""
    if not (cwd / "configs").exists():
        (cwd / "configs").symlink_to(ROOT / "configs")
    # A run's default compilation cache (`runs/jax_cache`, under the scratch directory) is the test
    # run's one cache, so an example loads the programs the suite compiled before it.
    cache = cwd / "runs" / "jax_cache"
    if not cache.exists() and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        cache.parent.mkdir(exist_ok=True)
        cache.symlink_to(os.environ["JAX_COMPILATION_CACHE_DIR"], target_is_directory=True)
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env(), timeout=1800)
    assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out
