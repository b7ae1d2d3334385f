"""The cluster benchmark's evaluation on a tiny plan: invariants between its idle measures."""

import pytest

from dflop_jax.bench.cluster import evaluate, format_tables
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
from dflop_jax.planner import LayoutCosts, PlannerConfig, make_plan, problem_for
from dflop_jax.planner.baseline import data_blind_scheduler
from dflop_jax.planner.scoring import online_scheduler, sample_batches
from dflop_jax.scheduler import llava_ov_mix


@pytest.fixture(scope="module")
def setup():
    shapes = llava_ov_mix(300, 0)
    cfg = PlannerConfig(
        global_batch=16,
        microbatches=(2, 4),
        samples=1,
        screen_top=2,
        screen_per_group=0,
        llm_pp=(1, 2),
    )
    plan = make_plan("tiny", "cpu", 4, shapes, cfg, mode="uniform")
    costs = LayoutCosts.build(
        AnalyticCostProvider(get_arch("tiny"), get_device("cpu")), plan.layout
    )
    return plan, costs, sample_batches(shapes, 16, 2, 99)


def test_idle_measures_are_consistent(setup):
    plan, costs, batches = setup
    static = evaluate(plan, batches, data_blind_scheduler(), costs)
    dynamic = evaluate(plan, batches, data_blind_scheduler(), costs, dynamic=True)
    online = evaluate(plan, batches, online_scheduler("greedy", 0), costs)
    # real loads never cost more than their buckets; device idle counts everything pipeline idle does
    assert dynamic.step_s <= static.step_s + 1e-12
    for m in (static, dynamic, online):
        assert 0 <= m.idle <= m.device_idle < 1
    assert dynamic.padding_tokens == 0.0 and 0 < static.padding_tokens < 1


def test_format_tables_has_both_tables():
    row = {
        "model": "m", "gpus": 8, "global_batch": 32, "dflop_layout": "a", "blind_layout": "b",
        "dflop": {"step_s": 1.0, "idle": 0.1, "device_idle": 0.1, "padding_tokens": 0.05},
        "blind": {"step_s": 2.0, "idle": 0.0, "device_idle": 0.5, "padding_tokens": 0.4},
        "blind_dynamic": {"step_s": 1.5, "idle": 0.0, "device_idle": 0.3, "padding_tokens": 0.0},
        "speedup": 2.0, "speedup_vs_dynamic": 1.5, "device_idle_reduction": 0.8,
        "device_idle_reduction_vs_dynamic": float("nan"), "plan_time_dflop_s": 12.4, "plan_time_blind_s": 0.4,
        "strongest_baseline": {"name": "maxtext-packer", "step_s": 1.25, "speedup": 1.25},
    }  # fmt: skip
    text = format_tables(
        [row], [{"model": "big", "gpus": 32, "error": "data-blind: no layout fits"}]
    )
    assert (
        "| m | 8 | 32 | a | b |" in text
        and "| 2.00x |" in text
        and "| 80% |" in text
        and "n/a" in text
        and "| 12 / 0 |" in text
        and "| maxtext-packer, 1.25 | 1.25x |" in text
        and "| big | 32 | data-blind: no layout fits |" in text
    )


