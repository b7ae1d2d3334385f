"""Bytes a built pipeline's transfers move per microbatch (`driver.transfer_bytes_per_microbatch`),
checked against the collective-permutes of the compiled transfer programs (their HLO), on a tiny
LLaVA-OV-style MLLM: one encoder stage (dp 2), one LLM stage at (llm_dp, llm_tp) (1, 1), (3, 1) and
(2, 2), each microbatch holding 6 tiles packed by row (the data layer's all-padding microbatch at
6 / llm_dp tiles per row; at (2, 2) each row's 3 tiles pad to a block of 4, a multiple of tp)."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_fixtures import tiny_llava_ov_config

from dflop_jax.contracts import ScheduledMicrobatch
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs.provider import boundary_shards
from dflop_jax.data.packing import pack_microbatch
from dflop_jax.programs import transfer as tr
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.driver import transfer_bytes_per_microbatch

CFG = tiny_llava_ov_config()
V_DP, TILES, S, TPT = 2, 6, 32, 16  # encoder dp, tiles per microbatch, row length, tokens per tile
HLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u8": 1, "pred": 1}


LLM_MESHES = [(1, 1), (3, 1), (2, 2)]  # (llm_dp, llm_tp)


def _layout(llm_dp: int, llm_tp: int = 1) -> Layout:
    return Layout(
        (StageSpec("encoder", 0, 2, dp=V_DP, has_embedding=True, has_head=True),),
        (StageSpec("llm", 0, 2, tp=llm_tp, dp=llm_dp, has_embedding=True, has_head=True),),
    )


def _microbatch(llm_dp: int, llm_tp: int = 1) -> dict:
    """The packer's microbatch at TILES / llm_dp tiles per row (tiles packed by row)."""
    plan = ScheduledMicrobatch(
        TILES // llm_dp, S, ((),) * llm_dp, tiles_by_row=True, row_align=llm_tp
    )
    mb, _ = pack_microbatch(plan, [], [], encoder_dp=V_DP, llm_dp=llm_dp, tile_shape=(28, 28, 3),
                            tokens_per_tile=TPT)  # fmt: skip
    return {k: v for k, v in vars(mb).items() if v is not None}


@functools.cache
def _pipeline(llm_dp: int, llm_tp: int = 1):
    layout = _layout(llm_dp, llm_tp)
    return build_stages(CFG, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32)


def _hlo_bytes(x: jax.ShapeDtypeStruct, dst: jax.ShapeDtypeStruct) -> int:
    """Bytes the compiled transfer program (x to `dst`'s sharding and shape) sends with its
    collective-permutes: per op, its per-device result size times its (source, target) pairs."""
    program = tr._program_of(x, dst.sharding, tuple(dst.shape))
    union = jax.ShapeDtypeStruct(
        (len(program.devices) * program.src_block[0], *program.src_block[1:]), x.dtype,
        sharding=jax.sharding.NamedSharding(program.mesh, jax.sharding.PartitionSpec(tr.AXIS)),
    )  # fmt: skip
    with jax.set_mesh(program.mesh):
        hlo = program._run.jit.lower(union).compile().as_text()
    total = 0
    op = r"= (\w+)\[([\d,]*)\][^ ]* collective-permute\(.*?source_target_pairs=\{(.*?)\}\}"
    for m in re.finditer(op, hlo):
        dtype, dims, pairs = m.groups()
        size = int(np.prod([int(d) for d in dims.split(",") if d])) * HLO_BYTES[dtype]
        total += size * pairs.count("{")  # one "{src,dst" per pair
    return total


def _busiest(program: tr.Transfer) -> int:
    """Bytes the busiest device of a transfer plan sends or receives across devices."""
    size, moved = program.dtype.itemsize, collections.Counter()
    for rnd in program.rounds:
        for p in rnd.pieces if not rnd.local else ():
            n = int(np.prod(p.shape)) * size
            moved["send", p.src] += n
            moved["receive", p.dst] += n
    return max(moved.values())


