"""Parameter counts of the presets against the figures their publishers state (model cards, papers).

Independent of our FLOP/parameter formulas and of transformers: the published numbers are rounded, so
each check allows half a unit of the last published digit, no more.
"""

import dataclasses

import pytest

from dflop_jax.costs import get_llm, get_vision, param_count

# (preset, published parameters, half a unit of the last published digit)
PUBLISHED = [
    ("qwen2.5-7b", 7.62e9, 0.005e9),  # Qwen/Qwen2.5-7B: 7.62B on HF (safetensors)
    ("qwen2.5-32b", 32.8e9, 0.05e9),  # Qwen/Qwen2.5-32B: 32.8B on HF
    ("qwen2.5-72b", 72.7e9, 0.05e9),  # Qwen/Qwen2.5-72B: 72.7B (model card and HF)
    ("llama3-8b", 8.03e9, 0.005e9),  # meta-llama/Meta-Llama-3-8B: 8.03B on HF
    ("llama3-70b", 70.6e9, 0.05e9),  # meta-llama/Meta-Llama-3-70B: 70.6B on HF
]


@pytest.mark.parametrize("name,published,half_unit", PUBLISHED)
def test_llm_presets_match_published_counts(name, published, half_unit):
    assert param_count(get_llm(name)) == pytest.approx(published, abs=half_unit)


def test_internvit_presets_match_published_counts():
    # InternViT-300M-448px: 304M; InternViT-6B-448px-V1-5: 5540M (the 48-layer InternViT-6B minus its
    # last 3 blocks); the original 48-layer InternViT-6B: 5.9B.
    assert param_count(get_vision("internvit-300m")) == pytest.approx(304e6, abs=0.5e6)
    six = get_vision("internvit-6b")
    assert param_count(six) == pytest.approx(5540e6, abs=5e6)
    assert param_count(dataclasses.replace(six, num_layers=48)) == pytest.approx(5.9e9, abs=0.05e9)


def test_siglip_so400m_matches_published_count_with_its_dropped_parts():
    # google/siglip-so400m-patch14-384's vision tower: 428M with all 27 layers, post-LN and the pooling
    # head (probe, attention, LN, MLP); LLaVA-OV's 26-layer preset must be exactly one layer + those less.
    v = get_vision("siglip-so400m")
    d, f = v.hidden_size, v.intermediate_size
    one_layer = param_count(dataclasses.replace(v, num_layers=27)) - param_count(v)
    head = d + (4 * d * d + 4 * d) + 2 * d + (2 * d * f + d + f)  # probe, MHA, LN, MLP
    assert param_count(v) + one_layer + 2 * d + head == pytest.approx(428e6, abs=0.5e6)


@pytest.mark.parametrize(
    "name,published,half_unit",
    [
        ("siglip-1b", 1e9, 0.05e9),
        ("internvit-1b", 1.1e9, 0.05e9),
        ("internvit-6b-dflop", 3.7e9, 0.05e9),
    ],
)
def test_reference_scaled_towers_have_their_nominal_size(name, published, half_unit):
    """The reference's scaled encoders have no checkpoint: their names are the check ("1b"), except
    the "6b" SigLIP, which its sizes (2304 x 40 layers, MLP 8608) make 2.44B."""
    assert param_count(get_vision(name)) == pytest.approx(published, abs=half_unit)
    assert param_count(get_vision("siglip-6b")) == pytest.approx(2.44e9, abs=0.005e9)
