"""Whisper / Qwen2-Audio encoders vs HF transformers (tiny random models, float32): last hidden state,
variable length against HF's padded-and-masked path, gradients against torch autograd, export, stage
split, remat and the named configs' sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.whisper import WHISPER_PRESETS, AudioStage, AudioTower, WhisperEncoderConfig

TOL = 1e-5
FRAMES, MELS = 40, 16  # the tiny encoders' window (models_fixtures.TINY_AUDIO_ENCODER)
run = nnx.jit(lambda m, x, n=None: m(x, n))


def _features(n, seed=0, frames=FRAMES):
    """[n, M, F] float32 log-mel-like features in HF's layout."""
    return np.random.default_rng(seed).standard_normal((n, MELS, frames)).astype(np.float32)


def _ours(model, x, lengths=None):
    """Our encoder on HF-layout features [B, M, F] -> numpy [B, T, D]."""
    n = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    return np.asarray(run(model, jnp.asarray(x.transpose(0, 2, 1)), n))


@pytest.mark.hf
@pytest.mark.parametrize("encoder_only", [False, True])
def test_whisper_encoder_matches_hf_and_exports(tmp_path, encoder_only):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models_fixtures import save_tiny_whisper
    from transformers import WhisperForConditionalGeneration
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from models.hf import load_pretrained, save_pretrained

    path = save_tiny_whisper(tmp_path / "hf", encoder_only=encoder_only)
    ours, cfg = load_pretrained(path)  # a full Whisper: the encoder, decoder tensors skipped
    assert isinstance(ours, AudioTower) and cfg.pool == 1 and cfg.num_mel_bins == MELS
    if encoder_only:
        ref = WhisperEncoder.from_pretrained(path).eval()
    else:
        ref = WhisperForConditionalGeneration.from_pretrained(path).model.encoder.eval()
    x = _features(2)
    with torch.no_grad():
        want = ref(torch.from_numpy(x)).last_hidden_state.numpy()
    np.testing.assert_allclose(_ours(ours, x), want, atol=TOL)
    save_pretrained(ours, cfg, tmp_path / "ours")
    back = WhisperEncoder.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        again = back(torch.from_numpy(x)).last_hidden_state.numpy()
    np.testing.assert_array_equal(again, want)


def _hf_qwen2_audio_encoder(tmp_path):
    from models_fixtures import save_tiny_qwen2_audio
    from transformers import Qwen2AudioForConditionalGeneration

    from models.hf import load_pretrained

    path = save_tiny_qwen2_audio(tmp_path / "qwen2_audio")
    ref = Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
    tower = ref.model.audio_tower
    tower.save_pretrained(tmp_path / "tower")  # model_type qwen2_audio_encoder
    ours, cfg = load_pretrained(tmp_path / "tower")
    return tower, ours, cfg


