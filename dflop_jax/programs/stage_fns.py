"""A stage as pure functions, and what a program call is keyed by.

A stage is given as pure functions over (params, x, side):
  forward(params, x, side) -> y                      every stage but the last
  loss(params, x, side) -> (loss_sum, count)         the last stage (forward + loss)
where `x` is the activation from the previous stage (None for the pipeline's first stage), `side` a
dict of this stage's microbatch arrays (tiles, segment ids, targets, ...), and `params` fp32 master
weights (`StageFns`; the real models' are built by `programs/stage_builder.py`). A program compiles
once per input `signature` (x and side shapes and dtypes); a stage takes its input at
`boundary_shape`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts.cost_table import RESIDUAL_POLICIES
from dflop_jax.programs.sharding import mesh_axes

PyTree = Any
ForwardFn = Callable[[PyTree, Any, Mapping[str, jax.Array]], jax.Array]
LossFn = Callable[[PyTree, Any, Mapping[str, jax.Array]], tuple[jax.Array, jax.Array]]


def check_residual_policy(policy: str) -> str:
    if policy not in RESIDUAL_POLICIES:
        raise ValueError(f"residual policy {policy!r}: use one of {list(RESIDUAL_POLICIES)}")
    return policy


def signature(x, side: Mapping[str, Any]) -> tuple:
    """The input-shape signature of a stage program call: (x shape and dtype, side shapes and
    dtypes), from arrays, ShapeDtypeStructs or tracers alike (a jit compiles once per signature)."""
    return x_signature(x), tuple(
        (k, tuple(side[k].shape), str(side[k].dtype)) for k in sorted(side)
    )


def x_signature(x) -> tuple | None:
    """x's shape and dtype (a stage joining two branches: per part, by name)."""
    if x is None:
        return None
    if isinstance(x, Mapping):
        return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(x.items()))
    return tuple(x.shape), str(x.dtype)


def per_part(fn: Callable, value):
    """`fn` of `value`, or of each part of a stage input made of parts (a dict by branch: the first
    LLM stage joining the vision and the audio branch), kept in its dict."""
    if isinstance(value, Mapping):
        return {k: fn(v) for k, v in value.items()}
    return fn(value)


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The pure functions of one stage (exactly one of `forward` / `loss` is set).

    Attributes:
      forward: (params, x, side) -> y, for every stage but the last.
      loss: (params, x, side) -> (loss_sum, count) for the last stage; loss_sum is un-normalized.
      side_keys: the microbatch fields this stage reads (keys of `side`).
      optional_keys: fields placed only when the microbatch has them (present and not None), e.g.
        the exact feature taps of LLaVA-OV data; the functions test `key in side` (a separate compile).
      x_spec: PartitionSpec of the stage input x on this stage's mesh, as the transfer delivers it
        (None: the stage has no x). An axis it shards that its devices do not divide arrives
        padded with zeros at the end (`boundary_shape`). A stage joining two branches takes x as
        a dict of parts, one per parent stage's module ("encoder", "audio"), and gives a spec per
        part (`per_part`); so do `x_compute_spec` and dL/dx.
      x_compute_spec: the spec the functions take x in, when it differs from `x_spec` (None: the
        same): the programs reshard x to it on entry, an in-mesh collective (e.g. the all-gather
        of features that arrive split over the stage's devices), and dL/dx back to `x_spec` (the
        matching reduce-scatter), so the bytes that cross the stage boundary are one copy. Such an
        x must arrive unpadded (`StageProgram.x_struct` refuses one that would need padding).
      y_spec: PartitionSpec of the stage output y (unused for the last stage).
    """

    forward: ForwardFn | None = None
    loss: LossFn | None = None
    side_keys: tuple[str, ...] = ()
    optional_keys: tuple[str, ...] = ()
    x_spec: P | dict[str, P] | None = None
    x_compute_spec: P | dict[str, P] | None = None
    y_spec: P = P("data")

    def __post_init__(self):
        if (self.forward is None) == (self.loss is None):
            raise ValueError(
                "StageFns: set exactly one of forward (inner stage) or loss (last stage)"
            )

    def fields(self, batch: Mapping[str, Any]) -> tuple[str, ...]:
        """The microbatch fields this stage reads from `batch`: its side keys, plus the optional
        ones the batch has (present and not None)."""
        optional = tuple(k for k in self.optional_keys if batch.get(k) is not None)
        return self.side_keys + optional


def boundary_shape(shape: Sequence[int], sharding: NamedSharding) -> tuple[int, ...]:
    """`shape` with each axis that `sharding` splits padded up to a multiple of its shard count:
    the shape a stage takes its input in (a jit input's sharded axis must divide evenly). Unchanged
    where every axis divides, as between stages of one module."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    out = []
    for n, entry in zip(shape, spec):
        k = int(np.prod([sharding.mesh.shape[a] for a in mesh_axes(entry)], dtype=int))
        out.append(-(-n // k) * k)
    return tuple(out)
