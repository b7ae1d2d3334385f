"""Union-mesh stage transfers (programs/transfer.py) in one process on 8 CPU devices: exact values for
many (source, destination) sharding pairs, both directions, no host round trip, one program per
signature."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.programs import transfer as tr

SHAPE = (12, 6, 4)


def _sharding(ids, grid, spec):
    devices = np.array([jax.devices()[i] for i in ids]).reshape(grid)
    return NamedSharding(Mesh(devices, ("data", "model")[: len(grid)]), spec)


CASES = {
    "dp2->dp3 replicated": (((0, 1), (2,), P("data")), ((2, 3, 4), (3,), P())),
    "dp2->dp3 sharded": (((0, 1), (2,), P("data")), ((2, 3, 4), (3,), P("data"))),
    "dp2->2x2 tp": (((0, 1), (2,), P("data")), ((4, 5, 6, 7), (2, 2), P("data", "model"))),
    "2x2 tp->dp3 on dim 1": (((0, 1, 2, 3), (2, 2), P(None, "model")), ((4, 5, 6), (3,), P(None, "data"))),
    "replicated->sharded": (((0, 1, 2), (3,), P()), ((3, 4, 5, 6), (2, 2), P("model", "data"))),
    "1 device->dp4": (((7,), (1,), P()), ((0, 1, 2, 3), (4,), P("data"))),
    "same devices, new spec": (((0, 1, 2, 3), (4,), P("data")), ((0, 1, 2, 3), (2, 2), P(None, "data"))),
    "overlapping devices": (((0, 1, 2, 3), (4,), P("data")), ((2, 3, 4, 5, 6, 7), (6,), P("data"))),
    "dp3 replicated->dp2": (((2, 3, 4), (3,), P()), ((0, 1), (2,), P("data"))),
    # blocks that line up: device-to-device copies (`transfer.copies`), no program
    "dp2->dp2 aligned": (((0, 1), (2,), P("data")), ((2, 3), (2,), P("data"))),
    "tp2->tp2 aligned": (((0, 1), (1, 2), P("data")), ((4, 5), (1, 2), P("data"))),
    "dp4->2x2 features aligned": (((0, 1, 2, 3), (4,), P("data")), ((4, 5, 6, 7), (2, 2), P(("data", "model")))),
}  # fmt: skip
ALIGNED = sorted(name for name in CASES if name.endswith("aligned"))


def _placed(sharding):
    value = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    return value, jax.device_put(value, sharding)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "backward"])
def test_transfer_is_exact_on_device(name, reverse):
    src, dst = (_sharding(*c) for c in CASES[name])
    src, dst = (dst, src) if reverse else (src, dst)
    value, x = _placed(src)
    with (
        jax.transfer_guard_device_to_host("disallow"),
        jax.transfer_guard_host_to_device("disallow"),
    ):
        y = jax.block_until_ready(tr.transfer(x, dst))
    assert y.sharding == dst
    for shard in y.addressable_shards:  # every device holds exactly its block of the value
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_one_program_per_signature_and_bytes():
    src, dst = (_sharding(*c) for c in CASES["dp2->dp3 replicated"])
    _, x = _placed(src)
    program = tr._program_of(x, dst, SHAPE)
    assert tr._program_of(x, dst, SHAPE) is program
    # a source sharding naming another layout-equivalent spec (P("data") over one replica, as
    # a program's output may report P()) shares the program compiled for it
    one = _sharding((0,), (1,), P("data"))
    alike = NamedSharding(one.mesh, P())
    a, b = (jax.ShapeDtypeStruct(SHAPE, x.dtype, sharding=s) for s in (one, alike))
    assert tr._program_of(a, dst, SHAPE) is tr._program_of(b, dst, SHAPE)
    # Each of the 3 destination devices needs both halves; none holds a source block: all cross.
    assert program.bytes_moved == 3 * x.nbytes
    # 2 senders, 3 receivers of 2 pieces each: at least 3 rounds, no round reuses a device.
    assert len(program.rounds) == 3
    for rnd in program.rounds:
        assert (
            len({p.src for p in rnd.pieces}) == len({p.dst for p in rnd.pieces}) == len(rnd.pieces)
        )


@pytest.mark.parametrize("name", sorted(CASES))
def test_only_aligned_blocks_are_copied_without_a_program(name):
    """Where the blocks line up, the transfer compiles nothing and is one counted copy; its bytes
    are what the union program's piece plan would move. Elsewhere it stays the program."""
    from dflop_jax.programs.dispatch import ISSUED, TRANSFER

    src, dst = (_sharding(*c) for c in CASES[name])
    x = jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=src)
    aligned = name in ALIGNED
    assert tr.copies(src, dst, SHAPE, SHAPE) == aligned
    assert (tr.lower_transfer(x, dst) == []) == aligned
    if not aligned:
        return
    assert tr.transfer_bytes(x, dst) == tr.Transfer(src, dst, SHAPE, np.float32).bytes_moved > 0
    _, placed = _placed(src)
    before = ISSUED.snapshot()[TRANSFER]
    jax.block_until_ready(tr.transfer(placed, dst))
    assert ISSUED.snapshot()[TRANSFER] == before + 1
    # a padded destination shape needs the program
    assert not tr.copies(src, dst, SHAPE, (SHAPE[0] + 4, *SHAPE[1:]))


