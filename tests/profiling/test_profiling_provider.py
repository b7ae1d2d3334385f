"""MeasuredCostProvider over synthetic cost tables (no jax): exact interpolation / extrapolation on
linear costs, per-layer extrapolation, the sum-of-parts rule, memory fields, fallback with a warning,
and the cost-table file round trip."""

import logging

import numpy as np
import pytest

from dflop_jax.contracts.cost_table import CostEntry, ProfiledCostTable, load_table, save_table
from dflop_jax.costs import AnalyticCostProvider, StageSpec, get_arch, get_device
from dflop_jax.costs.measured import MeasuredCostProvider, interpolate

ARCH, DEV = get_arch("tiny"), get_device("cpu")
BASE = 1e-4  # per-program fixed seconds
PER_LAYER = {"fwd": 2e-6, "bwd": 5e-6}  # seconds per token per layer
EMB = {"fwd": 1e-7, "bwd": 3e-7}
HEAD = {"fwd": 4e-7, "bwd": 9e-7}
BUCKETS = (64, 256, 1024)


def _entry(kind, tp, bucket, layers, slope, param_bytes, temp):
    fwd = BASE + slope["fwd"] * bucket * max(layers, 1) / tp
    bwd = BASE + slope["bwd"] * bucket * max(layers, 1) / tp
    peak = 2 * param_bytes + 10 * bucket + temp
    return CostEntry(kind, tp, bucket, layers, fwd_s=fwd, bwd_s=bwd, param_bytes=param_bytes,
                     input_bytes=10 * bucket, memory_bwd={"peak": peak})  # fmt: skip


def synthetic_table(tps=(1, 2)) -> ProfiledCostTable:
    t = ProfiledCostTable("cpu", "cpu", 8, "h", "c", model="tiny")
    for tp in tps:
        for b in BUCKETS:
            for n in (1, 2):
                t.add(_entry("llm_layers", tp, b, n, PER_LAYER, 1000.0 * n, 7.0 * n * b))
            t.add(_entry("llm_embedding", tp, b, 0, EMB, 500.0, 3.0 * b))
            t.add(_entry("llm_head", tp, b, 0, HEAD, 800.0, 5.0 * b))
    return t


def truth(stage: StageSpec, s: int, d: str) -> float:
    """One colocated program: one BASE, plus each part's per-token work."""
    t = BASE + stage.num_layers * PER_LAYER[d] * s / stage.tp
    t += EMB[d] * s / stage.tp if stage.has_embedding else 0.0
    return t + (HEAD[d] * s / stage.tp if stage.has_head else 0.0)


@pytest.mark.parametrize("bucket", [64, 100, 256, 700, 1024, 2048, 32])
@pytest.mark.parametrize("layers,emb,head,tp", [(1, False, False, 1), (3, False, False, 2),
                                                (4, True, True, 1), (2, False, True, 2)])  # fmt: skip
def test_interpolation_and_layer_extrapolation_exact_on_linear_costs(bucket, layers, emb, head, tp):
    p = MeasuredCostProvider(synthetic_table(), ARCH, DEV)
    stage = StageSpec("llm", 0, layers, tp=tp, has_embedding=emb, has_head=head)
    fwd, bwd = p.stage_time(stage, bucket)
    assert fwd == pytest.approx(truth(stage, bucket, "fwd"), rel=1e-9)
    assert bwd == pytest.approx(truth(stage, bucket, "bwd"), rel=1e-9)


def test_sources_flag_measured_interpolated_extrapolated():
    p = MeasuredCostProvider(synthetic_table(), ARCH, DEV, fit="interpolate")
    for b in (256, 300, 4096):
        p.stage_time(StageSpec("llm", 0, 1), b)
    assert p.sources() == {"llm_layers": {"measured": 1, "interpolated": 1, "extrapolated": 1}}
    fitted = MeasuredCostProvider(synthetic_table(), ARCH, DEV)
    for b in (256, 300, 4096):
        fitted.stage_time(StageSpec("llm", 0, 1), b)
    assert fitted.sources() == {"llm_layers": {"fitted": 2, "extrapolated": 1}}
    assert p.stage_time(StageSpec("llm", 0, 1), 0) == (0.0, 0.0)


def _quadratic_table(buckets, inflate=None) -> ProfiledCostTable:
    """Layer cost with an attention-like b^2 term; `inflate` = (bucket, layers, factor) of one entry."""
    t = ProfiledCostTable("cpu", "cpu", 8, "h", "c", model="tiny")
    for b in buckets:
        for n in (1, 2):
            f = inflate[2] if inflate and (b, n) == inflate[:2] else 1.0
            fwd = f * (BASE + n * (2e-6 * b + 3e-9 * b * b))
            t.add(CostEntry("llm_layers", 1, b, n, fwd_s=fwd, bwd_s=2.5 * fwd, param_bytes=1.0,
                            input_bytes=10 * b, memory_bwd={"peak": 0.0}))  # fmt: skip
    return t


def _quadratic_truth(b, n):
    return BASE + n * (2e-6 * b + 3e-9 * b * b)


BUCKETS5 = (64, 128, 256, 512, 1024)


@pytest.mark.parametrize("bucket", [96, 300, 700, 1024])
@pytest.mark.parametrize("layers", [1, 3])
def test_least_squares_recovers_quadratic_costs_that_interpolation_misses(bucket, layers):
    stage = StageSpec("llm", 0, layers)
    fit = MeasuredCostProvider(_quadratic_table(BUCKETS5), ARCH, DEV)
    assert fit.stage_time(stage, bucket)[0] == pytest.approx(
        _quadratic_truth(bucket, layers), rel=1e-6
    )
    if bucket not in BUCKETS5:  # a chord of a convex curve lies above it
        interp = MeasuredCostProvider(_quadratic_table(BUCKETS5), ARCH, DEV, fit="interpolate")
        assert interp.stage_time(stage, bucket)[0] > _quadratic_truth(bucket, layers) * 1.001


