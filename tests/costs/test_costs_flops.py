"""FLOP formulas and parameter counts of dflop_jax.costs against hand arithmetic and published sizes."""

import dataclasses

import pytest

from dflop_jax.costs import (
    causal_pairs,
    get_arch,
    get_llm,
    get_vision,
    hardware_flops,
    llm_flops,
    llm_layer_flops,
    param_count,
    projector_flops_per_tile,
    sample_model_flops,
    vision_flops_per_tile,
)


def test_tiny_llm_flops_by_hand():
    # tiny: D=64, H=4, K=2, Dh=16, F=128, V=512, L=4; segments of 3 and 5 tokens.
    per_token_params = (
        64 * 64 + 2 * 64 * (2 * 16) + 64 * 64 + 3 * 64 * 128
    )  # q, k+v, o, mlp = 36864
    linear = 2 * 8 * per_token_params  # 2 FLOPs per param per token, 8 tokens
    pairs = 3 * 4 // 2 + 5 * 6 // 2  # causal per segment, diagonal included: 6 + 15
    attn = 2 * 2 * 16 * 4 * pairs
    head = 2 * 8 * 64 * 512
    expected = 4 * (linear + attn) + head
    assert expected == 2905088
    assert llm_flops(get_llm("tiny"), [3, 5]) == pytest.approx(expected, rel=1e-12)
    assert llm_flops(get_llm("tiny"), [3, 5], include_head=False) == pytest.approx(expected - head)


