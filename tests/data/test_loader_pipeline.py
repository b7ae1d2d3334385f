"""The grain loader with a fake processor: batches, skips by reason, epochs, exact resume, multi-host."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from loader_fakes import (
    TILE,
    TPT,
    CountingProcessor,
    DyingProcessor,
    FakeProcessor,
    FirstFit,
    fake_problem,
    fake_records,
    tile_tag,
)

from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.loader import Loader, PackSpec, TooFewRecords, build_dataset, check_usable
from dflop_jax.data.packing import HostShardSpec
from dflop_jax.data.transforms import ShapeStage

ARRAYS = ("tiles", "tile_valid", "tile_pool", "tokens", "segment_ids", "positions", "targets")
ARRAYS += ("loss_mask", "feature_index")


def make(
    records,
    *,
    batch=8,
    seed=0,
    problem=None,
    host=None,
    strict=False,
    epochs=None,
    workers=0,
    processor=None,
    prefetch=2,
    scheduler=None,
    shapes=None,
):
    problem = problem or fake_problem()
    spec = PackSpec.from_problem(problem, TILE, TPT)
    ds = build_dataset(
        records,
        processor or FakeProcessor(),
        scheduler or FirstFit(problem),
        spec,
        global_batch_size=batch,
        seed=seed,
        host=host,
        strict=strict,
        num_epochs=epochs,
        shapes=shapes,
    )
    return Loader(ds, num_workers=workers, prefetch=prefetch)


def batch_ids(gb) -> list[int]:
    """Sample ids in the batch, recovered from the packed token ids (id * 100 + 1 starts each sample)."""
    ids = []
    for mb in gb.microbatches:
        starts = (mb.positions == 0) & (mb.segment_ids > 0)
        ids += [int(t - 1) // 100 for t in mb.tokens[starts]]
    return ids


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.stats.schedule_digest == y.stats.schedule_digest
        assert x.num_loss_tokens == y.num_loss_tokens
        assert len(x.microbatches) == len(y.microbatches)
        for mx, my in zip(x.microbatches, y.microbatches):
            for name in ARRAYS:
                np.testing.assert_array_equal(getattr(mx, name), getattr(my, name), err_msg=name)


def test_one_epoch_covers_every_record_once_in_bucket_shapes():
    records = fake_records(32)
    problem = fake_problem()
    with make(records, epochs=1, problem=problem) as loader:
        batches = list(loader)
    assert len(batches) == 4
    seen = [i for gb in batches for i in batch_ids(gb)]
    assert sorted(seen) == list(range(32))
    assert seen != list(range(32))  # shuffled
    for gb in batches:
        for mb, plan in zip(gb.microbatches, gb.schedule.microbatches):
            assert mb.tiles.shape == (problem.encoder_dp * plan.tile_bucket, *TILE)
            assert (
                plan.tile_bucket in problem.buckets.tiles
                and plan.length_bucket in problem.buckets.lengths
            )
            assert mb.tokens.shape == (problem.llm_dp, plan.length_bucket)
        want = sum((records[i]["text"] + records[i]["tiles"] * TPT - 1) // 2 for i in batch_ids(gb))
        # FakeProcessor marks even positions as assistant; loss is on targets = positions 1..L-1.
        assert gb.num_loss_tokens == want
        assert 0 <= gb.stats.llm_padding_ratio < 1
    assert loader.stats()["batches"] == 4 and loader.stats()["samples"] == 32


def test_stats_time_the_schedule_function_and_the_consumer_wait():
    """A schedule function that takes >= 20 ms: its latency covers it, and without prefetch the batch is
    scheduled inside `next()`, so the consumer's data wait covers the latency; the run's means are
    the per-batch means."""
    first_fit = FirstFit(fake_problem())

    def slow(shapes, index):
        time.sleep(0.02)
        return first_fit(shapes, index)

    with make(fake_records(16), epochs=1, prefetch=0, scheduler=slow) as loader:
        stats = [gb.stats for gb in loader]
        totals = loader.stats()
    assert len(stats) == 2
    for st in stats:
        assert st.data_wait_s >= st.scheduler_latency_s >= 0.02
    for key in ("scheduler_latency_s", "data_wait_s"):
        assert totals[f"{key}_mean"] == pytest.approx(np.mean([getattr(st, key) for st in stats]))


def test_every_epoch_is_a_new_permutation():
    with make(fake_records(16), epochs=3) as loader:
        epochs = [[i for _ in range(2) for i in batch_ids(next(loader))] for _ in range(3)]
    assert all(sorted(e) == list(range(16)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_bad_records_are_counted_by_reason_and_skipped():
    bad = {
        1: "missing_file",
        2: "corrupt_image",
        3: "invalid_json",
        4: "no_conversations",
        5: "unknown_fields",
    }
    bad_load = {6: "corrupt_image", 7: "unreadable_video"}
    records = fake_records(24, bad=bad, bad_load=bad_load)
    records[8]["text"] = 200  # longer than the largest length bucket (64)
    records[9]["tiles"] = 9  # more tiles than encoder_dp x largest tile bucket (8)
    with make(records, epochs=1) as loader:
        batches = list(loader)
        totals = loader.stats()["skipped"]
    want = {"missing_file": 1, "corrupt_image": 2, "invalid_json": 1, "no_conversations": 1}
    want |= {"unknown_fields": 1, "unreadable_video": 1, "too_long": 2}
    assert totals == want
    per_batch = {}
    for gb in batches:
        for k, v in gb.stats.skipped.items():
            per_batch[k] = per_batch.get(k, 0) + v
    assert per_batch == want
    seen = sorted(i for gb in batches for i in batch_ids(gb))
    # Shape-stage skips never reach the scheduler; load failures keep their room as padding.
    assert seen == sorted(set(range(24)) - set(bad) - set(bad_load) - {8, 9})
    assert sum(gb.stats.num_samples for gb in batches) == 24 - len(bad) - 2


@pytest.mark.parametrize("where", ["shape", "load"])
def test_strict_mode_raises(where):
    kind = {"bad": {3: "corrupt_image"}} if where == "shape" else {"bad_load": {3: "corrupt_image"}}
    with make(fake_records(8, **kind), strict=True, epochs=1) as loader, pytest.raises(BadSample):
        list(loader)


def test_all_bad_batch_yields_an_empty_batch():
    records = fake_records(4, bad=dict.fromkeys(range(4), "missing_file"))
    with make(records, batch=4, epochs=1) as loader:
        (gb,) = list(loader)
    assert (
        gb.microbatches == []
        and gb.num_loss_tokens == 0
        and gb.stats.skipped == {"missing_file": 4}
    )


def test_too_few_usable_records_for_a_global_batch_is_one_config_error():
    """Bad records and ones too long for the largest bucket do not count; the count stops reading
    once a global batch's worth is usable."""
    records = fake_records(12, bad={1: "missing_file", 4: "corrupt_image", 7: "missing_file"})
    records[9]["text"] = 200  # too long for the largest length bucket (64)
    spec = PackSpec.from_problem(fake_problem(), TILE, TPT)
    processor = CountingProcessor()
    stage = ShapeStage(processor, spec, strict=False, quiet=True)
    assert check_usable(records, stage, 6) == (6, {"missing_file": 2, "corrupt_image": 1})
    assert processor.shaped == list(range(9))  # stopped at the 6th usable record
    with pytest.raises(TooFewRecords) as e:
        check_usable(records, stage, 9)
    assert str(e.value) == (
        "global_batch=9: the data has 8 usable record(s), fewer than one global batch (12 records; "
        "4 skipped (corrupt_image 1, missing_file 2, too_long 1)); set global_batch=8 or fewer, or "
        "give more data"
    )
    held = e.value.with_held_out(3, 0.2)
    assert (
        "12 records; 4 skipped (corrupt_image 1, missing_file 2, too_long 1); 3 more held out by "
        "eval.fraction=0.2); set global_batch=8 or fewer, or give more data (or a smaller "
        "eval.fraction)" in str(held)
    )
    all_bad = fake_records(3, bad=dict.fromkeys(range(3), "missing_file"))
    with pytest.raises(TooFewRecords, match="0 usable record.*; fix the skipped records or give"):
        check_usable(all_bad, stage, 2)


