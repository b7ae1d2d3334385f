"""Frozen-aware execution (`optimizer.trainable`): a pipelined step of the tiny LLaVA-OV over 2
encoder + 2 LLM stages equals one single-device step of the unsplit model whose frozen parts go
through `stop_gradient` (loss and every updated parameter, float32), for a projector-only run and a
vision-frozen run; the frozen parameters come out bit-identical.

What runs is checked on what is compiled: the vision-only encoder stage (nothing trained, nothing
trained before it) has no backward program, dispatched none and its forward program outputs only the
activation; an LLM stage frozen behind the trainable projector has a backward whose outputs are
dL/dx only (no parameter-shaped output) and which runs fewer matmuls than the same stage's backward
when it trains. The colocated layout (encoder on LLM stage 0) trains under the same recipes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_fixtures import (
    MLLM_TEXT,
    SEPARATE_LAYOUT,
    SEPARATE_VISION,
    colocated_layout,
    colocated_microbatch,
    colocated_model,
    mllm_loss_sum,
    separate_batch,
    separate_model,
)
from pipeline_reference import (
    RECIPE_HYPERPARAMS,
    TRAINABLE_BY_RECIPE,
    assert_trees_close,
    no_host_round_trip,
    stop_gradient_reference,
)

from dflop_jax.config import load_config
from dflop_jax.programs.accumulator import accumulator_structs
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.param_paths import key_name, tied_groups
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.driver import Op, pipeline_order, run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates
from dflop_jax.train import run
from models.llava_onevision import LlavaOnevision, llava_onevision_config

# A pipelined step and its single-device reference compile about a minute of programs per recipe: the
# fast tier steps the projector-only recipe (the one with a dx-only stage), the slow tier both.
RECIPE_PARAMS = [
    pytest.param(TRAINABLE_BY_RECIPE["projector_only"], id="projector_only"),
    pytest.param(TRAINABLE_BY_RECIPE["vision_frozen"], id="vision_frozen", marks=pytest.mark.slow),
]


@dataclasses.dataclass
class _Run:
    """One pipelined recipe step and its single-device reference (host values)."""

    stages: list
    out: object  # the pipeline's StepOutput
    loss: float
    norm: float  # the global gradient norm `apply_updates` computed (tied copies counted once)
    got: dict  # the updated model tree
    before: dict  # the model tree before the step
    tied: list  # `tied_groups` of the stages
    ref_loss: float
    ref_norm: float
    ref: dict


def _step(model, layout, mbs, loss, trainable, residuals=None) -> _Run:
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    stages = build_stages(model.cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32,
                          trainable=trainable, residuals=residuals)  # fmt: skip
    opt = OptimizerConfig(**RECIPE_HYPERPARAMS, trainable=trainable)
    opts = [StageOptimizer(s, opt.build()) for s in stages]
    tied = tied_groups(list(layout.stages), [s.params for s in stages])
    before = _tree(layout, stages)
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, norm, "1f1b")
    stats = apply_updates(opts, out.grads, opt.clip_norm, tied=tied)
    ref_loss, ref_norm, ref = stop_gradient_reference(model, mbs, loss, trainable)
    got_loss = sum(float(x) for x in out.loss)
    got_norm = float(np.asarray(stats[-1])[1])
    return _Run(stages, out, got_loss, got_norm, _tree(layout, stages), before, tied, ref_loss,
                ref_norm, ref)  # fmt: skip


def _check_step(run: _Run, trainable) -> None:
    """Loss, gradient norm and every updated parameter equal the stop_gradient reference's; frozen
    parts bit-identical."""
    np.testing.assert_allclose(run.loss, run.ref_loss, rtol=1e-5)
    np.testing.assert_allclose(run.norm, run.ref_norm, rtol=1e-5)
    assert_trees_close(run.got, run.ref)
    _check_frozen_kept(run.before, run.got, trainable)


def _tree(layout, stages):
    return jax.device_get(
        model_tree(list(layout.stages), [s.params for s in stages], [{} for _ in stages])
    )


def _check_frozen_kept(before, after, trainable):
    """Frozen leaves bit-identical, every trained part changed."""
    flat_before = dict(jax.tree_util.tree_flatten_with_path(before)[0])
    changed = set()
    for path, value in jax.tree_util.tree_flatten_with_path(after)[0]:
        names = [key_name(k) for k in path]  # (module, "params", part or layers...)
        part = names[2] if names[0] == "encoder" else "llm"
        if part not in trainable:
            np.testing.assert_array_equal(value, flat_before[path], err_msg=str(path))
        elif not np.array_equal(value, flat_before[path]):
            changed.add(part)
    assert changed == set(trainable)


def _one_signature(mbs: list[dict]) -> list[dict]:
    """The microbatches of `mbs` at its first microbatch's shapes: one compile per program (the
    recipes' checks do not depend on the bucket; the placements of other shapes are
    test_runtime_mllm_pipeline's and test_runtime_colocated's)."""
    shapes = lambda mb: {k: np.shape(v) for k, v in mb.items() if v is not None}  # noqa: E731
    return [mb for mb in mbs if shapes(mb) == shapes(mbs[0])]


@functools.cache
def _separate_step(trainable) -> _Run:
    """The recipe's step on the separate layout, shared by the tests that inspect it."""
    mbs = _one_signature(separate_batch())
    return _step(separate_model(), SEPARATE_LAYOUT, mbs, mllm_loss_sum, trainable)


