"""Audio as a third resource of a microbatch: the audio ladder (`BucketSet.audio`), each scheduled
microbatch's audio bucket (the smallest holding its fullest row's frames), the planner's audio ladder
fitted to the data, and packing a schedule's audio rows."""

import numpy as np
import pytest

from dflop_jax.contracts import SampleShape, kept_frames, schedule_digest
from dflop_jax.contracts.shapes import encoder_outputs, row_audio_frames
from dflop_jax.planner.buckets import ShapeStats, bucket_set, fullest_rows
from dflop_jax.scheduler import BucketSet, ScheduleProblem, SchedulerConfig, schedule_batch
from dflop_jax.scheduler.baselines import data_blind_schedule


def _omni_shapes(n: int, seed: int = 0) -> list[SampleShape]:
    """Images, text and speech-length clips (1-35 s: 1-2 windows), as the omni mix holds them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = rng.choice(["image", "text", "audio"], p=[0.4, 0.3, 0.3])
        if kind == "audio":
            seconds = float(np.clip(rng.lognormal(2.3, 0.55), 1, 35))
            frames = round(seconds * 100)
            windows = (3000, frames - 3000) if frames > 3003 else (frames,)
            out.append(SampleShape(i, 0, 60 + sum(w // 4 for w in windows), "audio", windows))
        else:
            tiles = int(rng.integers(1, 10)) if kind == "image" else 0
            out.append(SampleShape(i, tiles, int(rng.integers(40, 500)) + 180 * tiles, kind))
    return out


def _problem(buckets: BucketSet, llm_dp: int = 2, audio_s: float = 1e-6) -> ScheduleProblem:
    def cost(t, s, a=0):  # encoder then LLM stage (running the audio encoder), seconds grow
        return np.array(
            [[1e-3 * t, 2e-3 * t], [1e-5 * s + audio_s * a, 2e-5 * s + 2 * audio_s * a]]
        )

    return ScheduleProblem(llm_dp, llm_dp, 2, (2, 6), buckets, cost, tiles_by_row=True)


def test_the_audio_ladder_is_validated_and_written():
    with pytest.raises(ValueError, match="multiples of 4"):
        BucketSet((4,), (512,), audio=(6, 12))
    with pytest.raises(ValueError, match="multiples of 4"):
        BucketSet((4,), (512,), audio=(16, 8))
    b = BucketSet((4,), (512,), audio=(400, 1200, 3600))
    assert BucketSet.from_dict(b.to_dict()) == b and "audio" in b.to_dict()
    assert "audio" not in BucketSet((4,), (512,)).to_dict()  # plan files without audio unchanged
    assert [b.audio_bucket(f) for f in (0, 1, 400, 401, 3600)] == [0, 400, 400, 1200, 3600]
    with pytest.raises(ValueError, match="3604 audio frames .* largest audio bucket 3600"):
        b.audio_bucket(3604)


@pytest.mark.parametrize("solver", ["greedy", "baseline"])
def test_each_microbatch_takes_the_smallest_audio_bucket_of_its_fullest_row(solver):
    shapes = _omni_shapes(48)
    ladder = (800, 1600, 3200, 6400)
    problem = _problem(BucketSet((4, 8, 16), (1024, 2048, 4096), audio=ladder))
    if solver == "greedy":
        sched = schedule_batch(shapes, problem, SchedulerConfig(solver="greedy"))
    else:
        sched = data_blind_schedule(shapes, problem, 4)
    seen = set()
    for mb in sched.microbatches:
        fullest = max(sum(shapes[i].audio_frames for i in row) for row in mb.shards)
        seen.add(mb.audio_bucket)
        if fullest == 0:
            assert mb.audio_bucket == 0
        else:
            assert mb.audio_bucket == min(a for a in ladder if a >= fullest)
    assert len(seen - {0}) >= 1
    assert sorted(i for mb in sched.microbatches for i in mb.samples()) == list(range(48))


def test_the_objective_prices_each_microbatchs_audio_bucket():
    """The schedule's predicted step (its surrogate) includes the audio encoder at each
    microbatch's audio bucket: equal to the surrogate of its microbatches' costs with audio, and
    above the same batch's with the audio encoder free."""
    from dflop_jax.scheduler import surrogate_step_time

    shapes = _omni_shapes(48)
    buckets = BucketSet((4, 8, 16), (1024, 2048, 4096), audio=(800, 1600, 3200, 6400))
    heard, free = _problem(buckets), _problem(buckets, audio_s=0.0)
    sched = schedule_batch(shapes, heard, SchedulerConfig(solver="greedy"))
    assert sched.objective == pytest.approx(surrogate_step_time(_audio_costs(sched, heard)),
                                            rel=1e-12)  # fmt: skip
    silent = schedule_batch(shapes, free, SchedulerConfig(solver="greedy"))
    assert sched.objective > silent.objective