@pytest.mark.parametrize("workers", [0])  # worker processes: test_loader_real.py
def test_resume_is_exact(workers):
    records = fake_records(40, bad={5: "missing_file"}, bad_load={11: "corrupt_image"})
    # Worker processes take slices of the batch indices in turn, so they yield the in-process order.
    with make(records) as loader:
        full = [next(loader) for _ in range(8)]  # crosses the epoch boundary (5 batches per epoch)
    with make(records, workers=workers) as loader:
        first = [next(loader) for _ in range(4)]
        state = json.loads(json.dumps(loader.get_state()))  # checkpoints store it as JSON
        stats_at_4 = loader.stats()
    with make(records, workers=workers) as loader:
        loader.set_state(state)
        assert loader.stats()["skipped"] == stats_at_4["skipped"]
        rest = [next(loader) for _ in range(4)]
        final_stats = loader.stats()
    assert_same_batches(full, first + rest)
    assert final_stats["batches"] == 8


def test_hosts_agree_on_schedule_and_load_only_their_shards():
    records = fake_records(24)
    problem = fake_problem(encoder_dp=2, llm_dp=4)
    with make(records, problem=problem, epochs=1) as loader:
        full = list(loader)
    hosts = [HostShardSpec.contiguous(p, 2, encoder_dp=2, llm_dp=4) for p in range(2)]
    parts, processed = [], []
    for host in hosts:
        proc = CountingProcessor()
        with make(records, problem=problem, host=host, epochs=1, processor=proc) as loader:
            parts.append(list(loader))
        processed.append(proc.processed)
    # Each host decodes exactly the samples whose tokens or tiles its own arrays hold.
    for part, done in zip(parts, processed):
        tile_ids = {
            tile_tag(tile)[0]
            for gb in part
            for mb in gb.microbatches
            for tile in mb.tiles[mb.tile_valid]
        }
        assert sorted(done) == sorted({i for gb in part for i in batch_ids(gb)} | tile_ids)
    assert set(processed[0]) | set(processed[1]) == set(range(24))
    for k, gb in enumerate(full):
        for part in parts:
            assert part[k].stats.schedule_digest == gb.stats.schedule_digest
        for m, mb in enumerate(gb.microbatches):
            # Global shapes; every shard filled by exactly one host, zero on the other.
            tiles = sum(p[k].microbatches[m].tiles for p in parts)
            np.testing.assert_array_equal(tiles, mb.tiles)
            for name in ("tokens", "segment_ids", "targets", "loss_mask"):
                got = sum(getattr(p[k].microbatches[m], name) for p in parts)
                np.testing.assert_array_equal(got, getattr(mb, name))
            for p, host in zip(parts, hosts):
                rows = list(host.llm_shards)
                got = p[k].microbatches[m].feature_index[rows]
                np.testing.assert_array_equal(got, mb.feature_index[rows])
        # Each host's loss tokens are its own rows; together they are the global count.
        assert sum(p[k].num_loss_tokens for p in parts) == gb.num_loss_tokens