@pytest.fixture(scope="module", params=RECIPE_PARAMS)
def separate(request):
    """Only the step's own test takes both recipes: the slow recipe's run is built by one test
    (under xdist a module fixture is built again on each worker that runs a test taking it)."""
    return request.param, _separate_step(request.param)


@pytest.fixture(scope="module")
def projector_only():
    trainable = TRAINABLE_BY_RECIPE["projector_only"]
    return trainable, _separate_step(trainable)


def test_recipe_step_matches_single_device_with_stop_gradient(separate):
    trainable, run = separate
    stages, out = run.stages, run.out
    _check_step(run, trainable)
    _check_vision_only_stage(stages)
    # No accumulator for a frozen leaf: the step's gradients are the trained leaves only.
    for stage, grads in zip(stages, out.grads):
        trained = [k for k in jax.tree.leaves(stage.trained) if k]
        held = jax.tree.leaves(stage.accumulator.unpack(grads)) if grads else []
        assert len(held) == len(trained)
    assert jax.tree.leaves(out.grads[0]) == []  # the vision-only stage
    if trainable == ("projector",):
        assert all(jax.tree.leaves(g) == [] for g in out.grads[2:])  # the frozen LLM


def _entry_outputs(compiled_text: str) -> list[tuple[int, ...]]:
    """Shapes of the entry computation's outputs in an XLA HLO module's text."""
    entry = next(line for line in compiled_text.splitlines() if line.startswith("ENTRY"))
    result = entry.split("->", 1)[1]
    return [
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", result)
    ]


def _shard(a) -> tuple[int, ...]:
    """Per-device shape of `a` (what the compiled, partitioned program sees)."""
    return tuple(a.sharding.shard_shape(a.shape))


def _abstract_args(stage, signature):
    """(x, side) ShapeDtypeStructs of a recorded (program, x shape, side shapes) signature."""
    _, xshape, sides = signature
    x = None
    if xshape is not None:
        x = jax.ShapeDtypeStruct(xshape[0], xshape[1], sharding=stage.x_sharding)
    side = {k: jax.ShapeDtypeStruct(s, d, sharding=stage.side_sharding) for k, s, d in sides}
    return x, side


def _texts(stage, fn, *args) -> tuple[str, str]:
    """(lowered StableHLO, compiled HLO) text of `fn` on `args`."""
    with jax.set_mesh(stage.mesh):
        lowered = fn.lower(*args)
        return lowered.as_text(), lowered.compile().as_text()


