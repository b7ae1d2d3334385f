"""`python -m dflop_jax.bench dispatch`: the real-size stage's Python layers with its programs stubbed
(fast: traced, never compiled), and the demo's dispatch path against its floor (slow: it trains)."""

import json

import pytest

from dflop_jax.bench import dispatch as bench


def test_real_part_times_our_layers_at_real_leaf_counts():
    rep = bench.real_part(rounds=1)
    m = rep["microbatches"]
    assert rep["calls"] == 1 + 2 * m  # a zero accumulator, a forward and a backward per microbatch
    assert rep["param_leaves"] > 0 and rep["residual_leaves"] > rep["param_leaves"]
    assert 0 < rep["us_per_call"] < rep["trees_us_per_call"]  # leaves cost less than trees


def test_unknown_part_is_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["parts=gpu"])
    assert e.value.code == 2 and "parts" in capsys.readouterr().err


@pytest.mark.slow  # trains the demo's model (compiles its stages): over a minute
def test_demo_part_compares_the_path_with_its_floor(tmp_path, capsys):
    out = tmp_path / "b"
    assert bench.main(["parts=demo", "steps=3", "rounds=1", f"out={out}",
                       f"json_out={out / 'r.json'}"]) == 0  # fmt: skip
    rep = json.loads((out / "r.json").read_text())["demo"]
    iso = rep["isolated"]
    assert iso["programs"] == iso["recorded"] > 0  # the floor calls every program the path issued
    assert iso["path_over_floor"] > 0 and iso["path_over_floor_cpu"] > 0
    assert rep["trainer"]["dispatch_programs"] > 0
    assert "path / floor" in capsys.readouterr().out