@pytest.mark.hf
def test_qwen2_audio_encoder_full_window_matches_hf(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tower, ours, cfg = _hf_qwen2_audio_encoder(tmp_path)
    assert cfg.pool == 2 and cfg.output_lengths(FRAMES) == FRAMES // 4
    x = _features(3, seed=1)
    with torch.no_grad():
        want = tower(torch.from_numpy(x)).last_hidden_state.numpy()  # pooled, then layer_norm
    got = _ours(ours, x)
    assert got.shape == (3, FRAMES // 4, cfg.hidden_size)
    np.testing.assert_allclose(got, want, atol=TOL)


def _hf_masked(tower, x, valid):
    """HF's encoder on features [C, M, F] padded to the window, keys past each clip's conv outputs
    masked as `Qwen2AudioModel.forward` builds the mask from `feature_attention_mask`."""
    import torch
    from transformers.masking_utils import create_bidirectional_mask

    conv, _ = tower._get_feat_extract_output_lengths(torch.as_tensor(valid))
    t = x.shape[2] // 2
    keep = (torch.arange(t)[None, :] < conv[:, None]).long()
    dummy = torch.zeros(len(valid), t, 1)
    mask = create_bidirectional_mask(config=tower.config, inputs_embeds=dummy, attention_mask=keep)
    with torch.no_grad():
        return tower(torch.from_numpy(x), attention_mask=mask).last_hidden_state.numpy()


@pytest.mark.hf
def test_qwen2_audio_encoder_variable_length_matches_hf_masked(tmp_path):
    """Short clips: HF pads to the window and masks; we run only the frames the clip needs (its
    valid frames plus the two the convolutions read past them, rounded up to 4) and mask within."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tower, ours, cfg = _hf_qwen2_audio_encoder(tmp_path)
    x = _features(3, seed=2)
    valid = np.array([9, 20, 40])
    want = _hf_masked(tower, x, valid)
    out_n = cfg.output_lengths(valid)
    assert list(out_n) == [2, 5, 10]
    full = _ours(ours, x, valid)  # the whole window, masked as HF
    for c, n in enumerate(valid):
        np.testing.assert_allclose(full[c, : out_n[c]], want[c, : out_n[c]], atol=TOL)
        frames = min(-(-(n + 2) // 4) * 4, FRAMES)
        short = _ours(ours, x[c : c + 1, :, :frames], [n])
        assert short.shape[1] == frames // 4
        np.testing.assert_allclose(short[0, : out_n[c]], want[c, : out_n[c]], atol=TOL)
    unmasked = _ours(ours, x[:1])  # the mask is what makes a short clip match
    assert np.abs(unmasked[0, : out_n[0]] - want[0, : out_n[0]]).max() > 1e-3
    # ... and so do the two frames past the clip: cut at its 20 valid frames, the last valid conv
    # output reads conv zero padding where HF reads frame 20
    cut = _ours(ours, x[1:2, :, :20], [20])
    assert np.abs(cut[0, : out_n[1]] - want[1, : out_n[1]]).max() > 1e-3


@pytest.mark.hf
def test_data_layer_features_give_hf_encoder_outputs(tmp_path):
    """A 1.28 s clip end to end: HF's feature extractor (padded to 30 s) and its masked encoder,
    against `dflop_jax.data.audio`'s 132 kept frames (128 valid) through ours (80 mel bins, a
    1500-position table)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("av")
    from models_fixtures import TINY_AUDIO_ENCODER, _randomize_all
    from transformers.models.whisper import feature_extraction_whisper as fx

    from dflop_jax.data.audio import audio_windows
    from models.hf import load_pretrained

    shape = {**TINY_AUDIO_ENCODER, "num_mel_bins": 80, "max_source_positions": 1500}
    torch.manual_seed(0)
    tower = transformers.Qwen2AudioEncoder(transformers.Qwen2AudioEncoderConfig(**shape)).eval()
    _randomize_all(tower, 0)
    tower.save_pretrained(tmp_path)
    ours, cfg = load_pretrained(tmp_path)
    t = np.arange(int(1.28 * 16000)) / 16000
    clip = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * np.random.default_rng(0).standard_normal(
        t.size
    )
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    with pytest.MonkeyPatch.context() as mp:  # HF's float64 numpy path, as the data layer computes
        mp.setattr(fx, "is_torch_available", lambda: False)
        hf = fe(clip.astype(np.float32), sampling_rate=16000, return_attention_mask=True)
    valid = int(np.sum(hf["attention_mask"]))
    want = _hf_masked(tower, np.asarray(hf["input_features"], np.float32), [valid])
    (window,) = audio_windows(clip.astype(np.float32), "clip", n_mels=80)
    assert window.valid_frames == valid == 128 and window.features.shape == (132, 80)
    got = np.asarray(run(ours, jnp.asarray(window.features[None]), jnp.asarray([valid])))
    n = cfg.output_lengths(valid)
    assert got.shape[1] == 33 and n == 32
    np.testing.assert_allclose(got[0, :n], want[0, :n], atol=TOL)


@pytest.mark.hf
def test_encoder_gradients_match_torch_autograd(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models.hf.io import tensor_maps
    from models.hf.whisper import whisper_name_map

    tower, ours, cfg = _hf_qwen2_audio_encoder(tmp_path)
    x = _features(2, seed=3)
    weight = np.random.default_rng(4).standard_normal((2, FRAMES // 4, cfg.hidden_size))
    # Frozen as HF's __init__ (and OpenAI's buffer) has it; transformers 5's from_pretrained
    # turns requires_grad back on, so set it again.
    tower.embed_positions.weight.requires_grad_(False)
    xt = torch.from_numpy(x).requires_grad_(True)
    (tower(xt).last_hidden_state * torch.from_numpy(weight).float()).sum().backward()

    def loss(model, feats):
        return jnp.sum(model(feats) * jnp.asarray(weight, jnp.float32))

    grads, g_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(ours, jnp.asarray(x.transpose(0, 2, 1)))
    _close(np.asarray(g_x).transpose(0, 2, 1), xt.grad.numpy(), "input features")
    want = {k: p.grad for k, p in tower.named_parameters()}
    names = whisper_name_map(cfg)
    for path, g in nnx.to_flat_state(grads):
        for tm in tensor_maps(names[path]):
            got = np.asarray(tm.to_hf(np.asarray(g[...])))
            if want[tm.hf_key] is None:  # embed_positions: frozen in HF, zero gradient here
                assert tm.hf_key == "embed_positions.weight" and not got.any()
                continue
            _close(got, want[tm.hf_key].numpy(), tm.hf_key)


def _close(got, want, name):
    """float32 sums of O(100) products: agreement to 1e-5 of the gradient's own scale."""
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), err_msg=name)


def _tiny(**changes):
    base = WhisperEncoderConfig(hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                                num_mel_bins=MELS, max_source_positions=20, pool=2)  # fmt: skip
    return base.replace(**changes)


def _weight(cfg):
    """A fixed random cotangent for the encoder's output [2, F/4, D]."""
    shape = (2, FRAMES // 4, cfg.hidden_size)
    return jnp.asarray(np.random.default_rng(9).standard_normal(shape), jnp.float32)


def test_audio_stage_split_equals_whole_in_value_and_grad():
    cfg = _tiny()
    whole = AudioTower(cfg, rngs=nnx.Rngs(3))
    flags = dict(rngs=nnx.Rngs(3))
    first = AudioStage(
        cfg, first_layer=0, num_layers=2, has_embedding=True, has_head=False, **flags
    )
    second = AudioStage(
        cfg, first_layer=2, num_layers=2, has_embedding=False, has_head=True, **flags
    )
    flat = dict(nnx.to_flat_state(nnx.state(whole.stage, nnx.Param)))
    for stage, offset in ((first, 0), (second, 2)):  # keyed init: a stage alone draws the same
        for path, var in nnx.to_flat_state(nnx.state(stage, nnx.Param)):
            src = ("layers", path[1] + offset, *path[2:]) if path[0] == "layers" else path
            np.testing.assert_array_equal(var[...], flat[src][...])
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, FRAMES, MELS)), jnp.float32)
    n = jnp.asarray([13, 40], jnp.int32)
    w = _weight(cfg)
    lw, gw = nnx.jit(nnx.value_and_grad(lambda m: jnp.sum((m(x, n) * w) ** 2)))(whole)
    split = nnx.value_and_grad(lambda a, b: jnp.sum((b(a(x, n), n) * w) ** 2), argnums=(0, 1))
    ls, (ga, gb) = nnx.jit(split)(first, second)
    np.testing.assert_allclose(ls, lw, rtol=1e-6)
    gw_flat = dict(nnx.to_flat_state(gw))
    for grads, offset in ((ga, 0), (gb, 2)):
        for path, g in nnx.to_flat_state(grads):
            src = ("layers", path[1] + offset, *path[2:]) if path[0] == "layers" else path
            np.testing.assert_allclose(g[...], gw_flat[("stage", *src)][...], atol=1e-5)


