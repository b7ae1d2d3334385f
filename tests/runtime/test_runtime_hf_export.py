"""`python -m dflop_jax.export`: a run's orbax checkpoint (saved by a multi-stage, tensor-parallel layout)
-> an HF directory that transformers loads with the logits of our unsplit model (float32), for
LLaVA-OV, InternVL and a decoder-only run; the tokenizer travels along; bad runs fail in one line."""

from __future__ import annotations

import dataclasses
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_fixtures import HF_LOGITS_TOL, TINY_PATCH, TINY_TILE, assert_llava_ov_logits_equal

from dflop_jax.config.parsing import dump_yaml
from dflop_jax.data.config import DataConfig
from dflop_jax.export import main
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.model_section import ModelConfig
from dflop_jax.programs.param_paths import held_modules, key_name, model_paths
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.resolve import RunContext
from dflop_jax.runtime.checkpoint import Checkpointer
from dflop_jax.runtime.config import LayoutConfig, TrainConfig
from dflop_jax.runtime.hf_export import with_token_ids
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer
from models import layouts

SEED = 3
SMALL = dict(hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=8, vision_hidden_size=16, vision_intermediate_size=32, vision_num_layers=2,
             vision_num_heads=2, init_seed=SEED)  # fmt: skip
# Several stages, tensor parallel: each module's params are split over stages and devices.
MLLM_LAYOUT = LayoutConfig(encoder_layers=(1, 1), encoder_tp=(2,), llm_layers=(1, 3), llm_tp=(2, 1))
TEXT_LAYOUT = LayoutConfig(encoder_layers=(), llm_layers=(3, 1), llm_tp=(2,))


def _bump(path: tuple[str, ...], x):
    """A deterministic change of each param (keyed by its model-level path), standing in for training:
    norms and biases stop being 1 / 0, so a mix-up of any two tensors shows in the logits."""
    seed = zlib.crc32("/".join(path).encode())
    noise = np.random.default_rng(seed).standard_normal(x.shape).astype(np.float32)
    return x + 0.1 * jnp.asarray(noise)


# An omni model: the audio encoder on the first LLM stage (tp 2), or on a stage of its own.
OMNI_LAYOUTS = {
    "audio_on_llm": dataclasses.replace(MLLM_LAYOUT, audio=(64,)),
    "audio_stage": dataclasses.replace(MLLM_LAYOUT, audio=(64,), audio_layers=(2,)),
}


# A Qwen2-Audio model (no vision): the audio encoder on the first LLM stage (tp 2), or on stages of
# its own (2 stages at tp 2).
AUDIO_LAYOUTS = {
    "audio_on_llm": dataclasses.replace(TEXT_LAYOUT, audio=(64,)),
    "audio_stage": dataclasses.replace(TEXT_LAYOUT, audio=(64,), audio_layers=(1, 1),
                                       audio_tp=(2,)),
}  # fmt: skip


def _run_config(tmp_path, kind: str, layout: LayoutConfig | None = None) -> TrainConfig:
    family = "internvl" if kind == "internvl" else "llava_ov"
    return TrainConfig(
        model=ModelConfig(kind=kind, **SMALL),
        data=DataConfig(
            model_family=family, tile_size=TINY_TILE, patch_size=TINY_PATCH, audio_mels=16
        ),  # fmt: skip
        layout=layout or (TEXT_LAYOUT if kind == "decoder" else MLLM_LAYOUT),
        compute_dtype="float32",
        run_dir=str(tmp_path / "run"),
    )