def _audio_costs(sched, problem) -> np.ndarray:
    """[M, P, 2] of the schedule's microbatches in run order at their own buckets."""
    return np.stack([problem.stage_costs(mb.tile_bucket, mb.length_bucket, mb.audio_bucket)
                     for mb in sched.microbatches])  # fmt: skip


@pytest.mark.parametrize("select", ["makespan", "surrogate"])
def test_the_packing_weighs_audio_frames_where_the_audio_encoder_costs(select):
    """With the audio encoder the dearest part of a microbatch, the schedule packs on audio frames
    too. By its selection rule it is never worse than the tile/length packing (the schedule the same
    batch gets with the audio encoder free) priced at its audio buckets, by the 1F1B makespan of
    the full order search or by the objective, and much better where that packing crowds clips
    into one row; it runs in the order its audio-priced 1F1B simulation chose."""
    from dflop_jax.scheduler import surrogate_step_time
    from dflop_jax.scheduler.objective import with_audio
    from dflop_jax.scheduler.order import order_microbatches
    from dflop_jax.sim.pipeline import simulate

    buckets = BucketSet((4, 8, 16), (1024, 2048, 4096), audio=(800, 1600, 3200, 6400, 16384))
    heard, free = _problem(buckets, audio_s=1e-4), _problem(buckets, audio_s=0.0)
    config = SchedulerConfig(solver="greedy", select=select)
    gains = []
    for seed in range(6):
        shapes = _omni_shapes(64, seed)
        sched = schedule_batch(shapes, heard, config)
        assert sorted(i for mb in sched.microbatches for i in mb.samples()) == list(range(64))
        costs = _audio_costs(sched, heard)
        assert sched.objective == pytest.approx(surrogate_step_time(costs), rel=1e-12)
        assert sched.info["simulated_makespan_s"] == pytest.approx(simulate(costs).step_time)
        blind = with_audio(schedule_batch(shapes, free, config).microbatches, shapes, buckets)
        blind_costs = np.stack([heard.microbatch_costs(mb) for mb in blind])
        if select == "makespan":
            ours = sched.info["simulated_makespan_s"]
            theirs = order_microbatches(blind_costs, config.order_evaluations)[1]
        else:
            ours, theirs = sched.objective, surrogate_step_time(blind_costs)
        assert ours <= theirs * (1 + 1e-12)
        gains.append(theirs / ours)
    # the tile/length packing balances each row's tiles as well as each microbatch's: it crowds
    # clips into one row on one of these batches (1.44x by makespan, 1.90x by the objective)
    assert max(gains) > 1.3, gains


def test_samples_beyond_the_audio_ladder_are_refused():
    shapes = _omni_shapes(24)
    no_ladder = _problem(BucketSet((16,), (4096,)))
    with pytest.raises(ValueError, match="audio frames > largest audio bucket 0"):
        schedule_batch(shapes, no_ladder, SchedulerConfig(solver="greedy"))
    small = _problem(BucketSet((16,), (4096,), audio=(400,)))
    with pytest.raises(ValueError, match="largest audio bucket 400"):
        schedule_batch(shapes, small, SchedulerConfig(solver="greedy"))


