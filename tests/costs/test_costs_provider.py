"""AnalyticCostProvider and the layout helpers: monotonicity, tp scaling, colocated encoder, memory."""

import dataclasses

import numpy as np
import pytest

from dflop_jax.contracts import BucketSet
from dflop_jax.costs import (
    AnalyticCostProvider,
    Layout,
    StageSpec,
    get_arch,
    get_device,
    layout_memory,
    layout_stage_costs,
    layout_transfer_costs,
    llm_layer_flops,
)

ARCH = get_arch("siglip-so400m+qwen2.5-7b")
H100 = get_device("h100")


def _layout(enc=True, tp=2, dp=2):
    encs = (
        (StageSpec("encoder", 0, 26, tp=1, dp=dp, has_embedding=True, has_head=True),)
        if enc
        else ()
    )
    llms = (
        StageSpec("llm", 0, 14, tp=tp, dp=dp, has_embedding=True),
        StageSpec("llm", 14, 14, tp=tp, dp=dp, has_head=True),
    )
    return Layout(encs, llms)


@pytest.mark.parametrize("remat", [False, True])
def test_stage_time_monotone_in_bucket_and_tp(remat):
    prov = AnalyticCostProvider(ARCH, H100, remat=remat)
    for module, buckets, layers in (
        ("encoder", [1, 2, 4, 8, 16], 26),
        ("llm", [512, 1024, 4096, 8192], 28),
    ):
        prev = (0.0, 0.0)
        for b in buckets:
            fb = prov.stage_time(StageSpec(module, 0, layers), b)
            assert fb[0] > prev[0] and fb[1] > prev[1] and fb[1] > fb[0]
            prev = fb
        times = [
            sum(prov.stage_time(StageSpec(module, 0, layers, tp=tp), buckets[-1]))
            for tp in (1, 2, 4, 8)
        ]
        assert all(a > b for a, b in zip(times, times[1:]))


def test_bucket_zero_costs_nothing():
    prov = AnalyticCostProvider(ARCH, H100)
    assert prov.stage_time(StageSpec("encoder", 0, 26, has_embedding=True), 0) == (0.0, 0.0)
    assert prov.stage_time(StageSpec("llm", 0, 28), 0) == (0.0, 0.0)


def test_tp1_llm_time_is_flops_over_effective_peak():
    prov = AnalyticCostProvider(ARCH, H100)
    s = 4096
    fwd, bwd = prov.stage_time(StageSpec("llm", 0, 10), s)
    flops = 10 * llm_layer_flops(ARCH.llm, s, s * s / 2)
    overhead = 10 * H100.layer_overhead_s
    assert fwd == pytest.approx(flops / (989e12 * H100.matmul_efficiency) + overhead)
    assert bwd == pytest.approx(2 * flops / (989e12 * H100.matmul_efficiency) + 2 * overhead)
    remat_bwd = AnalyticCostProvider(ARCH, H100, remat=True).stage_time(StageSpec("llm", 0, 10), s)[
        1
    ]
    assert remat_bwd == pytest.approx(bwd + fwd)


def test_colocated_encoder_adds_to_first_llm_stage():
    prov = AnalyticCostProvider(ARCH, H100)
    split = layout_stage_costs(prov, _layout(enc=True))(8, 8192)
    coloc = layout_stage_costs(prov, _layout(enc=False))(8, 8192)
    assert split.shape == (3, 2) and coloc.shape == (2, 2)
    np.testing.assert_allclose(coloc[1], split[2])
    enc_on_tp2 = prov.stage_time(
        StageSpec("encoder", 0, 26, tp=2, has_embedding=True, has_head=True), 8
    )
    np.testing.assert_allclose(coloc[0], split[1] + np.array(enc_on_tp2))
    # Text-only microbatch: the colocated encoder costs nothing.
    np.testing.assert_allclose(layout_stage_costs(prov, _layout(enc=False))(0, 8192)[0], split[1])


def test_transfer_costs_use_host_boundaries():
    prov = AnalyticCostProvider(ARCH, H100)
    t = layout_transfer_costs(prov, _layout(enc=True, tp=2, dp=2))(8, 8192)
    # encoder (2 devices) + llm0 (4) fit one host; llm0 + llm1 span devices 2..9 -> inter-host.
    # Tiles packed by row, 8 per row: the 16 feature tiles cross once, 4 to each of llm0's 2 x 2
    # devices, each encoder device sending its 8; then each row gathers its block over its 2 tp
    # devices only (each device receives the other 4 tiles of its row, none of the other row's).
    assert t[0] == pytest.approx((8 + 4) * 729 * 3584 * 2 / H100.intra_host_bandwidth)
    assert t[1] == pytest.approx(8192 * 3584 * 2 / H100.inter_host_bandwidth)


