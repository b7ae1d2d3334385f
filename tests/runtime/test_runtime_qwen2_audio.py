"""A Qwen2-Audio model (`models.qwen2_audio`: audio encoder + decoder, no vision) trained by the
pipeline: a step == single-device jax.grad of the unsplit `Qwen2Audio` + the same optax update (loss
and every updated parameter, float32), with the audio encoder on the first LLM stage or on stages
of its own; its stages read from an HF Qwen2-Audio checkpoint hold that checkpoint's tensors; the
run config's checks; the demo config trains and exports end to end (slow).

The pipeline runs each LLM row's audio windows packed in the row's own audio row and places them by
row-local index; the reference encodes every window as a clip of its own and places by GLOBAL
index (`qwen2_audio_loss_sum`), so packing, placement and the stage split are checked together.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_fixtures import QWEN2_AUDIO, audio_microbatch, qwen2_audio_loss_sum, qwen2_audio_model
from pipeline_reference import assert_trees_close, guarded_step, reference_step

from dflop_jax.config import ConfigError, load_config
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.optimizer_config import OptimizerConfig

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=1.0)
ROWS = 2

# The audio encoder inside LLM stage 0 (tp 2, dp 2).
ON_LLM = Layout(
    (),
    (StageSpec("llm", 0, 2, tp=2, dp=2, has_embedding=True),
     StageSpec("llm", 2, 1, tp=1, dp=2, has_head=True)),
)  # fmt: skip
# The audio encoder on two stages of its own (dp 1: both rows' audio on one replica), feeding
# LLM stage 0 (tp 2).
APART = Layout(
    (),
    (StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
     StageSpec("llm", 2, 1, tp=1, dp=1, has_head=True)),
    audio_stages=(StageSpec("audio", 0, 1, tp=1, dp=1, has_embedding=True),
                  StageSpec("audio", 1, 1, tp=2, dp=1, has_head=True)),
)  # fmt: skip
LAYOUTS = {"on_llm": ON_LLM, "apart": APART}


@functools.cache
def _batch(all_audio: bool) -> tuple[list[dict], list[dict]]:
    """(packed microbatches, their reference inputs): one with audio, and one without unless
    `all_audio` (audio stages run audio in every microbatch: the scheduler gives each a bucket)."""
    rng = np.random.default_rng(5)
    pairs = [audio_microbatch(rng, ROWS, audio=True), audio_microbatch(rng, ROWS, audio=all_audio)]
    return [p for p, _ in pairs], [r for _, r in pairs]


@functools.cache
def _reference(all_audio: bool) -> tuple[float, dict]:
    model = qwen2_audio_model()
    mbs, refs = _batch(all_audio)
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    loss, new, _ = reference_step(model, refs, norm, OPT, qwen2_audio_loss_sum)
    whole = StageSpec("llm", 0, QWEN2_AUDIO.text.num_layers, has_embedding=True, has_head=True)
    parts = {"audio": new["encoder"], "llm": new["llm"]}  # the pipeline's name of the encoder
    return loss, jax.device_get(model_tree([whole], [parts], [{}]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen2_audio_step_matches_single_device(layout):
    apart = bool(LAYOUTS[layout].audio_stages)
    loss, got = guarded_step(QWEN2_AUDIO, LAYOUTS[layout], _batch(apart)[0], OPT)
    ref_loss, ref_tree = _reference(apart)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert set(got) == {"audio", "llm"}
    assert_trees_close(got, ref_tree)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_memory_check_compiles_the_qwen2_audio_stages_as_built(layout):
    """`train --dry-run`'s abstract stage programs of a Qwen2-Audio layout are the built
    pipeline's: each transfer (audio branch into LLM stage 0, LLM stage 0 into 1) moves the bytes
    the built stages' transfers move for a microbatch at the same buckets, and each compiled stage
    holds the built stage's parameters (the audio encoder's on LLM stage 0 without audio stages)."""
    from pipeline_fixtures import OMNI_AUDIO_BUCKET, OMNI_LENGTH

    from dflop_jax.contracts import BucketSet
    from dflop_jax.profiling.compile_check import check_layout
    from dflop_jax.profiling.programs import per_device_bytes
    from dflop_jax.profiling.stage_report import transfer_bytes_per_microbatch as dry_run_bytes
    from dflop_jax.runtime.driver import transfer_bytes_per_microbatch

    lay = LAYOUTS[layout]
    mb = {k: v if v is None or v.shape[0] != ROWS else v[: lay.llm_dp] for k, v in _batch(True)[0][0].items()}  # fmt: skip
    buckets = BucketSet((1,), (OMNI_LENGTH,), audio=(OMNI_AUDIO_BUCKET,))
    stages = build_stages(QWEN2_AUDIO, lay, stage_meshes(lay), 0, compute_dtype=jnp.float32)
    built = transfer_bytes_per_microbatch(stages, mb, lay.children)
    dry = dry_run_bytes(lay, buckets, QWEN2_AUDIO, jnp.float32)
    assert dry == [{"stage": b.stage, "forward_bytes": b.forward, "backward_bytes": b.backward}
                   for b in built]  # fmt: skip
    assert len(dry) == lay.num_stages - 1 and all(d["forward_bytes"] > 0 for d in dry)
    n = lay.num_stages
    checks = check_layout(lay, buckets, [1] * n, [1.0] * n, QWEN2_AUDIO, compute_dtype=jnp.float32)
    for check, stage in zip(checks, stages):
        assert check.params == per_device_bytes(stage.params)


# A tiny HF Qwen2-Audio checkpoint's layouts (2 decoder layers, 2 audio layers, 4 heads each).
HF_LAYOUTS = {
    "on_llm": Layout(
        (),
        (StageSpec("llm", 0, 1, tp=2, dp=2, has_embedding=True),
         StageSpec("llm", 1, 1, tp=1, dp=2, has_head=True)),
    ),
    "apart": Layout(
        (),
        (StageSpec("llm", 0, 1, tp=2, dp=1, has_embedding=True),
         StageSpec("llm", 1, 1, tp=1, dp=1, has_head=True)),
        audio_stages=(StageSpec("audio", 0, 1, tp=1, dp=1, has_embedding=True),
                      StageSpec("audio", 1, 1, tp=2, dp=1, has_head=True)),
    ),
}  # fmt: skip


@pytest.mark.hf
@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_qwen2_audio_stages_read_an_hf_checkpoint(tmp_path, layout):
    """Stages built from an HF Qwen2-Audio directory (`model.hf_dir`) hold exactly the tensors the
    unsplit model loaded by `models.hf.load_pretrained` holds: the audio encoder inside LLM stage 0
    or split over its own stages, each tensor where the pipeline keeps it."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import save_tiny_qwen2_audio

    from models.hf import load_config, load_pretrained

    path = save_tiny_qwen2_audio(tmp_path / "hf", audio_token=90)
    lay = HF_LAYOUTS[layout]
    cfg = load_config(path)
    stages = build_stages(cfg, lay, stage_meshes(lay), str(path), compute_dtype=jnp.float32)
    got = model_tree(list(lay.stages), [s.params for s in stages], [{} for _ in stages])
    model, _ = load_pretrained(path)
    state = nnx.state(model, nnx.Param)
    whole = StageSpec("llm", 0, cfg.text.num_layers, has_embedding=True, has_head=True)
    want = model_tree([whole], [{"audio": state["encoder"], "llm": state["llm"]}], [{}])
    assert set(got) == {"audio", "llm"}
    assert_trees_close(got, jax.device_get(want), rtol=0, atol=0)


