"""Model profiler on the tiny model (8 simulated CPU devices): cost-table FLOPs equal XLA's
`cost_analysis()` of the same function jitted independently; predicted stage memory equals the part
programs compiled at the stage's own shape and bounds the compiled peak of the whole-stage program;
a re-run reuses a fresh table while a changed config is redone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflop_jax.contracts.profile_settings import ProfileSettings
from dflop_jax.costs import StageSpec, arch_of_model, get_device
from dflop_jax.costs.measured import MeasuredCostProvider
from dflop_jax.profiling import model_profiler
from dflop_jax.profiling.model_profiler import measure_program, profile_model
from dflop_jax.profiling.programs import StageShape, build_program
from dflop_jax.programs.model_section import model_config_for_arch

CFG = model_config_for_arch("tiny", "float32")
FAST = dict(warmup=0, runs=1, compute_dtype="float32")


def test_table_flops_equal_cost_analysis_of_the_same_function(tmp_path):
    from models.mllm import EncoderStage

    settings = ProfileSettings(tps=(1,), encoder_buckets=(3,), kinds=("encoder_head",), **FAST)
    recompute = dataclasses.replace(settings, residuals="recompute")
    table = profile_model(CFG, jax.devices(), recompute, tmp_path / "ct.json", plot=False)
    entry = table.get("encoder_head", 1, 3, 0)
    assert entry.ok and table.residuals == "recompute" and entry.residual_bytes == 0

    # the same projector head (with its video-frame pooling), jitted on one device without any mesh
    stage = EncoderStage(CFG, first_layer=0, num_layers=0, has_embedding=False, has_head=True,
                         rngs=nnx.Rngs(0))  # fmt: skip
    graphdef, params = nnx.split(stage)
    x = jnp.zeros((3, CFG.vision.seq_len, CFG.vision.hidden_size), jnp.float32)
    pool = jnp.zeros((3,), bool)
    ref = jax.jit(lambda p, x, pool: nnx.merge(graphdef, p)(x, pool)).lower(params, x, pool)
    ref = ref.compile()
    assert entry.flops_fwd == pytest.approx(ref.cost_analysis()["flops"], rel=1e-6)
    assert (
        entry.flops_fwd
        > 2 * 3 * CFG.tokens_per_tile * CFG.vision.hidden_size * CFG.text.hidden_size
    )
    assert entry.flops_bwd > 2 * entry.flops_fwd  # recompute + vjp
    assert entry.param_bytes == sum(a.nbytes for a in jax.tree.leaves(params))

    # By default the table times what "auto" trains: the backward from saved residuals, which
    # runs no forward again, and a forward that hands those residuals over.
    table = profile_model(CFG, jax.devices(), settings, tmp_path / "saving.json", plot=False)
    saving = table.get("encoder_head", 1, 3, 0)
    assert table.residuals == "all" and saving.residual_bytes > 0
    assert saving.flops_bwd < 2 * entry.flops_fwd < entry.flops_bwd


def _compiled_memory(layers: int, has_head: bool, bucket: int, settings) -> dict:
    """Backward memory analysis of an LLM program at tp 2 (over a tiny limit: compiled, never run)."""
    shape = StageShape("llm", layers, False, has_head)
    prog = build_program(CFG, shape, 2, bucket, jax.devices(), jnp.float32,
                         residuals=settings.residuals)  # fmt: skip
    measured = measure_program(prog, dataclasses.replace(settings, memory_limit_bytes=0.5))
    assert measured["status"] == "skipped"
    return measured


@pytest.mark.slow
def test_predicted_memory_is_the_parts_peaks_and_bounds_the_stage_peak(tmp_path):
    """A 3-layer LLM stage with its head; the table holds 1- and 2-layer entries at buckets 64, 128.

    The prediction (less the optimizer state, which no profiled program holds) is the sum of the
    parts' compiled backward peaks, the head's input (the layers' output) held once. At a profiled
    bucket nothing is interpolated, so it must equal, to round-off, the part programs compiled
    independently at the stage's own 3 layers: this checks the 1-to-2-layer extrapolation and the
    assembly with no tolerance. The stage's one program then needs at least its larger part (it runs
    that part, the other part's state on top) and at most the parts compiled apart (it may reuse
    their buffers). Between profiled buckets the prediction interpolates linearly, which
    over-estimates memory that grows convexly with the bucket (attention scores grow as S^2): it
    still bounds the compiled peak.
    """
    settings = ProfileSettings(tps=(2,), llm_buckets=(64, 128), kinds=("llm_layers", "llm_head"),
                               residuals="recompute", **FAST)  # fmt: skip
    table = profile_model(CFG, jax.devices(), settings, tmp_path / "ct.json", plot=False)
    provider = MeasuredCostProvider(table, arch_of_model(CFG, "tiny"), get_device("cpu"))
    spec = StageSpec("llm", 0, 3, tp=2, has_head=True)

    predicted = provider.stage_memory(spec, 128)
    layers, head = (_compiled_memory(3, False, 128, settings),
                    _compiled_memory(0, True, 128, settings))  # fmt: skip
    peaks = (layers["memory_bwd"]["peak"], head["memory_bwd"]["peak"])
    parts = sum(peaks) - head["input_bytes"]
    assert predicted.total() - predicted.optimizer == pytest.approx(parts, rel=1e-9)
    stage = _compiled_memory(3, True, 128, settings)
    assert predicted.params == pytest.approx(stage["param_bytes"], rel=1e-6)
    assert max(peaks) <= stage["memory_bwd"]["peak"] <= parts

    between = provider.stage_memory(spec, 96)
    stage = _compiled_memory(3, True, 96, settings)
    assert between.total() - between.optimizer >= stage["memory_bwd"]["peak"]


def test_saving_table_predicts_held_residuals_and_the_backward_peak(tmp_path):
    """Under a table of the default residual policy ("all") an inner 3-layer LLM stage holds its
    residuals per in-flight microbatch, not its input: at a profiled bucket the prediction equals the
    saving programs compiled independently at 3 layers, with no tolerance: the residuals the forward
    hands over, and the state, one input (the microbatch a forward reads) and the larger of the two
    programs' transients on top (the forward's y and temporaries; the backward's dy, dx and
    temporaries), as `compile_check` assembles a saving stage."""
    settings = ProfileSettings(tps=(2,), llm_buckets=(64, 128), kinds=("llm_layers",), **FAST)
    table = profile_model(CFG, jax.devices(), settings, tmp_path / "ct.json", plot=False)
    provider = MeasuredCostProvider(table, arch_of_model(CFG, "tiny"), get_device("cpu"))
    predicted = provider.stage_memory(StageSpec("llm", 1, 3, tp=2), 128)
    stage = _compiled_memory(3, False, 128, settings)
    assert stage["residual_bytes"] > stage["input_bytes"] > 0
    assert predicted.activations_per_microbatch == pytest.approx(stage["residual_bytes"], rel=1e-9)
    state, kept = stage["param_bytes"] + stage["grad_bytes"], stage["residual_bytes"]
    forward = stage["memory_fwd"]["peak"] - stage["param_bytes"] - stage["input_bytes"] - kept
    backward = stage["memory_bwd"]["peak"] - state - kept
    want = state + stage["input_bytes"] + kept + max(forward, backward)
    assert predicted.total() - predicted.optimizer == pytest.approx(want, rel=1e-9)


def test_rerun_reuses_fresh_entries_and_redoes_stale_ones(tmp_path, monkeypatch):
    calls = []
    real = model_profiler.profile_entry

    def counting(*args, **kwargs):
        calls.append(args[1:5])
        return real(*args, **kwargs)

    monkeypatch.setattr(model_profiler, "profile_entry", counting)
    path = tmp_path / "ct.json"
    settings = ProfileSettings(tps=(1,), encoder_buckets=(1, 2), kinds=("encoder_head",), **FAST)
    first = profile_model(CFG, jax.devices(), settings, path, plot=False)
    assert len(calls) == 2 and len(first.entries) == 2
    again = profile_model(CFG, jax.devices(), settings, path, plot=False)
    assert len(calls) == 2 and again.entries == first.entries  # fresh: nothing recomputed
    bigger = dataclasses.replace(settings, encoder_buckets=(1, 2, 4))
    profile_model(CFG, jax.devices(), bigger, path, plot=True)
    assert calls[-1] == ("encoder_head", 1, 4, 0) and len(calls) == 3  # only the new bucket
    assert path.with_suffix(".png").is_file()
    changed = dataclasses.replace(CFG, text=CFG.text.replace(hidden_size=32, head_dim=8))
    stale = profile_model(changed, jax.devices(), settings, path, plot=False)
    assert len(calls) == 5 and len(stale.entries) == 2  # config hash changed: redone from scratch
    assert stale.config_hash != first.config_hash


def test_candidate_tps_divide_heads_and_fit_devices():
    assert model_profiler.candidate_tps(CFG, "llm_layers", (1, 2, 4, 8), 8) == [1, 2]  # 2 kv heads
    assert model_profiler.candidate_tps(CFG, "encoder_layers", (1, 2, 4, 8), 2) == [1, 2]
    assert np.all(np.array(model_profiler.candidate_tps(CFG, "encoder_head", (4, 3), 8)) == [4])


@pytest.mark.parametrize(
    "name",
    ["siglip-so400m+qwen2.5-7b", "internvit-300m+qwen2.5-7b", "internvit-6b+llama3-70b", "tiny"],
)
def test_named_archs_map_to_model_configs_and_back(name):
    from dflop_jax.costs import get_arch
    from models.internvl import InternVLConfig

    arch = get_arch(name)
    cfg = model_config_for_arch(arch)
    assert isinstance(cfg, InternVLConfig) == name.startswith("internvit")
    back = arch_of_model(cfg, name)
    strip = lambda a: dataclasses.replace(a, name="")
    assert strip(back.vision) == strip(arch.vision)
    assert dataclasses.replace(strip(back.llm), head_dim=back.llm.dh) == dataclasses.replace(
        strip(arch.llm), head_dim=arch.llm.dh
    )
    assert back.projector == arch.projector


def test_internvl_style_arch_is_profiled_through_its_own_stages(tmp_path):
    """A tiny InternVL-style arch (class token, pixel shuffle 0.5): every part compiles and runs."""
    from dflop_jax.costs import MLLMArch, get_arch
    from dflop_jax.costs.architectures import VisionArch, projector_for
    from models.internvl import InternVLConfig

    tiny = get_arch("tiny")
    vision = VisionArch("tiny-ivl", 2, 64, 4, 128, 14, 56, 4, pixel_shuffle=True,
                        class_token=True, layer_scale=True)  # fmt: skip
    arch = MLLMArch("tiny-ivl", vision, projector_for(vision, tiny.llm), tiny.llm)
    cfg = model_config_for_arch(arch, "float32")
    assert isinstance(cfg, InternVLConfig) and cfg.vision.seq_len == 17  # 16 patches + CLS
    settings = ProfileSettings(tps=(2,), encoder_buckets=(3,), llm_buckets=(64,), **FAST)
    table = profile_model(cfg, jax.devices(), settings, tmp_path / "ct.json", plot=False)
    # 6 parts (layer parts at 1 and 2 layers), and the colocated stage's program
    assert not table.skipped() and len(table.entries) == 9
    colocated = table.get("colocated_embedding", 2, 3, 0)
    assert colocated.length == 64  # its row: the smallest LLM bucket
    # it holds exactly the whole encoder (2 layers) and the LLM's embedding, as one program
    parts = [("encoder_embedding", 0), ("encoder_layers", 2), ("encoder_head", 0)]
    expect = sum(table.get(k, 2, 3, n).param_bytes for k, n in parts)
    expect += table.get("llm_embedding", 2, 64, 0).param_bytes
    assert colocated.param_bytes == expect
    head = table.get("encoder_head", 2, 3, 0)
    # pixel shuffle 0.5 + LayerNorm + MLP(4 Dv -> D -> D) over 3 tiles x 4 tokens, per tp shard
    mlp = 2 * 3 * 4 * (4 * 64 * 64 + 64 * 64) / 2
    assert mlp <= head.flops_fwd < 2 * mlp
    provider = MeasuredCostProvider(table, arch_of_model(cfg, "custom"), get_device("cpu"))
    fwd, bwd = provider.stage_time(StageSpec("encoder", 0, 2, tp=2, has_embedding=True), 3)
    assert provider.sources()["encoder_layers"] == {"measured": 1}
    # One program of two profiled parts: at most their sum, at least the larger part (only the
    # parts' shared fixed cost, up to the smaller part, is taken off the sum); 1e-9: float round-off.
    for got, col in ((fwd, "fwd_s"), (bwd, "bwd_s")):
        part_times = [getattr(table.get(k, 2, 3, n), col)
                      for k, n in (("encoder_layers", 2), ("encoder_embedding", 0))]  # fmt: skip
        assert max(part_times) * (1 - 1e-9) <= got <= sum(part_times) * (1 + 1e-9)


def test_mixed_family_arch_is_refused_with_its_fields():
    from dflop_jax.costs import MLLMArch, get_arch
    from dflop_jax.costs.architectures import VisionArch, projector_for

    tiny = get_arch("tiny")
    vision = VisionArch("odd", 2, 64, 4, 128, 14, 56, 16, class_token=True)
    arch = MLLMArch("odd", vision, projector_for(vision, tiny.llm), tiny.llm)
    with pytest.raises(ValueError, match="class_token=True, pixel_shuffle=False"):
        model_config_for_arch(arch)
