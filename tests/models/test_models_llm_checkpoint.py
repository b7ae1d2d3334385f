"""HF-layout checkpoints without torch: export/import round trip, sharded index, direct-to-mesh
loading, single-stage loading, and the error messages for bad checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from models_fixtures import tiny_decoder_config
from safetensors.numpy import load_file, save_file

from dflop_jax.programs.sharding import rules_for
from models.decoder import Decoder, extract_stage
from models.hf import CheckpointError, load_config, load_pretrained, load_stage, save_pretrained

TOL = 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, model, cfg) of a tiny tied Qwen2-style Decoder exported in HF layout."""
    cfg = tiny_decoder_config(vocab_size=64, tie_embeddings=True)
    model = Decoder(cfg, rngs=nnx.Rngs(7))
    path = tmp_path_factory.mktemp("ckpt") / "qwen2"
    save_pretrained(model, cfg, path)
    return path, model, cfg


def _flat(module):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _assert_same_params(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert np.array_equal(fa[key], fb[key]), key


def test_round_trip_restores_every_parameter(saved):
    path, model, cfg = saved
    loaded, loaded_cfg = load_pretrained(path)
    assert loaded_cfg == cfg
    assert "lm_head.weight" not in load_file(path / "model.safetensors")  # tied: HF omits it
    _assert_same_params(loaded, model)


def test_sharded_index_round_trip(saved, tmp_path):
    _, model, cfg = saved
    files = save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=8_000)
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in index["weight_map"]
    loaded, _ = load_pretrained(tmp_path / "sharded")
    _assert_same_params(loaded, model)


def test_load_onto_mesh_places_shards_directly(saved):
    path, model, _ = saved
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    loaded, _ = load_pretrained(path, mesh=mesh, rules=rules_for("decoder"))
    q = loaded.stage.layers[0].attn.q_kernel[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert {s.data.shape for s in q.addressable_shards} == {(32, 2, 8)}  # heads split 4 -> 2 + 2
    _assert_same_params(loaded, model)


def test_load_single_stage_equals_slice_of_full_model(saved):
    path, model, _ = saved
    stage = load_stage(
        path, load_config(path), "llm", first_layer=1, num_layers=2, has_embedding=False,
        has_head=True,
    )  # fmt: skip
    assert stage.cfg.tie_embeddings and hasattr(stage, "embed_tokens")  # head's copy of the table
    ref = extract_stage(model, first_layer=1, num_layers=2, has_embedding=False, has_head=True)
    _assert_same_params(stage, ref)


def _edit(src, dst, *, drop=(), add=None, config=None):
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    for key in drop:
        tensors.pop(key)
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf.update(config or {})
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_error_lists_missing_keys(saved, tmp_path):
    path = _edit(saved[0], tmp_path / "bad", drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match=r"missing from checkpoint \(1\): model.layers.1.mlp"):
        load_pretrained(path)


def test_error_lists_unsupported_keys(saved, tmp_path):
    extra = {"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}
    path = _edit(saved[0], tmp_path / "bad", add=extra)
    with pytest.raises(CheckpointError, match="unsupported checkpoint keys.*o_proj.bias"):
        load_pretrained(path)


def test_error_lists_shape_mismatches(saved, tmp_path):
    path = _edit(saved[0], tmp_path / "bad", config={"intermediate_size": 40})
    with pytest.raises(CheckpointError, match=r"shape mismatches \(9\).*gate_proj"):
        load_pretrained(path)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type='yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_error_for_unsupported_configs(saved, tmp_path, config, match):
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(_edit(saved[0], tmp_path / "bad", config=config))


def test_error_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(tmp_path / "nowhere")


def test_loaded_bfloat16_compute(saved):
    path, model, _ = saved
    loaded, cfg = load_pretrained(path, dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and loaded.stage.layers[0].mlp.up[...].dtype == jnp.float32
    ids = jnp.arange(12, dtype=jnp.int32).reshape(1, 12)
    logits = nnx.jit(lambda m, x: m(x))(loaded, ids)
    assert logits.dtype == jnp.bfloat16 and bool(jnp.isfinite(logits).all())


def test_bfloat16_checkpoint_loads_into_float32_masters(saved, tmp_path):
    import ml_dtypes

    path, model, _ = saved
    tensors = load_file(path / "model.safetensors")
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    loaded, _ = load_pretrained(_edit(path, tmp_path / "bf16", add=bf16))
    got = _flat(loaded)[("stage", "layers", 0, "mlp", "up")]
    want = tensors["model.layers.0.mlp.up_proj.weight"].astype(ml_dtypes.bfloat16).T
    assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float32))


# Legacy (transformers 4.x) config.json files as published on the Hub: rope_theta / rope_scaling at
# the top level. Parsing them must give exactly the named presets.
QWEN25_7B_JSON = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 152064,
}  # fmt: skip
LLAMA31_8B_JSON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
}  # fmt: skip


@pytest.mark.parametrize(
    "hf, preset", [(QWEN25_7B_JSON, "qwen2.5-7b"), (LLAMA31_8B_JSON, "llama3.1-8b")]
)
def test_legacy_hub_configs_parse_to_presets(hf, preset):
    from models.decoder_config import DECODER_PRESETS
    from models.hf import adapter_for

    cfg = adapter_for(hf["model_type"]).config_from_hf(hf, "bfloat16", "float32")
    assert cfg == DECODER_PRESETS[preset]
