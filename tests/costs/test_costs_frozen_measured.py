"""Frozen-aware costs from a profile, no jax: a cost table profiled UNDER a recipe is used as
measured (a stage's backward is its parts' measured backwards, a frozen part with no backward of its
own re-run forward inside a stage that has one under "recompute", not from saved residuals), one
profiled under another frozen recipe is refused, an all-trainable table (and one written before
recipes) still derives; the colocated encoder's share of the colocated stage honours the recipe in
the analytic and the measured provider; a stage under a residual policy the table did not time is
priced with its measured forward moved into (or out of) its backward."""

import json

import numpy as np
import pytest

from dflop_jax.contracts.cost_table import CostEntry, ProfiledCostTable, load_table, save_table
from dflop_jax.contracts.layout import StageSpec as Spec
from dflop_jax.costs import AnalyticCostProvider, Layout, StageSpec, get_arch, get_device
from dflop_jax.costs.measured import MeasuredCostProvider
from dflop_jax.costs.provider import RerunTimes, colocated_encoder_stage, layout_stage_costs
from dflop_jax.costs.recipe import colocated_backward, recipe_backward

ARCH, DEV = get_arch("tiny"), get_device("cpu")
H100, BIG = get_device("h100"), get_arch("siglip-so400m+qwen2.5-7b")
BUCKETS, TILES, ROW = (64, 256, 1024), (1, 2, 4), 64
# per-bucket seconds of each part's programs: (fwd, trainable bwd, dx-only bwd, dw-only bwd)
SLOPE = {"llm_layers": (2e-6, 5e-6, 3e-6), "llm_embedding": (1e-7, 3e-7, 2e-7),
         "llm_head": (4e-7, 9e-7, 6e-7), "encoder_layers": (3e-5, 8e-5, 5e-5),
         "encoder_embedding": (1e-5, 2e-5, 0.0), "encoder_head": (2e-5, 6e-5, 4e-5)}  # fmt: skip
COLOCATED = (5e-4, 9e-4)  # colocated_embedding seconds per tile (fwd, trainable bwd)


def _entry(kind, bucket, layers, fwd, bwd, param_bytes, grad_bytes=None, length=0):
    return CostEntry(kind, 1, bucket, layers, fwd_s=fwd, bwd_s=bwd, param_bytes=param_bytes,
                     grad_bytes=grad_bytes, input_bytes=10.0 * bucket, length=length,
                     memory_bwd={"peak": 3 * param_bytes + 10.0 * bucket} if bwd else {},
                     memory_fwd={"peak": param_bytes + 10.0 * bucket})  # fmt: skip


def table(recipe=None, residuals="recompute") -> ProfiledCostTable:
    """Linear costs (exactly interpolated). recipe None: the trainable programs (a table written
    before recipes); ("projector",): LLaVA-OV stage 1's programs: vision parts forward only (bwd 0),
    the projector dw only, the LLM dx only. `residuals`: the policy the table says it timed."""
    kw = {} if recipe is None else {"trainable": recipe}
    t = ProfiledCostTable("cpu", "cpu", 8, "h", "c", model="tiny", residuals=residuals, **kw)
    for kind, (f, b, dx) in SLOPE.items():
        enc = kind.startswith("encoder")
        if recipe is not None:  # the part's program under projector-only
            b = dx if kind != "encoder_head" else b / 2
            b = 0.0 if kind in ("encoder_layers", "encoder_embedding") else b
        grads = None if recipe is None else (100.0 if kind == "encoder_head" else 0.0)
        for x in TILES if enc else BUCKETS:
            for n in (1, 2) if kind.endswith("_layers") else (0,):
                t.add(_entry(kind, x, n, f * x * max(n, 1), b * x * max(n, 1), 100.0, grads))
    for x in TILES:
        emb_f, emb_b = SLOPE["llm_embedding"][0] * ROW, SLOPE["llm_embedding"][1] * ROW
        t.add(_entry("colocated_embedding", x, 0, COLOCATED[0] * x + emb_f, COLOCATED[1] * x + emb_b,
                     300.0, length=ROW))  # fmt: skip
    return t


LLM = StageSpec("llm", 0, 3, tp=1, has_embedding=True)
ENC_BODY = StageSpec("encoder", 0, 1, tp=1, has_embedding=True)
ENC_HEAD = StageSpec("encoder", 1, 1, tp=1, has_head=True)


