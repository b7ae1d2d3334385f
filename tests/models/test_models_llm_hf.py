"""Parity with HF transformers (torch CPU, float32): tiny random Qwen2 / Llama saved with
`save_pretrained`, loaded with `models.hf.load_pretrained`, same logits; export back to HF layout."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

from models_fixtures import hf_logits, save_tiny_llama, save_tiny_qwen2

from models.decoder import Decoder
from models.hf import load_pretrained, save_pretrained

pytestmark = pytest.mark.hf
TOL = 1e-4
forward = nnx.jit(lambda model, ids: model(ids))


def _ids(vocab, b=2, s=11, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (b, s))


def _ours(model, ids):
    return np.asarray(forward(model, jnp.asarray(ids, jnp.int32)))


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_logits_match_hf(tmp_path, tied):
    path = save_tiny_qwen2(tmp_path / "qwen2", tied=tied)
    model, cfg = load_pretrained(path)
    assert isinstance(model, Decoder) and cfg.tie_embeddings == tied and cfg.qkv_bias
    assert cfg.num_kv_heads < cfg.num_heads  # GQA exercised
    ids = _ids(cfg.vocab_size)
    assert np.abs(_ours(model, ids) - hf_logits(path, ids)).max() <= TOL


def test_llama_with_llama3_rope_scaling_matches_hf(tmp_path):
    path = save_tiny_llama(tmp_path / "llama", llama3_scaling=True)
    model, cfg = load_pretrained(path)
    assert cfg.rope_scaling is not None and not cfg.qkv_bias
    ids = _ids(cfg.vocab_size, s=24)
    ref = hf_logits(path, ids)
    assert np.abs(_ours(model, ids) - ref).max() <= TOL
    # The scaling is observable: without it the logits differ.
    shell = nnx.eval_shape(lambda: Decoder(cfg.replace(rope_scaling=None), rngs=nnx.Rngs(0)))
    unscaled = nnx.merge(nnx.graphdef(shell), nnx.state(model))
    assert np.abs(_ours(unscaled, ids) - ref).max() > 1e-3


def test_export_round_trip_loads_in_hf_with_same_logits(tmp_path):
    src = save_tiny_qwen2(tmp_path / "src", tied=False, seed=3)
    model, cfg = load_pretrained(src)
    save_pretrained(model, cfg, tmp_path / "exported", max_shard_bytes=20_000)
    assert (tmp_path / "exported" / "model.safetensors.index.json").is_file()
    ids = _ids(cfg.vocab_size, seed=1)
    assert np.abs(hf_logits(tmp_path / "exported", ids) - hf_logits(src, ids)).max() <= TOL


def test_hf_sharded_checkpoint_loads(tmp_path):
    path = save_tiny_llama(tmp_path / "one", llama3_scaling=False)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path).save_pretrained(
        tmp_path / "sharded", max_shard_size="20KB"
    )
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model, cfg = load_pretrained(tmp_path / "sharded")
    ids = _ids(cfg.vocab_size)
    assert np.abs(_ours(model, ids) - hf_logits(path, ids)).max() <= TOL


def test_llama_export_of_our_model_loads_in_hf(tmp_path):
    from models_fixtures import tiny_decoder_config

    cfg = tiny_decoder_config(qkv_bias=False, tie_embeddings=True)
    model = Decoder(cfg, rngs=nnx.Rngs(5))
    save_pretrained(model, cfg, tmp_path / "ours")
    ids = _ids(cfg.vocab_size)
    assert np.abs(_ours(model, ids) - hf_logits(tmp_path / "ours", ids)).max() <= TOL
