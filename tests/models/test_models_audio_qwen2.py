"""Qwen2-Audio vs HF `Qwen2AudioForConditionalGeneration` (tiny random model, float32): logits on prompts
with clips of several lengths, projector output, gradients against torch autograd, export round trip,
both key layouts, and stages loaded alone."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models_fixtures import save_tiny_qwen2_audio  # noqa: E402

from models.hf import qwen2_audio as hf_qwen2_audio  # noqa: E402
from models.qwen2_audio import Qwen2Audio, audio_feature_index  # noqa: E402

TOL = 1e-5
AUDIO, FRAMES, MELS = 90, 40, 16
VALID = np.array([9, 40, 22])  # valid frames per clip: 2, 10 and 5 audio tokens
run = nnx.jit(lambda m, *a: m(*a))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from models.hf import load_pretrained

    path = save_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"), audio_token=AUDIO)
    ref = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
    model, cfg = load_pretrained(path)
    assert isinstance(model, Qwen2Audio) and cfg.audio_token_id == AUDIO
    return path, ref, model, cfg


def _prompt(cfg, valid):
    """[B,S] token rows: row 0 holds clips 0 and 1 (if given), row 1 the rest, text around them."""
    n = [int(k) for k in cfg.audio.output_lengths(np.asarray(valid))]
    rows = [
        [5, 6, *[AUDIO] * n[0], 7, *[AUDIO] * sum(n[1:2]), 8],
        [9, *[AUDIO] * sum(n[2:]), 10, 11],
    ]
    s = max(map(len, rows))
    return np.array([r + [12] * (s - len(r)) for r in rows], np.int64)


def _inputs(valid, seed=0):
    """HF inputs: features [C, M, 40] padded to the window and feature_attention_mask [C, 40]."""
    x = np.random.default_rng(seed).standard_normal((len(valid), MELS, FRAMES)).astype(np.float32)
    mask = (np.arange(FRAMES)[None] < np.asarray(valid)[:, None]).astype(np.int64)
    return x, mask


def _ours(model, cfg, x, valid, tokens, frames=FRAMES):
    """Our logits with each clip cut to `frames` frames (time-major)."""
    feats = jnp.asarray(x[:, :, :frames].transpose(0, 2, 1))
    out = cfg.audio.output_lengths(np.asarray(valid))
    fidx = audio_feature_index(tokens, AUDIO, out, frames // 4)
    s = tokens.shape[1]
    ones, pos = jnp.ones(tokens.shape, jnp.int32), jnp.broadcast_to(jnp.arange(s), tokens.shape)
    args = (jnp.asarray(valid, jnp.int32), jnp.asarray(tokens, jnp.int32), ones, pos)
    return np.asarray(run(model, feats, *args, jnp.asarray(fidx)))


def _theirs(ref, x, mask, tokens, **kw):
    with torch.no_grad():
        return ref(
            input_ids=torch.from_numpy(tokens), input_features=torch.from_numpy(x),
            feature_attention_mask=torch.from_numpy(mask), **kw,
        ).logits.numpy()  # fmt: skip


def test_logits_match_hf_on_clips_of_several_lengths(checkpoint):
    _, ref, model, cfg = checkpoint
    x, mask = _inputs(VALID)
    tokens = _prompt(cfg, VALID)
    want = _theirs(ref, x, mask, tokens)
    np.testing.assert_allclose(_ours(model, cfg, x, VALID, tokens), want, atol=TOL)


def test_short_clips_run_on_their_own_frames(checkpoint):
    """Clips of 9 and 22 valid frames: HF pads both to 40; we run 24 frames (22 + the two the
    convolutions read past them, rounded up to 4), same logits."""
    _, ref, model, cfg = checkpoint
    valid = VALID[[0, 2]]
    x, mask = _inputs(valid, seed=1)
    tokens = _prompt(cfg, valid)
    want = _theirs(ref, x, mask, tokens)
    np.testing.assert_allclose(_ours(model, cfg, x, valid, tokens, frames=24), want, atol=TOL)


def test_projector_output_matches_hf(checkpoint):
    _, ref, model, cfg = checkpoint
    x, mask = _inputs(VALID, seed=2)
    seen = []
    hook = ref.model.multi_modal_projector.register_forward_hook(
        lambda mod, inp, out: seen.append(out.detach().numpy())
    )
    try:
        _theirs(ref, x, mask, _prompt(cfg, VALID))
    finally:
        hook.remove()
    feats = jnp.asarray(x.transpose(0, 2, 1))
    got = np.asarray(nnx.jit(lambda m, f, n: m(f, n))(model.encoder, feats, jnp.asarray(VALID)))
    assert got.shape == seen[0].shape == (3, FRAMES // 4, cfg.text.hidden_size)
    for c, n in enumerate(cfg.audio.output_lengths(VALID)):
        np.testing.assert_allclose(got[c, :n], seen[0][c, :n], atol=TOL)


def test_loss_gradients_match_torch_autograd(checkpoint):
    from models.hf.io import tensor_maps

    _, ref, model, cfg = checkpoint
    x, mask = _inputs(VALID, seed=3)
    tokens = _prompt(cfg, VALID)
    ref.zero_grad()
    ref.model.audio_tower.embed_positions.weight.requires_grad_(False)  # as HF's __init__
    ref(input_ids=torch.from_numpy(tokens), input_features=torch.from_numpy(x),
        feature_attention_mask=torch.from_numpy(mask), labels=torch.from_numpy(tokens)).loss.backward()  # fmt: skip
    targets = np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    loss_mask = np.ones(tokens.shape, np.float32)
    loss_mask[:, -1] = 0
    fidx = audio_feature_index(tokens, AUDIO, cfg.audio.output_lengths(VALID), FRAMES // 4)
    s = tokens.shape[1]
    args = (jnp.asarray(x.transpose(0, 2, 1)), jnp.asarray(VALID), jnp.asarray(tokens, jnp.int32),
            jnp.ones(tokens.shape, jnp.int32), jnp.broadcast_to(jnp.arange(s), tokens.shape),
            jnp.asarray(fidx), jnp.asarray(targets, jnp.int32), jnp.asarray(loss_mask))  # fmt: skip

    def mean_loss(m):
        total, count = m.loss(*args)
        return total / count

    grads = nnx.jit(nnx.grad(mean_loss))(model)
    want = {k: p.grad for k, p in ref.named_parameters()}
    names = hf_qwen2_audio.name_map(cfg, hf_qwen2_audio.LAYOUT_MODULE)  # torch's module names
    for path, g in nnx.to_flat_state(grads):
        for tm in tensor_maps(names[path]):
            got = np.asarray(tm.to_hf(np.asarray(g[...])))
            if want[tm.hf_key] is None:  # the frozen position table
                assert tm.hf_key.endswith("embed_positions.weight") and not got.any()
                continue
            w = want[tm.hf_key].numpy()
            np.testing.assert_allclose(
                got, w, atol=1e-5 * max(1.0, np.abs(w).max()), err_msg=tm.hf_key
            )


def test_export_round_trip_loads_in_hf_with_our_logits(checkpoint, tmp_path):
    from models.hf import export_tensors, load_pretrained, save_pretrained

    path, ref, model, cfg = checkpoint
    save_pretrained(model, cfg, tmp_path / "ours")
    again, cfg2 = load_pretrained(tmp_path / "ours")
    assert cfg2 == cfg
    exported = dict(export_tensors(model, hf_qwen2_audio.name_map(cfg)))
    for key, value in export_tensors(again, hf_qwen2_audio.name_map(cfg2)):
        np.testing.assert_array_equal(value, exported[key], err_msg=key)
    back = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    assert set(back.state_dict()) == set(ref.state_dict())
    x, mask = _inputs(VALID, seed=4)
    tokens = _prompt(cfg, VALID)
    ours = _ours(model, cfg, x, VALID, tokens)
    np.testing.assert_allclose(_theirs(back, x, mask, tokens), ours, atol=TOL)


def test_module_style_key_layout_loads(checkpoint, tmp_path):
    """A checkpoint written with torch's module names (`model.audio_tower.*`, `lm_head.weight`)."""
    import json

    from models.hf import load_pretrained
    from models.hf.io import write_safetensors

    path, ref, model, cfg = checkpoint
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    assert hf_qwen2_audio.detect_layout(list(state)) == hf_qwen2_audio.LAYOUT_MODULE
    write_safetensors(state, tmp_path)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    loaded, _ = load_pretrained(tmp_path)
    x, _ = _inputs(VALID, seed=5)
    tokens = _prompt(cfg, VALID)
    np.testing.assert_array_equal(
        _ours(loaded, cfg, x, VALID, tokens), _ours(model, cfg, x, VALID, tokens)
    )
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_audio"


