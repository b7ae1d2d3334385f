"""The omni model (LLaVA-OV vision + Qwen2-Audio audio + one decoder) built from two HF checkpoints,
against transformers (float32): on video prompts it is `LlavaOnevisionForConditionalGeneration`, on
audio prompts `Qwen2AudioForConditionalGeneration` with the LLaVA-OV decoder, and on a prompt holding
both, the decoder run on the embeddings each HF model places for its own modality. Its export loads
in each HF class with our logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models_fixtures import (  # noqa: E402
    TINY_PATCH,
    TINY_TILE,
    save_tiny_llava_ov,
    save_tiny_qwen2_audio,
)

from models import layouts  # noqa: E402
from models.hf.io import CheckpointError  # noqa: E402
from models.hf.omni import load_omni, save_omni  # noqa: E402
from models.qwen2_audio import audio_feature_index  # noqa: E402

TOL = 1e-4
VIDEO, AUDIO = 91, 92
FRAMES, MELS, CLIP_FRAMES = 3, 16, 40
VALID = np.array([9, 40])  # valid mel frames per clip: 2 and 10 audio tokens
run = nnx.jit(lambda m, *a: m(*a))


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(vision dir, audio dir, the HF LLaVA-OV, the HF Qwen2-Audio given LLaVA-OV's decoder)."""
    root = tmp_path_factory.mktemp("omni")
    vision = save_tiny_llava_ov(root / "vision", video_token=VIDEO)
    audio = save_tiny_qwen2_audio(root / "audio", audio_token=AUDIO, hidden_size=32,
                                  intermediate_size=64)  # fmt: skip
    ref_v = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(vision).eval()
    ref_a = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(audio).eval()
    ref_a.model.language_model.load_state_dict(ref_v.model.language_model.state_dict())
    ref_a.lm_head.load_state_dict(ref_v.lm_head.state_dict())
    return vision, audio, ref_v, ref_a


@pytest.fixture(scope="module")
def omni(parts):
    vision, audio, _, _ = parts
    return load_omni(vision, audio)