def test_identical_layout_moves_nothing():
    src = _sharding((0, 1), (2,), P("data"))
    same = NamedSharding(
        Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "model")), P("data")
    )
    value, x = _placed(src)
    y = tr.transfer(x, same)
    assert y.sharding == same
    assert {s.data.unsafe_buffer_pointer() for s in y.addressable_shards} == {
        s.data.unsafe_buffer_pointer() for s in x.addressable_shards
    }
    np.testing.assert_array_equal(np.asarray(y), value)


def test_lowered_ahead_the_call_builds_nothing_and_keeps_no_buffer():
    """`lower_transfer` compiled ahead: the call builds no executable (`CompileCounter`) and gives
    the exact value; the program keeps no device buffer between calls (zero blocks per call)."""
    import gc

    from dflop_jax.runtime.precompile import CompileCounter

    src = _sharding((0, 1), (2,), P("data"))
    dst = _sharding((1, 2, 3), (3,), P("data"))  # devices 2 and 3 receive only: zero-filled
    value, x = _placed(src)
    lowered = tr.lower_transfer(jax.ShapeDtypeStruct(SHAPE, x.dtype, sharding=src), dst)
    assert len(lowered) == 2  # the transport and the zero blocks of the receive-only devices
    counter = CompileCounter()
    built = [lw.lowered.compile() for lw in lowered]
    before = counter.count
    assert built and before >= 2
    y = jax.block_until_ready(tr.transfer(x, dst))
    assert counter.count == before
    np.testing.assert_array_equal(np.asarray(y), value)
    program = tr._program_of(x, dst, SHAPE)
    del y
    gc.collect()
    held = jax.tree.leaves(list(vars(program).values()))
    assert not [a for a in held if isinstance(a, jax.Array)]


def test_the_pipeline_guard_passes_aligned_copies_only():
    """`no_host_round_trip` (the parity tests' guard) lets a device_put whose blocks line up
    through and fails one that reshards."""
    from pipeline_reference import no_host_round_trip

    (src, dst), (_, bad) = (
        [_sharding(*c) for c in CASES[n]] for n in ("dp2->dp2 aligned", "dp2->dp3 sharded")
    )
    _, x = _placed(src)
    with no_host_round_trip():
        jax.block_until_ready(jax.device_put(x, dst))
        with pytest.raises(AssertionError, match="non-aligned"):
            jax.device_put(x, bad)
