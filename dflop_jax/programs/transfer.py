"""Stage-to-stage transfers between any two shardings, within a process and across processes.

    y_next = transfer(y, next_stage.x_sharding)      # activations forward, cotangents back alike

Why not `jax.device_put`: across processes it refuses shardings whose device sets AND layouts differ
(encoder dp 2 -> LLM dp 3), and within one process a reshard whose shards do not line up (data-sharded
features -> replicated on the LLM stage) copies through host memory and blocks the dispatching thread
(DESIGN section 11). The transport here is one jitted `shard_map` program over a UNION mesh (both sides'
devices by id, on one axis "u"):

1. every process wraps the source shards it holds, plus zero blocks on its destination-only devices,
   into one union-mesh array (`jax.make_array_from_single_device_arrays`: no copy);
2. the body moves pieces with `jax.lax.ppermute` in rounds of disjoint (sender, receiver) pairs of one
   piece shape; offsets come from tables indexed by `axis_index`, pieces are cut and written with
   `dynamic_slice` / `dynamic_update_slice` (a device that keeps a piece copies it locally);
3. the destination shards of the result are wrapped as an array on the destination sharding.

Within one process, between disjoint device sets whose shardings hold the same block at the same
position of their device lists (stage to stage at the same dp and tp, features from encoder dp n to an
LLM stage of n devices, replicated vectors between stages of as many devices), a transfer is
`jax.device_put`: jax copies each block device to device, no program to compile or launch and no zero
blocks (`copies`; jax's own test for that path is the same: equal HLO shardings over device lists of
one length).

The piece plan depends only on metadata (`devices_indices_map` of both shardings), so every process
computes the same plan and program. It runs the same on CPU (gloo) and GPU (NCCL), in both directions,
and never touches host memory; dispatch returns at once (only a read of the result waits).

Rules for callers (the pipeline driver keeps them): every process owning a device of the union calls
the transfer, in the same order relative to other programs on those devices; a process outside the
union may call it too (it returns a stand-in without running anything); a process owning no source
device passes a stand-in (`stand_in`) or a `jax.ShapeDtypeStruct` with the source sharding. One program
is compiled per (source sharding, destination sharding, shapes, dtype). A replicated source sends each
piece from one replica (the destination device itself when it holds one); a replicated destination
receives one copy per device.

The destination may have another shape (`shape=`): what lies beyond the source's extent on an axis is
zeros, what lies beyond the destination's is not sent. A stage whose input axis its devices do not
divide takes that axis padded (`stage_fns.boundary_shape`: the encoder's features into the first LLM
stage), and its dL/dx goes back cropped, with nothing moved for the padding.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from dflop_jax.programs.dispatch import TRANSFER, issue
from dflop_jax.programs.lowering import KeptProgram, Lowering

AXIS = "u"
Block = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One box of the array moving from union device `src` to union device `dst`.

    Attributes:
      src, dst: positions on the union mesh.
      src_offset, dst_offset: where the box starts in the source / destination device's block.
      shape: the box's shape.
    """

    src: int
    dst: int
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Round:
    """Pieces of one shape, no device sending or receiving twice: one `ppermute` (or local copies)."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def local(self) -> bool:
        return all(p.src == p.dst for p in self.pieces)


def stand_in(shape: Sequence[int], dtype, sharding: Sharding) -> jax.Array:
    """The array of a process that holds none of `sharding`'s devices: no shards, right metadata."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def transfer(
    x: jax.Array | jax.ShapeDtypeStruct, dst: Sharding, shape: Sequence[int] | None = None
) -> jax.Array:
    """`x` placed on `dst` (same values), through the union-mesh program; see the module docstring.

    Args:
      x: the source array (on this process: its addressable shards are sent), or a stand-in /
        `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` on a process holding no source device.
      dst: the destination sharding.
      shape: the destination's shape (None: x's); past x's extent zeros, past its own x is cut off.

    Returns:
      The array on `dst` (a stand-in without shards where this process holds no destination device).
    """
    route = _route(x.sharding, dst, x.shape, x.shape if shape is None else tuple(shape), x.dtype)
    if route.same and isinstance(x, jax.Array):
        return x
    if route.copy:  # jax copies each block to the device at its position (module docstring)
        return issue(TRANSFER, None, jax.device_put, x, dst)
    if route.program is None:  # nothing moves: the same shards, re-labelled
        held = {s.device: s.data for s in x.addressable_shards} if isinstance(x, jax.Array) else {}
        shards = [held[d] for d in dst.addressable_devices]
        return jax.make_array_from_single_device_arrays(x.shape, dst, shards, dtype=x.dtype)
    return route.program(x)


