"""`bench audio` on a small audio mix: the arms count what they claim (the 30 s arm every window at
3000 frames, the packed arm llm_dp rows of each microbatch's audio bucket), and the table prints."""

import json

import pytest

from dflop_jax.bench import audio as bench_audio
from dflop_jax.contracts import kept_frames

pytest.importorskip("av")


def test_bench_audio_counts_its_arms(tmp_path, capsys):
    args = ["mix=audio", "samples=40", "batch=16", "microbatches=2", "llm_dp=2", "buckets=3",
            "batches=2", f"out={tmp_path}"]  # fmt: skip
    assert bench_audio.main(args) == 0
    result = json.loads((tmp_path / "bench_audio.json").read_text())
    arms = result["arms"]
    assert set(arms) == {"padded to 30 s", "padded per microbatch", "packed rows", "packed pool"}
    cfg = bench_audio.AudioBenchConfig(mix="audio", samples=40, out=str(tmp_path))
    shapes = bench_audio.mix_shapes(cfg)
    assert result["with_audio"] == len(shapes) == sum(1 for s in shapes if s.audio_windows)
    for row in arms.values():  # every arm computes at least the kept frames
        assert row["frames"] >= row["kept"] > 0
    assert result["audio_ladder"][-1] % 4 == 0
    assert "packed rows" in capsys.readouterr().out


def test_arms_on_a_hand_made_microbatch():
    from dflop_jax.contracts import BucketSet, SampleShape, Schedule, ScheduledMicrobatch

    batch = [SampleShape(0, 0, 900, "audio", (3000, 500)), SampleShape(1, 0, 300, "audio", (700,)),
             SampleShape(2, 0, 100, "text")]  # fmt: skip
    mb = ScheduledMicrobatch(1, 1024, ((0,), (1, 2)), audio_bucket=4000)
    schedule = Schedule((mb,), 0.0, 0.0, "hand", 0.0)
    buckets = BucketSet((1,), (1024,), audio=(1000, 4000))
    got = bench_audio.arms(batch, schedule, buckets, llm_dp=2)
    kept = kept_frames(3000) + kept_frames(500) + kept_frames(700)
    assert got["padded to 30 s"]["frames"] == 3 * 3000 and got["packed rows"]["kept"] == kept
    assert got["padded per microbatch"]["frames"] == 3 * 3000  # the longest window is a full one
    assert got["packed rows"]["frames"] == 2 * 4000
    # pooled: 3000 to one row, 704 + 504 to the other -> the fullest row (3000) takes 4000
    assert got["packed pool"]["frames"] == 2 * 4000