def _inputs(cfg, video: bool, clips: bool, seed: int = 0):
    """Token row and each modality's inputs (HF's and ours) for a prompt of text around a 3-frame
    video and/or two audio clips."""
    rng = np.random.default_rng(seed)
    layout = layouts.llava_ov_video_layout(FRAMES, patches_per_side=TINY_TILE // TINY_PATCH)
    n_audio = [int(k) for k in cfg.audio.audio.output_lengths(VALID)] if clips else []
    ids = [1, 2] + [VIDEO] * (layout.num_tokens if video else 0) + [3]
    ids += [AUDIO] * (n_audio[0] if clips else 0) + [4] + [AUDIO] * sum(n_audio[1:]) + [5]
    tokens = np.array([ids], np.int64)
    px = rng.standard_normal((1, FRAMES, 3, TINY_TILE, TINY_TILE)).astype(np.float32)
    mel = rng.standard_normal((len(VALID), MELS, CLIP_FRAMES)).astype(np.float32)
    mask = (np.arange(CLIP_FRAMES)[None] < VALID[:, None]).astype(np.int64)
    fidx = np.full(tokens.shape, layouts.TEXT, np.int32)
    if video:
        fidx[0, 2 : 2 + layout.num_tokens] = layout.offset(0)
    return tokens, px, mel, mask, fidx


def _ours(model, cfg, tokens, px, mel, fidx, video: bool, clips: bool):
    s = tokens.shape[1]
    tiles = jnp.asarray(px[0].transpose(0, 2, 3, 1)) if video else jnp.zeros((0, 28, 28, 3))
    audio = jnp.asarray(mel.transpose(0, 2, 1)) if clips else jnp.zeros((0, CLIP_FRAMES, MELS))
    out = cfg.audio.audio.output_lengths(VALID) if clips else []
    aidx = audio_feature_index(tokens, AUDIO, out, CLIP_FRAMES // 4)
    return np.asarray(run(
        model, tiles, jnp.ones(tiles.shape[0], bool), audio, jnp.asarray(VALID[: audio.shape[0]]),
        jnp.asarray(tokens, jnp.int32), jnp.ones((1, s), jnp.int32),
        jnp.arange(s, dtype=jnp.int32)[None], jnp.asarray(fidx[..., None]), jnp.asarray(aidx),
        jnp.ones((*fidx.shape, 1), jnp.float32),
    ))  # fmt: skip


def _hf_video(ref_v, tokens, px, **kw):
    with torch.no_grad():
        return ref_v(input_ids=torch.from_numpy(tokens), pixel_values_videos=torch.from_numpy(px),
                     **kw)  # fmt: skip


def _hf_audio(ref_a, tokens, mel, mask, **kw):
    with torch.no_grad():
        return ref_a(input_ids=torch.from_numpy(tokens), input_features=torch.from_numpy(mel),
                     feature_attention_mask=torch.from_numpy(mask), **kw)  # fmt: skip


def _decoder_input(model, call) -> torch.Tensor:
    """The embeddings `call()` hands the HF decoder `model` (a forward pre-hook)."""
    seen = {}

    def keep(_module, _args, kwargs):
        seen["h"] = kwargs["inputs_embeds"]  # returns None: the call goes on unchanged

    hook = model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        call()
    finally:
        hook.remove()
    return seen["h"]


def test_video_prompt_is_llava_onevision(parts, omni):
    _, _, ref_v, _ = parts
    model, cfg = omni
    tokens, px, mel, mask, fidx = _inputs(cfg, video=True, clips=False, seed=1)
    want = _hf_video(ref_v, tokens, px).logits.numpy()
    got = _ours(model, cfg, tokens, px, mel, fidx, video=True, clips=False)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_audio_prompt_is_qwen2_audio_on_the_same_decoder(parts, omni):
    _, _, _, ref_a = parts
    model, cfg = omni
    tokens, px, mel, mask, fidx = _inputs(cfg, video=False, clips=True, seed=2)
    want = _hf_audio(ref_a, tokens, mel, mask).logits.numpy()
    got = _ours(model, cfg, tokens, px, mel, fidx, video=False, clips=True)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_a_prompt_with_video_and_audio(parts, omni):
    """The reference: each HF model places its own modality's features (the other's tokens keep
    their token embedding); the audio positions come from Qwen2-Audio's embeddings, the rest from
    LLaVA-OV's, and LLaVA-OV's decoder and head run on the result."""
    _, _, ref_v, ref_a = parts
    model, cfg = omni
    tokens, px, mel, mask, fidx = _inputs(cfg, video=True, clips=True, seed=3)
    h_v = _decoder_input(ref_v.model.language_model, lambda: _hf_video(ref_v, tokens, px))
    h_a = _decoder_input(ref_a.model.language_model, lambda: _hf_audio(ref_a, tokens, mel, mask))
    heard = torch.from_numpy(tokens == AUDIO)[..., None]
    assert heard.sum() == sum(cfg.audio.audio.output_lengths(VALID))
    with torch.no_grad():
        h = ref_v.model.language_model(inputs_embeds=torch.where(heard, h_a, h_v))
        want = ref_v.lm_head(h.last_hidden_state).numpy()
    got = _ours(model, cfg, tokens, px, mel, fidx, video=True, clips=True)
    np.testing.assert_allclose(got, want, atol=TOL)
    # Both encoders matter here: other frames or other clips move the logits.
    for other_px, other_mel in ((px + 1.0, mel), (px, mel + 1.0)):
        moved = _ours(model, cfg, tokens, other_px, other_mel, fidx, video=True, clips=True)
        assert np.abs(moved - got).max() > 1e-3


def test_export_loads_in_each_hf_class_with_our_logits(parts, omni, tmp_path):
    model, cfg = omni
    save_omni(model, cfg, tmp_path)
    back_v = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        tmp_path / "vision"
    ).eval()
    back_a = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
        tmp_path / "audio"
    ).eval()
    assert set(back_v.state_dict()) == set(parts[2].state_dict())
    assert set(back_a.state_dict()) == set(parts[3].state_dict())
    tokens, px, mel, mask, fidx = _inputs(cfg, video=True, clips=False, seed=4)
    np.testing.assert_allclose(
        _hf_video(back_v, tokens, px).logits.numpy(),
        _ours(model, cfg, tokens, px, mel, fidx, video=True, clips=False),
        atol=TOL,
    )
    tokens, px, mel, mask, fidx = _inputs(cfg, video=False, clips=True, seed=5)
    np.testing.assert_allclose(
        _hf_audio(back_a, tokens, mel, mask).logits.numpy(),
        _ours(model, cfg, tokens, px, mel, fidx, video=False, clips=True),
        atol=TOL,
    )
    again, cfg2 = load_omni(tmp_path / "vision", tmp_path / "audio")
    assert cfg2 == cfg
    tokens, px, mel, mask, fidx = _inputs(cfg, video=True, clips=True, seed=6)
    np.testing.assert_array_equal(
        _ours(again, cfg, tokens, px, mel, fidx, video=True, clips=True),
        _ours(model, cfg, tokens, px, mel, fidx, video=True, clips=True),
    )


def test_mismatched_checkpoints_are_refused_in_one_line(parts, tmp_path):
    vision, audio, _, _ = parts
    with pytest.raises(CheckpointError, match="needs a LLaVA-OneVision one"):
        load_omni(audio, audio)
    narrow = save_tiny_qwen2_audio(tmp_path / "narrow", audio_token=AUDIO)  # a 24-wide LLM
    with pytest.raises(CheckpointError, match="24-wide features but the decoder is 32 wide"):
        load_omni(vision, narrow)
