"""LLaVA-OneVision vs HF `LlavaOnevisionForConditionalGeneration` (tiny random model, float32): an anyres
image (with anyres_max downscaling), a multi-image sample and a video; export round trip."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from models import layouts  # noqa: E402
from models.hf import llava_onevision as hf_llava  # noqa: E402
from models.layouts import NEWLINE  # noqa: E402

TOL = 1e-4
TILE, PATCH = 28, 7  # 4 x 4 = 16 patches per tile
PINS = [[TILE * r, TILE * c] for r in range(1, 5) for c in range(1, 5)]
IMG, VID = 90, 91


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
        patch_size=PATCH, vision_use_head=False,
    )  # fmt: skip
    text = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    cfg = transformers.LlavaOnevisionConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMG, video_token_index=VID,
        image_grid_pinpoints=PINS,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlavaOnevisionForConditionalGeneration(cfg).eval()
    path = tmp_path_factory.mktemp("llava_ov")
    ref.save_pretrained(path)
    model, ours_cfg = hf_llava.load_llava_onevision(path)
    ref.saved_to = path
    return ref, model, ours_cfg


def _forward(model, tiles, pool, tokens, fidx, fw):
    s = tokens.shape[1]
    run = nnx.jit(lambda m, *a: m(*a))
    return np.asarray(
        run(
            model,
            jnp.asarray(tiles),
            jnp.asarray(pool),
            jnp.asarray(tokens),
            jnp.ones((1, s), jnp.int32),
            jnp.arange(s, dtype=jnp.int32)[None],
            jnp.asarray(fidx),
            jnp.asarray(fw),
        )
    )


def _row(prefix, taps, weights, suffix):
    """Token row + [1,S,4] taps/weights: text ids `prefix`, image placeholders, text ids `suffix`."""
    n = len(prefix) + len(taps) + len(suffix)
    fidx = np.full((1, n, 4), layouts.TEXT, np.int32)
    fw = np.zeros((1, n, 4), np.float32)
    fw[..., 0] = 1
    fidx[0, len(prefix) : len(prefix) + len(taps)] = taps
    fw[0, len(prefix) : len(prefix) + len(taps)] = weights
    return fidx, fw


def _image(hw, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*hw, 3), dtype=np.uint8))


@pytest.mark.parametrize("hw", [(50, 90), (110, 110)])
def test_anyres_image_logits_match_hf(checkpoint, hw):
    ref, model, cfg = checkpoint
    proc = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINS
    )
    batch = proc(_image(hw, 1), return_tensors="pt")
    layout = layouts.llava_ov_image_layout(
        hw, pinpoints=PINS, tile_size=TILE, patches_per_side=TILE // PATCH
    )
    assert batch["pixel_values"].shape[1] == layout.num_tiles
    assert layout.is_exact_gather == (hw == (50, 90))  # (110, 110): 4x4 grid, downscaled
    taps, weights = layout.offset_taps(0)
    prefix, suffix = [1, 2, 3], [4, 5]
    tokens = np.array([prefix + [IMG] * layout.num_tokens + suffix], np.int32)
    with torch.no_grad():
        want = ref(
            input_ids=torch.from_numpy(tokens).long(),
            pixel_values=batch["pixel_values"],
            image_sizes=batch["image_sizes"],
        ).logits.numpy()
    tiles = batch["pixel_values"][0].numpy().transpose(0, 2, 3, 1)
    fidx, fw = _row(prefix, taps, weights, suffix)
    got = _forward(model, tiles, np.zeros(len(tiles), bool), tokens, fidx, fw)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_multi_image_logits_match_hf(checkpoint):
    ref, model, cfg = checkpoint
    proc = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINS
    )
    batch = proc([[_image((40, 70), 2), _image((60, 30), 3)]], return_tensors="pt")
    one = layouts.llava_ov_multi_image_layout(patches_per_side=TILE // PATCH)
    src = np.concatenate([one.offset(0), [7], one.offset(1)])  # text token 7 between the images
    tokens = np.array(
        [[1, 2] + [IMG] * one.num_tokens + [7] + [IMG] * one.num_tokens + [3]], np.int32
    )
    with torch.no_grad():
        want = ref(
            input_ids=torch.from_numpy(tokens).long(),
            pixel_values=batch["pixel_values"],
            image_sizes=batch["image_sizes"],
            batch_num_images=torch.as_tensor(batch["batch_num_images"]),
        ).logits.numpy()
    src = np.where(tokens[0, 2:-1] == IMG, src, layouts.TEXT)
    fidx = np.concatenate([[layouts.TEXT] * 2, src, [layouts.TEXT]])[None].astype(np.int32)
    tiles = batch["pixel_values"][:, 0].numpy().transpose(0, 2, 3, 1)
    got = _forward(
        model,
        tiles,
        np.zeros(2, bool),
        tokens,
        fidx[..., None],
        np.ones((*fidx.shape, 1), np.float32),
    )
    np.testing.assert_allclose(got, want, atol=TOL)


def test_video_logits_match_hf(checkpoint):
    ref, model, cfg = checkpoint
    frames = 3
    layout = layouts.llava_ov_video_layout(frames, patches_per_side=TILE // PATCH)
    assert layout.num_tokens == frames * 2 * 2 + 1 and layout.source[-1] == NEWLINE
    px = np.random.default_rng(5).standard_normal((1, frames, 3, TILE, TILE)).astype(np.float32)
    tokens = np.array([[1] + [VID] * layout.num_tokens + [2, 3]], np.int32)
    with torch.no_grad():
        want = ref(
            input_ids=torch.from_numpy(tokens).long(), pixel_values_videos=torch.from_numpy(px)
        ).logits.numpy()
    fidx = np.concatenate([[layouts.TEXT], layout.offset(0), [layouts.TEXT] * 2])[
        None, :, None
    ].astype(np.int32)
    got = _forward(
        model,
        px[0].transpose(0, 2, 3, 1),
        np.ones(frames, bool),
        tokens,
        fidx,
        np.ones(fidx.shape, np.float32),
    )
    np.testing.assert_allclose(got, want, atol=TOL)


def test_load_pretrained_and_export_round_trip(checkpoint, tmp_path):
    from models.hf import export_tensors, load_pretrained, save_pretrained

    ref, model, cfg = checkpoint
    state = {k: v.numpy() for k, v in ref.state_dict().items()}  # module-style names (model.*)
    by_module = dict(
        export_tensors(model, hf_llava.name_map(cfg, hf_llava.detect_layout(list(state))))
    )
    assert set(state) - set(by_module) == {
        f"model.vision_tower.post_layernorm.{w}" for w in ("weight", "bias")
    }
    for key, value in by_module.items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    exported = dict(export_tensors(model, hf_llava.name_map(cfg)))
    saved = tmp_path / "saved"
    save_pretrained(model, cfg, saved)
    again, cfg2 = load_pretrained(saved)
    assert cfg2 == cfg
    for key, value in dict(export_tensors(again, hf_llava.name_map(cfg2))).items():
        np.testing.assert_array_equal(value, exported[key], err_msg=key)
    back = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(saved).eval()
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        np.testing.assert_allclose(
            back(input_ids=tokens).logits.numpy(), ref(input_ids=tokens).logits.numpy(), atol=1e-6
        )


def test_legacy_key_layout_is_detected():
    keys = ["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "language_model.model.norm.weight",
            "language_model.lm_head.weight", "multi_modal_projector.linear_1.weight", "image_newline"]  # fmt: skip
    layout = hf_llava.detect_layout(keys)
    assert (
        layout.vision == "vision_tower.vision_model."
        and layout.text_body == "language_model.model."
    )
    new = hf_llava.detect_layout(["model.vision_tower.embeddings.patch_embedding.weight", "lm_head.weight",
                                  "model.language_model.norm.weight"])  # fmt: skip
    assert new.vision == "model.vision_tower." and new.text_head == "lm_head.weight"


def test_load_onto_sharded_mesh(checkpoint):
    import jax
    from jax.sharding import Mesh

    from dflop_jax.programs.sharding import rules_for
    from models.hf import load_pretrained

    ref, model, cfg = checkpoint
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rules = rules_for("vision")
    sharded, _ = load_pretrained(ref.saved_to, mesh=mesh, rules=rules)
    fc1 = sharded.encoder.vision.layers[0].mlp.fc1[...]
    assert {s.data.shape for s in fc1.addressable_shards} == {(32, 24)}  # "mlp" split over tp=2
    tokens = jnp.asarray([[1, 2, 3, 4, 5, 6]], jnp.int32)
    ones, pos = jnp.ones((1, 6), jnp.int32), jnp.arange(6, dtype=jnp.int32)[None]
    fidx = jnp.full((1, 6), layouts.TEXT, jnp.int32)
    tiles, pool = jnp.zeros((0, TILE, TILE, 3)), jnp.zeros((0,), bool)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        got = nnx.jit(lambda m, *a: m(*a))(sharded, tiles, pool, tokens, ones, pos, fidx)
    want = nnx.jit(lambda m, *a: m(*a))(model, tiles, pool, tokens, ones, pos, fidx)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
