"""Every stage program (forward, backward, last) of the demo's layout and of the 7B plan's stages,
built from abstract arrays by the runtime's builders, lowers for CUDA on this CPU host
(`compile_check.lower_stage_programs`): with XLA attention, with the Pallas kernels (lowered to
Triton, not interpreted) and, where jax's CUDA plugin with cuDNN is installed, with cuDNN.

The 7B plan (`configs/llava_ov_7b_h100x64.yaml` -> `enc tp1 dp8 | llm tp4 dp14`, docs/benchmarks.md)
is lowered per stage at its tp and per-shard buckets, its LLM stage at dp 2 (8 devices here; the
per-device program does not depend on dp but through the collectives' group size), 2 layers per
stage in the default suite and all layers in the slow test."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from dflop_jax.config import load_config
from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import get_arch
from dflop_jax.profiling.compile_check import lower_stage_programs
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.model_section import model_config_for_arch
from dflop_jax.resolve import RunContext, resolve_plan
from dflop_jax.runtime.config import TrainConfig
from models.stage_modules import with_attention, with_remat

TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel lowers to for CUDA


def _demo(tmp_path):
    """The demo's model and its explicit layout (2 encoder + 2 LLM stages) and buckets."""
    cfg = load_config(TrainConfig, "configs/demo.yaml", ["plan=explicit", f"run_dir={tmp_path}"])
    ctx = RunContext.build(cfg)
    plan = resolve_plan(ctx)
    return ctx.model_cfg, plan.layout, plan.buckets, stage_meshes(plan.layout, jax.devices())


def _mesh(spec):
    devices = np.array(jax.devices()[: spec.dp * spec.tp]).reshape(spec.dp, spec.tp)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _seven_b(layers):
    """Qwen2.5-7B + SigLIP-400M (`layers` per module, None = all) under the plan's remat, the 7B
    plan's stages (LLM dp 2) and per-shard buckets: 29 tiles, 13,440 tokens."""
    arch = get_arch("siglip-so400m+qwen2.5-7b")
    if layers:
        arch = dataclasses.replace(
            arch,
            vision=dataclasses.replace(arch.vision, num_layers=layers),
            llm=dataclasses.replace(arch.llm, num_layers=layers),
        )
    model_cfg = with_remat(model_config_for_arch(arch), {"vision": "full", "llm": "full"})
    layout = Layout(
        (StageSpec("encoder", 0, arch.vision.num_layers, 1, 8, True, True),),
        (StageSpec("llm", 0, arch.llm.num_layers, 4, 2, True, True),),
    )
    return model_cfg, layout, BucketSet((29,), (13440,)), [_mesh(s) for s in layout.stages]


def _lower_all(model_cfg, layout, buckets, meshes, impl):
    cfg = with_attention(model_cfg, impl)
    try:
        lowered = lower_stage_programs(layout, buckets, cfg, meshes, "cuda")
    except RuntimeError as e:  # jax 0.11's Pallas lowering asks the GPU for its target
        if impl == "pallas" and "No supported GPU devices found" in str(e):
            pytest.skip(f"jax {jax.__version__} lowers Pallas' Triton kernels only beside a GPU")
        raise
    assert len(lowered) == layout.num_stages
    texts = []
    for stage, programs in zip(layout.stages, lowered):
        assert set(programs) == {"forward", "last" if stage.has_head and stage.module == "llm"
                                 else "backward"}  # fmt: skip
        texts.append({name: low.as_text() for name, low in programs.items()})
    return texts


def _check_impl(texts, impl):
    for programs in texts:
        for name, text in programs.items():
            # Pallas: a Triton kernel per attention call (forward; in the backward also dq and
            # dk/dv); XLA: none.
            assert (TRITON in text) == (impl == "pallas"), name


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_demo_stage_programs_lower_for_cuda(tmp_path, impl):
    texts = _lower_all(*_demo(tmp_path), impl)
    _check_impl(texts, impl)
    if impl == "pallas":  # forward, then dq and dk/dv in the backward (and the remat'd forward)
        backward = texts[-2]["backward"]
        assert backward.count(TRITON) >= 3 * texts[-2]["forward"].count(TRITON)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_7b_stage_programs_lower_for_cuda(impl):
    texts = _lower_all(*_seven_b(2), impl)
    _check_impl(texts, impl)
    if impl == "pallas":  # the LLM stage at tp 4: the kernels run per head shard (a shard_map
        # over "model" inside the per-replica one), not on heads GSPMD would gather
        assert texts[1]["last"].count("manual_computation") > 1


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_7b_stage_programs_lower_for_cuda_all_layers(impl):
    _check_impl(_lower_all(*_seven_b(None), impl), impl)


def _cudnn_available() -> bool:
    """jax traces its cuDNN attention only where its CUDA plugin (with cuDNN) is installed."""
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    try:
        jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn")).trace(
            q
        ).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:
        if "cuDNN is not detected" in str(e):
            return False
        raise
    return True


def test_cudnn_stage_programs_lower_for_cuda(tmp_path):
    if not _cudnn_available():
        pytest.skip("jax's CUDA plugin (cuDNN) is not installed")
    texts = _lower_all(*_demo(tmp_path), "cudnn")
    assert any("cudnn" in text for programs in texts for text in programs.values())