def _check_vision_only_stage(stages):
    """The vision-only encoder stage 0 has, dispatched and compiled a forward only, outputting only
    the activation; nothing goes back to it."""
    enc0 = stages[0]
    assert not enc0.trains and not enc0.has_backward and enc0.jits.backward is None
    assert {sig[0] for sig in enc0.signatures} == {"fwd"}  # dispatched: forwards only
    assert enc0.compiles == 1  # one forward (one input signature), no backward
    for sig in enc0.signatures:  # what ran: outputs only the activation, no residuals
        x, side = _abstract_args(enc0, sig)
        y = enc0.output_struct(x, side)
        _, text = _texts(enc0, enc0.jits.forward, enc0.params, x, side)
        assert _entry_outputs(text) == [_shard(y)]
    # The next stage trains (the projector) but needs no input gradient: nothing goes back to enc0.
    assert stages[1].trains and not stages[1].input_grad and stages[2].input_grad


def _dots(lowered: str) -> int:
    return lowered.count("stablehlo.dot_general")


def test_recipe_step_from_saved_residuals_matches_single_device():
    """The projector-only recipe with every stage keeping all residuals: the frozen LLM stage's
    dx-only backward and the trained projector's run from them (no recompute backward) and the
    step equals the stop_gradient reference."""
    trainable = TRAINABLE_BY_RECIPE["projector_only"]
    layout = SEPARATE_LAYOUT
    run = _step(separate_model(), layout, separate_batch(), mllm_loss_sum, trainable,
                residuals=["all"] * layout.num_stages)  # fmt: skip
    _check_step(run, trainable)
    kinds = [{sig[0] for sig in s.signatures} for s in run.stages[:-1]]
    assert [k for k in kinds if "bwd" in k] == []
    assert {"fwd_res", "bwd_res"} <= kinds[-1]  # the frozen LLM stage before the last


def test_frozen_stage_behind_trainable_passes_dx_only(projector_only):
    """Only the projector-only recipe has an LLM stage frozen behind a trainable one."""
    stages = projector_only[1].stages
    llm0 = stages[2]
    assert not llm0.trains and llm0.input_grad
    params = jax.tree.leaves(llm0.params)
    shapes = {_shard(a) for a in params} | {(1, *_shard(a)) for a in params}  # dp 1
    sig = next(s for s in llm0.signatures if s[0] == "bwd")
    x, side = _abstract_args(llm0, sig)
    gy = llm0.output_struct(x, side)
    args = (llm0.params, x, side, gy, accumulator_structs(llm0.params, llm0.trained))
    frozen_hlo, frozen = _texts(llm0, llm0.jits.backward, *args)
    assert _entry_outputs(frozen) == [_shard(x)]  # dL/dx and nothing parameter-shaped
    assert not shapes & set(_entry_outputs(frozen))
    # The same stage trained: its backward outputs the gradient sums and runs more matmuls.
    trained = build_stages(separate_model().cfg, SEPARATE_LAYOUT, stage_meshes(SEPARATE_LAYOUT), 0,
                           compute_dtype=jnp.float32)[2]  # fmt: skip
    full_args = (trained.params, x, side, gy, accumulator_structs(trained.params))
    full_hlo, full = _texts(trained, trained.jits.backward, *full_args)
    assert len(_entry_outputs(full)) == 1 + len(trained.accumulator.structs)  # its buffers
    assert _dots(frozen_hlo) < _dots(full_hlo)


@pytest.mark.parametrize("trainable", RECIPE_PARAMS)
def test_colocated_recipe_step_matches_single_device(trainable):
    model = colocated_model("llava_ov")
    layout = colocated_layout(1, 2)
    rng = np.random.default_rng(1)  # two anyres microbatches (exact taps, a pooled video frame)
    mbs = [colocated_microbatch(rng, 1, 40, model.cfg.tokens_per_tile, taps=True, video=True)
           for _ in range(2)]  # fmt: skip
    run = _step(model, layout, mbs, mllm_loss_sum, trainable)
    assert run.stages[0].has_backward  # the colocated stage trains the projector
    _check_step(run, trainable)