def test_the_digest_sees_audio_buckets_and_is_unchanged_without_them():
    shapes = [s for s in _omni_shapes(40) if not s.audio_windows]
    plain = schedule_batch(shapes, _problem(BucketSet((16,), (4096,))), SchedulerConfig())
    same = schedule_batch(
        shapes, _problem(BucketSet((16,), (4096,), audio=(400,))), SchedulerConfig()
    )
    assert all(mb.audio_bucket == 0 for mb in same.microbatches)
    assert schedule_digest(same) == schedule_digest(plain)
    heard = _omni_shapes(40)
    a = schedule_batch(heard, _problem(BucketSet((16,), (4096,), audio=(8000,))), SchedulerConfig())
    b = schedule_batch(
        heard, _problem(BucketSet((16,), (4096,), audio=(4000, 8000))), SchedulerConfig()
    )
    assert [mb.shards for mb in a.microbatches] == [mb.shards for mb in b.microbatches]
    assert [mb.audio_bucket for mb in a.microbatches] != [mb.audio_bucket for mb in b.microbatches]
    assert schedule_digest(a) != schedule_digest(b)


def test_the_planners_audio_ladder_fits_the_fullest_rows():
    """n - 1 sizes placed on the fullest rows of token-balanced draws, up to the fullest drawn, then
    the size that holds any row of the top length bucket."""
    shapes = _omni_shapes(400, seed=3)
    stats = ShapeStats.of(shapes)
    assert len(stats.audio) == 400 and len(stats.tokens) == 400
    one = bucket_set(stats, 64, 8, 2, 2, 1, 128, by_row=True)
    four = bucket_set(stats, 64, 8, 2, 2, 4, 128, by_row=True)
    assert one.audio == (row_audio_frames(one.lengths[-1]),)
    assert four.audio[-1] == row_audio_frames(four.lengths[-1]) and len(four.audio) == 4
    assert all(a % 4 == 0 for a in four.audio)
    rows = np.maximum(fullest_rows(np.asarray(stats.audio, float), 8, 2,
                                   by=np.asarray(stats.tokens, float)), 4)  # fmt: skip
    assert four.audio[-2] >= rows.max()  # only rows past every draw take the top

    def padding(ladder):
        return sum(min(a for a in ladder if a >= r) - r for r in rows)

    assert padding(four.audio) < padding(one.audio) / 4
    no_audio = ShapeStats.of([s for s in shapes if not s.audio_windows])
    assert no_audio.audio == () and bucket_set(no_audio, 64, 8, 2, 2, 4, 128, True).audio == ()


def test_rows_balanced_on_tokens_carry_the_values():
    tokens = np.array([100.0, 100.0, 100.0, 100.0])
    audio = np.array([400.0, 0.0, 0.0, 0.0])
    fullest = fullest_rows(audio, samples=4, rows=4, draws=64, by=tokens)
    # one sample per row: the fullest row holds one sample's audio, 400 when it was drawn
    assert set(fullest.tolist()) <= {0.0, 400.0} and fullest.max() == 400.0


def test_balance_audio_repacks_rows_within_their_buckets():
    from dflop_jax.contracts import ScheduledMicrobatch
    from dflop_jax.scheduler.objective import balance_audio

    shapes = [
        SampleShape(0, 0, 300, "audio", (1000,)),
        SampleShape(1, 0, 300, "audio", (1000,)),
        SampleShape(2, 2, 300, "image"),
        SampleShape(3, 2, 300, "image"),
    ]
    plan = ScheduledMicrobatch(2, 600, ((0, 1), (2, 3)), tiles_by_row=True)
    better = balance_audio(plan, shapes)
    frames = [sum(shapes[i].audio_frames for i in row) for row in better.shards]
    assert frames == [1004, 1004] and sorted(better.samples()) == [0, 1, 2, 3]
    assert all(sum(shapes[i].tiles for i in row) <= 2 for row in better.shards)
    full = ScheduledMicrobatch(2, 600, ((0, 1), (2, 3)), tiles_by_row=True)
    tight = [SampleShape(0, 0, 300, "audio", (1000,)), SampleShape(1, 0, 300, "audio", (1000,)),
             SampleShape(2, 2, 300, "image"), SampleShape(3, 0, 300, "text")]  # fmt: skip
    assert balance_audio(full, tight).shards != full.shards  # the text sample swaps in
    no_room = ScheduledMicrobatch(1, 600, ((0, 1), (2, 3)), tiles_by_row=True)
    assert balance_audio(no_room, shapes) == no_room  # two images cannot share one tile


