"""The typed contracts between the parts: the loader's ScheduleFn (batch index explicit), BatchStats /
PackCounts, the driver reading packed microbatches without copies, ResolvedPlan's runnability check,
ModelConfig.build."""

import dataclasses

import numpy as np
import pytest

from dflop_jax.contracts import BucketSet, SampleShape, ScheduleProblem
from dflop_jax.contracts.layout import Layout
from dflop_jax.costs import StageSpec, arch_of_model, llm_arch_from_config
from dflop_jax.data.sample_arrays import BatchStats, PackCounts, PackedMicrobatch
from dflop_jax.planner.resolve import ResolvedPlan
from dflop_jax.programs.model_section import ModelConfig
from dflop_jax.runtime import driver
from dflop_jax.scheduler import Scheduler, SchedulerConfig, correction

PROBLEM = ScheduleProblem(
    1, 2, 2, (1, 4), BucketSet((4,), (256,)), lambda t, s: np.ones((2, 2)) * (t + s)
)
SHAPES = [SampleShape(i, 1, 50 + 10 * i) for i in range(6)]


def test_schedule_fn_seeds_batch_k_the_same_whatever_came_before(monkeypatch):
    """A resumed run (fresh Scheduler) and a prefetching one schedule batch k with the same seed."""
    seeds = []
    real = correction.schedule_batch

    def spy(shapes, problem, config, **kw):
        seeds.append(config.seed)
        return real(shapes, problem, config, **kw)

    monkeypatch.setattr(correction, "schedule_batch", spy)
    cfg = SchedulerConfig(solver="greedy", seed=100)
    ran_before = Scheduler(PROBLEM, cfg)
    for k in (0, 1, 2, 5):  # out of order, as a prefetching loader may call it
        ran_before.schedule(SHAPES, k)
    ran_before.schedule(SHAPES, 7)
    resumed = Scheduler(PROBLEM, cfg)
    resumed.schedule(SHAPES, 7)
    assert seeds == [100, 101, 102, 105, 107, 107]


def test_pack_counts_sum_and_padding_ratios():
    a = PackCounts(
        tokens_real=30, tokens_computed=64, tiles_real=3, tiles_computed=4, loss_tokens=9
    )
    b = PackCounts(
        tokens_real=34, tokens_computed=64, tiles_real=1, tiles_computed=4, loss_tokens=5
    )
    total = a + b
    assert total == PackCounts(64, 128, 4, 8, 14)
    stats = BatchStats(packed=total, skipped={"too_long": 2, "corrupt_image": 1})
    assert stats.llm_padding_ratio == pytest.approx(0.5)
    assert stats.encoder_padding_ratio == pytest.approx(0.5)
    assert stats.num_skipped == 3
    assert BatchStats().llm_padding_ratio == 0.0  # nothing computed: no padding, no division by 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.data_wait_s = 1.0


def test_driver_reads_packed_microbatch_arrays_without_copying():
    z = np.zeros((2, 8), np.int32)
    mb = PackedMicrobatch(
        tiles=np.zeros((4, 2, 2, 3), np.float32),
        tile_valid=np.zeros(4, bool),
        tile_pool=np.zeros(4, bool),
        tokens=np.arange(16, dtype=np.int32).reshape(2, 8),
        segment_ids=z,
        positions=z,
        targets=z,
        loss_mask=np.zeros((2, 8), np.float32),
        feature_index=z,
    )
    fields = driver.microbatch_fields(mb)
    assert fields["tokens"] is mb.tokens and fields["tiles"] is mb.tiles  # no deep copy per step
    assert fields["feature_taps"] is None
    assert dataclasses.asdict(mb)["tokens"] is not mb.tokens  # what the driver used to pay for


def _resolved(encoder_layers):
    enc = tuple(StageSpec("encoder", i, 1, 1, 1) for i in range(encoder_layers))
    llm = (StageSpec("llm", 0, 2, 1, 1, has_embedding=True, has_head=True),)
    return ResolvedPlan(Layout(enc, llm), BucketSet((4,), (256,)), (1, 2), provider=None)


def test_resolved_plan_rejects_layouts_the_runtime_cannot_run():
    assert _resolved(1).check_runnable("auto", multimodal=True).layout.encoder_stages
    assert (
        not _resolved(0).check_runnable("auto", multimodal=True).layout.encoder_stages
    )  # colocated
    llm = (StageSpec("llm", 0, 2, 2, 1, has_embedding=True, has_head=True),)
    own_tp = ResolvedPlan(Layout((), llm, 1), BucketSet((4,), (256,)), (1, 2), provider=None)
    with pytest.raises(ValueError, match="plan=auto: the encoder is colocated at its own tp=1"):
        own_tp.check_runnable("auto", multimodal=True)
    with pytest.raises(ValueError, match="the model has no vision encoder"):
        _resolved(1).check_runnable("explicit", multimodal=False)


def test_model_config_builds_a_decoder_with_a_padded_vocabulary():
    model = ModelConfig(kind="decoder", num_layers=1, hidden_size=32, intermediate_size=64,
                        num_heads=2, num_kv_heads=1, head_dim=16)  # fmt: skip
    cfg = model.model_config(300, tile_px=28, patch_size=14, compute_dtype="float32")
    assert cfg.vocab_size == 384  # 300 rounded up to a multiple of 128 (tp divides it)
    assert (cfg.hidden_size, cfg.num_layers, model.source) == (32, 1, 0)  # seed 0: random init
    arch = arch_of_model(cfg)
    assert arch.llm == llm_arch_from_config(cfg, "run-llm")