def test_a_table_profiled_under_the_recipe_is_used_as_measured():
    p = MeasuredCostProvider(table(("projector",)), ARCH, DEV)
    assert p.trainable == ("projector",) and p.name.endswith("+train:projector")
    # LLM stage: the parts' measured dx-only backwards, not 2/3 of a trainable one
    dx = (3 * SLOPE["llm_layers"][2] + SLOPE["llm_embedding"][2]) * 256
    assert p.stage_time(LLM, 256)[1] == pytest.approx(dx, rel=1e-9)
    assert dx != pytest.approx(
        2 / 3 * (3 * SLOPE["llm_layers"][1] + SLOPE["llm_embedding"][1]) * 256
    )
    # the frozen encoder prefix stage runs forward only
    fwd = (SLOPE["encoder_embedding"][0] + SLOPE["encoder_layers"][0]) * 4
    assert p.stage_time(ENC_BODY, 4) == pytest.approx((fwd, 0.0), rel=1e-9)
    # the projector's stage: its frozen layer re-run forward, the projector's own (dw-only) backward
    want = SLOPE["encoder_layers"][0] * 4 + SLOPE["encoder_head"][1] / 2 * 4
    assert p.stage_time(ENC_HEAD, 4)[1] == pytest.approx(want, rel=1e-9)
    mem = p.stage_memory(ENC_HEAD, 4)
    assert (mem.grads, mem.optimizer) == (100.0, 200.0)  # the projector's leaves only
    assert p.stage_memory(LLM, 256).grads == 0.0
    # temp from each part's own program: peak - params - accumulator - input
    assert p.stage_memory(ENC_BODY, 4).temp == pytest.approx(0.0 + 10.0 * 4)  # + its input


def test_a_saving_table_reruns_no_frozen_forward_and_derives_dx_as_half():
    """Timed under "all" (the backward from saved residuals), a frozen part adds nothing to a
    backward and a dx-only backward is half the trainable one (dx of dx + weight gradients)."""
    p = MeasuredCostProvider(table(("projector",), "all"), ARCH, DEV)
    assert p.stage_time(ENC_HEAD, 4)[1] == pytest.approx(SLOPE["encoder_head"][1] / 2 * 4, rel=1e-9)
    derived = MeasuredCostProvider(table(None, "all"), ARCH, DEV).with_trainable(("projector",))
    trainable_bwd = (3 * SLOPE["llm_layers"][1] + SLOPE["llm_embedding"][1]) * 256
    assert derived.stage_time(LLM, 256)[1] == pytest.approx(trainable_bwd / 2, rel=1e-9)
    # the projector-only head stage: the projector's backward alone, no frozen layer re-run
    head = SLOPE["encoder_head"][1] * 4
    assert derived.stage_time(ENC_HEAD, 4)[1] == pytest.approx(head, rel=1e-9)
    recompute = MeasuredCostProvider(table(), ARCH, DEV).with_trainable(("projector",))
    assert recompute.stage_time(ENC_HEAD, 4)[1] > head  # its frozen layer's forward on top
    with pytest.raises(ValueError, match="residuals='some'"):
        table(residuals="some")


def test_a_table_of_another_frozen_recipe_is_refused():
    p = MeasuredCostProvider(table(("projector",)), ARCH, DEV)
    with pytest.raises(
        ValueError, match=r"profiled under trainable=\['projector'\] and cannot cost"
    ):
        p.with_trainable(("projector", "llm"))
    with pytest.raises(ValueError, match="cannot cost"):
        MeasuredCostProvider(
            table(("projector",)), ARCH, DEV, trainable=("vision", "projector", "llm")
        )


def test_a_table_from_before_recipes_loads_all_trained_and_derives(tmp_path):
    path = save_table(table(), tmp_path / "ct.json")
    doc = json.loads(path.read_text())
    del doc["trainable"]
    for e in doc["entries"]:
        del e["grad_bytes"]
    path.write_text(json.dumps(doc))
    old = load_table(path)
    assert old.all_trained and old.trainable == ("vision", "projector", "llm")
    p = MeasuredCostProvider(old, ARCH, DEV).with_trainable(("projector",))
    trainable_bwd = (3 * SLOPE["llm_layers"][1] + SLOPE["llm_embedding"][1]) * 256
    assert p.stage_time(LLM, 256)[1] == pytest.approx(2 / 3 * trainable_bwd, rel=1e-9)
    # and a recipe table round-trips with its recipe and accumulator bytes
    back = load_table(save_table(table(("projector",)), tmp_path / "r.json"))
    assert (
        back.trainable == ("projector",) and back.get("encoder_head", 1, 2, 0).grad_bytes == 100.0
    )


