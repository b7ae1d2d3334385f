"""The planner's search space fitted to the device count (1, 2, 3, 4, 8), checked before profiling."""

import pytest

from dflop_jax.config import ConfigError
from dflop_jax.costs import get_arch, get_device
from dflop_jax.planner.candidates import enumerate_candidates
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.space import fit_search_space

# the demo's pinned space: 2 encoder + 2 LLM stages, no colocated encoder
DEMO = PlannerConfig(tp=(1, 2), encoder_pp=(2,), llm_pp=(2,), colocate=False, microbatches=(2, 4))


@pytest.mark.parametrize(
    "n, encoder_pp, llm_pp, colocate",
    [(1, (1,), (1,), True), (2, (1,), (2,), True), (3, (1,), (2,), False),
     (4, (2,), (2,), False), (8, (2,), (2,), False)],
)  # fmt: skip
def test_the_demo_space_fits_every_device_count(n, encoder_pp, llm_pp, colocate):
    arch, cpu = get_arch("tiny"), get_device("cpu")
    fitted = fit_search_space(arch, n, cpu, DEMO)
    assert (fitted.encoder_pp, fitted.llm_pp, fitted.colocate) == (encoder_pp, llm_pp, colocate)
    assert fitted.tp == ((1,) if n == 1 else (1, 2))
    layouts = [c.layout for c in enumerate_candidates(arch, n, cpu.devices_per_host, fitted)]
    assert layouts and all(lay.num_devices == n for lay in layouts)
    separate = [lay for lay in layouts if lay.encoder_stages]
    # a separate encoder wherever one fits beside the LLM stages; colocated on 1 device
    assert bool(separate) == (n >= 3)
    if n == 1:
        assert all(lay.num_stages == 1 for lay in layouts)


def test_a_space_the_devices_cannot_hold_is_one_config_error():
    arch, cpu = get_arch("tiny"), get_device("cpu")
    space = PlannerConfig(tp=(1,), encoder_pp=(1,), llm_pp=(1,), microbatches=(64,), global_batch=8)
    with pytest.raises(
        ConfigError,
        match=r"^planner.global_batch=8 is smaller than the smallest microbatch count 64",
    ) as e:
        fit_search_space(arch, 4, cpu, space)
    assert "\n" not in str(e.value)


def test_a_space_that_fits_is_left_as_written():
    arch, cpu = get_arch("tiny"), get_device("cpu")
    assert fit_search_space(arch, 8, cpu, DEMO) == DEMO