@pytest.mark.slow
def test_dead_worker_process_raises_instead_of_hanging():
    loader = make(fake_records(32), workers=1, processor=DyingProcessor(die_at=3))
    with loader, pytest.raises(RuntimeError, match="terminated unexpectedly"):
        for _ in range(8):
            next(loader)


def test_without_prefetch_batch_k_is_scheduled_inside_next_k():
    """prefetch=0: scheduler state the runtime updates before next() applies to exactly that batch (the
    deterministic setting for adaptive correction across hosts)."""
    sched = FirstFit(fake_problem())
    with make(fake_records(32), prefetch=0, scheduler=sched) as loader:
        for k in range(3):
            assert sched.calls == k
            next(loader)
            assert sched.calls == k + 1


def test_processed_size_differing_from_metadata_is_counted_or_raised():
    records = fake_records(8)
    records[2]["lie"] = 1  # process() yields one token more than shape() promised
    with make(records, epochs=1) as loader:
        (gb,) = list(loader)
    assert gb.stats.skipped == {"metadata_mismatch": 1}
    assert sorted(batch_ids(gb)) == [0, 1, 3, 4, 5, 6, 7]
    with make(records, epochs=1, strict=True) as loader, pytest.raises(ValueError, match="fake:2"):
        list(loader)


