"""Stage-local params (`programs.stage_builder.build_stages`): each stage made on its own mesh equals the
same cut of the whole model, bit for bit, for a seeded random init (keyed by global layer index) and for
an HF checkpoint read stage by stage, slice by slice; a non-local stage stays abstract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models_fixtures import tiny_decoder_config

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.sharding import create_sharded, rules_for
from dflop_jax.programs.stage_builder import build_stages, init_stage
from models.decoder import Decoder, extract_stage
from models.llava_onevision import LlavaOnevision, llava_onevision_config
from models.mllm import extract_stages
from models.siglip import SiglipConfig

DECODER_LAYOUT = Layout(
    (),
    (
        StageSpec("llm", 0, 2, tp=2, dp=2, has_embedding=True),
        StageSpec("llm", 2, 3, tp=2, dp=2, has_head=True),
    ),
)
MLLM_LAYOUT = Layout(
    (
        StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True),
        StageSpec("encoder", 2, 3, tp=1, dp=2, has_head=True),
    ),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 3, tp=2, dp=1, has_head=True),
    ),
)
SEED = 3


def _flat(state) -> dict:
    """{path string: host array} of a stage's params (`nnx.State` of arrays or Variables)."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _whole(factory):
    """The whole model initialized by one jitted program on one device (eager op-by-op init may
    round the scaled normals differently in the last bit; compiled inits agree exactly)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    return create_sharded(factory, SEED, mesh, rules_for("decoder"))


def _decoder_cuts(model, layout):
    return [
        extract_stage(model, first_layer=s.first_layer, num_layers=s.num_layers,
                      has_embedding=s.has_embedding, has_head=s.has_head)
        for s in layout.stages
    ]  # fmt: skip


def _mllm_cuts(model, layout):
    encoders, llms = extract_stages(
        model,
        [s.num_layers for s in layout.encoder_stages],
        [s.num_layers for s in layout.llm_stages],
    )
    return encoders + llms


def _check_split(stages, cuts, layout) -> None:
    """Every stage equals its cut of the whole model and lives on its own mesh only."""
    for stage, cut, mesh in zip(stages, cuts, stage_meshes(layout)):
        _assert_equal(_flat(stage.params), _flat(nnx.state(cut)))
        for leaf in jax.tree.leaves(stage.params):
            assert leaf.sharding.mesh.devices.tolist() == mesh.devices.tolist()


@pytest.mark.parametrize("tie", [False, True])
def test_decoder_stage_init_equals_whole_model_init(tie):
    """2 + 3 layers at tp=2: the head stage's tied embedding copy draws what the embedding draws."""
    cfg = tiny_decoder_config(num_layers=5, vocab_size=64, tie_embeddings=tie)
    stages = build_stages(cfg, DECODER_LAYOUT, stage_meshes(DECODER_LAYOUT), SEED)
    whole = _whole(lambda rngs: Decoder(cfg, rngs=rngs))
    _check_split(stages, _decoder_cuts(whole, DECODER_LAYOUT), DECODER_LAYOUT)
    q = stages[1].params["layers"][0]["attn"]["q_kernel"]
    assert q.sharding.spec == P(None, "model", None)  # made in its tp sharding, not replicated
    if tie:
        _assert_equal(
            _flat(stages[1].params["embed_tokens"]), _flat(stages[0].params["embed_tokens"])
        )
    other = build_stages(cfg, DECODER_LAYOUT, stage_meshes(DECODER_LAYOUT), SEED + 1)
    a = np.asarray(stages[1].params["layers"][0]["mlp"]["up"])
    assert not np.array_equal(a, np.asarray(other[1].params["layers"][0]["mlp"]["up"]))


def test_llava_ov_stage_init_equals_whole_model_init():
    text = tiny_decoder_config(num_layers=5, vocab_size=64)
    vision = SiglipConfig(
        hidden_size=16, intermediate_size=32, num_layers=5, num_heads=2, image_size=28, patch_size=7
    )
    cfg = llava_onevision_config(vision, text)
    stages = build_stages(cfg, MLLM_LAYOUT, stage_meshes(MLLM_LAYOUT), SEED)
    whole = _whole(lambda rngs: LlavaOnevision(cfg, rngs=rngs))
    _check_split(stages, _mllm_cuts(whole, MLLM_LAYOUT), MLLM_LAYOUT)
    # distinct layers draw distinct weights (the key really folds in the layer index)
    layers = whole.llm.decoder.layers
    assert not np.array_equal(np.asarray(layers[0].mlp.up[...]), np.asarray(layers[1].mlp.up[...]))