def _write_run(tmp_path, kind: str, steps=(2,), cfg: TrainConfig | None = None):
    """A run directory: config.yaml + a checkpoint (params bumped per step, optimizer state too);
    `cfg` replaces the run config of `kind` (its params start from `cfg.model.source`)."""
    cfg = cfg or _run_config(tmp_path, kind)
    run = tmp_path / "run"
    run.mkdir()
    dump_yaml(cfg, run / "config.yaml")
    model_cfg = with_token_ids(RunContext.build(cfg, read_plan=False).model_cfg, cfg)
    layout = cfg.layout.layout()
    stages = build_stages(model_cfg, layout, stage_meshes(layout), cfg.model.source,
                          compute_dtype=jnp.float32)  # fmt: skip
    opts = [StageOptimizer(s, OptimizerConfig().build()) for s in stages]
    ckpt = Checkpointer(run / "checkpoints")
    for step in steps:
        for spec, s in zip(layout.stages, stages):
            held = held_modules(s.params)  # a stage holding whole encoders: each by its module
            s.params = jax.tree_util.tree_map_with_path(
                lambda p, x, spec=spec, step=step, held=held: _bump(
                    (*model_paths(p, spec, held)[0], str(step)), x
                ),
                s.params,
            )
        params = [s.params for s in stages]
        ckpt.save(step, list(layout.stages), params, [o.state for o in opts], meta={})
    ckpt.close()
    return cfg, model_cfg, run


def _saved_params(run, step) -> dict:
    """The checkpoint's params (model-level paths -> host arrays), read by the runtime's own reader."""
    from dflop_jax.runtime.checkpoint import SavedState

    saved = SavedState(run / "checkpoints", step)
    out = {p: saved.read(p) for p in saved.leaves if p[1] == "params"}
    saved.close()
    return out


def _decoder_export_holds_saved_params(out, run, step):
    """Asserts our HF importer reads the decoder export `out` back as the checkpoint's params of
    `step`, bit for bit (read leaf by leaf, `_saved_params`); returns the config it read."""
    from models.hf import load_pretrained

    again, again_cfg = load_pretrained(out)
    saved = _saved_params(run, step)
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(again))[0]
    assert len(flat) == len(saved)
    for path, x in flat:
        stored = ("llm", "params", *(key_name(k) for k in path[1:]))  # "stage" -> module "llm"
        np.testing.assert_array_equal(np.asarray(x), saved[stored], err_msg=str(stored))
    return again_cfg


def _reference(model_cfg, cls, steps=(2,)):
    """The unsplit model (same seed: equal to the stages' init) with the same bumps (a `Decoder`'s
    state lives under "stage", the checkpoint's under module "llm")."""
    model = cls(model_cfg, rngs=nnx.Rngs(SEED))
    graphdef, state = nnx.split(model)

    def path_of(p):
        names = [key_name(k) for k in p]
        return ("llm", *names[1:]) if names[0] == "stage" else tuple(names)

    for step in steps:
        state = jax.tree_util.tree_map_with_path(
            lambda p, x, step=step: _bump((*path_of(p), str(step)), x), state
        )
    return nnx.merge(graphdef, state)


def _export(run, out, *args):
    assert main([f"run={run}", f"out={out}", *args]) == 0


@pytest.mark.hf
def test_llava_ov_export_loads_in_transformers_with_our_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models.llava_onevision import LlavaOnevision

    _, model_cfg, run = _write_run(tmp_path, "llava_ov")
    out = tmp_path / "hf"
    _export(run, out, "shard_gb=0.00005")  # 50 kB shards: several files + index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert_llava_ov_logits_equal(out, _reference(model_cfg, LlavaOnevision), model_cfg)

    # The bundled tokenizer travels along and encodes as ours does.
    from dflop_jax.data import load_tokenizer

    text = "<|im_start|>user\nhi <image>"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(text)["input_ids"] == list(load_tokenizer("bundled").encode(text)[0])
    # The family's image processor with the run's data settings, as an HF directory brings them.
    _assert_processor_of_run(out, _run_config(tmp_path, "llava_ov"), "LlavaOnevisionImageProcessor")


