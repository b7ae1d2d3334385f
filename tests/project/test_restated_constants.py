"""Constants restated across the jax-free wall agree with the ones the models run.

The cost model, contracts and data layer import no jax (`test_boundaries.py`), so they restate a few
of `models/`'s constants instead of importing them. Each pair here must stay equal: a model that
gains an attention kernel or remat policy, or a placement code that changes, is priced, scheduled
and packed as it runs."""

import importlib

import pytest

from dflop_jax.contracts import cost_table
from dflop_jax.contracts.layout import Module
from dflop_jax.costs import memory
from dflop_jax.data import sample_arrays as data_types
from models import (
    cudnn_packed,
    decoder_config,
    layers,
    layouts,
    placement,
    stage_modules,
)

# `models.attention` the module (the package exports a function of that name)
attention = importlib.import_module("models.attention")

RESTATED = {
    "TEXT": [
        (data_types.TEXT, "data.sample_arrays"),
        (layouts.TEXT, "models.layouts"),
        (placement.TEXT, "models.placement"),
    ],  # fmt: skip
    "NEWLINE": [
        (data_types.NEWLINE, "data.sample_arrays"),
        (layouts.NEWLINE, "models.layouts"),
        (placement.NEWLINE, "models.placement"),
    ],  # fmt: skip
    "TRAINABLE_PARTS": [
        (cost_table.TRAINABLE_PARTS, "contracts.cost_table"),
        (stage_modules.TRAINABLE_PARTS, "models.stage_modules"),
    ],  # fmt: skip
    "FEATURE_TAPS": [
        (memory.FEATURE_TAPS, "costs.memory"),
        (data_types.FEATURE_TAPS, "data.sample_arrays"),
    ],  # fmt: skip
    "REMAT_POLICIES": [
        (tuple(memory.REMAT_POLICIES), "costs.memory"),
        (tuple(layers.REMAT_POLICIES), "models.layers"),
        (tuple(decoder_config.REMAT_MODES), "models.decoder_config"),
    ],  # fmt: skip
    "ATTENTION_IMPLS": [
        (tuple(memory.ATTENTION_IMPLS), "costs.memory"),
        (tuple(attention.IMPLEMENTATIONS), "models.attention"),
        (tuple(i for i in decoder_config.ATTENTION_IMPLS if i), "models.decoder_config"),
    ],  # fmt: skip
    "CUDNN_SEGMENTS": [
        ((memory.CUDNN_SEGMENT_TOKENS, memory.CUDNN_MAX_SEGMENTS), "costs.memory"),
        ((cudnn_packed.SEGMENT_TOKENS, cudnn_packed.MAX_SEGMENTS), "models.cudnn_packed"),
    ],  # fmt: skip
    "DENSE_MAX_TOKENS": [
        (memory.DENSE_MAX_TOKENS, "costs.memory"),
        (attention.dense_max("gpu"), "models.attention.dense_max"),
    ],  # fmt: skip
    "LOSS_CHUNK": [
        (memory.LOSS_CHUNK, "costs.memory"),
        (
            decoder_config.DecoderConfig.__dataclass_fields__["loss_chunk"].default,
            "models.DecoderConfig.loss_chunk",
        ),
    ],  # fmt: skip
    "MODULES": [
        (tuple(Module.__args__), "contracts.layout.Module"),
        (tuple(stage_modules.MODULES), "models.stage_modules"),
    ],  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(RESTATED))
def test_restated_constant_agrees(name):
    (first, where), *others = RESTATED[name]
    for value, there in others:
        assert value == first, f"{name}: {where} has {first!r}, {there} has {value!r}"