def lower_transfer(
    x: jax.Array | jax.ShapeDtypeStruct, dst: Sharding, shape: Sequence[int] | None = None
) -> list[Lowering]:
    """The programs `transfer(x, dst, shape)` runs on this process, lowered (none when nothing
    moves, or when it is a copy)."""
    route = _route(x.sharding, dst, x.shape, x.shape if shape is None else tuple(shape), x.dtype)
    return [] if route.program is None else route.program.lower()


def transfer_bytes(
    x: jax.Array | jax.ShapeDtypeStruct, dst: Sharding, shape: Sequence[int] | None = None
) -> int:
    """Bytes `transfer(x, dst, shape)` moves between devices (0 when the layout already matches)."""
    route = _route(x.sharding, dst, x.shape, x.shape if shape is None else tuple(shape), x.dtype)
    return route.bytes_moved


@dataclasses.dataclass(frozen=True)
class _Route:
    """What `transfer` does for one (source sharding, destination, shapes, dtype): `same`: return x
    itself (when it is an array); `copy`: `jax.device_put` (`copies`); else re-label its shards
    (`program` None) or run `program`. `bytes_moved`: between devices, per call."""

    same: bool
    program: Transfer | None
    copy: bool = False
    bytes_moved: int = 0


@functools.cache
def _route(src: Sharding, dst: Sharding, shape: tuple[int, ...], dst_shape: tuple[int, ...],
           dtype) -> _Route:  # fmt: skip
    same = src == dst and tuple(shape) == tuple(dst_shape)
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=src)
    if _same_layout(x, dst, tuple(dst_shape)):
        return _Route(same, None)
    if copies(src, dst, tuple(shape), tuple(dst_shape)):
        block = int(np.prod(dst.shard_shape(tuple(shape)))) * jnp.dtype(dtype).itemsize
        return _Route(same, None, copy=True, bytes_moved=block * len(dst.device_set))
    program = _program_of(x, dst, tuple(dst_shape))
    return _Route(same, program, bytes_moved=program.bytes_moved)


def copies(
    src: Sharding, dst: Sharding, shape: tuple[int, ...], dst_shape: tuple[int, ...]
) -> bool:
    """Whether `transfer` moves an array of `shape` from `src` to `dst` by `jax.device_put`: one
    shape, both shardings on this process's devices (a device_put across processes needs one device
    set), the device sets disjoint, and each position of the destination's device list taking the
    block the same position of the source's holds. The last is jax's own condition for copying
    block by block (equal HLO shardings, device lists of one length), asked through the public
    `is_equivalent_to` of the destination's sharding moved onto the source's devices."""
    if shape != dst_shape or not (
        isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)
    ):
        return False
    if not (src.is_fully_addressable and dst.is_fully_addressable):
        return False
    if not src.device_set.isdisjoint(dst.device_set) or len(src.device_set) != len(dst.device_set):
        return False
    devices = np.array(list(src.mesh.devices.flat)).reshape(dst.mesh.devices.shape)
    moved = NamedSharding(Mesh(devices, dst.mesh.axis_names, axis_types=dst.mesh.axis_types),
                          dst.spec, memory_kind=dst.memory_kind)  # fmt: skip
    return src.is_equivalent_to(moved, len(shape))


def _same_layout(x, dst: Sharding, shape: tuple[int, ...]) -> bool:
    """True when both sides have one shape and every device holds the same block (nothing
    moves)."""
    if x.sharding.device_set != dst.device_set or tuple(x.shape) != shape:
        return False
    a, b = x.sharding.devices_indices_map(shape), dst.devices_indices_map(shape)
    return all(_box(a[d], shape) == _box(b[d], shape) for d in a)


def _program_of(x, dst: Sharding, shape: tuple[int, ...]) -> Transfer:
    """The one program of a transfer. The source is known by its layout, not its sharding object:
    a program's output may report a sharding equivalent to the one asked for (`P("data")` over a
    size-1 axis comes back as `P()`), and both must find the program compiled before step 1."""
    same = shape == tuple(x.shape)  # one cache entry per transfer, however the shape is given
    key = (_layout(x.sharding, tuple(x.shape)), dst, tuple(x.shape), jnp.dtype(x.dtype),
           None if same else shape)  # fmt: skip
    if key not in _PROGRAMS:
        _PROGRAMS[key] = Transfer(x.sharding, *key[1:])
    return _PROGRAMS[key]


_PROGRAMS: dict[tuple, Transfer] = {}  # per source layout, destination, shapes and dtype


def _layout(sharding: Sharding, shape: tuple[int, ...]) -> tuple:
    """Which block of `shape` each device of `sharding` holds: equal for equivalent shardings."""
    boxes = sharding.devices_indices_map(shape)
    return tuple(sorted((d.id, _box(boxes[d], shape)) for d in boxes))