def test_qwen7b_llm_flops_by_hand():
    # Qwen2.5-7B: D=3584, H=28, K=4, Dh=128, F=18944, V=152064, L=28; one segment of 1000 tokens.
    q = o = 3584 * 3584
    k = v = 3584 * 4 * 128
    mlp = 3 * 3584 * 18944
    linear = 2 * 1000 * (q + k + v + o + mlp)
    attn = 4 * 128 * 28 * (1000 * 1001 // 2)
    head = 2 * 1000 * 3584 * 152064
    expected = 28 * (linear + attn) + head
    assert expected == 14_341_476_352_000
    assert llm_flops(get_llm("qwen2.5-7b"), [1000]) == pytest.approx(expected, rel=1e-12)


def test_siglip_and_projector_flops_by_hand():
    # SigLIP-SO400M as in LLaVA-OV: 729 tokens, D=1152, F=4304, H=16 (Dh=72), 26 layers, patch 14.
    n = 27 * 27
    linear = 2 * n * (4 * 1152 * 1152 + 2 * 1152 * 4304)
    attn = 4 * 72 * 16 * n * n  # bidirectional: n^2 pairs
    embed = 2 * n * (3 * 14 * 14) * 1152
    expected = 26 * (linear + attn) + embed
    assert expected == 641_801_428_992
    arch = get_arch("siglip-so400m+qwen2.5-7b")
    assert vision_flops_per_tile(arch.vision) == pytest.approx(expected, rel=1e-12)
    # mlp2x_gelu: Linear(1152, 3584), GELU, Linear(3584, 3584) on 729 tokens.
    assert projector_flops_per_tile(arch) == pytest.approx(2 * 729 * (1152 * 3584 + 3584 * 3584))


def test_internvit_projector_after_pixel_shuffle():
    # InternVL: 1024 patches -> 256 tokens of width 4 * 1024 = 4096, then Linear(4096, D), Linear(D, D).
    arch = get_arch("internvit-300m+qwen2.5-7b")
    assert arch.projector.kind == "internvl_mlp" and arch.projector.in_dim == 4096
    assert projector_flops_per_tile(arch) == pytest.approx(2 * 256 * (4096 * 3584 + 3584 * 3584))
    assert arch.vision.seq_len == 1025  # 32 x 32 patches + class token


def test_segment_causal_attention_sums_per_segment():
    llm = get_llm("tiny")
    packed = llm_flops(llm, [100, 200, 300], include_head=False)
    separate = sum(llm_flops(llm, [n], include_head=False) for n in (100, 200, 300))
    assert packed == pytest.approx(separate)
    assert causal_pairs([100, 200, 300]) == 5050 + 20100 + 45150
    assert llm_flops(llm, [600], include_head=False) > packed  # one long segment attends more


def test_gqa_kv_projection_scales_with_kv_heads():
    llm = get_llm("qwen2.5-7b")
    mha = dataclasses.replace(llm, num_kv_heads=28)
    diff = llm_layer_flops(mha, 10, 0) - llm_layer_flops(llm, 10, 0)
    # K and V each: 2 * D * (kv * Dh) per token; 24 more kv heads.
    assert diff == pytest.approx(10 * 2 * 2 * 3584 * (28 - 4) * 128)


def test_training_and_hardware_flops():
    arch = get_arch("tiny")
    fwd = 3 * (vision_flops_per_tile(arch.vision) + projector_flops_per_tile(arch)) + llm_flops(
        arch.llm, [50]
    )
    assert sample_model_flops(arch, 3, 50) == pytest.approx(3 * fwd)
    assert sample_model_flops(arch, 0, 50) == pytest.approx(3 * llm_flops(arch.llm, [50]))
    assert hardware_flops(arch, 3, 50, recompute=False) == pytest.approx(3 * fwd)
    extra = hardware_flops(arch, 3, 50) - 3 * fwd
    layers_fwd = llm_flops(arch.llm, [50], include_head=False)
    assert layers_fwd < extra < fwd  # one more forward of the layers, not of the head / projector


PUBLISHED = [  # (arch, published parameter count)
    ("qwen2.5-0.5b", 0.49e9),
    ("qwen2.5-7b", 7.62e9),
    ("qwen2.5-32b", 32.8e9),
    ("qwen2.5-72b", 72.7e9),
    ("llama3-8b", 8.03e9),
    ("llama3-70b", 70.6e9),
]


@pytest.mark.parametrize(("name", "published"), PUBLISHED)
def test_llm_param_counts_match_published(name, published):
    assert param_count(get_llm(name)) == pytest.approx(published, rel=0.01)


def test_vision_param_counts_match_published():
    # LLaVA-OV's SigLIP tower: 26 of the 27 layers, no pooling head (~0.40B).
    assert param_count(get_vision("siglip-so400m")) == pytest.approx(0.40e9, rel=0.01)
    # Published SigLIP-SO400M vision tower: 27 layers + post-norm + MAP head = 428M.
    full = dataclasses.replace(get_vision("siglip-so400m"), num_layers=27)
    head = (
        1152
        + (3 * 1152 * 1152 + 3 * 1152)
        + (1152 * 1152 + 1152)
        + 2 * 1152
        + (2 * 1152 * 4304 + 4304 + 1152)
    )
    assert param_count(full) + 2 * 1152 + head == pytest.approx(428e6, rel=0.01)
    assert param_count(get_vision("internvit-300m")) == pytest.approx(304e6, rel=0.01)
    # InternViT-6B-448px-V1-5: 45 layers, 5.54B; the 48-layer original: 5.9B.
    six_b = get_vision("internvit-6b")
    assert param_count(six_b) == pytest.approx(5.54e9, rel=0.01)
    assert param_count(dataclasses.replace(six_b, num_layers=48)) == pytest.approx(5.9e9, rel=0.01)


def test_bad_names_list_known_ones():
    with pytest.raises(ValueError, match="qwen2.5-7b"):
        get_arch("siglip-so400m+gpt5")
    with pytest.raises(ValueError, match="siglip-so400m"):
        get_arch("nonsense")
    with pytest.raises(ValueError, match="llama3-8b"):
        get_llm("llama2")


def test_mfu_definition():
    from dflop_jax.costs import batch_model_flops, mfu

    arch = get_arch("tiny")
    total = batch_model_flops(arch, [(2, 40), (0, 30)])
    assert total == pytest.approx(sample_model_flops(arch, 2, 40) + sample_model_flops(arch, 0, 30))
    assert mfu(total, 0.5, 4, 1e9) == pytest.approx(total / (0.5 * 4 * 1e9))
    with pytest.raises(ValueError, match="step_time_s"):
        mfu(total, 0.0, 4, 1e9)
