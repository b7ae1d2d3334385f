"""SigLIP and InternViT encoders vs HF transformers (tiny random models, float32), stage splits, shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.internvit import INTERNVIT_PRESETS, InternViTConfig
from models.siglip import SIGLIP_PRESETS, SiglipConfig, feature_layer_config
from models.vit import VisionStage, VisionTower

TOL = 1e-4


def _count(cfg) -> int:
    abstract = nnx.eval_shape(lambda: VisionTower(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    "name, published",
    [
        # HF meta-device counts of the vision towers (SigLIP-SO400M without its pooling head; the
        # InternViT model cards publish 304M and 5540M).
        ("siglip-so400m", 412_987_248),
        ("internvit-300m", 303_938_560),
        ("internvit-6b", 5_536_496_000),
    ],
)
def test_named_vision_configs_param_counts(name, published):
    cfg = {**SIGLIP_PRESETS, **INTERNVIT_PRESETS}[name]
    assert abs(_count(cfg) - published) / published < 0.01


def _pixels(n, size, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 3, size, size)).astype(np.float32)


@pytest.mark.hf
def test_siglip_vision_features_match_hf(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from models.hf import siglip as hf_siglip

    hf_cfg = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=30, patch_size=7, vision_use_head=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.SiglipVisionModel(hf_cfg).eval()
    ref.save_pretrained(tmp_path)
    tensors = hf_siglip.strip_prefix(
        load_file(tmp_path / "model.safetensors"), hf_siglip.SIGLIP_VISION_PREFIXES
    )
    cfg = hf_siglip.siglip_config_from_hf(hf_cfg.to_dict())
    ours = VisionTower(cfg, rngs=nnx.Rngs(0))
    entries = hf_siglip.prefixed(
        hf_siglip.siglip_entries(cfg, first_layer=0, num_layers=3, embedding=True, head=True),
        "",
        ("stage",),
    )
    hf_siglip.assign(ours, entries, tensors)
    px = _pixels(2, 30)
    with torch.no_grad():
        out = ref(torch.from_numpy(px), output_hidden_states=True)
    got = np.asarray(ours(jnp.asarray(px.transpose(0, 2, 3, 1))))
    np.testing.assert_allclose(got, out.last_hidden_state.numpy(), atol=TOL)
    # vision_feature_layer=-1: the last layer's output before post_layernorm.
    pre = feature_layer_config(cfg, -1)
    stage = VisionStage(
        pre, first_layer=0, num_layers=3, has_embedding=True, has_head=True, rngs=nnx.Rngs(0)
    )
    hf_siglip.assign(
        stage, hf_siglip.siglip_entries(pre, first_layer=0, num_layers=3, embedding=True, head=True), tensors,
        ignore=lambda k: k.startswith("post_layernorm"),
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(stage(jnp.asarray(px.transpose(0, 2, 3, 1)))),
        out.hidden_states[-1].numpy(),
        atol=TOL,
    )
    exported = hf_siglip.export(ours, entries)
    for key, value in exported.items():
        np.testing.assert_array_equal(value, tensors[key])


@pytest.mark.hf
def test_internvl_vision_features_match_hf(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionModel

    from models.hf import internvl as hf_internvl

    for qk_norm, norm_type in ((False, "layer_norm"), (True, "rms_norm")):
        hf_cfg = InternVLVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
            patch_size=7, use_qk_norm=qk_norm, norm_type=norm_type, attention_bias=not qk_norm,
        )  # fmt: skip
        torch.manual_seed(1)
        ref = InternVLVisionModel(hf_cfg).eval()
        with (
            torch.no_grad()
        ):  # HF initializes layer scales / cls / positions to constants: randomize
            for p in ref.parameters():
                p.add_(0.1 * torch.randn_like(p))
        ref.save_pretrained(tmp_path / norm_type)
        tensors = load_file(tmp_path / norm_type / "model.safetensors")
        cfg = hf_internvl.internvit_config_from_hf(hf_cfg.to_dict())
        ours = VisionTower(cfg, rngs=nnx.Rngs(0))
        entries = hf_internvl.internvit_entries(
            cfg, first_layer=0, num_layers=2, embedding=True, head=True
        )
        hf_internvl.assign(ours, hf_internvl.prefixed(entries, "", ("stage",)), tensors)
        px = _pixels(3, 28, seed=2)
        with torch.no_grad():
            want = ref(torch.from_numpy(px)).last_hidden_state.numpy()
        got = np.asarray(ours(jnp.asarray(px.transpose(0, 2, 3, 1))))
        np.testing.assert_allclose(got, want, atol=TOL)


def _tiny_siglip():
    return SiglipConfig(
        hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, image_size=28, patch_size=7
    )


def test_vision_stage_split_equals_whole_in_value_and_grad():
    cfg = _tiny_siglip()
    whole = VisionTower(cfg, rngs=nnx.Rngs(3))
    first = VisionStage(
        cfg, first_layer=0, num_layers=2, has_embedding=True, has_head=False, rngs=nnx.Rngs(0)
    )
    second = VisionStage(
        cfg, first_layer=2, num_layers=2, has_embedding=False, has_head=True, rngs=nnx.Rngs(0)
    )
    flat = dict(nnx.to_flat_state(nnx.state(whole.stage, nnx.Param)))
    for stage, offset in ((first, 0), (second, 2)):
        for path, var in nnx.to_flat_state(nnx.state(stage, nnx.Param)):
            src = ("layers", path[1] + offset, *path[2:]) if path[0] == "layers" else path
            var.set_value(flat[src][...])
    px = jnp.asarray(np.random.default_rng(4).standard_normal((2, 28, 28, 3)), jnp.float32)

    def loss_whole(m):
        return jnp.sum(m(px) ** 2)

    def loss_split(a, b):
        return jnp.sum(b(a(px)) ** 2)

    lw, gw = nnx.value_and_grad(loss_whole)(whole)
    ls, (ga, gb) = nnx.value_and_grad(loss_split, argnums=(0, 1))(first, second)
    np.testing.assert_allclose(ls, lw, rtol=1e-6)
    gw_flat = dict(nnx.to_flat_state(gw))
    for grads, offset in ((ga, 0), (gb, 2)):
        for path, g in nnx.to_flat_state(grads):
            src = (
                ("stage", "layers", path[1] + offset, *path[2:])
                if path[0] == "layers"
                else ("stage", *path)
            )
            np.testing.assert_allclose(g[...], gw_flat[src][...], atol=1e-5)
            assert np.any(np.asarray(g[...]) != 0) or path[-1] in ("bias",)


def test_internvit_shapes_with_cls_token():
    cfg = InternViTConfig(
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        image_size=28,
        patch_size=14,
    )
    out = VisionTower(cfg, rngs=nnx.Rngs(0))(jnp.zeros((3, 28, 28, 3)))
    assert out.shape == (3, 1 + 4, 16)
