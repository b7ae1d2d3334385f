"""`Lowering`: a program lowered ahead of the step that runs it (`runtime/precompile.py`), and where
its compiled form goes when an executable store gives it (`programs/executable_store.py`).

    lw = Lowering("transfer", jit.lower(x), devices=ids, keep=owner.keep)

Without a store, compiling `lowered` fills its jit's cache, and the jit's later calls find it.
A program an `ExecutableStore` deserialized is a `jax.stages.Compiled` that no jit cache knows, so
the lowering names the devices it runs on (the store's key, and the devices a loaded program is
placed on) and how to hand it to its owner (`keep`), which calls it in place of the jit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A lowered program to compile before the step that runs it.

    Attributes:
      kind: which program ("fwd", "fwd_res", "bwd", "bwd_res", "last", "eval", "count",
        "transfer", "read", "step").
      lowered: the program, traced and lowered from abstract inputs.
      then: given the compiled program, further lowerings that need its compiled output shardings
        (the backward from residuals of a forward with residuals); None when there are none.
      devices: the global ids of the devices it runs on, in its device assignment's order (the
        flat order of the one mesh its shardings use); None: it never comes from a store.
      keep: takes the compiled program where a store gave it, to be called in place of the jit;
        None: it never comes from a store.
    """

    kind: str
    lowered: jax.stages.Lowered
    then: Callable[[jax.stages.Compiled], list[Lowering]] | None = None
    devices: tuple[int, ...] | None = None
    keep: Callable[[jax.stages.Compiled], None] | None = None


class KeptProgram:
    """A jitted program called with one signature only (a transfer's, an optimizer's per-step
    program), and the compiled program a store gave for it: `run` calls that one, else the jit.

    `devices`: the devices its shardings' one mesh holds, in the mesh's order."""

    def __init__(self, jit: Callable, devices: Sequence[jax.Device]):
        self.jit = self.run = jit
        self.devices = tuple(d.id for d in devices)

    def lowering(self, kind: str, *args) -> Lowering:
        """The program lowered for `args` (abstract or real), for `precompile`."""
        return Lowering(kind, self.jit.lower(*args), devices=self.devices, keep=self.keep)

    def keep(self, compiled: jax.stages.Compiled) -> None:
        self.run = compiled
