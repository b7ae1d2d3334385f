"""Dummy model builders shared by the models tests: tiny decoder configs and tiny random HF models
written with `save_pretrained` to a tmp dir (no download), and the logits parity of an exported
LLaVA-OV with transformers. HF builders import torch/transformers lazily; callers skip with
`pytest.importorskip` first."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.decoder_config import DecoderConfig
from models.layers import Llama3RopeScaling


def tiny_decoder_config(**changes) -> DecoderConfig:
    """A 3-layer GQA decoder (H=4, K=2, Dh=8) small enough for CPU gradient tests."""
    base = DecoderConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        qkv_bias=True,
        tie_embeddings=False,
        max_position_embeddings=128,
    )
    return base.replace(**changes)


TINY_LLAMA3_SCALING = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)


def tiny_llava_ov_config():
    """A 2-layer SigLIP + 2-layer decoder LLaVA-OV config (28 px tiles of 7 px patches: 16 feature
    rows per tile) for tests of how features move, where the model's size is not the subject."""
    from models.llava_onevision import llava_onevision_config
    from models.siglip import SiglipConfig

    text = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    vision = SiglipConfig(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                          image_size=28, patch_size=7)  # fmt: skip
    return llava_onevision_config(vision, text)


def _save(model, path: Path) -> Path:
    model.eval()
    model.save_pretrained(path)
    return path


def save_tiny_qwen2(path: Path, *, tied: bool, seed: int = 0, **changes) -> Path:
    """Tiny random Qwen2ForCausalLM (GQA 4/2 heads, qkv bias) saved to `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        tie_word_embeddings=tied,
    )
    kwargs.update(changes)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    _randomize_biases(model, seed)
    return _save(model, path)


def save_tiny_llama(path: Path, *, llama3_scaling: bool, seed: int = 0, **changes) -> Path:
    """Tiny random LlamaForCausalLM (GQA 4/2 heads), optionally with llama3 rope scaling."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if llama3_scaling:
        s = TINY_LLAMA3_SCALING
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    kwargs = dict(
        vocab_size=89,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )
    kwargs.update(changes)
    model = LlamaForCausalLM(LlamaConfig(**kwargs))
    return _save(model, path)


def _randomize_biases(model, seed: int) -> None:
    """HF initializes biases to zero; random ones make the bias mapping observable in parity tests."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(
                    torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0)
                )


def hf_logits(path: Path, input_ids):
    """Logits [B,S,V] float32 numpy of the HF model saved at `path` (torch CPU, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(input_ids, dtype=torch.long))
    return out.logits.float().numpy()


# The tiny exported models' image geometry in px (4 x 4 patches per tile), and how close our logits
# (float32) must be to those of transformers on their export's HF directory.
TINY_TILE, TINY_PATCH = 28, 7
HF_LOGITS_TOL = 1e-4


