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
        pytest.param("internvit-6b", 5_536_496_000, marks=pytest.mark.slow),
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
    from models.hf import load_pretrained, save_pretrained
    from models.hf.io import hf_keys
    from models.hf.siglip import siglip_name_map

    hf_cfg = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=30, patch_size=7, vision_use_head=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.SiglipVisionModel(hf_cfg).eval()
    ref.save_pretrained(tmp_path / "hf")
    ours, cfg = load_pretrained(tmp_path / "hf")
    assert isinstance(ours, VisionTower) and cfg.num_layers == 3
    px = _pixels(2, 30)
    with torch.no_grad():
        out = ref(torch.from_numpy(px), output_hidden_states=True)
    run = nnx.jit(lambda m, x: m(x))
    got = np.asarray(run(ours, jnp.asarray(px.transpose(0, 2, 3, 1))))
    np.testing.assert_allclose(got, out.last_hidden_state.numpy(), atol=TOL)
    # vision_feature_layer=-1 (LLaVA-OV): the last layer's output before post_layernorm.
    pre = feature_layer_config(cfg, -1)
    stage = VisionStage(
        pre, first_layer=0, num_layers=3, has_embedding=True, has_head=True, rngs=nnx.Rngs(0)
    )
    for path, var in nnx.to_flat_state(nnx.state(stage, nnx.Param)):
        var.set_value(dict(nnx.to_flat_state(nnx.state(ours.stage, nnx.Param)))[path][...])
    np.testing.assert_allclose(
        np.asarray(run(stage, jnp.asarray(px.transpose(0, 2, 3, 1)))),
        out.hidden_states[-1].numpy(),
        atol=TOL,
    )
    save_pretrained(ours, cfg, tmp_path / "ours")
    back = transformers.SiglipVisionModel.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        again = back(torch.from_numpy(px)).last_hidden_state.numpy()
    np.testing.assert_array_equal(again, out.last_hidden_state.numpy())
    keys = [k for entry in siglip_name_map(cfg).values() for k in hf_keys(entry)]
    assert sorted(keys) == sorted(ref.state_dict())


@pytest.mark.hf
def test_internvl_vision_features_match_hf(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionModel

    from models.hf import load_pretrained

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
        ours, cfg = load_pretrained(tmp_path / norm_type)
        assert cfg.qk_norm == qk_norm and cfg.norm == norm_type
        px = _pixels(3, 28, seed=2)
        with torch.no_grad():
            want = ref(torch.from_numpy(px)).last_hidden_state.numpy()
        got = np.asarray(nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(px.transpose(0, 2, 3, 1))))
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

    lw, gw = nnx.jit(nnx.value_and_grad(loss_whole))(whole)
    ls, (ga, gb) = nnx.jit(nnx.value_and_grad(loss_split, argnums=(0, 1)))(first, second)
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
    out = nnx.jit(lambda m, x: m(x))(VisionTower(cfg, rngs=nnx.Rngs(0)), jnp.zeros((3, 28, 28, 3)))
    assert out.shape == (3, 1 + 4, 16)


def test_vision_remat_matches_plain():
    cfg = _tiny_siglip().replace(num_layers=2)
    px = jnp.asarray(np.random.default_rng(5).standard_normal((2, 28, 28, 3)), jnp.float32)

    def loss(m):
        return jnp.sum(m(px) ** 2)

    plain = nnx.jit(nnx.value_and_grad(loss))(VisionTower(cfg, rngs=nnx.Rngs(1)))
    remat = nnx.jit(nnx.value_and_grad(loss))(
        VisionTower(cfg.replace(remat="full"), rngs=nnx.Rngs(1))
    )
    np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
    want = dict(nnx.to_flat_state(plain[1]))
    for path, g in nnx.to_flat_state(remat[1]):
        np.testing.assert_allclose(g[...], want[path][...], atol=1e-5)


@pytest.mark.hf
def test_dual_siglip_checkpoint_loads_vision_tower(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from models.hf import load_pretrained

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    text = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=50,
    )
    torch.manual_seed(2)
    ref = transformers.SiglipModel(
        transformers.SiglipConfig(vision_config=vision, text_config=text)
    ).eval()
    ref.save_pretrained(tmp_path)
    ours, cfg = load_pretrained(tmp_path)  # text tower, logit scale and pooling head are skipped
    px = _pixels(1, 28, seed=3)
    with torch.no_grad():
        want = ref.vision_model(torch.from_numpy(px)).last_hidden_state.numpy()
    got = nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(px.transpose(0, 2, 3, 1)))
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL)


def test_patch_embedding_matmul_equals_the_conv_it_replaces():
    """The embedding's patchify + one matmul equals a stride-P "valid" conv with HF's kernel layout
    [D, C, P, P] (what `patch_conv` maps; 30 px / 7 leaves 2 px unused, as SigLIP's 384 / 14 does)."""
    from models.hf.siglip import patch_conv

    cfg = SiglipConfig(hidden_size=8, intermediate_size=16, num_layers=0, num_heads=2,
                       image_size=30, patch_size=7)  # fmt: skip
    rng = np.random.default_rng(0)
    conv_w = rng.standard_normal((8, 3, 7, 7)).astype(np.float32)
    pixels = jnp.asarray(rng.standard_normal((2, 30, 30, 3)), jnp.float32)  # float: as given
    stage = VisionStage(cfg, first_layer=0, num_layers=0, has_embedding=True, has_head=False,
                        rngs=nnx.Rngs(0))  # fmt: skip
    stage.patch_kernel.set_value(jnp.asarray(patch_conv(cfg)["to_ours"](conv_w)))
    stage.pos_embed.set_value(jnp.zeros_like(stage.pos_embed[...]))
    conv = jax.lax.conv_general_dilated(
        pixels, jnp.asarray(conv_w), (7, 7), "VALID", dimension_numbers=("NHWC", "OIHW", "NHWC")
    )  # [T, 4, 4, D]
    got = np.asarray(stage.embed(pixels))  # sums of 147 products of O(1): f32 round-off, relative
    np.testing.assert_allclose(got, conv.reshape(2, 16, 8), rtol=1e-5, atol=1e-5)
    back = patch_conv(cfg)["to_hf"](patch_conv(cfg)["to_ours"](conv_w))
    np.testing.assert_array_equal(back, conv_w)
