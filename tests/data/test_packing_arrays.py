"""Packing a schedule into static-shape arrays: shapes, segments, shifted targets, feature placement."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from loader_fakes import tile_tag
from packing_fixtures import TILE, TPT, make_sample, packing_cases

from dflop_jax.contracts import SampleShape, Schedule, ScheduledMicrobatch
from dflop_jax.data.packing import HostShardSpec, needed_samples, pack_global_batch, pack_microbatch
from dflop_jax.data.sample_arrays import ProcessedSample


def shape_of(s: ProcessedSample) -> SampleShape:
    return SampleShape(s.id, s.num_tiles, s.num_tokens, s.modality)


def check_microbatch(mb, plan, samples, encoder_dp, llm_dp, slots=None):
    """Independent check of one packed microbatch against the samples it should hold (`slots`:
    its tile slots, default encoder_dp x the tile bucket)."""
    T, S = plan.tile_bucket, plan.length_bucket
    slots = encoder_dp * T if slots is None else slots
    assert mb.tiles.shape == (slots, *TILE)
    assert mb.tiles.dtype == np.uint8  # pixels cross host -> device as uint8 (normalized on device)
    assert mb.tile_valid.shape == mb.tile_pool.shape == (slots,)
    for name in ("tokens", "segment_ids", "positions", "targets", "loss_mask", "feature_index"):
        assert getattr(mb, name).shape == (llm_dp, S), name
    # Every sample tile appears exactly once among valid slots.
    want = sorted((i, t) for i in plan.samples() for t in range(samples[i].num_tiles))
    got = sorted(tile_tag(tile) for tile in mb.tiles[mb.tile_valid])
    assert got == want
    assert not mb.tiles[~mb.tile_valid].any()
    for r in range(llm_dp):
        seg = mb.segment_ids[r]
        members = plan.shards[r]
        # Segments are contiguous 1..n then padding 0.
        n = sum(samples[i].num_tokens for i in members)
        assert (seg[n:] == 0).all() and (mb.loss_mask[r, n:] == 0).all()
        offset = 0
        for k, i in enumerate(members, start=1):
            s = samples[i]
            L = s.num_tokens
            span = slice(offset, offset + L)
            assert (seg[span] == k).all()
            np.testing.assert_array_equal(mb.tokens[r, span], s.token_ids)
            np.testing.assert_array_equal(mb.positions[r, span], np.arange(L))
            np.testing.assert_array_equal(mb.targets[r, offset : offset + L - 1], s.token_ids[1:])
            np.testing.assert_array_equal(
                mb.loss_mask[r, offset : offset + L - 1], s.assistant_mask[1:]
            )
            assert mb.loss_mask[r, offset + L - 1] == 0
            for p in range(L):
                f = int(mb.feature_index[r, offset + p])
                src = int(s.feature_source[p])
                if src < 0:
                    assert f == src
                    continue
                slot, j = divmod(f, TPT)
                assert mb.tile_valid[slot]
                assert tile_tag(mb.tiles[slot]) == (i, src // TPT)
                assert j == src % TPT
                assert mb.tile_pool[slot] == s.tile_pool[src // TPT]
            offset += L
    # No position attends across samples: a target is only learned within its own segment.
    same_next = np.zeros_like(mb.segment_ids, bool)
    same_next[:, :-1] = (mb.segment_ids[:, 1:] == mb.segment_ids[:, :-1]) & (
        mb.segment_ids[:, :-1] > 0
    )
    assert (mb.loss_mask[~same_next] == 0).all()


def test_hand_built_microbatch():
    rng = np.random.default_rng(0)
    samples = [make_sample(0, 3, 4, rng), make_sample(1, 0, 5, rng), make_sample(2, 2, 3, rng)]
    # Encoder: 5 tiles over 2 shards of T=3: shard 0 gets s0 t0..t2, shard 1 gets s2 t0..t1.
    plan = ScheduledMicrobatch(tile_bucket=3, length_bucket=32, shards=((0, 1), (2,)))
    mb, stats = pack_microbatch(
        plan, samples, encoder_dp=2, llm_dp=2, tile_shape=TILE, tokens_per_tile=TPT
    )
    check_microbatch(mb, plan, samples, 2, 2)
    assert mb.tile_valid.tolist() == [True, True, True, True, True, False]
    # Sample 2's tile 1 is in slot 4 -> its feature j lands at row 4*TPT + j.
    row = mb.feature_index[1]
    assert row[row >= 0].tolist()[TPT:] == [4 * TPT + j for j in range(TPT)]
    n_tokens = sum(s.num_tokens for s in samples)
    assert stats.tokens_real == n_tokens and stats.tokens_computed == 64
    assert stats.tiles_real == 5 and stats.tiles_computed == 6
    want_loss = sum(int(s.assistant_mask[1:].sum()) for s in samples)
    assert stats.loss_tokens == want_loss == int(mb.loss_mask.sum())


def test_tiles_packed_by_row_stay_in_their_rows_blocks():
    """Packed by row at tile bucket 3 (tiles per row), LLM dp 3 x tp 2, encoder dp 2: each row's
    block pads to 4 slots (a multiple of tp 2, and 3 x 4 = 12 slots split over 2 encoder shards),
    row r's samples' tiles fill slots 4r.. and its feature indices point into its own block only;
    a host with encoder shard 1 packs slots 6..11 (rows 1's last two and row 2's) only."""
    rng = np.random.default_rng(1)
    samples = [make_sample(0, 3, 4, rng), make_sample(1, 1, 5, rng), make_sample(2, 2, 3, rng),
               make_sample(3, 0, 6, rng)]  # fmt: skip
    plan = ScheduledMicrobatch(3, 48, ((0,), (1, 2), (3,)), tiles_by_row=True, row_align=2)
    mb, stats = pack_microbatch(
        plan, samples, encoder_dp=2, llm_dp=3, tile_shape=TILE, tokens_per_tile=TPT
    )
    check_microbatch(mb, plan, samples, 2, 3, slots=12)
    tags = [tile_tag(t) if v else None for t, v in zip(mb.tiles, mb.tile_valid)]
    assert tags == [(0, 0), (0, 1), (0, 2), None, (1, 0), (2, 0), (2, 1), None] + [None] * 4
    for r in range(3):
        f = mb.feature_index[r][mb.feature_index[r] >= 0]
        assert ((f >= r * 4 * TPT) & (f < (r + 1) * 4 * TPT)).all()
    assert stats.tiles_real == 6 and stats.tiles_computed == 12
    host = HostShardSpec(encoder_shards=(1,), llm_shards=())
    assert needed_samples(plan, [shape_of(s) for s in samples], 2, host) == {2}
    local, _ = pack_microbatch(plan, samples, encoder_dp=2, llm_dp=3, tile_shape=TILE,
                               tokens_per_tile=TPT, host=host)  # fmt: skip
    assert local.tile_valid.tolist() == [False] * 6 + [True] + [False] * 5  # sample 2, tile 1
    with pytest.raises(ValueError, match="row 0 has 4 tiles > tile bucket 3"):
        pack_microbatch(ScheduledMicrobatch(3, 48, ((0, 1), (2,), (3,)), tiles_by_row=True),
                        samples, encoder_dp=2, llm_dp=3, tile_shape=TILE,
                        tokens_per_tile=TPT)  # fmt: skip


def test_overflow_is_rejected():
    rng = np.random.default_rng(1)
    samples = [make_sample(0, 2, 10, rng), make_sample(1, 2, 10, rng)]
    too_short = ScheduledMicrobatch(tile_bucket=4, length_bucket=16, shards=((0, 1),))
    with pytest.raises(ValueError, match="length bucket"):
        pack_microbatch(
            too_short, samples, encoder_dp=1, llm_dp=1, tile_shape=TILE, tokens_per_tile=TPT
        )
    few_tiles = ScheduledMicrobatch(tile_bucket=3, length_bucket=64, shards=((0, 1),))
    with pytest.raises(ValueError, match="tiles"):
        pack_microbatch(
            few_tiles, samples, encoder_dp=1, llm_dp=1, tile_shape=TILE, tokens_per_tile=TPT
        )


def test_metadata_mismatch_is_rejected():
    rng = np.random.default_rng(2)
    samples = [make_sample(0, 1, 4, rng)]
    shapes = [SampleShape(0, 1, samples[0].num_tokens + 1)]
    plan = ScheduledMicrobatch(tile_bucket=1, length_bucket=32, shards=((0,),))
    with pytest.raises(ValueError, match="metadata said"):
        pack_microbatch(
            plan, samples, shapes, encoder_dp=1, llm_dp=1, tile_shape=TILE, tokens_per_tile=TPT
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing_cases())
def test_random_schedules(case):
    encoder_dp, llm_dp, sizes, n_mb, bins, extra_s, extra_t, seed = case
    rng = np.random.default_rng(seed)
    samples = [make_sample(i, t, x, rng, newline=bool(i % 2)) for i, (t, x) in enumerate(sizes)]
    plans = []
    for k in range(n_mb):
        shards = tuple(
            tuple(i for i, b in enumerate(bins) if b == k * llm_dp + r) for r in range(llm_dp)
        )
        tokens = max(sum(samples[i].num_tokens for i in sh) for sh in shards)
        tiles = sum(samples[i].num_tiles for sh in shards for i in sh)
        T = -(-tiles // encoder_dp) + extra_t or 1
        plans.append(ScheduledMicrobatch(T, max(tokens, 1) + extra_s, shards))
    schedule = Schedule(tuple(plans), 1.0, 1.0, "test", 0.0)
    gb = pack_global_batch(
        schedule,
        samples,
        encoder_dp=encoder_dp,
        llm_dp=llm_dp,
        tile_shape=TILE,
        tokens_per_tile=TPT,
    )
    for mb, plan in zip(gb.microbatches, plans):
        check_microbatch(mb, plan, samples, encoder_dp, llm_dp)
    assert gb.num_loss_tokens == sum(int(s.assistant_mask[1:].sum()) for s in samples)
    assert gb.stats.packed.tokens_real == sum(s.num_tokens for s in samples)
    assert gb.stats.packed.tiles_real == sum(s.num_tiles for s in samples)
    computed = sum(llm_dp * p.length_bucket for p in plans)
    assert gb.stats.llm_padding_ratio == pytest.approx(1 - gb.stats.packed.tokens_real / computed)


def test_host_shards_materialise_local_rows_only():
    rng = np.random.default_rng(3)
    samples = [make_sample(i, t, 4, rng) for i, t in enumerate([2, 1, 3, 0])]
    shapes = [shape_of(s) for s in samples]
    plan = ScheduledMicrobatch(tile_bucket=2, length_bucket=40, shards=((0,), (1, 3), (2,), ()))
    full, full_stats = pack_microbatch(
        plan, samples, encoder_dp=3, llm_dp=4, tile_shape=TILE, tokens_per_tile=TPT
    )
    host = HostShardSpec.contiguous(1, 2, encoder_dp=3, llm_dp=4)
    assert host == HostShardSpec(encoder_shards=(2,), llm_shards=(2, 3))
    need = needed_samples(plan, shapes, 3, host)
    # Shard 2 of the encoder holds s2's tiles 1..2; LLM shards 2, 3 hold s2.
    assert need == {2}
    partial = [s if i in need else None for i, s in enumerate(samples)]
    local, stats = pack_microbatch(
        plan,
        partial,
        shapes,
        encoder_dp=3,
        llm_dp=4,
        tile_shape=TILE,
        tokens_per_tile=TPT,
        host=host,
    )
    # Global shapes; this host's rows equal the full packing's, the others stay zero.
    assert local.tiles.shape == full.tiles.shape and local.tokens.shape == full.tokens.shape
    np.testing.assert_array_equal(local.tiles[4:6], full.tiles[4:6])
    np.testing.assert_array_equal(local.tile_valid[4:6], full.tile_valid[4:6])
    assert not local.tiles[:4].any() and not local.tile_valid[:4].any()
    for name in ("tokens", "segment_ids", "positions", "targets", "loss_mask", "feature_index"):
        np.testing.assert_array_equal(getattr(local, name)[2:4], getattr(full, name)[2:4])
        assert not getattr(local, name)[:2].any()
    # Throughput counts describe the global batch on every host; the loss tokens are this host's.
    assert dataclasses.replace(stats, loss_tokens=0) == dataclasses.replace(
        full_stats, loss_tokens=0
    )
    assert stats.loss_tokens == int(full.loss_mask[2:4].sum()) < full_stats.loss_tokens


def test_failed_sample_leaves_padding_in_place():
    rng = np.random.default_rng(4)
    samples = [make_sample(i, 1, 3, rng) for i in range(3)]
    shapes = [shape_of(s) for s in samples]
    plan = ScheduledMicrobatch(tile_bucket=3, length_bucket=64, shards=((0, 1, 2),))
    full, _ = pack_microbatch(
        plan, samples, encoder_dp=1, llm_dp=1, tile_shape=TILE, tokens_per_tile=TPT
    )
    broken = [samples[0], None, samples[2]]
    mb, _ = pack_microbatch(
        plan, broken, shapes, encoder_dp=1, llm_dp=1, tile_shape=TILE, tokens_per_tile=TPT
    )
    assert mb.tile_valid.tolist() == [True, False, True]
    L0, L1 = samples[0].num_tokens, samples[1].num_tokens
    assert (mb.segment_ids[0, L0 : L0 + L1] == 0).all()
    # Sample 2 keeps its scheduled place, segment id and global feature rows.
    np.testing.assert_array_equal(mb.segment_ids[0, L0 + L1 :], full.segment_ids[0, L0 + L1 :])
    np.testing.assert_array_equal(mb.feature_index[0, L0 + L1 :], full.feature_index[0, L0 + L1 :])


def test_contiguous_host_specs_partition_the_shards():
    for procs, enc, llm in [(2, 4, 2), (4, 2, 8), (3, 1, 3), (2, 3, 5)]:
        specs = [HostShardSpec.contiguous(p, procs, enc, llm) for p in range(procs)]
        assert sorted(e for s in specs for e in s.encoder_shards) == list(range(enc))
        assert sorted(r for s in specs for r in s.llm_shards) == list(range(llm))
    # Fewer shards than processes: shard s goes to the process holding its first device.
    assert [HostShardSpec.contiguous(p, 4, 2, 4).encoder_shards for p in range(4)] == [
        (0,),
        (),
        (1,),
        (),
    ]
    # From stage meshes: process 1 holds encoder row 1 and LLM rows 0 (one device of it) and 2.
    dev = [types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1, 1, 0)]
    encoder = [np.array([[dev[0]], [dev[2]]], dtype=object)]
    llm = [np.array([[dev[1], dev[3]], [dev[5], dev[5]], [dev[4], dev[4]]], dtype=object)]
    assert HostShardSpec.from_meshes(encoder, llm, 1) == HostShardSpec((1,), (0, 2))
    assert HostShardSpec.from_meshes(encoder, llm, 0) == HostShardSpec((0,), (0, 1))
    with pytest.raises(ValueError, match="ascending"):
        HostShardSpec((1, 0), (0,))
    with pytest.raises(ValueError, match="encoder_dp"):
        HostShardSpec((0, 2), (0,)).check(encoder_dp=2, llm_dp=1)
