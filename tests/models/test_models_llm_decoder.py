"""Decoder: packed rows == samples alone, stage split == unsplit (loss and grads), remat, loss, presets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_fixtures import TINY_LLAMA3_SCALING, tiny_decoder_config

from models.decoder import Decoder, DecoderStage, extract_stage
from models.decoder_config import DECODER_PRESETS, DecoderConfig
from models.loss import cross_entropy_sum

TOL = 1e-4


def _batch(cfg, b=2, s=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 5 + [2] * 5 + [0] * 2], b, 0), jnp.int32)
    pos = jnp.asarray(np.repeat([list(range(5)) * 2 + [0, 0]], b, 0), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
    mask = (seg > 0).astype(jnp.float32)
    return ids, seg, pos, targets, mask


def test_packed_row_equals_each_sample_alone():
    cfg = tiny_decoder_config(rope_scaling=TINY_LLAMA3_SCALING)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    ids, seg, pos, _, _ = _batch(cfg, b=1)
    forward = nnx.jit(lambda m, *a: m(*a))
    packed = np.asarray(forward(model, ids, seg, pos))
    for lo, hi in ((0, 5), (5, 10)):
        alone = np.asarray(forward(model, ids[:, lo:hi]))
        assert np.abs(packed[:, lo:hi] - alone).max() <= TOL


def _full_loss(model, ids, seg, pos, targets, mask):
    return cross_entropy_sum(model(ids, seg, pos), targets, mask)[0]


def _split_loss(stages, ids, seg, pos, targets, mask):
    first, middle, last = stages
    h = first(first.embed(ids), seg, pos)
    h = middle(h, seg, pos)
    return cross_entropy_sum(last.logits(last(h, seg, pos)), targets, mask)[0]


@pytest.mark.parametrize("tied", [False, True])
def test_stage_split_gives_same_loss_and_grads(tied):
    cfg = tiny_decoder_config(tie_embeddings=tied)
    model = Decoder(cfg, rngs=nnx.Rngs(1))
    batch = _batch(cfg)
    ranges = ((0, 1, True, False), (1, 1, False, False), (2, 1, False, True))
    stages = [
        extract_stage(model, first_layer=f, num_layers=n, has_embedding=e, has_head=h)
        for f, n, e, h in ranges
    ]
    full_loss, full_grads = nnx.jit(nnx.value_and_grad(_full_loss))(model, *batch)
    split_loss, split_grads = jax.jit(
        jax.value_and_grad(_split_loss_pure, argnums=1), static_argnums=0
    )(tuple(nnx.graphdef(s) for s in stages), tuple(nnx.state(s) for s in stages), *batch)
    assert abs(float(full_loss) - float(split_loss)) <= TOL
    full = dict(nnx.to_flat_state(full_grads))
    seen = set()
    for (first, _, _, _), grads in zip(ranges, split_grads):
        for path, g in nnx.to_flat_state(grads):
            src = ("stage", *path)
            if path[0] == "layers":
                src = ("stage", "layers", first + path[1], *path[2:])
            seen.add(src)
            if path[0] == "embed_tokens":
                continue  # tied copies: compared as a sum below
            assert np.abs(np.asarray(g[...]) - np.asarray(full[src][...])).max() <= TOL, src
    embed_sum = sum(
        np.asarray(g[...])
        for grads in split_grads
        for path, g in nnx.to_flat_state(grads)
        if path[0] == "embed_tokens"
    )
    embed_full = np.asarray(full[("stage", "embed_tokens", "weight")][...])
    assert np.abs(embed_sum - embed_full).max() <= TOL
    assert seen == set(full)


def _split_loss_pure(graphdefs, states, *batch):
    return _split_loss([nnx.merge(g, s) for g, s in zip(graphdefs, states)], *batch)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_loss_and_grads(remat):
    cfg = tiny_decoder_config(num_layers=2)
    batch = _batch(cfg)
    plain = Decoder(cfg, rngs=nnx.Rngs(2))
    remat_model = Decoder(cfg.replace(remat=remat), rngs=nnx.Rngs(2))
    step = nnx.jit(nnx.value_and_grad(_full_loss))
    (l0, g0), (l1, g1) = step(plain, *batch), step(remat_model, *batch)
    assert abs(float(l0) - float(l1)) <= TOL
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= TOL


def test_cross_entropy_sum_hand_computed():
    logits = jnp.asarray([[[0.0, 0.0, 0.0], [1000.0, 0.0, -1000.0]]])  # stable at extreme logits
    targets = jnp.asarray([[2, 1]])
    loss, count = cross_entropy_sum(logits, targets, jnp.asarray([[1.0, 1.0]]))
    assert abs(float(loss) - (np.log(3.0) + 1000.0)) <= TOL and float(count) == 2.0
    loss, count = cross_entropy_sum(logits, targets, jnp.asarray([[1.0, 0.0]]))
    assert abs(float(loss) - np.log(3.0)) <= TOL and float(count) == 1.0


PUBLISHED = {
    "qwen2.5-0.5b": 0.494e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-32b": 32.8e9,
    "qwen2.5-72b": 72.7e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
}


def _abstract_param_count(cfg, num_layers):
    abstract = nnx.eval_shape(
        lambda: DecoderStage(
            cfg,
            first_layer=0,
            num_layers=num_layers,
            has_embedding=True,
            has_head=True,
            rngs=nnx.Rngs(0),
        )
    )
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_param_count_extrapolation_equals_full_count():
    cfg = tiny_decoder_config(num_layers=3)
    full = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(full, nnx.Param)))
    base, one = (_abstract_param_count(cfg, n) for n in (0, 1))
    assert count == base + 3 * (one - base)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    cfg = DECODER_PRESETS[name]
    # Layers are identical: count a 0-layer and a 1-layer stage, extrapolate (fast, same shapes).
    base, one = (_abstract_param_count(cfg, n) for n in (0, 1))
    count = base + cfg.num_layers * (one - base)
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] <= 0.01, (name, count)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"remat": "some"}, "remat"),
        ({"dtype": "int8"}, "dtype"),
        ({"attention_impl": "flash"}, "attention_impl"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_config_validation_names_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        tiny_decoder_config(**changes)


def test_stage_range_outside_model_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        DecoderStage(
            tiny_decoder_config(),
            first_layer=2,
            num_layers=2,
            has_embedding=False,
            has_head=False,
            rngs=nnx.Rngs(0),
        )
    assert isinstance(tiny_decoder_config(), DecoderConfig)
