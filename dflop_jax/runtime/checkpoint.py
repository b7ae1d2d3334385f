"""Checkpoints: orbax `CheckpointManager`s (async, keep last K, atomic) over every stage's state,
for any layout in single- and multi-process runs.

Layout independence: params and optimizer state are NOT stored per stage. Each stage's trees are
flattened with GLOBAL layer indices (a path component after a `layers` key is offset by the stage's
`first_layer`) and merged per module into a model-level tree `{"encoder": {...}, "llm": {...}}`;
any other layout of the same model (or another process count) restores from it: each new stage
picks its own keys and orbax reads them straight into the new stage's shardings, each process
reading only the slices its own devices hold. Leaves shared by several stages (optimizer step
counts) are stored once per group below. A stage holding whole encoders beside its LLM layers
(the colocated encoder, `{"encoder": ..., "llm": ...}`, `models.mllm.ColocatedStage`; an omni
model's audio encoder, "audio", `models.omni.OmniFirstStage`) maps each part to its module (encoder
layers from 0) and its shared leaves to every module it holds (`param_paths.held_modules`), so a
colocated run resumes on a layout with encoder (or audio) stages and back.

Process groups: the stages are grouped by the set of processes their meshes span ("owners"), and
each group is one orbax `CheckpointManager` under `<directory>/procs_<i-j-...>/` that only the
owners run (`MultiprocessingOptions(active_processes=owners, primary_host=min(owners))`,
key-value-store barriers among the owners only; DESIGN section 11). Every process writes only its
own shards. A stage local to one process is a host-local array, which orbax refuses to save in a
multi-process run; it is saved through a zero-copy global VIEW (`_global_view`) whose extra replica
lives on another process's devices and is never written. Every process also owns `procs_<i>/` (its
singleton group), which holds the JSON meta: step, loader state (per process), scheduler state,
layout, the last evaluation (`eval`: its step, loss and loss tokens, or None), and the list of group
directories of the save. A step is complete when process 0's meta
and every listed group directory have it (each manager commits atomically; the list makes the
whole save atomic). A resumed run first discards what a run killed mid-save left after its step
(`discard_after`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding

from dflop_jax.contracts.layout import StageSpec
from dflop_jax.programs.param_paths import held_modules, key_name, model_paths
from dflop_jax.programs.stage_fns import PyTree


def _insert(tree: dict, path: tuple[str, ...], value) -> None:
    node = tree
    for name in path[:-1]:
        node = node.setdefault(name, {})
    node.setdefault(path[-1], value)


def _lookup(tree: dict, path: tuple[str, ...]):
    node = tree
    for name in path:
        if name not in node:
            raise KeyError(
                f"checkpoint has no entry {'/'.join(path)}; was it saved from another model?"
            )
        node = node[name]
    return node


def model_tree(specs: list[StageSpec], params: list[PyTree], opt_states: list[PyTree]) -> dict:
    """The layout-independent tree {module: {"params": ..., "opt": ...}} of these stages' state."""
    tree: dict = {}
    for spec, p, o in zip(specs, params, opt_states):
        held = held_modules(p)
        for kind, sub in (("params", p), ("opt", o)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
                for module, *names in model_paths(path, spec, held):
                    _insert(tree, (module, kind, *names), leaf)
    return tree


def owners(tree: PyTree) -> tuple[int, ...]:
    """The processes whose devices hold `tree` (arrays or ShapeDtypeStructs with shardings)."""
    leaf = jax.tree.leaves(tree)[0]
    return tuple(sorted({d.process_index for d in leaf.sharding.device_set}))


def group_name(procs: tuple[int, ...]) -> str:
    return "procs_" + "-".join(map(str, procs))


def _global_view(leaf: jax.Array, path: str) -> jax.Array:
    """`leaf` (all devices on this process) as an array orbax accepts in a multi-process run.

    The stage mesh gains a leading "ckpt" axis of size 2: row 0 is the stage's own devices holding
    `leaf`'s shards (zero copy), row 1 as many devices of other processes, which hold replica 1 of
    every shard and are never touched: orbax writes replica 0 only (replica-parallel writing is
    off), and the other processes never see this array.
    """
    s = leaf.sharding
    if not isinstance(s, NamedSharding):
        raise ValueError(
            f"checkpoint: {path} has a {type(s).__name__}; stage state needs NamedSharding"
        )
    grid, me = s.mesh.devices, jax.process_index()
    others = [d for d in jax.devices() if d.process_index != me][: grid.size]
    if len(others) < grid.size:
        raise ValueError(
            f"checkpoint: {path} lives on {grid.size} devices of process {me} but the other "
            f"processes have only {len(others)}; a stage local to one process may use at most as "
            "many devices as the others hold together"
        )
    rows = np.stack([grid, np.array(others, dtype=object).reshape(grid.shape)])
    mesh = Mesh(rows, ("ckpt", *s.mesh.axis_names))
    shards = [x.data for x in leaf.addressable_shards]
    return jax.make_array_from_single_device_arrays(leaf.shape, NamedSharding(mesh, s.spec), shards)


def _options(procs: tuple[int, ...]) -> ocp.options.MultiprocessingOptions:
    return ocp.options.MultiprocessingOptions(
        primary_host=min(procs),
        active_processes=set(procs),
        barrier_sync_key_prefix=group_name(procs),
    )


def _tree_handler(procs: tuple[int, ...]) -> ocp.PyTreeCheckpointHandler:
    """A pytree handler whose array writer treats the group's first process as the primary one.

    The default registry's `ArrayHandler` has primary_host=0 (a group without process 0 would write
    no array metadata) and an array-metadata check that expects every process of the run.
    """
    arrays = ocp.type_handlers.ArrayHandler(primary_host=min(procs), use_replica_parallel=False)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    return ocp.PyTreeCheckpointHandler(
        multiprocessing_options=_options(procs), type_handler_registry=registry
    )


def _steps(directory: Path) -> list[int]:
    """Committed steps under one manager directory (orbax renames `<step>.orbax-...-tmp`)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _flat(tree: PyTree) -> dict[tuple[str, ...], Any]:
    return {
        tuple(key_name(k) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _nest(flat: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        _insert(tree, path, leaf)
    return tree


def _meta(directory: Path, process: int, step: int) -> dict:
    path = directory / group_name((process,)) / str(step) / "meta" / "meta.json"
    return json.loads(path.read_text())


def complete_steps(directory: Path) -> list[int]:
    """The steps whose every group directory committed (process 0's meta lists them), oldest first."""
    return [
        step
        for step in _steps(directory / group_name((0,)))
        if all((directory / g / str(step)).is_dir() for g in _meta(directory, 0, step)["groups"])
    ]


def latest_step(directory: Path) -> int | None:
    """The newest complete step under `directory`, or None."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


class Checkpointer:
    """Saves/restores the run state under `directory` (last `keep` kept), one manager per group.

    Args:
      directory: checkpoint root (created); all processes must see the same directory.
      keep: checkpoints kept (older ones deleted).
      async_save: write in background threads (the step loop continues).
    """

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory, self.keep, self.async_save = Path(directory).absolute(), keep, async_save
        self.directory.mkdir(parents=True, exist_ok=True)
        self.managers: dict[tuple[int, ...], ocp.CheckpointManager] = {}

    def _manager(self, procs: tuple[int, ...]) -> ocp.CheckpointManager:
        if procs not in self.managers:
            path = self.directory / group_name(procs)
            path.mkdir(exist_ok=True)  # orbax will not create it when active_processes is set
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                create=False,
                enable_async_checkpointing=self.async_save,
                multiprocessing_options=_options(procs),
                # Async directory creation signals through global key-value keys numbered per
                # process; managers over different process subsets would read each other's keys.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            )
            handlers = {
                "state": _tree_handler(procs),
                "meta": ocp.JsonCheckpointHandler(
                    "meta.json", multiprocessing_options=_options(procs)
                ),
            }
            self.managers[procs] = ocp.CheckpointManager(
                path, options=options, item_handlers=handlers
            )
        return self.managers[procs]

    def latest_step(self) -> int | None:
        """The newest step whose every group directory committed (process 0's meta lists them)."""
        return latest_step(self.directory)

    def discard_after(self, step: int) -> None:
        """Deletes every group's saves after `step`, committed or not (process 0; all wait).

        A run killed mid-save leaves some groups with a newer committed step and others with a
        temporary directory; the resumed run saves those steps again, which orbax refuses while they
        exist.
        """
        if jax.process_index() == 0:
            for group in self.directory.glob("procs_*"):
                for saved in group.iterdir():
                    name = saved.name.split(".")[0]
                    if name.isdigit() and (int(name) > step or not saved.name.isdigit()):
                        shutil.rmtree(saved)
        everyone = set(range(jax.process_count()))
        ocp.multihost.sync_global_processes(f"dflop_discard_after_{step}", processes=everyone)

    def _meta(self, process: int, step: int) -> dict:
        return _meta(self.directory, process, step)

    def save(self, step: int, specs, params, opt_states, meta: dict[str, Any]) -> None:
        """Starts saving (async) this process's share; `meta` must be JSON-serializable.

        Non-local stages (no device on this process; params may be ShapeDtypeStructs) are skipped:
        their owners save them.
        """
        me, n = jax.process_index(), jax.process_count()
        stage_groups = [owners(p) for p in params]
        groups = sorted(set(stage_groups) | {(i,) for i in range(n)}, key=lambda g: (len(g), g))
        meta = dict(
            meta, step=step, process=me, process_count=n, groups=[group_name(g) for g in groups]
        )
        for g in groups:  # the same order on every process: no cycle among group barriers
            if me not in g:
                continue
            mine = [i for i, sg in enumerate(stage_groups) if sg == g]
            tree = model_tree([specs[i] for i in mine], [params[i] for i in mine],
                              [opt_states[i] for i in mine])  # fmt: skip
            if n > 1 and len(g) == 1:
                tree = jax.tree_util.tree_map_with_path(
                    lambda path, x: _global_view(x, "/".join(key_name(k) for k in path)), tree
                )
            args = {"state": ocp.args.PyTreeSave(tree)} if tree else {}
            if g == (me,):
                args["meta"] = ocp.args.JsonSave(meta)
            self._manager(g).save(step, args=ocp.args.Composite(**args))

    def restore(self, specs, params, opt_states, step: int | None = None, progress=None):
        """Restores onto the CURRENT stages' shapes and shardings (any layout, any process count).

        Each process reads only the slices its devices hold of the stages it takes part in; the
        others' entries are returned unchanged. `progress("restore checkpoint", done, total)`
        after each stage (`planner.progress.progress_bar`).

        Returns:
          (params per stage, opt state per stage, meta dict of this process, or of process 0 when
          the checkpoint came from another process count).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.directory}")
        me = jax.process_index()
        meta = self._meta(0, step)
        if meta["process_count"] == jax.process_count() and me != 0:
            meta = self._meta(me, step)
        handler = _tree_handler((me,))
        reader = ocp.Checkpointer(handler, multiprocessing_options=_options((me,)))
        sources = [self.directory / g / str(step) / "state" for g in meta["groups"]]
        stored = [(d, set(_flat(_metadata_tree(handler, d)))) for d in sources if d.is_dir()]
        new_p, new_o = list(params), list(opt_states)
        report = progress or (lambda *_: None)
        report("restore checkpoint", 0, len(specs))
        for i, (spec, p, o) in enumerate(zip(specs, params, opt_states)):
            if me in owners(p):
                values = _read(reader, stored, model_tree([spec], [p], [o]), step)
                new_p[i], new_o[i] = _stage_trees(spec, p, o, values)
            report("restore checkpoint", i + 1, len(specs))
        reader.close()
        return new_p, new_o, meta

    def wait(self) -> None:
        for m in self.managers.values():
            m.wait_until_finished()

    def close(self) -> None:
        for m in self.managers.values():
            m.wait_until_finished()
            m.close()


class SavedState:
    """A committed checkpoint step read on one host, a leaf or a group of leaves at a time, whatever
    layout and process count saved it (the exporter's view: no stage, mesh or device is involved).

    Attributes:
      step: the step read; meta: process 0's meta of that step.
      leaves: stored path -> (group directory, ArrayMetadata with `shape` and `dtype`) of every
        array leaf (model-level paths, `model_tree`).
    """

    def __init__(self, directory: str | Path, step: int | None = None):
        directory = Path(directory).absolute()  # orbax reads no item metadata under a relative path
        steps = complete_steps(directory)
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint under {directory}")
        if step is not None and step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint of step {step} under {directory} (steps: {steps})"
            )
        self.step = steps[-1] if step is None else step
        self.meta = _meta(directory, 0, self.step)
        self._handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=_options((0,)))
        self._reader = ocp.Checkpointer(self._handler, multiprocessing_options=_options((0,)))
        self.leaves: dict[tuple[str, ...], tuple[Path, Any]] = {}
        for g in self.meta["groups"]:
            state = directory / g / str(self.step) / "state"
            if state.is_dir():
                for path, md in _flat(_metadata_tree(self._handler, state)).items():
                    self.leaves.setdefault(path, (state, md))

    def read(self, path: tuple[str, ...]) -> np.ndarray:
        """One leaf, whole, as a host array (only its bytes are read)."""
        return self.read_many([path])[path]

    def read_many(self, paths: list[tuple[str, ...]]) -> dict[tuple[str, ...], np.ndarray]:
        """The leaves `paths`, whole, as host arrays: one orbax restore per group directory holding
        some of them (only their bytes are read). Why not `read` per leaf: every restore parses the
        item's whole tree metadata, so reading a model leaf by leaf costs leaves x tree entries."""
        by_state: dict[Path, list[tuple[str, ...]]] = {}
        for path in paths:
            by_state.setdefault(self.leaves[path][0], []).append(path)
        out: dict[tuple[str, ...], np.ndarray] = {}
        for state, group in by_state.items():
            mds = {path: self.leaves[path][1] for path in group}
            restore = {p: ocp.RestoreArgs(restore_type=np.ndarray, dtype=md.dtype)
                       for p, md in mds.items()}  # fmt: skip
            args = ocp.args.PyTreeRestore(
                item=_nest(mds), restore_args=_nest(restore), partial_restore=True
            )
            read = _flat(self._reader.restore(state, args=args))
            out.update((path, np.asarray(read[path])) for path in group)
        return out

    def close(self) -> None:
        self._reader.close()


def _metadata_tree(handler: ocp.PyTreeCheckpointHandler, directory: Path) -> dict:
    """The stored tree structure of one pytree item (no array data read). `directory` must be
    absolute: orbax reads no item metadata under a relative path. Asked of the item's handler, not
    a `Checkpointer`: that one also reads step metadata, which lives a directory up, beside the
    items (`<step>/_CHECKPOINT_METADATA`), and warns on every restore that it is missing here."""
    return handler.metadata(directory).tree


def _read(reader: ocp.Checkpointer, stored, target: dict, step: int) -> dict:
    """Reads every leaf of `target` (one stage's model tree) from the group directory holding it."""
    want = {
        path: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        for path, x in _flat(target).items()
    }
    found: dict[tuple[str, ...], Any] = {}
    for directory, keys in stored:
        part = {k: v for k, v in want.items() if k in keys and k not in found}
        if part:
            tree = _nest(part)
            args = ocp.args.PyTreeRestore(
                item=tree,
                restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
                partial_restore=True,
            )
            found.update(_flat(reader.restore(directory, args=args)))
    missing = sorted("/".join(k) for k in want.keys() - found.keys())
    if missing:
        raise KeyError(
            f"checkpoint step {step} has no entry {missing[0]} ({len(missing)} missing); "
            "was it saved from another model?"
        )
    return _nest(found)


def _stage_trees(spec: StageSpec, params: PyTree, opt_state: PyTree, tree: dict):
    """Inverse of `model_tree` for one stage: (params, opt state) shaped like the templates."""

    held = held_modules(params)

    def pick(kind, template):
        def one(path, _):
            module, *names = model_paths(path, spec, held)[0]
            return _lookup(tree, (module, kind, *names))

        return jax.tree_util.tree_map_with_path(one, template)

    return pick("params", params), pick("opt", opt_state)