def test_a_row_full_of_audio_fits_the_top_audio_bucket():
    """Rows of clips as the processor tokenizes them (bos, one token per output, eos), tiny and
    long: their frames never pass `row_audio_frames` of their tokens."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        frames = tokens = 0
        for _ in range(int(rng.integers(1, 12))):
            seconds = float(rng.choice([rng.uniform(0.03, 0.2), rng.uniform(0.2, 200)]))
            valid = round(seconds * 100)
            windows = [3000] * (valid // 3000) + ([valid % 3000] if valid % 3000 else [])
            windows = [w for w in windows if encoder_outputs(w)]
            if not windows:
                continue
            frames += sum(kept_frames(w) for w in windows)
            tokens += 2 + sum(encoder_outputs(w) for w in windows)
        assert frames <= row_audio_frames(tokens)


def test_kept_frames_is_the_encoders_rule():
    assert [kept_frames(v) for v in (1, 9, 22, 2997, 3000)] == [4, 12, 24, 3000, 3000]
    shape = SampleShape(0, 0, 10, "audio", (3000, 9))
    assert shape.audio_frames == 3012 and shape.audio_seconds == pytest.approx(30.09)


def test_planning_leaves_out_the_samples_a_run_skips(tmp_path, caplog):
    """A model without an audio encoder: the loader skips samples with audio, so the planner's
    shapes leave them out too (a plan for work the run never does would misprice every layout);
    a model with one plans on every sample. A model without a vision encoder (Qwen2-Audio) leaves
    out the samples with images in the same way."""
    from dflop_jax.contracts.shape_distribution import save_shape_distribution
    from dflop_jax.planner.resolve import load_shapes

    shapes = _omni_shapes(60)
    save_shape_distribution(shapes, tmp_path / "d.json", "omni", {})
    with caplog.at_level("WARNING"):
        kept = load_shapes(str(tmp_path / "d.json"))
    heard = sum(1 for s in shapes if s.audio_windows)
    assert len(kept) == 60 - heard and not any(s.audio_windows for s in kept)
    assert f"without the {heard} of 60 profiled samples that hold audio" in caplog.text
    assert load_shapes(str(tmp_path / "d.json"), audio=True) == shapes
    save_shape_distribution([s for s in shapes if s.audio_windows], tmp_path / "a.json", "a", {})
    with pytest.raises(ValueError, match="every profiled sample holds media the model has no"):
        load_shapes(str(tmp_path / "a.json"))
    hearing = load_shapes(str(tmp_path / "d.json"), audio=True, vision=False)
    seen = sum(1 for s in shapes if s.tiles)
    assert hearing == [s for s in shapes if not s.tiles] and len(hearing) == 60 - seen > 0


@pytest.mark.parametrize("select", ["makespan", "surrogate"])
def test_rows_stay_within_the_largest_audio_bucket_where_tokens_alone_would_overfill_one(select):
    """Audio-only samples whose tokens two of fit one length bucket but whose frames two of do not
    fit the largest audio bucket: the tile/length search's packing overfills a row's audio, so the
    three-resource packings decide, and every row holds at most the largest bucket's frames."""
    frames = [2732, 2600, 2900, 2800, 2700, 2650, 2750]  # one 30 s window each (<= 3000)
    shapes = [SampleShape(i, 0, 40 + f // 4, "audio", (f,)) for i, f in enumerate(frames)]
    problem = _problem(BucketSet((1,), (2048,), audio=(1024, 4096)))
    sched = schedule_batch(shapes, problem, SchedulerConfig(solver="greedy", select=select))
    for mb in sched.microbatches:
        assert max(sum(shapes[i].audio_frames for i in row) for row in mb.shards) <= 4096
    assert sorted(i for mb in sched.microbatches for i in mb.samples()) == list(range(7))
    assert sched.info["audio_packing"] == "three resources"