def test_encoder_slots_of_tiles_packed_by_row():
    """Packed by row, tile bucket T counts a row's tiles: the encoder takes llm_dp row blocks, each
    padded to a multiple of LLM stage 0's tp and so that the encoder's shards split them evenly."""
    prov = AnalyticCostProvider(ARCH, H100)
    enc = StageSpec("encoder", 0, 26, tp=1, dp=2, has_embedding=True, has_head=True)
    llm = StageSpec("llm", 0, 28, tp=2, dp=3, has_embedding=True, has_head=True)
    lay = Layout((enc,), (llm,))
    assert lay.tiles_by_row and lay.row_align == 2
    assert lay.encoder_tiles(3) == 3 * 4 // 2  # rows of 3 tiles pad to 4 (tp 2): 12 slots / 2
    assert layout_stage_costs(prov, lay)(3, 8192)[0] == pytest.approx(prov.stage_time(enc, 6))
    wide = Layout((dataclasses.replace(enc, dp=4),), (dataclasses.replace(llm, tp=1),))
    assert wide.encoder_tiles(3) == 3  # rows of 3 pad to 4 so that 4 encoder shards split 3 rows
    assert wide.encoder_tiles(4) == 3
    colocated = Layout((), (llm,))
    assert colocated.row_align == 1 and colocated.encoder_tiles(3) == 3  # a shard per row


def test_layout_memory_in_flight_counts():
    prov = AnalyticCostProvider(ARCH, H100)
    mems = layout_memory(prov, _layout(), BucketSet((4, 8), (4096, 8192)))
    assert [m.in_flight for m in mems] == [3, 2, 1]
    assert mems[0].total() == pytest.approx(
        mems[0].total(1) + 2 * mems[0].activations_per_microbatch
    )
    assert [m.in_flight for m in layout_memory(prov, _layout(), (8, 8192), in_flight=2)] == [
        2,
        2,
        1,
    ]
    assert [
        m.in_flight for m in layout_memory(prov, _layout(), (8, 8192), in_flight=[5, 4, 1])
    ] == [5, 4, 1]
    counts = np.array([3, 1, 1])
    assert [m.in_flight for m in layout_memory(prov, _layout(), (8, 8192), in_flight=counts)] == [
        3,
        1,
        1,
    ]
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        layout_memory(prov, _layout(), (8, 8192), in_flight=[1, 1])
    # the colocated encoder's memory lands on LLM stage 0
    coloc = layout_memory(prov, _layout(enc=False), (8, 8192))
    enc = prov.stage_memory(
        StageSpec("encoder", 0, 26, tp=2, dp=2, has_embedding=True, has_head=True), 8
    )
    assert coloc[0].params == pytest.approx(mems[1].params + enc.params)
    assert coloc[0].total(1) > mems[1].total(1)


def test_bad_device_and_arch_names():
    with pytest.raises(ValueError, match="h100"):
        get_device("tpu9")
    with pytest.raises(ValueError, match="tiny"):
        get_arch("bogus")


def test_stage_beyond_model_layers_is_rejected():
    prov = AnalyticCostProvider(ARCH, H100)
    with pytest.raises(ValueError, match="exceed the 28 layers"):
        prov.stage_time(StageSpec("llm", 20, 10), 1024)
    with pytest.raises(ValueError, match="exceed the 26 layers"):
        prov.stage_memory(StageSpec("encoder", 0, 27), 4)


def test_tp_adds_allreduce_time_over_ideal_split():
    prov = AnalyticCostProvider(ARCH, H100)
    f1, b1 = prov.stage_time(StageSpec("llm", 0, 4), 8192)
    f2, b2 = prov.stage_time(StageSpec("llm", 0, 4, tp=2), 8192)
    overhead = 4 * H100.layer_overhead_s
    # 2 all-reduces per layer of [8192, 3584] bf16, ring: 2 (tp-1)/tp * bytes / NVLink
    ar = 2 * (2 - 1) / 2 * 8192 * 3584 * 2 / H100.intra_host_bandwidth
    assert f2 == pytest.approx((f1 - overhead) / 2 + overhead + 4 * 2 * ar)
    assert b2 == pytest.approx((b1 - 2 * overhead) / 2 + 2 * overhead + 4 * 2 * ar)


def test_cli_json_and_bad_model(capsys):
    import json

    from dflop_jax.costs.__main__ import main

    assert (
        main(["arch=tiny", "device=cpu", "tp=[1,2]", "tiles=[4]", "lengths=[256]", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["llm"] == 213568 and set(out["llm_s"]) == {"1", "2"}
    assert main(["arch=nope"]) == 2
    assert "unknown arch" in capsys.readouterr().err