def test_audio_remat_matches_plain():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, FRAMES, MELS)), jnp.float32)
    n = jnp.asarray([21, 36], jnp.int32)

    w = _weight(_tiny())

    def loss(m):  # weighted: a plain sum(out ** 2) is constant after the final LayerNorm
        return jnp.sum((m(x, n) * w) ** 2)

    plain = nnx.jit(nnx.value_and_grad(loss))(AudioTower(_tiny(), rngs=nnx.Rngs(1)))
    remat = nnx.jit(nnx.value_and_grad(loss))(AudioTower(_tiny(remat="full"), rngs=nnx.Rngs(1)))
    np.testing.assert_allclose(remat[0], plain[0], rtol=1e-6)
    want = dict(nnx.to_flat_state(plain[1]))
    # Remat recomputes each layer's forward inside its backward, an order of float32 operations
    # XLA:CPU vectorizes differently per CPU model (an AMD EPYC host differs from the plain
    # gradient by 1.06e-6 of a leaf's largest entry, about 9 float32 ulps): 4e-6 of the largest
    # (32 ulps) bounds that round-off; a wrong rematerialization differs by whole values.
    for path, g in nnx.to_flat_state(remat[1]):
        np.testing.assert_allclose(
            g[...], want[path][...], atol=4e-6 * np.abs(want[path][...]).max()
        )


