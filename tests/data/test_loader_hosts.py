"""Two OS processes, one per host, agree on every global schedule and together hold the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HOST_SCRIPT = r"""
import json, sys
import numpy as np
from dflop_jax.data.config import DataConfig
from dflop_jax.data.loader import make_loader
from dflop_jax.data.packing import HostShardSpec
from dflop_jax.data.dataset import load_source
from dflop_jax.scheduler import BucketSet, ScheduleProblem, Scheduler, SchedulerConfig

mix, index, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = DataConfig(source=mix, tile_size=28, max_frames=4, cache_dir="")
costs = lambda T, S: np.array([[T * 1e-3, T * 2e-3], [S * 1e-5, S * 2e-5]])
problem = ScheduleProblem(2, 4, 2, (1, 8), BucketSet((8, 16, 24), (256, 512, 1024)), costs)
host = HostShardSpec.contiguous(index, count, 2, 4) if count > 1 else None
out = []
scheduler = Scheduler(problem, SchedulerConfig(solver="greedy"))
with make_loader(cfg, load_source(cfg), problem, scheduler.schedule,
                 global_batch_size=12, seed=3, host=host) as loader:
    for _ in range(3):
        gb = next(loader)
        out.append({
            "digest": gb.stats.schedule_digest,
            "loss_tokens": gb.num_loss_tokens,
            "tokens": [mb.tokens.tolist() for mb in gb.microbatches],
            "tile_sums": [mb.tiles.sum(axis=(1, 2, 3)).round(3).tolist() for mb in gb.microbatches],
        })
print(json.dumps(out))
"""


def run_hosts(mix: str, count: int) -> list[list[dict]]:
    env = dict(os.environ, PYTHONHASHSEED="random")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOST_SCRIPT, mix, str(i), str(count)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        for i in range(count)
    ]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_host_processes_agree_with_a_single_host(tmp_path):
    from dflop_jax.data.synth import synth_dataset

    mix = str(synth_dataset(tmp_path / "synth", 36, "llava-ov", seed=1, tile=28))
    (single,) = run_hosts(mix, 1)
    hosts = run_hosts(mix, 2)
    for k, whole in enumerate(single):
        assert [h[k]["digest"] for h in hosts] == [whole["digest"]] * 2
        assert sum(h[k]["loss_tokens"] for h in hosts) == whole["loss_tokens"]
        for m, tokens in enumerate(whole["tokens"]):
            # Host 0 fills LLM shards 0-1 and encoder shard 0, host 1 the rest (global shapes,
            # other hosts' rows zero).
            got = np.add(hosts[0][k]["tokens"][m], hosts[1][k]["tokens"][m])
            np.testing.assert_array_equal(got, tokens)
            tiles = np.add(hosts[0][k]["tile_sums"][m], hosts[1][k]["tile_sums"][m])
            np.testing.assert_allclose(tiles, whole["tile_sums"][m], rtol=1e-6)