def test_one_inflated_entry_spoils_the_fit_less_than_interpolation():
    """A 1-layer entry timed 2x too slow (a contended minute), as on a shared machine."""
    table = _quadratic_table(BUCKETS5, inflate=(512, 1, 2.0))
    errors = {}
    for mode in ("least_squares", "interpolate"):
        p = MeasuredCostProvider(table, ARCH, DEV, fit=mode)
        errs = [abs(p.stage_time(StageSpec("llm", 0, n), b)[0] / _quadratic_truth(b, n) - 1)
                for n in (1, 2, 4) for b in (300, 400, 512, 700, 900)]  # fmt: skip
        errors[mode] = (float(np.mean(errs)), max(errs))
    assert errors["least_squares"][0] < 0.5 * errors["interpolate"][0]
    assert errors["least_squares"][1] < errors["interpolate"][1]


def test_unknown_fit_mode_is_refused():
    with pytest.raises(ValueError, match="least_squares"):
        MeasuredCostProvider(synthetic_table(), ARCH, DEV, fit="spline")


def test_interpolate_helper():
    xs, ys = np.array([1.0, 3.0]), np.array([10.0, 30.0])
    assert interpolate(xs, ys, 2.0) == (20.0, "interpolated")
    assert interpolate(xs, ys, 5.0) == (50.0, "extrapolated")
    assert interpolate(xs, ys, 3.0) == (30.0, "measured")
    assert interpolate(np.array([4.0]), np.array([8.0]), 2.0) == (4.0, "extrapolated")


def test_memory_from_entries():
    p = MeasuredCostProvider(synthetic_table(), ARCH, DEV)
    m = p.stage_memory(StageSpec("llm", 0, 3, has_embedding=True, has_head=True), 256)
    params = 500.0 + 3000.0 + 800.0  # embedding + 3 layers (1000 each) + head
    assert m.params == pytest.approx(params)
    assert m.grads == pytest.approx(params) and m.optimizer == pytest.approx(2 * params)
    assert m.activations_per_microbatch == pytest.approx(10 * 256)  # the embedding's input
    assert m.temp == pytest.approx((3.0 + 21.0 + 5.0) * 256)  # temps of the parts, summed


def test_missing_entries_fall_back_to_analytic_with_one_warning(caplog):
    analytic = AnalyticCostProvider(ARCH, DEV)
    p = MeasuredCostProvider(synthetic_table(tps=(1,)), ARCH, DEV, fallback=analytic)
    stage = StageSpec("llm", 0, 2, tp=2)
    with caplog.at_level(logging.WARNING, logger="dflop_jax.costs.measured"):
        got = [p.stage_time(stage, b) for b in (64, 128)]
    assert got[0] == analytic.stage_time(stage, 64)
    warnings = [r for r in caplog.records if "llm_layers" in r.getMessage()]
    assert len(warnings) == 1 and "tp=2" in warnings[0].getMessage()
    assert p.sources() == {"llm_layers": {"fallback": 2}}
    enc = StageSpec("encoder", 0, 1, has_head=True)
    # No encoder entries at all: each part is the analytic model's, summed (no fixed cost to share).
    parts = [analytic.stage_time(StageSpec("encoder", 0, n, has_head=h), 4)
             for n, h in ((1, False), (0, True))]  # fmt: skip
    assert p.stage_time(enc, 4) == pytest.approx(tuple(map(sum, zip(*parts))), rel=1e-12)
    assert p.sources()["encoder_head"] == {"fallback": 1}


def test_missing_entry_without_fallback_raises():
    p = MeasuredCostProvider(synthetic_table(tps=(1,)), ARCH, DEV)
    with pytest.raises(KeyError, match="tp=4"):
        p.stage_time(StageSpec("llm", 0, 1, tp=4), 64)


def test_table_file_round_trip(tmp_path):
    t = synthetic_table()
    t.add(CostEntry("encoder_layers", 8, 4, 1, status="skipped", reason="over memory"))
    path = save_table(t, tmp_path / "ct.json")
    back = load_table(path)
    assert back.entries == t.entries and back.config_hash == "h"
    assert [e.reason for e in back.skipped()] == ["over memory"]
    p = MeasuredCostProvider(path, ARCH, DEV)  # a path works too
    assert p.stage_time(StageSpec("llm", 0, 1), 64)[0] == pytest.approx(BASE + 2e-6 * 64)
    (tmp_path / "bad.json").write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version"):
        load_table(tmp_path / "bad.json")


def test_frozen_stages_derive_from_the_trainable_programs():
    """Under trainable=[projector] an LLM stage runs dx only: the measured forward, 2/3 of the
    measured backward (derived), no accumulator and no optimizer state for its parameters."""
    full = MeasuredCostProvider(synthetic_table(), ARCH, DEV)
    proj = full.with_trainable(("projector",))
    stage = StageSpec("llm", 0, 3, tp=1, has_embedding=True)
    assert proj.stage_time(stage, 256) == pytest.approx(
        (truth(stage, 256, "fwd"), 2 / 3 * truth(stage, 256, "bwd")), rel=1e-9
    )
    mem, ref = proj.stage_memory(stage, 256), full.stage_memory(stage, 256)
    assert (mem.params, mem.grads, mem.optimizer) == (ref.params, 0.0, 0.0)
    assert ref.grads == ref.params and proj.name.endswith("+train:projector")
    assert full.stage_time(stage, 256)[1] == pytest.approx(truth(stage, 256, "bwd"), rel=1e-9)
