"""Every command has the one CLI form and a `--help` that ends with an example that works.

The fast test checks each `--help` and runs the examples that take seconds; the slow ones run the rest
(plan -> simulate and train -> export, each chain in the order its inputs need; the benchmarks that
train or time compiled programs one by one, but those whose own test runs their example). Examples
run in a scratch directory (`example_fixtures.run_example`).
"""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from example_fixtures import env, run_example

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    "dflop_jax.train",
    "dflop_jax.plan",
    "dflop_jax.profile",
    "dflop_jax.export",
    "dflop_jax.schedule",
    "dflop_jax.simulate",
    "dflop_jax.costs",
    "dflop_jax.data.synth",
    "dflop_jax.bench",
]
BENCHES = ["attention", "audio", "cluster", "colocated", "costmodel", "dispatch", "first_step",
           "gpu", "loader", "loss", "multihost", "scheduler", "step", "train", "zero1"]  # fmt: skip
FAST_BENCHES = ["attention", "audio", "cluster", "loader", "loss", "scheduler"]
COMMANDS += [f"dflop_jax.bench {name}" for name in BENCHES]
FAST = ["dflop_jax.costs", "dflop_jax.schedule", "dflop_jax.data.synth", "dflop_jax.profile",
        "dflop_jax.bench", *(f"dflop_jax.bench {name}" for name in FAST_BENCHES)]  # fmt: skip
# The benchmarks that have no small size: their examples take 5-15 minutes (the third tier, `long`).
LONG_BENCHES = ["colocated", "costmodel", "first_step"]
# The benchmarks whose own test runs their example and checks the figures it writes
# (tests/bench/test_bench_<name>.py); `bench gpu`'s runs the example's part and size (attention,
# smoke) in the fast tier, beside the stage part.
EXAMPLE_RUN_BY_OWN_TEST = ["dispatch", "gpu", "train", "zero1"]
SLOW_BENCHES = [
    pytest.param(
        f"dflop_jax.bench {name}", marks=[pytest.mark.long] if name in LONG_BENCHES else []
    )
    for name in BENCHES
    if name not in FAST_BENCHES + EXAMPLE_RUN_BY_OWN_TEST
]
# The examples that read what another one wrote, each chain in the order its inputs need.
SLOW_CHAINS = [("dflop_jax.plan", "dflop_jax.simulate"), ("dflop_jax.train", "dflop_jax.export")]


def help_example(module: str) -> list[str]:
    """The example `python -m <module> --help` ends with, as an argv (`module` may name a benchmark:
    "dflop_jax.bench loss")."""
    out = subprocess.run([sys.executable, "-m", *module.split(), "--help"], capture_output=True,
                         text=True, env=env(), timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.rstrip().splitlines() if line.strip()]
    assert lines[-2].strip() == "example:", (
        f"{module} --help must end with an example:\n{out.stdout}"
    )
    argv = shlex.split(lines[-1])
    assert argv[: 2 + len(module.split())] == ["python", "-m", *module.split()], argv
    return [sys.executable, *argv[1:]]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_ends_with_an_example_in_the_one_form(module):
    argv = help_example(module)[2 + len(module.split()) :]
    files = {i + 1 for i, a in enumerate(argv) if a in ("--config", "--gin")}
    settings = [a for i, a in enumerate(argv) if not a.startswith("--") and i not in files]
    assert all("=" in a or a in ("data", "model", "auto", *BENCHES) for a in settings), argv


def test_every_benchmark_is_listed():
    from dflop_jax.bench.__main__ import available

    assert available() == BENCHES


def test_a_bad_benchmark_value_is_one_config_error_line(capsys):
    from dflop_jax.bench import loss

    with pytest.raises(SystemExit) as e:
        loss.main(["tp=5"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: tp=5")


def test_the_gpu_example_is_what_its_own_test_runs():
    """`bench gpu`'s example runs in tests/bench/test_bench_gpu.py (`EXAMPLE_RUN_BY_OWN_TEST`)."""
    argv = help_example("dflop_jax.bench gpu")[4:]
    assert sorted(argv) == ["parts=attention", "runs=1", "size=smoke", "warmup=0"]


@pytest.mark.parametrize("module", FAST)
def test_fast_examples_work(module, tmp_path):
    run_example(help_example(module), tmp_path)


def test_a_setting_given_as_a_flag_is_one_line(capsys):
    from dflop_jax import export

    with pytest.raises(SystemExit) as e:
        export.main(["--run", "runs/demo"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run=..." in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("chain", SLOW_CHAINS, ids=" then ".join)
@pytest.mark.seconds(45)
def test_examples_that_train_or_plan_work(chain, tmp_path):
    for module in chain:
        run_example(help_example(module), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("module", SLOW_BENCHES)
def test_benchmark_examples_that_train_or_time_programs_work(module, tmp_path):
    run_example(help_example(module), tmp_path)
