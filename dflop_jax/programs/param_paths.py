"""Where a parameter lives: its path in a stage, in the whole model, its part and whether it trains.

A stage's params are one module's layer range (`contracts.layout.StageSpec`), or for the colocated
stage (and an omni model's first LLM stage) whole encoders beside the first LLM layers
(`COLOCATED_MODULES` at the top). The model-level
path of a leaf (`model_paths`: module, names, layer indices offset to global ones) is what
checkpoints store and what ties a parameter held by two stages (`tied_groups`: a tied embedding);
its part (`param_labels`: vision, projector, llm, by `models.stage_modules.param_part`) is what a training
recipe trains or freezes (`trained_mask`). The profiler, the stage builder, the optimizer and the
checkpoints all read these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from dflop_jax.contracts.layout import StageSpec
from models.stage_modules import param_part

PyTree = Any


def key_name(k) -> str:
    """The name of one pytree path entry (dict key, sequence index or attribute)."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


# Top-level keys of a stage that holds a whole encoder beside its LLM layers: the colocated vision
# encoder (`models.mllm.ColocatedStage`) and the audio encoder of an omni model's first LLM stage
# (`models.omni.OmniFirstStage`).
COLOCATED_MODULES = ("encoder", "audio", "llm")


def global_path(path, spec: StageSpec) -> tuple[str, ...]:
    """A leaf's path in the model-level tree: key names, layer indices offset to global ones."""
    return _offset_layers([key_name(k) for k in path], spec.first_layer)


def _offset_layers(names: list[str], first_layer: int) -> tuple[str, ...]:
    for i in range(1, len(names)):
        if names[i - 1] == "layers" and names[i].isdigit():
            names[i] = str(int(names[i]) + first_layer)
    return tuple(names)


def held_modules(params: PyTree) -> tuple[str, ...]:
    """The modules a stage holding whole encoders beside its LLM layers holds (`COLOCATED_MODULES`
    at the top of its params, "llm" among them: an audio encoder stage alone also has an "audio"
    subtree), in `COLOCATED_MODULES` order; () for a stage of one module."""
    tops = {key_name(path[0]) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    if "llm" not in tops or not tops <= set(COLOCATED_MODULES):
        return ()
    return tuple(m for m in COLOCATED_MODULES if m in tops)


def model_paths(path, spec: StageSpec, held: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """A stage leaf's paths (module, *names) in the model-level tree, the stage's own first.

    held: the modules of a stage holding whole encoders (`held_modules`); a leaf under one of their
    keys (wherever it sits, e.g. inside an optimizer's moment tree) goes to that module without the
    key, an encoder's layers counted from 0; a leaf under none (an optimizer step count) to every
    module the stage holds.
    """
    names = [key_name(k) for k in path]
    if not held:
        return [(spec.module, *_offset_layers(names, spec.first_layer))]
    part = next((i for i, n in enumerate(names) if n in held), None)
    if part is None:
        return [(m, *names) for m in (spec.module, *(m for m in held if m != spec.module))]
    module = names.pop(part)
    first = spec.first_layer if module == spec.module else 0
    return [(module, *_offset_layers(names, first))]


def param_labels(params: PyTree) -> PyTree:
    """The part of each leaf of a stage's params (`models.stage_modules.param_part` of its key path)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_part(leaf_names(path)), params)


def trained_mask(params: PyTree, trainable: Sequence[str]) -> PyTree:
    """Bool per leaf of a stage's params: whether its part is in `trainable` (`StageProgram.trained`)."""
    return jax.tree.map(lambda part: part in trainable, param_labels(params))


def gathered_mask(params: PyTree, paths: frozenset[tuple[str, ...]]) -> PyTree:
    """Bool per leaf of a stage's params: whether it lies at one of `paths`, the params the stage
    reads only by a gather (`models.stage_modules.gathered_paths`)."""

    def at(path, _) -> bool:
        names = leaf_names(path)
        return any(names[: len(p)] == p for p in paths)

    return jax.tree_util.tree_map_with_path(at, params)


TiedGroup = tuple[tuple[int, tuple[str, ...]], ...]  # ((stage index, leaf path in its params), ...)


def leaf_names(path) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def tied_groups(specs: list[StageSpec], params: list[PyTree]) -> list[TiedGroup]:
    """Leaves that several stages hold (same model-level path): one group per tied parameter."""
    where: dict[tuple, list] = {}
    for i, (spec, tree) in enumerate(zip(specs, params)):
        held = held_modules(tree)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
            where.setdefault(model_paths(path, spec, held)[0], []).append((i, leaf_names(path)))
    return [tuple(group) for group in where.values() if len(group) > 1]