def _coloc(arch):
    return colocated_encoder_stage(
        arch, Layout((), (Spec("llm", 0, 4, tp=1, dp=2, has_embedding=True, has_head=True),))
    )


@pytest.mark.parametrize("provider", ["analytic", "measured"])
def test_colocated_encoder_share_honours_the_recipe(provider):
    """All trained: the colocated program's share. LLM only trained: the frozen encoder is re-run
    forward in the colocated stage's backward (its forward, no backward of its own). Projector only /
    vision frozen: the frozen layers' forward plus the projector's backward, no dx into the ViT."""
    if provider == "analytic":
        enc, tiles = _coloc(BIG), 8
        make = lambda r: AnalyticCostProvider(BIG, H100, trainable=r)  # noqa: E731
        hf, hb = make(("vision", "projector", "llm")).stage_time(
            Spec("encoder", 0, 0, 1, has_head=True), tiles
        )
    else:
        enc, tiles = _coloc(ARCH), 2
        make = lambda r: MeasuredCostProvider(table(), ARCH, DEV, trainable=r)  # noqa: E731
        hf, hb = SLOPE["encoder_head"][0] * tiles, SLOPE["encoder_head"][1] * tiles
    f, b = make(("vision", "projector", "llm")).colocated_encoder_time(enc, tiles)
    if provider == "measured":
        assert (f, b) == pytest.approx((COLOCATED[0] * tiles, COLOCATED[1] * tiles), rel=1e-9)
    assert make(("llm",)).colocated_encoder_time(enc, tiles) == pytest.approx((f, f), rel=1e-9)
    for recipe in (("projector",), ("projector", "llm")):
        share = make(recipe).colocated_encoder_time(enc, tiles)
        assert share == pytest.approx((f, f - hf + hb), rel=1e-9)
        assert f < share[1] < b


def test_colocated_stage_costs_add_the_recipe_share():
    lay = Layout((), (Spec("llm", 0, 28, tp=4, dp=16, has_embedding=True, has_head=True),))
    llm_only = AnalyticCostProvider(BIG, H100, trainable=("llm",))
    row = layout_stage_costs(llm_only, lay)(4, 8192)[0]
    llm = llm_only.stage_time(lay.llm_stages[0], 8192)
    enc_f, _ = AnalyticCostProvider(BIG, H100).stage_time(colocated_encoder_stage(BIG, lay), 4)
    assert row == pytest.approx((llm[0] + enc_f, llm[1] + enc_f))


def test_a_recipe_table_colocated_share_is_the_measured_colocated_program():
    p = MeasuredCostProvider(table(("projector",)), ARCH, DEV)
    emb_f = SLOPE["llm_embedding"][0] * ROW
    emb_b = SLOPE["llm_embedding"][2] * ROW  # the embedding's dx-only program under the recipe
    f, b = p.colocated_encoder_time(_coloc(ARCH), 2)
    assert (f, b) == pytest.approx(
        (COLOCATED[0] * 2, COLOCATED[1] * 2 + SLOPE["llm_embedding"][1] * ROW - emb_b), rel=1e-9
    )
    assert emb_f > 0


def test_a_recipe_table_falls_back_to_the_analytic_model_under_the_same_recipe():
    t = table(("projector",))
    t.entries = {k: e for k, e in t.entries.items() if k[0] != "llm_head"}
    analytic = AnalyticCostProvider(ARCH, DEV)  # all trained, as the pipeline passes it
    p = MeasuredCostProvider(t, ARCH, DEV, fallback=analytic)
    head = Spec("llm", 0, 0, tp=1, has_head=True)
    f, b = analytic.stage_time(head, 256)
    assert p.stage_time(head, 256) == pytest.approx((f, 2 / 3 * b), rel=1e-9)  # dx only
    assert p.sources()["llm_head"] == {"fallback": 1}