@pytest.mark.parametrize("llm_dp, llm_tp", LLM_MESHES)
def test_bytes_per_microbatch_match_the_compiled_programs(llm_dp, llm_tp):
    stages = _pipeline(llm_dp, llm_tp)
    mb = _microbatch(llm_dp, llm_tp)
    (boundary,) = transfer_bytes_per_microbatch(stages, mb)
    enc, llm = stages
    y = enc.output_struct(None, enc.side_structs(mb))  # features [llm_dp * R, TPT, D], dp-sharded
    row = -(-TILES // llm_dp // llm_tp) * llm_tp  # each row's block, padded to a multiple of tp
    assert y.shape == (llm_dp * row, TPT, CFG.text.hidden_size)
    x = llm.x_struct(y)  # the tile axis split over all llm_dp * llm_tp devices, no end padding
    devices = llm_dp * llm_tp
    assert x.shape == y.shape
    assert x.sharding.shard_shape(x.shape)[0] == row // llm_tp
    assert boundary.stage == 0
    assert boundary.forward == _hlo_bytes(y, x) > 0
    y_back = jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=enc.y_sharding)
    assert boundary.backward == _hlo_bytes(x, y_back) > 0
    # one copy of the features crosses the boundary (the padding moves nothing), both ways
    assert boundary.forward == boundary.backward == y.size * jnp.dtype(y.dtype).itemsize
    # the cost model prices the plan's busiest device (shard units), then the in-mesh gather
    shard = y.size // V_DP * jnp.dtype(y.dtype).itemsize
    across, within = boundary_shards(_layout(llm_dp, llm_tp), 0, y.shape[0] // V_DP)
    assert across * shard == pytest.approx(_busiest(tr._program_of(y, x.sharding, x.shape)))
    block = x.size // devices * jnp.dtype(x.dtype).itemsize
    # the in-mesh gather: each row's block over its tp devices only
    assert within * shard == pytest.approx((llm_tp - 1) * block)


@pytest.mark.parametrize("llm_dp, llm_tp", LLM_MESHES)
def test_dry_run_transfers_are_the_built_pipelines(llm_dp, llm_tp):
    """`train --dry-run`'s transfers (abstract stage programs, no params) == the built pipeline's
    for a microbatch at the same buckets."""
    from dflop_jax.contracts import BucketSet
    from dflop_jax.profiling.stage_report import transfer_bytes_per_microbatch as dry_run_bytes

    layout = _layout(llm_dp, llm_tp)
    buckets = BucketSet((TILES // llm_dp,), (S,))  # tiles per row
    dry = dry_run_bytes(layout, buckets, CFG, jnp.float32)
    (built,) = transfer_bytes_per_microbatch(_pipeline(llm_dp, llm_tp), _microbatch(llm_dp, llm_tp))
    assert dry == [{"stage": 0, "forward_bytes": built.forward, "backward_bytes": built.backward}]
    assert built.forward > 0 and built.backward > 0
    frozen = dry_run_bytes(layout, buckets, CFG, jnp.float32, ("llm",))
    assert frozen == [{**dry[0], "backward_bytes": 0}]  # nothing trained before the LLM


def test_features_bytes_do_not_grow_with_llm_dp():
    """The same 6 tiles: one row of 6 at llm_dp 1, three rows of 2 at llm_dp 3; as built and as
    `train --dry-run` reports them (its buckets: tiles per row)."""
    from dflop_jax.contracts import BucketSet
    from dflop_jax.profiling.stage_report import transfer_bytes_per_microbatch as dry_run_bytes

    one, three = (transfer_bytes_per_microbatch(_pipeline(dp), _microbatch(dp))[0] for dp in (1, 3))
    assert three.forward == one.forward > 0
    assert three.backward == one.backward > 0
    dry = [dry_run_bytes(_layout(dp), BucketSet((TILES // dp,), (S,)), CFG, jnp.float32)[0]
           for dp in (1, 3)]  # fmt: skip
    assert dry[0] == dry[1] == {"stage": 0, "forward_bytes": one.forward,
                                "backward_bytes": one.backward}  # fmt: skip


def test_features_not_in_row_blocks_of_the_stage_are_refused():
    """Rows of 3 tiles (packed for tp 1) into an LLM stage at tp 2: its blocks would need end
    padding, which shifts them: refused with a clear message, never silently misplaced."""
    with pytest.raises(ValueError, match="does not split evenly .* packed for another layout"):
        transfer_bytes_per_microbatch(_pipeline(2, 2), _microbatch(2, 1))