def _tied_model():
    """The separate-layout test model with its embedding also the head (Qwen2.5-0.5B style): stages 2
    and 3 (the 2 LLM stages) each hold a copy."""
    text = dataclasses.replace(MLLM_TEXT, tie_embeddings=True)
    with jax.default_device(jax.devices()[0]):
        return LlavaOnevision(llava_onevision_config(SEPARATE_VISION, text), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("trainable", [("projector",), ("projector", "llm")],
                         ids=["llm_frozen", "llm_trained"])  # fmt: skip
def test_tied_embedding_counts_once_in_the_norm_under_a_recipe(trainable):
    """`apply_updates`' tied-copy correction under a recipe: with the LLM frozen the tied embedding has
    no gradient (no correction, no transfer); trained behind the frozen vision tower its two copies get
    the summed gradient, counted once in the global norm (the unsplit model's jax.grad norm), and take
    the same update."""
    run = _step(_tied_model(), SEPARATE_LAYOUT, separate_batch(), mllm_loss_sum, trainable)
    assert [[i for i, _ in group] for group in run.tied] == [[2, 3]]
    _check_step(run, trainable)
    for group in run.tied:
        copies = [_leaf(run.stages[i].params, path) for i, path in group]
        np.testing.assert_array_equal(*jax.device_get(copies))


def _leaf(tree, names):
    return next(leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
                if tuple(key_name(k) for k in path) == names)  # fmt: skip


def test_pipeline_order_leaves_forward_only_stages_out_of_the_backward_wave():
    stages, mbs = 4, 6
    seq = pipeline_order(stages, mbs, "1f1b", forward_only=2)
    assert sorted(seq, key=lambda o: (o.stage, o.kind, o.mb)) == sorted(
        [Op(s, m, "F") for s in range(stages) for m in range(mbs)]
        + [Op(s, m, "B") for s in (2,) for m in range(mbs)],
        key=lambda o: (o.stage, o.kind, o.mb),
    )
    at = {op: i for i, op in enumerate(seq)}
    for op in seq:
        if op.kind == "F" and op.stage > 0:
            assert at[Op(op.stage - 1, op.mb, "F")] < at[op]
        if op.kind == "B":
            assert at[Op(op.stage + 1, op.mb, "F")] < at[op]
    # A forward-only stage runs at most (stages - s) microbatches ahead of the next stage.
    for s in (0, 1):
        for m in range(stages - s, mbs):
            assert at[Op(s + 1, m - (stages - s), "F")] < at[Op(s, m, "F")]
    with pytest.raises(ValueError, match="forward_only"):
        pipeline_order(stages, mbs, "1f1b", forward_only=stages)


STAGE1 = ["plan=explicit", "layout.encoder_layers=[1, 1]", "layout.encoder_tp=[1]",
          "layout.encoder_dp=2", "layout.llm_layers=[2, 2]", "layout.llm_tp=[1]", "layout.llm_dp=2",
          "layout.tiles=[16]", "layout.lengths=[1024]", "layout.microbatches=[2, 3]",
          "global_batch=8", "data.synth_samples=32", "checkpoint.every=2", "compute_dtype=float32",
          "device.peak_flops=1000000000.0", "optimizer.warmup_steps=0", "log_every=1"]  # fmt: skip


def _stage1(tmp_path, name, steps):
    """configs/llava_ov_stage1.yaml (projector only) on an explicit 2 encoder + 2 LLM stage layout."""
    cfg = Path(__file__).parents[2] / "configs" / "llava_ov_stage1.yaml"
    over = [f"data.synth_dir={tmp_path / 'synth'}", f"run_dir={tmp_path / name}",
            "compilation_cache=", f"steps={steps}", "checkpoint.every=1"]  # fmt: skip
    return load_config(TrainConfig, cfg, [*STAGE1, *over])


@pytest.mark.slow  # over a minute in the fast tier (CI's second tier runs it)
def test_stage1_recipe_trains_the_projector_only_and_resumes_exactly(tmp_path):
    """The trainer under the LLaVA-OV stage-1 recipe: the vision-only encoder stage runs forward only,
    2 steps straight == 1, stop, resume to 2 (losses, every param: the resumed step starts from the
    checkpoint's AdamW moments), the frozen parts bit-identical to step 1's, the projector not."""
    straight = run(_stage1(tmp_path, "a", 2))
    half = run(_stage1(tmp_path, "b", 1))
    resumed = run(_stage1(tmp_path, "b", 2))
    assert resumed.first_step == 1 and half.losses + resumed.losses == straight.losses
    assert {sig[0] for sig in straight.stages[0].signatures} == {"fwd"}
    for a, b in zip(straight.stages, resumed.stages):
        jax.tree.map(np.testing.assert_array_equal, *jax.device_get((a.params, b.params)))
    layout = straight.layout
    at2 = _tree(layout, straight.stages)
    at1 = _tree(layout, half.stages)
    _check_frozen_kept(at1, at2, ("projector",))


# The demo trained under LLaVA-OV stage 1 (`optimizer.trainable=[projector]`), checkpointed and
# exported at two steps. Kept small: the demo's model on an explicit 2 encoder + 2 LLM stage layout at
# one bucket pair, 32 samples, 4 steps.
EARLY, LATE = 2, 4  # the exported steps
DEMO_STAGE1 = [*STAGE1, "optimizer.trainable=[projector]", f"checkpoint.every={EARLY}",
               f"steps={LATE}"]  # fmt: skip


@pytest.fixture(scope="module")
def demo_stage1_exports(tmp_path_factory):
    """{step: {HF tensor name: host array}} of the demo's stage-1 run exported at steps EARLY and
    LATE, and the LATE export's directory."""
    from safetensors.numpy import load_file

    from dflop_jax.export import main as export

    tmp = tmp_path_factory.mktemp("demo_stage1")
    cfg = Path(__file__).parents[2] / "configs" / "demo.yaml"
    over = [f"data.synth_dir={tmp / 'synth'}", f"run_dir={tmp / 'run'}",
            "compilation_cache="]  # fmt: skip
    run(load_config(TrainConfig, cfg, [*DEMO_STAGE1, *over]))
    tensors = {}
    for step in (EARLY, LATE):
        assert export([f"run={tmp / 'run'}", f"step={step}", f"out={tmp / f'hf{step}'}"]) == 0
        tensors[step] = {}
        for file in sorted((tmp / f"hf{step}").glob("*.safetensors")):
            tensors[step].update(load_file(file))
    return tensors, tmp / f"hf{LATE}"


def _hf_part(name: str) -> str:
    """The recipe part of an HF LLaVA-OV tensor name (independent of the runtime's labels)."""
    if "vision_tower." in name:
        return "vision"
    if "multi_modal_projector." in name:
        return "projector"
    return "llm"  # the image newline too (models/stage_modules.py `param_part`, as in LLaVA-NeXT)


def test_demo_stage1_exports_differ_in_the_projector_only(demo_stage1_exports):
    """Vision tower and LLM bit-identical between the two exports, every projector tensor changed."""
    tensors, _ = demo_stage1_exports
    early, late = tensors[EARLY], tensors[LATE]
    assert early.keys() == late.keys()
    parts = {}
    for name in early:
        parts.setdefault(_hf_part(name), []).append(name)
    assert set(parts) == {"vision", "projector", "llm"}
    for name in parts["vision"] + parts["llm"]:
        np.testing.assert_array_equal(early[name], late[name], err_msg=name)
    changed = [n for n in parts["projector"] if not np.array_equal(early[n], late[n])]
    assert changed == parts["projector"]


def _unprefixed(name: str) -> str:
    """An HF tensor name without its `model.` / `language_model.` wrappers (transformers 5 renames
    `language_model.model.*` to `model.language_model.*` on load)."""
    return re.sub(r"\b(model|language_model)\.", "", name)


@pytest.mark.hf
def test_demo_stage1_export_loads_in_transformers(demo_stage1_exports):
    """transformers loads the later export with every tensor as exported; the only weights it does not
    find are the vision tower's post-layernorm (LLaVA-OV reads the last layer's features before it)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    tensors, out = demo_stage1_exports
    model, info = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert {k.rsplit(".", 2)[-2] for k in info["missing_keys"]} <= {"post_layernorm"}
    got = {_unprefixed(k): v.detach().numpy() for k, v in model.state_dict().items()}
    for name, value in tensors[LATE].items():
        np.testing.assert_array_equal(got[_unprefixed(name)], value, err_msg=name)