@pytest.mark.slow
@pytest.mark.long  # a full 32-GPU search, 60-70 s on 2 cores; the report's form: the tests above
def test_paper_smoke_one_model_at_32_gpus(capsys):
    """`--paper` on one of the reference's models (its default "6B" SigLIP + Qwen2.5-7B): both planners
    find a layout, the baseline's encoder runs colocated, the report says it is a simulation."""
    from dflop_jax.bench.cluster import main

    rc = main(["--paper", "gpus=32", "models=siglip-6b+qwen2.5-7b", "eval_batches=1", "samples=1",
               "json_out=/dev/null"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "Simulation with analytic costs" in out
    row = next(
        line for line in out.splitlines() if line.startswith("| siglip-6b+qwen2.5-7b | 32 | 128")
    )
    assert "enc@llm0 / llm" in row.split("|")[5]  # the data-blind layout


def test_paper_model_set_is_the_references():
    """14 pairs: every encoder of the reference (SigLIP 400M/1B/6B on LLaVA-OV data, InternViT 300M/1B/6B
    on the OmniBal statistics) and every LLM it names appear, and each name resolves to its arch."""
    from dflop_jax.bench.cluster import PAPER_MODELS

    archs = {name: get_arch(arch) for name, (arch, _) in PAPER_MODELS.items()}
    assert {a.vision.name for a in archs.values()} == {
        "siglip-so400m", "siglip-1b", "siglip-6b", "internvit-300m", "internvit-1b", "internvit-6b"
    }  # fmt: skip
    assert {a.llm.name for a in archs.values()} == {
        "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "llama3-8b", "llama3-70b"
    }  # fmt: skip
    for name, (_, data) in PAPER_MODELS.items():
        assert data == ("llava-ov" if name.startswith("siglip") else "omnibal")


def test_strongest_scheduler_baseline_column(tmp_path, capsys):
    """Default model at 8 GPUs with two cheap scheduler baselines on DFLOP's layout: every row has the
    column, and its name / step / speedup are those of the lowest baseline step in the JSON rows
    (recomputed here, not read back)."""
    import json

    from dflop_jax.bench.cluster import main

    out_json = tmp_path / "rows.json"
    rc = main(["--quick", "gpus=8", "eval_batches=1", "samples=1",
               "baselines=data_blind,maxtext-packer", f"json_out={out_json}"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "strongest scheduler baseline on DFLOP's layout" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert rows
    for r in rows:
        steps = {n: b["step_s"] for n, b in r["baselines"].items()}
        assert set(steps) == {"data_blind", "maxtext-packer"}
        name = min(steps, key=steps.get)
        ratio = steps[name] / r["dflop"]["step_s"]
        sb = r["strongest_baseline"]
        assert sb["name"] == name and sb["speedup"] == pytest.approx(ratio, rel=1e-12)
        line = next(
            ln
            for ln in out.splitlines()
            if ln.startswith(f"| {r['model']} | {r['gpus']} | {r['dflop']['step_s']:.2f}")
        )
        assert f"| {name}, {steps[name]:.2f} | {ratio:.2f}x |" in line


def test_unknown_baseline_is_a_one_line_error(capsys):
    from dflop_jax.bench.cluster import main

    with pytest.raises(SystemExit) as e:
        main(["--quick", "baselines=nope"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "unknown baseline ['nope']" in err and "\n" not in err


def test_bad_recipe_is_a_one_line_error(capsys):
    from dflop_jax.bench.cluster import main

    with pytest.raises(SystemExit) as e:
        main(["--quick", "trainable=vision,bogus"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("config error: trainable=") and "\n" not in err


def test_omni_rows_price_the_audio_encoder_at_each_microbatchs_frames():
    """Omni rows: the cost model prices the audio encoder on the first LLM stage of a plan without
    audio stages, at the microbatch's audio bucket (DFLOP's packing: at least its fullest row's
    kept frames) or, packed data-blind, at 30 s per clip window of the fullest row; it costs time,
    and the padded packing computes at least the frames of every row's whole windows."""
    import dataclasses

    from dflop_jax.bench.cluster import AudioFrames
    from dflop_jax.contracts.shapes import WINDOW_FRAMES
    from dflop_jax.costs import AudioArch
    from dflop_jax.scheduler import omni_mix

    arch = dataclasses.replace(get_arch("tiny"), audio=AudioArch("tiny-audio", 2, 64, 4, 128, 16))
    shapes = omni_mix(300, 0, 0.5)
    assert 0.4 < sum(bool(s.audio_windows) for s in shapes) / 300 < 0.6
    cfg = PlannerConfig(global_batch=16, microbatches=(2, 4), samples=1, screen_top=2,
                        screen_per_group=0, llm_pp=(1, 2), audio_stages=False)  # fmt: skip
    plan = make_plan(arch, "cpu", 4, shapes, cfg)
    assert len(plan.buckets.audio) > 1 and not plan.layout.audio_stages  # the planner's ladder
    provider = AnalyticCostProvider(arch, get_device("cpu"))
    costs = LayoutCosts.build(provider, plan.layout)
    batches = sample_batches(shapes, 16, 2, 99)
    packed, padded = AudioFrames(padded=False), AudioFrames(padded=True)
    sched = online_scheduler("greedy", 0)(batches[0], problem_for(costs, plan.microbatch_range,
                                                                  plan.buckets))  # fmt: skip
    for mb in sched.microbatches:
        rows = [[batches[0][i] for i in row] for row in mb.shards]
        fullest = max(sum(s.audio_frames for s in row) for row in rows)
        assert packed.computed(mb, batches[0]) == mb.audio_bucket >= fullest
        windows = max(sum(len(s.audio_windows) for s in row) for row in rows)
        assert padded.computed(mb, batches[0]) == WINDOW_FRAMES * windows
    heard = evaluate(plan, batches, online_scheduler("greedy", 0), costs)
    padded_step = evaluate(plan, batches, online_scheduler("greedy", 0), costs, audio=padded)
    assert padded_step.step_s > heard.step_s
    t, s = plan.buckets.top
    first = plan.layout.first_llm
    silent, short, window = (costs.stage(t, s, a)[first].sum() for a in (0, 752, 3000))
    assert window > short > silent > 0
    # exactly the encoder's own price (`audio_time`) at the stage's tp, one row per shard
    stage = dataclasses.replace(plan.layout.llm_stages[0], module="audio", first_layer=0,
                                num_layers=2, has_embedding=True, has_head=True)  # fmt: skip
    assert short - silent == pytest.approx(sum(provider.audio_time(stage, 752)), rel=1e-9)