class Transfer:
    """The compiled transport of one (source sharding, destination sharding, shapes, dtype)."""

    def __init__(
        self,
        src: Sharding,
        dst: Sharding,
        shape: tuple[int, ...],
        dtype,
        dst_shape: tuple[int, ...] | None = None,
    ):
        if not shape:
            raise ValueError("transfer: scalars have no blocks to move; give arrays of rank >= 1")
        dst_shape = shape if dst_shape is None else tuple(dst_shape)
        if len(dst_shape) != len(shape):
            raise ValueError(f"transfer: shape {shape} to {dst_shape}: the ranks differ")
        self.src, self.dst, self.shape, self.dtype = src, dst, shape, jnp.dtype(dtype)
        self.dst_shape = dst_shape
        self.devices = _union(src, dst)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.src_block = _block_shape(src, shape)
        self.dst_block = _block_shape(dst, dst_shape)
        self.rounds = plan_rounds(src, dst, shape, self.devices, dst_shape)
        me = jax.process_index()
        self._local = [d for d in self.devices if d.process_index == me]
        self.participates = bool(self._local)
        # Input blocks of this process's union devices outside the source: zeros made per call by
        # one small program, so no activation-sized buffer outlives the transfer.
        self._fill = [d for d in self._local if d not in src.device_set]
        self._zeros = _zero_blocks(self._fill, self.src_block, self.dtype)
        self._run = KeptProgram(
            jax.jit(
                jax.shard_map(
                    self._body, mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False
                )
            ),
            self.devices,
        )
        size = self.dtype.itemsize
        self.bytes_moved = sum(
            int(np.prod(r.shape)) * size * len(r.pieces) for r in self.rounds if not r.local
        )  # bytes that cross between devices per call (local copies excluded)
        # Per call: this process's union devices in order, each taking its block from x (its
        # device) or from the zero blocks (its position there); the destination's devices here.
        self._where = [(d, self._fill.index(d) if d in self._fill else None) for d in self._local]
        self._dst_devices = list(dst.addressable_devices)
        self._union_shape = (len(self.devices) * self.src_block[0], *self.src_block[1:])
        self._union_sharding = NamedSharding(self.mesh, P(AXIS))

    def __call__(self, x: jax.Array | jax.ShapeDtypeStruct) -> jax.Array:
        if not self.participates:
            return stand_in(self.dst_shape, self.dtype, self.dst)
        union = self._union_input(x)
        out = issue(TRANSFER, self.mesh, self._run.run, union)
        mine = {s.device: s.data for s in out.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            self.dst_shape, self.dst, [mine[d] for d in self._dst_devices], dtype=self.dtype
        )

    def lower(self) -> list[Lowering]:
        """The programs a call runs (the zero blocks', the transport), lowered for compiling ahead
        (`runtime/precompile.py`), each of one signature that an executable store may give; none
        on a process outside the union."""
        if not self.participates:
            return []
        shape = (len(self.devices) * self.src_block[0], *self.src_block[1:])
        union = jax.ShapeDtypeStruct(shape, self.dtype, sharding=NamedSharding(self.mesh, P(AXIS)))
        with jax.set_mesh(self.mesh):
            run = self._run.lowering("transfer", union)
        return [run] + ([self._zeros.lowering("transfer")] if self._fill else [])

    def _union_input(self, x) -> jax.Array:
        """x's local shards plus zero blocks on this process's destination-only devices, as one
        union-mesh array [n * block0, *block[1:]] sharded over "u" (no copy of x)."""
        held = {s.device: s.data for s in x.addressable_shards} if isinstance(x, jax.Array) else {}
        zeros = _blocks(issue(TRANSFER, None, self._zeros.run), self._fill) if self._fill else []
        blocks = [held[d] if k is None else zeros[k] for d, k in self._where]
        return jax.make_array_from_single_device_arrays(
            self._union_shape, self._union_sharding, blocks, dtype=self.dtype
        )

    def _body(self, block: jax.Array) -> jax.Array:  # [*src_block] -> [*dst_block]
        n = len(self.devices)
        me = jax.lax.axis_index(AXIS)
        out = jnp.zeros(self.dst_block, self.dtype)
        for rnd in self.rounds:
            src_off = np.zeros((n, len(self.shape)), np.int32)
            dst_off = np.zeros_like(src_off)
            receives = np.zeros(n, bool)
            for p in rnd.pieces:
                src_off[p.src], dst_off[p.dst], receives[p.dst] = p.src_offset, p.dst_offset, True
            piece = jax.lax.dynamic_slice(block, tuple(jnp.asarray(src_off)[me]), rnd.shape)
            if not rnd.local:
                piece = jax.lax.ppermute(piece, AXIS, perm=[(p.src, p.dst) for p in rnd.pieces])
            at = tuple(jnp.asarray(dst_off)[me])
            kept = jax.lax.dynamic_slice(out, at, rnd.shape)
            out = jax.lax.dynamic_update_slice(
                out, jnp.where(jnp.asarray(receives)[me], piece, kept), at
            )
        return out


