"""Jitted programs whose tree arguments and outputs cross the jit boundary as lists of leaves.

    prog = LeafProgram(fn, (params_treedef, None), acc_treedef, in_shardings=..., ...)
    acc_leaves = prog.jit(param_leaves, x)     # the hot path: leaves flattened once by the caller
    new_leaves = prog.run(param_leaves, x)     # a program of one signature: a store's, or the jit
    acc_tree = prog(params, x)                 # the same program called with the trees

Why: jax flattens a jit's arguments on every call. A list of arrays is flattened in C++; an nnx
parameter tree (flax `Variable` nodes) calls back into Python for every leaf, and a tree output is
rebuilt leaf by leaf. The stage programs (`programs/stage_jits.py`) and the optimizer's per-step programs
(`runtime/train_state.py`) take their parameter, accumulator and optimizer-state trees as leaves,
which their owners flatten once per step (when the values change), not once per call.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from dflop_jax.programs.lowering import Lowering


class LeafProgram:
    """A jitted program whose parameter and accumulator trees cross the jit boundary as lists of
    their leaves: `jit` takes and returns leaves in place of the arguments and outputs that `ins` /
    `outs` give a treedef for (None: passed as they are), so a call flattens no tree (jax flattens
    a list of arrays in C++; an nnx tree calls back into Python per leaf, and its outputs are
    rebuilt leaf by leaf). `StageProgram` calls `jit` with leaves it flattened once; called or
    lowered here (the profiler, `plan --check`, tests) the trees are flattened and the outputs
    rebuilt. The lowered program is the same either way: jit flattens a tree to the same leaves.

    Args:
      fn: the program over trees, returning one value (`outs` a treedef or None) or a tuple
        (`outs` a tuple, one entry per element).
      ins: per positional argument, the treedef of a tree passed as leaves, or None.
      outs: as `ins`, for the outputs.
      in_shardings, out_shardings: as `jax.jit`'s, given for the trees (made leaves here).
      name: the program's name (jax's `jit_<name>` module); None: `fn`'s `__name__`.
      **jit: `jax.jit`'s other arguments (`donate_argnums`, `static_argnums`: positions as given).
    """

    def __init__(self, fn: Callable, ins: tuple, outs, *, in_shardings=None,
                 out_shardings=None, name: str | None = None, **jit):  # fmt: skip
        self.ins, self.outs = ins, outs
        self._many = isinstance(outs, tuple)

        def on_leaves(*args):
            trees = [a if t is None else t.unflatten(a) for a, t in zip(args, ins)]
            return self._leaves_out(fn(*trees))

        # jax names the program after its function (compile logs, `bench multihost`'s counts)
        name = getattr(fn, "__name__", "on_leaves") if name is None else name
        on_leaves.__name__ = on_leaves.__qualname__ = name
        if in_shardings is not None:
            jit["in_shardings"] = tuple(
                s if t is None else jax.tree.leaves(s) for s, t in zip(in_shardings, ins)
            )
        if out_shardings is not None:
            jit["out_shardings"] = self._leaves_out(out_shardings)
        self.jit = self.run = jax.jit(on_leaves, **jit)

    def _leaves_out(self, out):
        if not self._many:
            return out if self.outs is None else jax.tree.leaves(out)
        return tuple(o if t is None else jax.tree.leaves(o) for o, t in zip(out, self.outs))

    def _trees_out(self, out):
        if not self._many:
            return out if self.outs is None else self.outs.unflatten(out)
        return tuple(o if t is None else t.unflatten(o) for o, t in zip(out, self.outs))

    def leaves_of(self, args: tuple) -> list:
        """`args` with each tree argument (`ins`) as its leaves (a list of leaves stays one)."""
        return [a if t is None else jax.tree.leaves(a) for a, t in zip(args, self.ins)]

    def __call__(self, *args):
        """The program over trees: the tree arguments flattened, the tree outputs rebuilt."""
        return self._trees_out(self.jit(*self.leaves_of(args)))

    def lower(self, *args) -> jax.stages.Lowered:
        """The program lowered for the trees `args` (or their leaves); compiled, it is called
        with the trees too (`_Compiled`)."""
        return _Lowered(self.jit.lower(*self.leaves_of(args)), self)

    def lowering(self, kind: str, devices: tuple[int, ...], *args) -> Lowering:
        """The program lowered for the trees `args` as `precompile` takes it: a program of one
        signature, whose compiled form an executable store may give (`keep`: `run` calls it);
        `devices`: its mesh's device ids, in the mesh's order."""
        return Lowering(kind, self.jit.lower(*self.leaves_of(args)), devices=devices,
                        keep=self.keep)  # fmt: skip

    def keep(self, compiled: jax.stages.Compiled) -> None:
        """Calls `compiled` (a store's, over leaves) in place of the jit from now on (`run`)."""
        self.run = compiled

    def trace(self, *args) -> jax.stages.Traced:
        return self.jit.trace(*self.leaves_of(args))


class _Lowered:
    """A `LeafProgram`'s lowered program (`jax.stages.Lowered`'s attributes) whose `compile` gives
    a program called with the trees."""

    def __init__(self, lowered: jax.stages.Lowered, program: LeafProgram):
        self._lowered, self._program = lowered, program

    def compile(self, *args, **kwargs) -> _Compiled:
        return _Compiled(self._lowered.compile(*args, **kwargs), self._program)

    def __getattr__(self, name):
        return getattr(self._lowered, name)


class _Compiled:
    """A `LeafProgram`'s compiled program (`jax.stages.Compiled`'s attributes), called with the
    trees (or their leaves) as the program is."""

    def __init__(self, compiled: jax.stages.Compiled, program: LeafProgram):
        self._compiled, self._program = compiled, program

    def __call__(self, *args):
        p = self._program
        return p._trees_out(self._compiled(*p.leaves_of(args)))

    def __getattr__(self, name):
        return getattr(self._compiled, name)