def test_precomputed_shapes_replace_the_metadata_stage():
    records = fake_records(24, bad={4: "missing_file"})
    records[7]["text"] = 200  # too long for the buckets: still skipped with precomputed shapes
    with make(records, epochs=1) as loader:
        lazy = list(loader)
    ref = FakeProcessor()
    shapes = []
    for r in records:
        try:
            shapes.append(ref.shape(r))
        except BadSample as e:
            shapes.append(e)
    proc = CountingProcessor()
    with make(records, epochs=1, shapes=shapes, processor=proc) as loader:
        known = list(loader)
    assert proc.shaped == []  # no shape() call during iteration
    assert_same_batches(lazy, known)
    assert [gb.stats.skipped for gb in known] == [gb.stats.skipped for gb in lazy]
    assert sum(sum(gb.stats.skipped.values()) for gb in known) == 2


@pytest.mark.parametrize(
    "family, tile, patch, tokens",
    [
        ("llava_ov", 384, 14, 729),
        ("internvl", 448, 14, 256),
        ("llava_ov", 32, 8, 16),
        ("internvl", 64, 8, 16),
    ],
)
def test_pack_geometry_follows_the_configured_patch_size(family, tile, patch, tokens):
    from dflop_jax.data.config import DataConfig
    from dflop_jax.data.loader import pack_geometry

    cfg = DataConfig(model_family=family, tile_size=tile, patch_size=patch)
    assert pack_geometry(cfg) == ((tile, tile, 3), tokens)


@pytest.mark.parametrize("prefetch", [2, 0])
def test_place_runs_in_the_prefetch_thread(prefetch):
    """The `place` hook sees every batch where it is prepared: the prefetch thread (the consuming
    thread when there is none), and its result is what the loader yields."""
    import dataclasses
    import threading

    records, problem = fake_records(24), fake_problem()
    spec = PackSpec.from_problem(problem, TILE, TPT)
    ds = build_dataset(records, FakeProcessor(), FirstFit(problem), spec, global_batch_size=8,
                       seed=0, num_epochs=1)  # fmt: skip
    threads = []

    def place(gb):
        threads.append(threading.current_thread())
        return dataclasses.replace(gb, placed=[[{"n": len(gb.microbatches)}]])

    batches = list(Loader(ds, prefetch=prefetch, place=place))
    assert len(batches) == 3 and len(threads) >= 3
    assert all(b.placed == [[{"n": len(b.microbatches)}]] for b in batches)
    main = threading.main_thread()
    assert all((t is main) == (prefetch == 0) for t in threads)


def test_a_curriculum_is_read_in_phase_order_and_resumes_exactly():
    """A `mix.Phased` source (a mix with `phases:`) is not shuffled by the loader: global batches
    follow the phases in order; resume is exact; a phase that would split a global batch is refused."""
    from dflop_jax.config import ConfigError
    from dflop_jax.data.mix import Phased

    records = fake_records(32)
    order = [*range(16, 32), *range(16)]  # phase 0: the second half, then the first
    phased = Phased(records, order, (16, 32))
    straight = [sorted(batch_ids(gb)) for gb in make(phased, epochs=1)]
    assert straight == [sorted(order[k : k + 8]) for k in range(0, 32, 8)]
    loader = make(phased, epochs=1)
    next(loader), next(loader)
    state = loader.get_state()
    resumed = make(phased, epochs=1)
    resumed.set_state(state)
    assert [sorted(batch_ids(gb)) for gb in resumed] == straight[2:]
    with pytest.raises(ConfigError, match=r"phases\[0\] ends at record 16, not a multiple of "):
        make(phased, batch=6)