def test_non_local_stage_is_abstract_and_never_compiled(monkeypatch):
    """A stage whose devices all belong to another process: ShapeDtypeStructs with the shardings."""
    cfg = tiny_decoder_config(num_layers=5)
    spec, mesh = DECODER_LAYOUT.stages[1], stage_meshes(DECODER_LAYOUT)[1]
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # every device is process 0's
    monkeypatch.setattr(jax, "jit", _no_jit)
    bp = init_stage(cfg, spec, mesh, SEED)
    leaves = jax.tree.leaves(bp.state)
    assert leaves and all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)
    assert bp.state["layers"][0]["attn"]["q_kernel"].sharding.spec == P(None, "model", None)


def _no_jit(*args, **kwargs):
    raise AssertionError("a non-local stage compiled a program")


# --- HF checkpoints: stage-loaded == whole-loaded, for each family -------------------------------


def _save_family(family: str, path):
    import models_fixtures as fx

    if family == "qwen2":
        return fx.save_tiny_qwen2(path, tied=True, num_hidden_layers=5)
    if family == "llama":
        return fx.save_tiny_llama(path, llama3_scaling=True, num_hidden_layers=5)
    if family == "llava_ov":
        return fx.save_tiny_llava_ov(path, layers=5)
    return fx.save_tiny_internvl(path, layers=5)


def _whole_loaded(family: str, path):
    from models.hf import llava_onevision as hf_llava
    from models.hf import load_pretrained

    if family == "llava_ov":
        return hf_llava.load_llava_onevision(path)[0]  # any key layout
    return load_pretrained(path)[0]


@pytest.mark.hf
@pytest.mark.parametrize("family", ["qwen2", "llama", "llava_ov", "internvl"])
def test_hf_stage_loading_equals_whole_loading(family, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from models.hf import CheckpointReader, load_config

    path = _save_family(family, tmp_path / family)
    multimodal = family in ("llava_ov", "internvl")
    layout = MLLM_LAYOUT if multimodal else DECODER_LAYOUT
    reads = []
    real_read = CheckpointReader.read

    def logged(self, key, view, box):
        out = real_read(self, key, view, box)
        reads.append((key, out.nbytes))
        return out

    monkeypatch.setattr(CheckpointReader, "read", logged)
    cfg = load_config(path)
    stages = build_stages(cfg, layout, stage_meshes(layout), str(path), compute_dtype=jnp.float32)
    # Each shard reads its slice: a tp=2 stage's column-split q_proj is read once in halves (dp=1)
    # or twice (dp=2, once per replica), never whole per device; no stage reads another's layer.
    suffix = "layers.3.self_attn.q_proj.weight"
    reader = CheckpointReader(path)
    key = next(k for k in reader.keys() if k.endswith(suffix) and "vision" not in k)  # noqa: SIM118
    full = int(np.prod(reader.shape(key))) * 4
    assert [n for k, n in reads if k == key] == [full // 2] * (2 * layout.llm_stages[1].dp)
    unused = {k for k in reader.keys() if "post_layernorm" in k}  # noqa: SIM118 (LLaVA-OV: pre-norm)
    assert {k for k, _ in reads} == set(
        reader.keys()
    ) - unused  # every key it needs, once per shard

    whole = _whole_loaded(family, path)
    cuts = (_mllm_cuts if multimodal else _decoder_cuts)(whole, layout)
    _check_split(stages, cuts, layout)


@pytest.mark.hf
def test_train_run_loads_an_hf_dir_per_stage(tmp_path):
    """`train.run` with model.hf_dir: the stages load their own tensors and the run trains."""
    pytest.importorskip("transformers")
    from models_fixtures import TINY_TRAIN_DECODER, save_tiny_qwen2

    from dflop_jax.config import load_config as load_train_config
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import run
    from models.hf import load_pretrained

    hf = save_tiny_qwen2(tmp_path / "qwen2", tied=False, vocab_size=384)
    over = [
        "model.kind=decoder", f"model.hf_dir={hf}", *TINY_TRAIN_DECODER, "layout.encoder_layers=[]",
        "layout.llm_layers=[1, 1]", "layout.llm_tp=[2]", "layout.lengths=[256]",
        "layout.microbatches=[1, 4]", f"data.synth_dir={tmp_path / 'synth'}", "data.synth_mix=text",
        "data.synth_samples=32", "data.max_tokens=256", "data.cache_dir=", "global_batch=4",
        "steps=1", "optimizer.warmup_steps=4", "optimizer.decay_steps=8", "checkpoint.every=0",
        "compute_dtype=float32", "scheduler.solver=greedy", f"run_dir={tmp_path / 'run'}",
        "device.peak_flops=1000000000.0", "measure_stage_times_every=0",
    ]  # fmt: skip
    report = run(load_train_config(TrainConfig, None, over))
    assert len(report.losses) == 1 and np.isfinite(report.losses[0])
    whole, _ = load_pretrained(hf)
    cuts = _decoder_cuts(whole, report.layout)
    for stage, cut in zip(report.stages, cuts):  # step 1 warms up from lr 0: still the checkpoint
        _assert_equal(_flat(stage.params), _flat(nnx.state(cut)))