def assert_llava_ov_logits_equal(
    hf_dir, ours, model_cfg, tile: int = TINY_TILE, patch: int = TINY_PATCH
) -> None:
    """transformers' LLaVA-OV loaded from `hf_dir` and our `ours` give the same logits (float32) on
    text around a 3-frame video of `tile`-px frames."""
    import jax.numpy as jnp
    import torch
    import transformers
    from flax import nnx

    from models import layouts

    ref = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(hf_dir).eval()
    frames, vid = 3, model_cfg.video_token_id
    layout = layouts.llava_ov_video_layout(frames, patches_per_side=tile // patch)
    px = np.random.default_rng(5).standard_normal((1, frames, 3, tile, tile)).astype(np.float32)
    tokens = np.array([[1, 2] + [vid] * layout.num_tokens + [3, 4]], np.int32)
    with torch.no_grad():
        want = ref(
            input_ids=torch.from_numpy(tokens).long(), pixel_values_videos=torch.from_numpy(px)
        ).logits.numpy()
    fidx = np.concatenate([[layouts.TEXT] * 2, layout.offset(0), [layouts.TEXT] * 2])
    fidx = fidx[None, :, None].astype(np.int32)
    s = tokens.shape[1]
    got = nnx.jit(lambda m, *a: m(*a))(
        ours,
        jnp.asarray(px[0].transpose(0, 2, 3, 1)),
        jnp.ones(frames, bool),
        jnp.asarray(tokens),
        jnp.ones((1, s), jnp.int32),
        jnp.arange(s, dtype=jnp.int32)[None],
        jnp.asarray(fidx),
        jnp.ones(fidx.shape, jnp.float32),
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=HF_LOGITS_TOL)


def assert_qwen2_audio_logits_equal(hf_dir, ours, omni_cfg, valid=(9, 40)) -> None:
    """transformers' Qwen2-Audio loaded from `hf_dir` and our model `ours` (`models.omni.Omni` of
    config `omni_cfg`, or `models.qwen2_audio.Qwen2Audio` of its config) give the same logits
    (float32) on text around two audio clips of `valid` mel frames, each padded to a whole window
    (as HF requires), with no image."""
    import jax.numpy as jnp
    import torch
    import transformers
    from flax import nnx

    from models import layouts
    from models.qwen2_audio import Qwen2Audio, audio_feature_index

    ref = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(hf_dir).eval()
    alone = isinstance(ours, Qwen2Audio)
    a, valid = (omni_cfg if alone else omni_cfg.audio), np.asarray(valid)
    frames = 2 * a.audio.max_source_positions
    outputs = a.audio.output_lengths(valid)
    tok = a.audio_token_id
    tokens = np.array([[1, 2] + [tok] * int(outputs[0]) + [3] + [tok] * int(outputs[1]) + [4]])
    mel = np.random.default_rng(6).standard_normal((len(valid), a.audio.num_mel_bins, frames))
    mel = mel.astype(np.float32)
    mask = (np.arange(frames)[None] < valid[:, None]).astype(np.int64)
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(tokens), input_features=torch.from_numpy(mel),
                   feature_attention_mask=torch.from_numpy(mask)).logits.numpy()  # fmt: skip
    s = tokens.shape[1]
    audio = (jnp.asarray(mel.transpose(0, 2, 1)), jnp.asarray(valid))
    text = (jnp.asarray(tokens, jnp.int32), jnp.ones((1, s), jnp.int32),
            jnp.arange(s, dtype=jnp.int32)[None])  # fmt: skip
    audio_index = jnp.asarray(audio_feature_index(tokens, tok, outputs, frames // 4))
    if alone:
        got = nnx.jit(lambda m, *x: m(*x))(ours, *audio, *text, audio_index)
    else:
        px = omni_cfg.vision.image_size
        got = nnx.jit(lambda m, *x: m(*x))(
            ours, jnp.zeros((0, px, px, 3), jnp.uint8), jnp.zeros((0,), bool), *audio, *text,
            jnp.full((1, s, 1), layouts.TEXT, jnp.int32), audio_index,
            jnp.ones((1, s, 1), jnp.float32),
        )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want, atol=HF_LOGITS_TOL)


# The trainer tests' tiny decoder as config overrides (each test adds model.kind, layout and data).
TINY_TRAIN_DECODER = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=8",
]


def tiny_decoder_run(tmp_path: Path, name: str, samples: int, **over) -> list[str]:
    """Config overrides of a single-process run of the tiny decoder on text: 2 LLM stages of one layer
    (tp 1 and 2, dp 2) at one 256-token bucket. One list for every in-process trainer test, so their
    stage programs are the same (compiled once per test run: tests/conftest.py shares the cache);
    `over` (dotted key -> value) adds or replaces keys."""
    base = {
        "model.kind": "decoder",
        "layout.encoder_layers": "[]",
        **dict(x.split("=", 1) for x in TINY_TRAIN_DECODER),
        "data.synth_dir": str(tmp_path / "synth"),
        "data.synth_mix": "text",
        "data.synth_samples": samples,
        "data.max_tokens": 256,
        "data.cache_dir": "",
        "layout.llm_layers": "[1, 1]",
        "layout.llm_tp": "[1, 2]",
        "layout.llm_dp": 2,
        "layout.lengths": "[256]",
        "scheduler.solver": "greedy",
        "optimizer.lr": 0.01,
        "optimizer.warmup_steps": 1,
        "optimizer.decay_steps": 20,
        "global_batch": 8,
        "compute_dtype": "float32",
        "compilation_cache": "",
        "run_dir": str(tmp_path / name),
        "device.peak_flops": 1000000000.0,
    }
    return [f"{k}={v}" for k, v in {**base, **over}.items()]


