"""The memory model by attention implementation (costs/memory.py, `attention_transient_bytes`): Pallas's
backward f32 dk / dv partials per query head and delta, (8 Dh + 4) H / tp per token, in a stage that
runs a backward only; cuDNN's packed path its f32 statistics per segment slot (M - 1 more per head and
token than a flash kernel) plus the Pallas fallback's partials; XLA adds nothing; the provider carries
the implementation into its memory and name."""

import dataclasses

import pytest

from dflop_jax.contracts.layout import StageSpec
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
from dflop_jax.costs.memory import stage_memory

ARCH = get_arch("siglip-so400m+qwen2.5-7b")
LLM = StageSpec("llm", 1, 4, tp=4, dp=2)
ENC = StageSpec("encoder", 0, 4, tp=2, dp=1)


def _temp(spec, bucket, impl, **kw):
    return stage_memory(ARCH, spec, bucket, remat="full", attention_impl=impl, **kw).temp


def _cudnn_extra(spec, tokens):
    """What the cudnn LLM stage holds beyond xla under remat "full": one layer's statistics beyond
    a flash kernel's, [M - 1, H / tp, S] f32 with M = models.cudnn_packed.segment_bound(S), and the
    Pallas fallback's backward partials."""
    from models.cudnn_packed import segment_bound

    stats = (segment_bound(tokens) - 1) * 4 * ARCH.llm.num_heads / spec.tp * tokens
    return stats + _temp(spec, tokens, "pallas") - _temp(spec, tokens, "xla")


@pytest.mark.parametrize("tokens", [4096, 8192, 32768])
def test_cudnn_holds_segment_statistics_and_the_pallas_fallback(tokens):
    extra = _temp(LLM, tokens, "cudnn") - _temp(LLM, tokens, "xla")
    assert extra == pytest.approx(_cudnn_extra(LLM, tokens))
    wide = dataclasses.replace(LLM, tp=1)
    assert _temp(wide, tokens, "cudnn") - _temp(wide, tokens, "xla") == pytest.approx(
        _cudnn_extra(wide, tokens)
    )


def test_cost_model_restates_the_segment_bound_of_the_packed_path():
    """costs/ imports no JAX, so it restates `models.cudnn_packed.segment_bound`: they agree."""
    from dflop_jax.costs.memory import cudnn_segment_bound
    from models.cudnn_packed import segment_bound

    for length in (1, 255, 256, 511, 512, 4096, 8192, 13440, 16383, 16384, 32768, 1 << 20):
        assert cudnn_segment_bound(length) == segment_bound(length), length


def test_pallas_backward_holds_per_head_partials():
    m, tokens = ARCH.llm, 8192
    extra = _temp(LLM, tokens, "pallas") - _temp(LLM, tokens, "xla")
    assert extra == pytest.approx(m.num_heads / LLM.tp * tokens * (8 * m.dh + 4))
    # the ViT's tiles too (unmasked: cuDNN adds nothing there)
    v, tiles = ARCH.vision, 16
    enc = _temp(ENC, tiles, "pallas") - _temp(ENC, tiles, "xla")
    assert enc == pytest.approx(tiles * v.num_heads / ENC.tp * v.seq_len * (8 * v.dh + 4))
    assert _temp(ENC, tiles, "cudnn") == _temp(ENC, tiles, "xla")


def test_forward_only_stage_holds_no_backward_partials():
    """Projector-only recipe: the first encoder stage (nothing trained in or before it) runs its
    forward alone, so Pallas adds nothing there."""
    first = StageSpec("encoder", 0, 4, tp=2, dp=1, has_embedding=True)
    recipe = ("projector",)
    a, b = (_temp(first, 16, i, trainable=recipe) for i in ("pallas", "xla"))
    assert a == b
    assert _temp(first, 16, "pallas") > _temp(first, 16, "xla")  # trained: it differentiates


def test_provider_knows_the_implementation():
    h100 = get_device("h100")
    xla = AnalyticCostProvider(ARCH, h100, remat=True)
    cudnn = AnalyticCostProvider(ARCH, h100, remat=True, attention_impl="cudnn")
    assert cudnn.name == xla.name + "+cudnn"
    assert cudnn.stage_memory(LLM, 4096).temp - xla.stage_memory(LLM, 4096).temp == pytest.approx(
        _cudnn_extra(LLM, 4096)
    )
    assert cudnn.with_trainable(("projector",)).attention_impl == "cudnn"
    with pytest.raises(ValueError, match="attention_impl='flash': use one of"):
        AnalyticCostProvider(ARCH, h100, attention_impl="flash")


def test_training_plan_prices_the_models_implementation(tmp_path):
    """`resolve.resolve_plan` costs the implementation the model config runs; the model profiler's
    table is keyed by it too (its hash covers the whole model config)."""
    import jax

    from dflop_jax.config import load_config
    from dflop_jax.contracts.profile_settings import ProfileSettings
    from dflop_jax.profiling.model_profiler import table_hash
    from dflop_jax.resolve import RunContext, resolve_plan
    from dflop_jax.runtime.config import TrainConfig
    from models.stage_modules import with_attention

    cfg = load_config(TrainConfig, "configs/demo.yaml", ["plan=explicit", f"run_dir={tmp_path}"])
    ctx = RunContext.build(cfg)
    model_cfg = ctx.model_cfg
    assert resolve_plan(ctx).provider.attention_impl == "xla"
    cudnn = with_attention(model_cfg, "cudnn")
    assert resolve_plan(RunContext.of(cfg, cudnn)).provider.attention_impl == "cudnn"
    devices, settings = jax.devices(), ProfileSettings()
    assert table_hash(model_cfg, settings, devices) != table_hash(cudnn, settings, devices)