def test_stages_loaded_alone_compose_to_the_whole_model(checkpoint):
    from models.hf import load_config, load_stage

    path, _, model, cfg = checkpoint
    assert load_config(path) == cfg
    enc = [load_stage(path, cfg, "encoder", first_layer=i, num_layers=1, has_embedding=i == 0,
                      has_head=i == 1) for i in (0, 1)]  # fmt: skip
    llm = [load_stage(path, cfg, "llm", first_layer=i, num_layers=1, has_embedding=i == 0,
                      has_head=i == 1) for i in (0, 1)]  # fmt: skip
    x, _ = _inputs(VALID, seed=6)
    tokens = _prompt(cfg, VALID)
    feats, n = jnp.asarray(x.transpose(0, 2, 1)), jnp.asarray(VALID)
    clips = enc[1](enc[0](feats, n), n)
    fidx = audio_feature_index(tokens, AUDIO, cfg.audio.output_lengths(VALID), FRAMES // 4)
    s = tokens.shape[1]
    ones, pos = jnp.ones(tokens.shape, jnp.int32), jnp.broadcast_to(jnp.arange(s), tokens.shape)
    h = llm[0].embed(jnp.asarray(tokens, jnp.int32), clips, jnp.asarray(fidx))
    logits = llm[1].logits(llm[1](llm[0](h, ones, pos), ones, pos))
    np.testing.assert_allclose(np.asarray(logits), _ours(model, cfg, x, VALID, tokens), atol=1e-6)


def test_feature_index_counts_tokens_against_features():
    tokens = np.array([[1, AUDIO, AUDIO, 2], [AUDIO, 3, 4, 5]])
    idx = audio_feature_index(tokens, AUDIO, [2, 1], slots=4)
    np.testing.assert_array_equal(idx, [[-1, 0, 1, -1], [4, -1, -1, -1]])
    with pytest.raises(ValueError, match="3 audio tokens but 4 audio features"):
        audio_feature_index(tokens, AUDIO, [2, 2], slots=4)


def test_stage_exports_cover_the_checkpoint(checkpoint):
    """`module_tensors` (the trainer's layout-free export) names every tensor of the checkpoint
    once, and `unread_tensors` finds none the model skips."""
    from models.hf import module_tensors, unread_tensors
    from models.hf.io import CheckpointReader

    path, _, _, cfg = checkpoint
    keys = CheckpointReader(path).keys()
    written = [tm.hf_key for m in ("encoder", "llm") for _, _, tm in module_tensors(cfg, m)]
    assert sorted(written) == keys
    assert unread_tensors(cfg, keys) == {}


def test_load_onto_sharded_mesh(checkpoint):
    import jax
    from jax.sharding import Mesh

    from dflop_jax.programs.sharding import rules_for
    from models.hf import load_pretrained

    path, _, model, cfg = checkpoint
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rules = rules_for("vision")
    sharded, _ = load_pretrained(path, mesh=mesh, rules=rules)
    fc1 = sharded.encoder.audio.layers[0].mlp.fc1[...]
    assert {s.data.shape for s in fc1.addressable_shards} == {(32, 24)}  # "mlp" split over tp=2
    x, _ = _inputs(VALID, seed=7)
    tokens = _prompt(cfg, VALID)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        got = _ours(sharded, cfg, x, VALID, tokens)
    np.testing.assert_allclose(got, _ours(model, cfg, x, VALID, tokens), atol=1e-5)