@pytest.mark.hf
@pytest.mark.parametrize("layout", list(OMNI_LAYOUTS))
def test_omni_export_loads_in_both_hf_classes_with_our_logits(tmp_path, layout):
    """An omni run's checkpoint (the audio encoder on the first LLM stage, or on a stage of its
    own) exports `vision/` and `audio/`: transformers' LLaVA-OneVision and Qwen2-Audio load them
    with nothing missing or left over, each with the logits of our unsplit `Omni` on its modality,
    the decoder the same in both; the tokenizer and each processor's settings travel along."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import assert_qwen2_audio_logits_equal

    from models.llava_onevision import LlavaOnevision
    from models.omni import Omni

    cfg = _run_config(tmp_path, "omni", OMNI_LAYOUTS[layout])
    _, model_cfg, run = _write_run(tmp_path, "omni", cfg=cfg)
    out = tmp_path / "hf"
    _export(run, out)
    ours = _reference(model_cfg, Omni)
    graphdef, state = nnx.split(LlavaOnevision(model_cfg.llava, rngs=nnx.Rngs(0)))
    state["encoder"], state["llm"] = nnx.state(ours)["encoder"], nnx.state(ours)["llm"]
    assert_llava_ov_logits_equal(out / "vision", nnx.merge(graphdef, state), model_cfg.llava)
    assert_qwen2_audio_logits_equal(out / "audio", ours, model_cfg)
    _assert_whole_qwen2_audio(out / "audio")
    _assert_processor_of_run(out / "vision", cfg, "LlavaOnevisionImageProcessor")


@pytest.mark.hf
@pytest.mark.parametrize("layout", list(AUDIO_LAYOUTS))
def test_qwen2_audio_export_loads_in_transformers_with_our_logits(tmp_path, layout):
    """A Qwen2-Audio run's checkpoint (the audio encoder on the first LLM stage, or split over
    stages of its own at tp 2) exports one directory that transformers' Qwen2-Audio loads with
    nothing missing or left over and with the logits of our unsplit `Qwen2Audio`; the audio token
    is the run tokenizer's, and the feature extractor has the run's mel bins."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import assert_qwen2_audio_logits_equal

    from dflop_jax.data import load_tokenizer
    from models.qwen2_audio import Qwen2Audio

    cfg = _run_config(tmp_path, "qwen2_audio", AUDIO_LAYOUTS[layout])
    _, model_cfg, run = _write_run(tmp_path, "qwen2_audio", cfg=cfg)
    out = tmp_path / "hf"
    _export(run, out)
    # The unsplit model's encoder is the checkpoint's "audio" module: bumped under that name.
    model = Qwen2Audio(model_cfg, rngs=nnx.Rngs(SEED))
    graphdef, state = nnx.split(model)
    renamed = nnx.State({"audio": state["encoder"], "llm": state["llm"]})
    for step in (2,):
        renamed = jax.tree_util.tree_map_with_path(
            lambda p, x, step=step: _bump((*map(key_name, p), str(step)), x), renamed
        )
    state["encoder"], state["llm"] = renamed["audio"], renamed["llm"]
    assert_qwen2_audio_logits_equal(out, nnx.merge(graphdef, state), model_cfg)
    hf = _assert_whole_qwen2_audio(out)
    assert hf.config.audio_token_index == load_tokenizer("bundled").token_id("<|AUDIO|>")


def _assert_whole_qwen2_audio(out):
    """transformers' Qwen2-Audio loaded from `out` with nothing missing or left over, beside a
    Whisper feature extractor of the run's 16 mel bins at 16 kHz; returns the model."""
    import transformers

    hf, info = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    features = transformers.WhisperFeatureExtractor.from_pretrained(out)
    assert (features.feature_size, features.sampling_rate) == (16, 16000)
    return hf


def _assert_processor_of_run(out, cfg: TrainConfig, name: str):
    """`out`'s preprocessor_config.json loads in transformers as `name` and gives back the run's
    tile size, pixel mean/std and tiling limit (what `model.hf_dir=<export>` reads)."""
    import transformers

    from dflop_jax.data.hf_settings import hf_data_settings

    proc = transformers.AutoImageProcessor.from_pretrained(out)
    assert type(proc).__name__.startswith(name)
    d = cfg.data
    assert (proc.size["height"], proc.size["width"]) == (d.tile_px, d.tile_px)
    assert tuple(proc.image_mean) == d.mean and tuple(proc.image_std) == d.std
    got = hf_data_settings(str(out))
    assert (got["tile_size"], got["pixel_mean"], got["pixel_std"]) == (d.tile_px, d.mean, d.std)
    if d.model_family == "llava_ov":
        assert got["max_grid"] == d.anyres_grid
    else:
        assert got["max_tiles"] == d.dynamic_max_tiles == proc.max_patches


