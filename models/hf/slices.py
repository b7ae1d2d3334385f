"""Reading only the part of an HF tensor that one shard of OUR layout needs.

A `TensorMap.to_ours` is written with array methods only (`.T`, `.transpose`, `.reshape`, integer
indexing). Applied to a `LazyView` of the HF tensor's shape it records those steps instead of doing
them; `read_box(view, source, index)` then walks them backwards from the requested box of our layout
to the smallest aligned box of the HF tensor, reads just that box from `source` (a safetensors
`get_slice` handle, which reads only those bytes), and replays the steps forwards on it.

Why: loading a stage of a 32B model on one host of many must not read (or hold) the whole tensor when
the host's devices keep a tensor-parallel slice of it. A reshape that splits or merges dimensions
aligns the box outward (to whole rows of the merged dimension), so the read box can be larger than
the shard but never the whole tensor unless the shard needs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Box = list[tuple[int, int]]  # [start, stop) per dimension


class LazyView:
    """The shape of an HF tensor and the layout steps `to_ours` applied to it (nothing is read)."""

    def __init__(self, shape: Sequence[int], ops: tuple = ()):
        self.shape, self.ops = tuple(int(n) for n in shape), ops

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def T(self) -> LazyView:
        return self.transpose(*reversed(range(self.ndim)))

    def transpose(self, *perm) -> LazyView:
        perm = tuple(perm[0]) if len(perm) == 1 and not isinstance(perm[0], int) else perm
        shape = tuple(self.shape[p] for p in perm)
        return LazyView(shape, (*self.ops, ("transpose", perm, self.shape)))

    def reshape(self, *shape) -> LazyView:
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(math.prod(self.shape) // known if n == -1 else n for n in shape)
        if math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return LazyView(shape, (*self.ops, ("reshape", shape, self.shape)))

    def __getitem__(self, index) -> LazyView:
        index = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(i, int) for i in index):
            raise TypeError("LazyView supports integer indexing of leading dimensions only")
        return LazyView(self.shape[len(index) :], (*self.ops, ("index", index, self.shape)))


def _groups(src: tuple, dst: tuple) -> list[tuple[range, range]]:
    """Consecutive dimension groups of equal size that a reshape maps onto each other."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        i0, j0 = i, j
        ps = src[i] if i < len(src) else 1
        pd = dst[j] if j < len(dst) else 1
        i, j = min(i + 1, len(src)), min(j + 1, len(dst))
        while ps != pd:
            if ps < pd:
                ps, i = ps * src[i], i + 1
            else:
                pd, j = pd * dst[j], j + 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def _reshape_back(out: Box, src: tuple, dst: tuple) -> tuple[Box, Box]:
    """(input box, output box produced): per group, whole inner rows, outer range aligned to both."""
    box_in: Box = [(0, n) for n in src]
    box_out: Box = [(0, n) for n in dst]
    for gs, gd in _groups(src, dst):
        if not len(gd) or not len(gs):
            continue
        s_inner = math.prod(src[k] for k in gs[1:])
        d_inner = math.prod(dst[k] for k in gd[1:])
        lcm = math.lcm(s_inner, d_inner)
        lo, hi = out[gd[0]][0] * d_inner, out[gd[0]][1] * d_inner
        lo, hi = lo // lcm * lcm, -(-hi // lcm) * lcm
        box_in[gs[0]] = (lo // s_inner, hi // s_inner)
        box_out[gd[0]] = (lo // d_inner, hi // d_inner)
    return box_in, box_out


def _back(op, out: Box) -> tuple[Box, Box]:
    kind, arg, src = op
    if kind == "transpose":
        box_in: Box = [(0, 0)] * len(src)
        for i, p in enumerate(arg):
            box_in[p] = out[i]
        return box_in, list(out)
    if kind == "index":
        return [(i % n, i % n + 1) for i, n in zip(arg, src)] + list(out), list(out)
    return _reshape_back(out, src, arg)


def _forward(op, block: np.ndarray, box_out: Box) -> np.ndarray:
    kind, arg, _ = op
    if kind == "transpose":
        return block.transpose(arg)
    if kind == "index":
        return block[(0,) * len(arg)]
    return block.reshape([b - a for a, b in box_out])


def _crop(block: np.ndarray, have: Box, want: Box) -> np.ndarray:
    return block[tuple(slice(w0 - h0, w1 - h0) for (h0, _), (w0, w1) in zip(have, want))]


def index_box(index: tuple, shape: Sequence[int]) -> Box:
    """The box of a `make_array_from_callback` index (slices with step 1) in an array of `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    box = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {sl} is not supported")
        box.append((start, stop))
    return box


def read_box(view: LazyView, source, box: Box) -> np.ndarray:
    """The block `box` of `to_ours(tensor)`, reading only an aligned box of the tensor from `source`.

    Args:
      view: `to_ours(LazyView(tensor_shape))`.
      source: anything sliceable by a tuple of slices (a safetensors `get_slice`, a numpy array).
      box: [start, stop) per dimension of our layout.
    """
    steps = []  # (op, input box, output box produced), last op first
    want = list(box)
    for op in reversed(view.ops):
        box_in, box_out = _back(op, want)
        steps.append((op, box_in, box_out))
        want = box_in
    block = np.asarray(source[tuple(slice(a, b) for a, b in want)])
    have = want
    for op, box_in, box_out in reversed(steps):
        block = _forward(op, _crop(block, have, box_in), box_out)
        have = box_out
    return _crop(block, have, list(box))