def test_profile_model_profiles_the_run_recipe():
    """`profile model` profiles under the run's `optimizer.trainable` (its pipeline settings'
    planner recipe, which the model profile's digest and programs take)."""
    from dflop_jax.config import load_config
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.plan_sources import auto_plan_config
    from dflop_jax.runtime.config import TrainConfig

    cfg = load_config(TrainConfig, None, ["model=tiny", "num_devices=8", "device=cpu",
                                          "optimizer.trainable=[projector]"])  # fmt: skip
    auto = auto_plan_config(RunContext.build(cfg))
    assert auto.planner.trainable == ("projector",)


def test_a_stage_under_a_policy_the_table_did_not_time_moves_its_forward():
    """A table timed under "all" (backwards from saved residuals): a stage the plan trains under
    "recompute" or "layers" costs its forward once more in its backward, one under "all" the
    table's own times; a table timed under "recompute" prices an "all" stage's backward without
    that forward. The colocated encoder on LLM stage 0 moves with that stage's policy, a frozen
    one too."""
    enc = Spec("encoder", 0, 2, tp=1, dp=1, has_embedding=True, has_head=True)
    llm = Spec("llm", 0, 3, tp=1, dp=1, has_embedding=True, has_head=True)
    apart, colocated = Layout((enc,), (llm,)), Layout((), (llm,))
    saving = MeasuredCostProvider(table(residuals="all"), ARCH, DEV)
    own = [saving.stage_time(enc, apart.encoder_tiles(2)), saving.stage_time(llm, 256)]
    assert all(f > 0 and b > 0 for f, b in own)
    for policy in ("recompute", "layers"):
        got = layout_stage_costs(saving, apart, [policy, "all"])(2, 256)
        want = [[own[0][0], own[0][1] + own[0][0]], own[1]]
        np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(layout_stage_costs(saving, apart, ["all", "all"])(2, 256), own)
    rerun = MeasuredCostProvider(table(residuals="recompute"), ARCH, DEV)
    f, b = rerun.stage_time(llm, 256)
    assert layout_stage_costs(rerun, apart, ["all", "all"])(2, 256)[1] == pytest.approx((f, b - f))
    assert layout_stage_costs(rerun, apart, ["recompute"] * 2)(2, 256)[1] == pytest.approx((f, b))
    share = saving.colocated_encoder_time(colocated_encoder_stage(ARCH, colocated), 2)
    row = [a + c for a, c in zip(own[1], share)]
    assert layout_stage_costs(saving, colocated, ["all"])(2, 256)[0] == pytest.approx(row)
    moved = [row[0], row[1] + row[0]]
    assert layout_stage_costs(saving, colocated, ["recompute"])(2, 256)[0] == pytest.approx(moved)
    # A frozen colocated encoder has no backward of its own, yet LLM stage 0's recomputing
    # backward re-runs its forward: "recompute" costs the whole row's forward more than "all",
    # from a table timed under either policy.
    for timed in ("all", "recompute"):
        frozen = MeasuredCostProvider(table(None, timed), ARCH, DEV).with_trainable(("llm",))
        enc_fwd, enc_bwd = frozen.colocated_encoder_time(
            colocated_encoder_stage(ARCH, colocated), 2
        )
        assert enc_fwd > 0 and enc_bwd == (0.0 if timed == "all" else pytest.approx(enc_fwd))
        kept, rerun = (
            layout_stage_costs(frozen, colocated, [p])(2, 256)[0] for p in ("all", "recompute")
        )
        assert kept[0] == rerun[0] and rerun[1] - kept[1] == pytest.approx(kept[0])
        assert kept[0] == pytest.approx(frozen.stage_time(llm, 256)[0] + enc_fwd)


def test_a_frozen_audio_encoder_moves_its_forward_only_inside_llm_stage_0():
    """A frozen audio encoder (forward only) re-runs in LLM stage 0's recomputing backward when it
    runs inside that stage's program (`colocated_backward`), never as a stage of its own."""

    class Frozen:
        def audio_time(self, stage, frames, rule, rows):
            return 2.0, 0.0

    stage = Spec("audio", 0, 2, tp=1, dp=1, has_embedding=True, has_head=True)
    assert RerunTimes(Frozen(), 1).audio_time(stage, 1024, colocated_backward) == (2.0, 2.0)
    assert RerunTimes(Frozen(), 1).audio_time(stage, 1024, recipe_backward) == (2.0, 0.0)
    assert RerunTimes(Frozen(), -1).audio_time(stage, 1024, colocated_backward) == (2.0, 0.0)