DEMO = Path(__file__).parents[2] / "configs" / "qwen2_audio_demo.yaml"


def _demo_cfg(tmp_path, *extra) -> TrainConfig:
    over = [f"data.synth_dir={tmp_path / 'synth'}", f"run_dir={tmp_path / 'run'}",
            "compilation_cache=", "data.cache_dir="]  # fmt: skip
    return load_config(TrainConfig, DEMO, [*over, *extra])


def test_qwen2_audio_run_config_checks():
    """A Qwen2-Audio run: its model from the fields, an explicit layout with audio buckets and no
    vision encoder stage, any data family; refused in one line naming the key otherwise."""
    from models.qwen2_audio import Qwen2AudioConfig

    tmp = Path("/nonexistent")  # nothing is written at config load
    cfg = _demo_cfg(tmp)
    model = cfg.model_config()
    assert isinstance(model, Qwen2AudioConfig) and model.audio.num_mel_bins == cfg.data.audio_mels
    assert not hasattr(model, "vision") and cfg.model.has_audio and not cfg.model.has_vision
    assert "model.vision_hidden_size" in cfg.ignored_keys()
    assert "model.audio_hidden_size" not in cfg.ignored_keys()
    assert _demo_cfg(tmp, "plan=auto").plan == "auto"  # its audio and LLM parts are profiled
    refused = {
        "layout.audio=[]": "layout.audio",
        "layout.encoder_layers=[2]": "layout.encoder_layers",
        "layout.encoder_colocated=true": "layout.encoder_colocated",
        "model.arch=tiny": "model.kind",
    }
    for override, key in refused.items():
        extra = [override] + (["layout.encoder_tp=[1]"] if "layers" in override else [])
        with pytest.raises(ConfigError, match=key):
            _demo_cfg(tmp, *extra)