def save_tiny_llava_ov(
    path: Path,
    *,
    layers: int = 2,
    seed: int = 0,
    image_token: int = 90,
    video_token: int = 91,
    vision_use_head: bool = False,
    **text,
) -> Path:
    """Tiny random LlavaOnevisionForConditionalGeneration (28 px tiles, 7 px patches) saved to `path`;
    `text` changes its Qwen2 config (e.g. `vocab_size`). Its SigLIP tower has a post-layernorm and,
    with `vision_use_head`, a pooling head: tensors LLaVA-OV never reads."""
    import torch
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        image_size=28, patch_size=7, vision_use_head=vision_use_head,
    )  # fmt: skip
    text_cfg = transformers.Qwen2Config(**{
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False, **text,
    })  # fmt: skip
    cfg = transformers.LlavaOnevisionConfig(
        vision_config=vision.to_dict(), text_config=text_cfg.to_dict(),
        image_token_index=image_token, video_token_index=video_token,
    )  # fmt: skip
    torch.manual_seed(seed)
    return _save(transformers.LlavaOnevisionForConditionalGeneration(cfg), path)


def save_tiny_internvl(path: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """Tiny random InternVLForConditionalGeneration (InternViT 28 px tiles + Qwen2) saved to `path`;
    the vision tower's constant-initialized layer scales / CLS / positions are randomized."""
    import torch
    import transformers
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    vision = InternVLVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        image_size=28, patch_size=7,
    )  # fmt: skip
    text = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    cfg = transformers.InternVLConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=90
    )
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.model.vision_tower.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return _save(model, path)


def packed_segment_ids(s: int, lengths) -> np.ndarray:
    """[S] segment ids 1.. of consecutive samples of `lengths` (a negative length: a padding run),
    0 for the tail: a packed attention row as the loader builds it."""
    ids, pos, sample = np.zeros(s, np.int32), 0, 1
    for n in lengths:
        if n > 0:
            ids[pos : pos + n] = sample
            sample += 1
        pos += abs(n)
    return ids


# Tiny audio encoders: 16 mel bins, 20 positions (40 frames, a "0.4 s" window).
TINY_AUDIO_ENCODER = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4,
                          encoder_ffn_dim=48, d_model=32, max_source_positions=20)  # fmt: skip


def _randomize_all(model, seed: int) -> None:
    """Every parameter plus noise: HF's zero biases, unit norms and (Whisper) sinusoidal positions
    would hide a mapping that swaps or drops them."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def save_tiny_whisper(path: Path, *, seed: int = 0, encoder_only: bool = False) -> Path:
    """Tiny random WhisperForConditionalGeneration (encoder + a 1-layer decoder; `encoder_only`: a
    bare WhisperEncoder) saved to `path`."""
    import torch
    import transformers
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = transformers.WhisperConfig(
        **TINY_AUDIO_ENCODER, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=48,
        vocab_size=100, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3,
    )  # fmt: skip
    torch.manual_seed(seed)
    cls = WhisperEncoder if encoder_only else transformers.WhisperForConditionalGeneration
    model = cls(cfg)
    _randomize_all(model, seed)
    return _save(model, path)


def save_tiny_qwen2_audio(path: Path, *, seed: int = 0, audio_token: int = 90, **text) -> Path:
    """Tiny random Qwen2AudioForConditionalGeneration (the tiny audio encoder + a 2-layer Qwen2)
    saved to `path`; `text` changes its Qwen2 config."""
    import torch
    import transformers

    audio = transformers.Qwen2AudioEncoderConfig(**TINY_AUDIO_ENCODER)
    text_cfg = transformers.Qwen2Config(**{
        "vocab_size": 96, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False, **text,
    })  # fmt: skip
    cfg = transformers.Qwen2AudioConfig(
        audio_config=audio.to_dict(), text_config=text_cfg.to_dict(), audio_token_index=audio_token
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(cfg)
    _randomize_all(model, seed)
    return _save(model, path)