def test_frame_count_is_checked():
    tower = AudioTower(_tiny(num_layers=1), rngs=nnx.Rngs(0))
    for frames in (42, 44):  # not a multiple of 4; past the 40-frame window
        with pytest.raises(ValueError, match="multiple of 4 and at most 40"):
            tower(jnp.zeros((1, frames, MELS)))


def _count(cfg) -> int:
    abstract = nnx.eval_shape(lambda: AudioTower(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    "name, published",
    [
        # HF meta-device counts of the encoders (WhisperEncoder of openai/whisper-large-v3 and
        # openai/whisper-base; Qwen2AudioEncoder of Qwen/Qwen2-Audio-7B), positions included.
        ("whisper-large-v3", 636_968_960),
        ("whisper-base", 20_590_592),
        ("qwen2-audio", 636_968_960),
    ],
)
def test_named_audio_configs_param_counts(name, published):
    assert _count(WHISPER_PRESETS[name]) == published


def _packed_row(x, valid, pad_to: int):
    """Clips [C, M, F] (HF layout) packed into one row: each clip's kept frames (valid + 2, rounded
    up to 4, at most the window) back to back, then padding to `pad_to` frames. Returns features
    [1, pad_to, M], windows and valid [1, pad_to], and each clip's first frame."""
    feats, windows, ok, starts = [], [], [], []
    at = 0
    for c, n in enumerate(valid):
        kept = min(-(-(int(n) + 2) // 4) * 4, FRAMES)
        feats.append(x[c, :, :kept].T)
        windows += [c + 1] * kept
        ok += [True] * int(n) + [False] * (kept - int(n))
        starts.append(at)
        at += kept
    rest = pad_to - at
    row = np.concatenate([*feats, np.zeros((rest, MELS), np.float32)])[None]
    windows = np.array([windows + [0] * rest], np.int32)
    ok = np.array([ok + [False] * rest])
    return row, windows, ok, starts


@pytest.mark.hf
def test_packed_windows_match_hf_clip_by_clip(tmp_path):
    """Three clips in one row (kept frames 12 + 40 + 24, then 4 of padding): each window's valid
    outputs equal HF's on that clip alone, padded to the window and masked; the row costs 80 frames
    where one window per clip would cost 120."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tower, ours, cfg = _hf_qwen2_audio_encoder(tmp_path)
    x = _features(3, seed=7)
    valid = np.array([9, 40, 22])
    want = _hf_masked(tower, x, valid)
    row, windows, ok, starts = _packed_row(x, valid, pad_to=80)
    got = nnx.jit(lambda m, *a: m.stage(*a))(
        ours, jnp.asarray(row), None, jnp.asarray(windows), jnp.asarray(ok)
    )
    got = np.asarray(got)[0]
    assert got.shape[0] == 80 // 4
    for c, n in enumerate(cfg.output_lengths(valid)):
        first = starts[c] // 4
        np.testing.assert_allclose(got[first : first + n], want[c, :n], atol=TOL)
    # The windows are what keep the clips apart: one window over the whole row does not match.
    mixed = nnx.jit(lambda m, *a: m.stage(*a))(
        ours, jnp.asarray(row), None, jnp.asarray(np.minimum(windows, 1)), jnp.asarray(ok)
    )
    n1 = cfg.output_lengths(valid)[1]
    first = starts[1] // 4
    assert np.abs(np.asarray(mixed)[0, first : first + n1] - want[1, :n1]).max() > 1e-3