def plan_rounds(
    src: Sharding,
    dst: Sharding,
    shape: tuple[int, ...],
    devices: Sequence[jax.Device],
    dst_shape: tuple[int, ...] | None = None,
) -> list[Round]:
    """The pieces every destination block needs, grouped into rounds (same plan on every process).

    Each destination device takes every distinct source block overlapping its own from one holder:
    itself if it holds that block, else a holder on its own process, else the least loaded holder.
    With a `dst_shape`, destination boxes are cut from it (a box past the source's extent overlaps
    nothing there: it stays zeros).
    """
    dst_shape = shape if dst_shape is None else dst_shape
    pos = {d: i for i, d in enumerate(devices)}
    src_map, dst_map = src.devices_indices_map(shape), dst.devices_indices_map(dst_shape)
    holders: dict[tuple, list[jax.Device]] = {}
    for d in sorted(src_map, key=lambda d: d.id):
        holders.setdefault(_box(src_map[d], shape), []).append(d)
    load: dict[jax.Device, int] = dict.fromkeys(src_map, 0)
    pieces = []
    for d in sorted(dst_map, key=lambda d: d.id):
        want = _box(dst_map[d], dst_shape)
        for have, who in holders.items():
            overlap = _intersect(have, want)
            if overlap is None:
                continue
            sender = min(
                who, key=lambda s: (s != d, s.process_index != d.process_index, load[s], s.id)
            )
            load[sender] += 1
            pieces.append(
                Piece(
                    pos[sender],
                    pos[d],
                    tuple(o[0] - h[0] for o, h in zip(overlap, have)),
                    tuple(o[0] - w[0] for o, w in zip(overlap, want)),
                    tuple(o[1] - o[0] for o in overlap),
                )
            )
    return _rounds(pieces)


def _rounds(pieces: list[Piece]) -> list[Round]:
    """Local copies apart from sends; per shape, greedy rounds of pieces whose sender and receiver
    are still free in the round, busiest devices first (so the round count stays near the lower
    bound, the most pieces one device sends or receives)."""
    groups: dict[tuple, list[Piece]] = {}
    for p in pieces:
        groups.setdefault((p.src != p.dst, p.shape), []).append(p)
    out = []
    for (_, shp), todo in sorted(groups.items()):
        while todo:
            sends = collections.Counter(p.src for p in todo)
            receives = collections.Counter(p.dst for p in todo)
            todo = sorted(todo, key=lambda p: -(sends[p.src] + receives[p.dst]))
            senders, receivers, now, later = set(), set(), [], []
            for p in todo:
                if p.src in senders or p.dst in receivers:
                    later.append(p)
                    continue
                senders.add(p.src)
                receivers.add(p.dst)
                now.append(p)
            out.append(Round(shp, tuple(now)))
            todo = later
    return out


def _union(src: Sharding, dst: Sharding) -> list[jax.Device]:
    """Both sides' devices by id: transfers over one device set (both directions between two stages,
    every `host_scalars` read) share one communicator, set up once."""
    return sorted(src.device_set | dst.device_set, key=lambda d: d.id)


def _box(index: Block, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A device's index (slices) as ((start, stop), ...) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _intersect(a, b):
    box = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b))
    return None if any(lo >= hi for lo, hi in box) else box


def _block_shape(sharding: Sharding, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sharding.shard_shape(shape))


def _zero_blocks(
    devices: Sequence[jax.Device], block: tuple[int, ...], dtype
) -> KeptProgram | None:
    """The program making one zero block per device of `devices`, on the devices themselves
    (`jnp.zeros(device=...)` would copy its fill value from the host); None without devices."""
    if not devices:
        return None
    mesh = Mesh(np.array(devices), (AXIS,))
    shape = (len(devices) * block[0], *block[1:])
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, P(AXIS)))
    return KeptProgram(zeros, devices)


def _blocks(zeros: jax.Array, devices: Sequence[jax.Device]) -> list[jax.Array]:
    by_device = {s.device: s.data for s in zeros.addressable_shards}
    return [by_device[d] for d in devices]


def put_host(value, sharding: NamedSharding) -> jax.Array:
    """Places a host value (identical on every process) onto `sharding`; each process writes only
    the shards it addresses, so this also works when the mesh spans (or lies on) other processes."""
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx], dtype=arr.dtype)
