"""`python -m dflop_jax.bench dispatch`: the real-size stage's Python layers with its programs stubbed
(fast: traced, never compiled), jax's own call cost by inputs and outputs, and the demo's dispatch path
against its floor (slow: it trains)."""

import json

import pytest
from example_fixtures import example_argv, run_example

from dflop_jax.bench import dispatch as bench


def test_real_part_times_our_layers_at_real_leaf_counts():
    rep = bench.real_part(rounds=1)
    m = rep["microbatches"]
    assert rep["calls"] == 1 + 2 * m  # a zero accumulator, a forward and a backward per microbatch
    assert rep["param_leaves"] > 0 and rep["residual_leaves"] > rep["param_leaves"]
    # both paths timed (which costs less is the benchmark's figure, not a test's: one round on a
    # loaded machine can order them either way)
    assert rep["us_per_call"] > 0 and rep["trees_us_per_call"] > 0


def test_jax_part_measures_every_shape_and_fits_its_cost():
    rep = bench.jax_part(rounds=1, devices=(1, 2), leaves=(1, 4), calls=3)
    got = {(r["devices"], r["inputs"], r["outputs"]) for r in rep["rows"]}
    assert got == {(d, n, o) for d in (1, 2) for n in (1, 4) for o in {1, n}}
    assert len(rep["rows"]) == len(got)  # one row each
    assert all(r["cpu_us_per_call"] >= 0 for r in rep["rows"]) and set(rep["fit"]) == {"1", "2"}


def test_call_cost_fit_recovers_known_coefficients():
    """The fit separates a fixed cost, a per-input and a per-output cost per device count."""
    cost = {1: (10.0, 0.5, 4.0), 2: (20.0, 1.0, 7.0)}
    rows = [{"devices": d, "inputs": n, "outputs": o,
             "cpu_us_per_call": cost[d][0] + cost[d][1] * n + cost[d][2] * o}
            for d in cost for n in (1, 16, 64) for o in {1, n}]  # fmt: skip
    fit = bench._fit_call_cost(rows)
    for d, (fixed, per_in, per_out) in cost.items():
        f = fit[str(d)]
        assert (f["fixed_us"], f["per_input_us"], f["per_output_us"]) == pytest.approx(
            (fixed, per_in, per_out)
        )


def test_unknown_part_is_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["parts=gpu"])
    assert e.value.code == 2 and "parts" in capsys.readouterr().err


@pytest.mark.slow  # trains the demo's model (compiles its stages): over a minute
@pytest.mark.seconds(43)
def test_demo_part_compares_the_path_with_its_floor(tmp_path):
    """The benchmark's `--help` example (the demo part), as a user runs it."""
    printed = run_example(example_argv(bench.COMMAND), tmp_path).stdout
    rep = json.loads((tmp_path / "runs" / "bench_dispatch" / "report.json").read_text())["demo"]
    iso = rep["isolated"]
    assert iso["programs"] == iso["recorded"] > 0  # the floor calls every program the path issued
    assert iso["path_over_floor"] > 0 and iso["path_over_floor_cpu"] > 0
    assert sum(r["calls"] for r in iso["floor_by_program"]) == iso["recorded"]
    by_program = {r["program"]: r for r in iso["floor_by_program"] if r["kind"] == "stage"}
    # a backward returns dL/dx and its packed accumulator (at most 2 buffers), not a leaf per param
    assert 0 < by_program["bwd_res"]["outputs"] <= 3 < by_program["bwd_res"]["inputs"]
    assert "floor by program" in printed
    assert rep["trainer"]["dispatch_programs"] > 0
    assert "path / floor" in printed