@pytest.mark.hf
def test_an_export_of_a_run_from_an_hf_checkpoint_is_complete(tmp_path):
    """A run started from an HF LLaVA-OV whose SigLIP tower has a post-layernorm and a pooling head
    (never built: LLaVA-OV reads the last layer's features) exports every tensor of that checkpoint,
    the ones it never trained bit for bit, and its image processor; transformers loads both with
    nothing missing or left over."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import save_tiny_llava_ov

    from models.hf import CheckpointReader

    hf = save_tiny_llava_ov(tmp_path / "ov", vision_use_head=True)
    transformers.LlavaOnevisionImageProcessor(
        size={"height": TINY_TILE, "width": TINY_TILE}, image_mean=[0.1, 0.2, 0.3], image_std=[0.4, 0.5, 0.6],
        image_grid_pinpoints=[[TINY_TILE * r, TINY_TILE * c] for r in (1, 2) for c in (1, 2)],
    ).save_pretrained(hf)  # fmt: skip
    (hf / "processor_config.json").write_text('{"processor_class": "LlavaOnevisionProcessor"}')
    cfg = dataclasses.replace(
        _run_config(tmp_path, "llava_ov"),
        model=ModelConfig(hf_dir=str(hf)),
        data=DataConfig(patch_size=TINY_PATCH),  # tile size, mean/std, max grid: hf's processor's
        layout=LayoutConfig(
            encoder_layers=(1, 1), encoder_tp=(2,), llm_layers=(1, 1), llm_tp=(2, 1)
        ),
    )
    _, _, run = _write_run(tmp_path, "llava_ov", cfg=cfg)
    out = tmp_path / "hf_out"
    _export(run, out)
    source, exported = CheckpointReader(hf), CheckpointReader(out)
    keys = source.keys()
    assert exported.keys() == keys
    never_built = ("vision_tower.post_layernorm.", "vision_tower.head.")
    untouched = [k for k in keys if k.startswith(never_built)]
    assert any(".head." in k for k in untouched) and any("post_layernorm" in k for k in untouched)
    for key in untouched:
        a, b = source.get(key), exported.get(key)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), key
    trained = "language_model.model.layers.0.mlp.up_proj.weight"
    assert not np.array_equal(source.get(trained), exported.get(trained))  # the run's, not copied
    model, info = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.vision_config.vision_use_head
    assert (out / "preprocessor_config.json").read_bytes() == (
        hf / "preprocessor_config.json"
    ).read_bytes()  # the run's data settings are hf's own: copied
    assert (out / "processor_config.json").is_file()
    _assert_processor_of_run(out, cfg, "LlavaOnevisionImageProcessor")


@pytest.mark.hf
def test_internvl_export_loads_in_transformers_with_our_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from models.internvl import InternVL

    _, model_cfg, run = _write_run(tmp_path, "internvl")
    _export(run, tmp_path / "hf")
    _assert_processor_of_run(tmp_path / "hf", _run_config(tmp_path, "internvl"), "GotOcr2")
    ref = transformers.InternVLForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ours = _reference(model_cfg, InternVL)
    img = model_cfg.image_token_id
    layout = layouts.internvl_image_layout(
        (60, 130), tile_size=TINY_TILE, max_tiles=6, tokens_per_tile=4
    )
    px = np.random.default_rng(0).standard_normal((layout.num_tiles, 3, TINY_TILE, TINY_TILE))
    px = px.astype(np.float32)
    tokens = np.array([[1, 2] + [img] * layout.num_tokens + [3, 4, 5]], np.int32)
    with torch.no_grad():
        want = ref(
            input_ids=torch.from_numpy(tokens).long(), pixel_values=torch.from_numpy(px)
        ).logits.numpy()
    fidx = np.concatenate([[layouts.TEXT] * 2, layout.offset(0), [layouts.TEXT] * 3])[None]
    s = tokens.shape[1]
    got = nnx.jit(lambda m, *a: m(*a))(
        ours,
        jnp.asarray(px.transpose(0, 2, 3, 1)),
        jnp.zeros(layout.num_tiles, bool),
        jnp.asarray(tokens),
        jnp.ones((1, s), jnp.int32),
        jnp.arange(s, dtype=jnp.int32)[None],
        jnp.asarray(fidx.astype(np.int32)),
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=HF_LOGITS_TOL)


@pytest.mark.hf
def test_decoder_export_of_the_chosen_step_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from models.decoder import Decoder

    _, model_cfg, run = _write_run(tmp_path, "decoder", steps=(2, 4))
    tokens = np.random.default_rng(1).integers(0, model_cfg.vocab_size, (2, 12)).astype(np.int32)
    for step, bumps in ((2, (2,)), (4, (2, 4))):
        out = tmp_path / f"hf{step}"
        _export(run, out, f"step={step}")
        ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(ref).__name__ == "LlamaForCausalLM"  # the demo's decoder has no q/k/v bias
        with torch.no_grad():
            want = ref(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
        ours = _reference(model_cfg, Decoder, bumps)
        np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=HF_LOGITS_TOL)
    # Our importer reads the export back bit for bit (a run can train on from it: model.hf_dir).
    assert _decoder_export_holds_saved_params(out, run, 4) == model_cfg
    assert (tmp_path / "hf4" / "model.safetensors").is_file()  # one file under the default size


def test_missing_checkpoint_or_another_model_is_one_line(tmp_path, capsys):
    cfg, _, run = _write_run(tmp_path, "decoder")
    out = str(tmp_path / "hf")
    assert main([f"run={tmp_path / 'nowhere'}", f"out={out}"]) == 2
    assert main([f"run={run}", "step=7", f"out={out}"]) == 2
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=48))
    dump_yaml(other, run / "config.yaml")
    assert main([f"run={run}", f"out={out}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3, errors
    assert "no config.yaml" in errors[0]
    assert "step 7" in errors[1] and "steps: [2]" in errors[1]
    assert "not a checkpoint of this run's model" in errors[2] and "shapes differ" in errors[2]


@pytest.mark.multiprocess
def test_a_two_process_checkpoint_reads_on_one_host(tmp_path):
    """The exporter's reader (`SavedState`) reads every leaf of a checkpoint that 2 processes wrote,
    each stage local to one process (orbax saved those through `_global_view`)."""
    import checkpoint_worker
    from multiprocess_launch import checkpoint_workers

    from dflop_jax.runtime.checkpoint import SavedState

    directory = tmp_path / "ckpt"
    checkpoint_workers("save", "two_on_p0", str(directory))
    saved = SavedState(directory)
    weights = [p for p in saved.leaves if p[-1] == "w"]
    assert len(weights) == 8  # 4 layers x (params, opt)
    for module, kind, _, layer, _ in weights:
        want = checkpoint_worker.value(int(layer), kind)
        np.testing.assert_array_equal(saved.read((module, kind, "layers", layer, "w")), want)
    saved.close()


def test_a_sharded_export_reads_each_file_in_one_restore_and_holds_every_saved_param(
    tmp_path, monkeypatch
):
    """Each safetensors file's tensors come from one orbax restore (per group directory; a decoder
    run saves one), not one per tensor: a restore parses the item's whole tree metadata, so reading
    leaf by leaf grows as tensors x leaves. The shards hold every saved param bit for bit."""
    import orbax.checkpoint as ocp

    _, _, run = _write_run(tmp_path, "decoder")
    restores = []
    real = ocp.Checkpointer.restore
    monkeypatch.setattr(ocp.Checkpointer, "restore",
                        lambda self, *a, **k: restores.append(1) or real(self, *a, **k))  # fmt: skip
    out = tmp_path / "hf"
    _export(run, out, "shard_gb=0.00002")  # 20 kB files: several tensors each, several files
    files = sorted(out.glob("model-*.safetensors"))
    assert 2 < len(files) < len(json.loads((out / "model.safetensors.index.json").read_text())[
        "weight_map"])  # fmt: skip
    assert len(restores) == len(files)
    monkeypatch.undo()
    _decoder_export_holds_saved_params(out, run, 2)


def test_a_relative_run_path_exports(tmp_path, monkeypatch):
    """`run=` relative to the working directory (as the CLI is used) reads the checkpoint's tree."""
    _, _, run = _write_run(tmp_path, "decoder")
    monkeypatch.chdir(run.parent)
    _export(run.name, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