@pytest.mark.hf
def test_an_hf_directory_of_the_other_kind_is_refused(tmp_path):
    """model.hf_dir holding a Qwen2-Audio checkpoint needs model.kind=qwen2_audio, and
    kind=qwen2_audio needs a Qwen2-Audio checkpoint: one line naming model.kind."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import save_tiny_qwen2_audio

    from dflop_jax.programs.model_section import ModelConfig

    path = save_tiny_qwen2_audio(tmp_path / "hf")
    sizes = dict(tile_px=28, patch_size=14, compute_dtype="float32", audio_mels=16)
    assert ModelConfig(kind="qwen2_audio", hf_dir=str(path)).model_config(0, **sizes).audio
    with pytest.raises(ConfigError, match="model.kind.*set model.kind to qwen2_audio"):
        ModelConfig(kind="decoder", hf_dir=str(path)).model_config(0, **sizes)


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.seconds(70)
def test_the_demo_trains_and_its_export_loads_in_transformers(tmp_path):
    """`configs/qwen2_audio_demo.yaml` trains on 8 simulated devices with the audio encoder on its
    own stages (loss falls, nothing compiled after step 1), and its export loads in transformers'
    Qwen2-Audio with nothing missing or left over and the logits of our `Qwen2Audio` holding the
    checkpoint's params, read by the runtime's checkpoint reader."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import assert_qwen2_audio_logits_equal

    from dflop_jax.export import main as export
    from dflop_jax.programs.param_paths import key_name
    from dflop_jax.resolve import RunContext
    from dflop_jax.runtime.checkpoint import SavedState
    from dflop_jax.runtime.hf_export import with_token_ids
    from dflop_jax.train import run
    from models.qwen2_audio import Qwen2Audio

    cfg = _demo_cfg(tmp_path, "steps=4", "checkpoint.every=4", "compute_dtype=float32",
                    "layout.audio_layers=[1,1]", "layout.audio_dp=2", "layout.llm_dp=2",
                    "data.synth_samples=64")  # fmt: skip
    report = run(cfg)
    assert len(report.losses) == 4 and report.losses[-1] < report.losses[0]
    assert report.summary["programs_after_precompile"] == 0
    assert len(report.layout.audio_stages) == 2 and not report.layout.encoder_stages
    out = tmp_path / "hf"
    assert export([f"run={cfg.run_dir}", f"out={out}"]) == 0
    _, info = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]

    model_cfg = with_token_ids(RunContext.build(cfg, read_plan=False).model_cfg, cfg)
    ours = Qwen2Audio(model_cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(ours)
    saved = SavedState(Path(cfg.run_dir) / "checkpoints", 4)
    stored = {"encoder": "audio", "llm": "llm"}
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(saved.read((stored[key_name(p[0])], "params",
                                             *map(key_name, p[1:])))),
        state,
    )  # fmt: skip
    saved.close()
    assert_qwen2_audio_logits_equal(out, nnx.merge(graphdef, state), model_cfg)


@pytest.mark.hf
def test_a_run_starts_from_an_hf_qwen2_audio_checkpoint(tmp_path):
    """`model.kind=qwen2_audio model.hf_dir=...` trains the checkpoint (its shapes, its mel bins)
    with the audio encoder on its own stage, and the first step (from lr 0) leaves every stage
    holding exactly the checkpoint's tensors; data.audio_mels other than the checkpoint's is one
    config error."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import save_tiny_qwen2_audio

    from dflop_jax.train import run
    from models.hf import load_pretrained

    hf = save_tiny_qwen2_audio(tmp_path / "hf", audio_token=270, vocab_size=384)
    over = [f"model.hf_dir={hf}", "data.audio_mels=16", "layout.llm_layers=[1,1]",
            "layout.llm_tp=[2]", "layout.llm_dp=1", "layout.audio_layers=[2]", "layout.audio_tp=[2]",
            "layout.audio=[1024,4096]", "data.synth_samples=32", "global_batch=4", "steps=1",
            "checkpoint.every=0", "compute_dtype=float32", "measure_stage_times_every=0"]  # fmt: skip
    report = run(_demo_cfg(tmp_path, *over))
    assert len(report.losses) == 1 and np.isfinite(report.losses[0])
    assert [s.module for s in report.layout.stages] == ["audio", "llm", "llm"]
    got = model_tree(list(report.layout.stages), [s.params for s in report.stages],
                     [{} for _ in report.stages])  # fmt: skip
    model, _ = load_pretrained(hf)
    state = nnx.state(model, nnx.Param)
    whole = StageSpec("llm", 0, 2, has_embedding=True, has_head=True)
    want = model_tree([whole], [{"audio": state["encoder"], "llm": state["llm"]}], [{}])
    assert_trees_close(got, jax.device_get(want), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="data.audio_mels=80.*reads 16 log-mel bins"):
        run(_demo_cfg(tmp_path, *over, "data.audio_mels=80"))
