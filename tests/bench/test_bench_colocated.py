"""bench colocated: the composition it checks is the measured provider's (encoder share at the
smallest row plus the LLM stage at the stage's row), computed from the rounds' medians; noise is the
rounds' spread."""

import numpy as np
import pytest

from dflop_jax.bench import colocated


def test_compare_composes_the_share_as_the_provider_does():
    s0, s1 = colocated.LENGTHS
    times = {}
    for tp in colocated.TPS:
        for t in colocated.TILES:
            for s in colocated.LENGTHS:
                enc = 0.010 * t + (0.002 if s == s1 else 0.0)  # the share grows with the row at s1
                times["G_0", tp, t, s] = 0.001 * s / s0
                times["G_n", tp, t, s] = 0.005 * s / s0
                times["F_0", tp, t, s] = enc + times["G_0", tp, t, s]
                times["F_n", tp, t, s] = enc + times["G_n", tp, t, s]
    rounds = {k: np.array([[0.6 * v, 0.4 * v], [0.6 * v, 0.4 * v], [0.6 * v, 0.4 * v]])
              for k, v in times.items()}  # fmt: skip
    rounds["F_n", 1, 2, s0][1] *= 1.1  # one slow round: the median ignores it, the noise shows it
    rows = {(r["tp"], r["tiles"], r["length"]): r for r in colocated.compare(rounds)}
    at_s0, at_s1 = rows[1, 2, s0], rows[1, 2, s1]
    assert at_s0["composed_err"] == pytest.approx(0) and at_s0["provider_err"] == pytest.approx(0)
    assert at_s1["composed_err"] == pytest.approx(0)
    # the provider takes the share at s0: it misses the 2 ms the share gains at s1
    assert at_s1["provider_s"] == pytest.approx(at_s1["colocated_s"] - 0.002)
    assert at_s0["noise"] == pytest.approx(0.1) and rows[2, 2, s0]["noise"] == pytest.approx(0)
