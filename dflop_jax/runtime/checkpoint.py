"""Checkpoints: orbax `CheckpointManager` (async, keep last K, atomic) over every stage's state.

Layout independence: params and optimizer state are NOT stored per stage. Each stage's trees are
flattened with GLOBAL layer indices (a path component after a `layers` key is offset by the stage's
`first_layer`) and merged per module, so a checkpoint is a model-level tree
`{"encoder": {...}, "llm": {...}}` that any other layout of the same model restores from: each new
stage picks its own keys and orbax reads them straight into the new stage's shardings. Leaves shared by
all stages of a module (optimizer step counts) are stored once.

Beside the arrays, a JSON item holds the step, the data loader state (grain iterator + counters), the
scheduler's correction state, the plan/layout and anything else the trainer passes in `meta`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dflop_jax.costs.layout import StageSpec
from dflop_jax.runtime.stages import PyTree


def key_name(k) -> str:
    """The name of one pytree path entry (dict key, sequence index or attribute)."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def global_path(path, spec: StageSpec) -> tuple[str, ...]:
    """A leaf's path in the model-level tree: key names, layer indices offset to global ones."""
    names = [key_name(k) for k in path]
    for i in range(1, len(names)):
        if names[i - 1] == "layers" and names[i].isdigit():
            names[i] = str(int(names[i]) + spec.first_layer)
    return tuple(names)


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
    """The layout-independent tree {module: {"params": ..., "opt": ...}} of all stages' state."""
    tree: dict = {}
    for spec, p, o in zip(specs, params, opt_states):
        for kind, sub in (("params", p), ("opt", o)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
                _insert(tree, (spec.module, kind, *global_path(path, spec)), leaf)
    return tree


def stage_trees(specs, params, opt_states, tree: dict) -> tuple[list[PyTree], list[PyTree]]:
    """Inverse of `model_tree`: per-stage (params, opt state) shaped like the given templates."""

    def pick(spec, kind, template):
        def leaf(path, t):
            value = _lookup(tree, (spec.module, kind, *global_path(path, spec)))
            sharding = getattr(t, "sharding", None)
            if sharding is not None and getattr(value, "sharding", None) != sharding:
                value = jax.device_put(value, sharding)
            return value

        return jax.tree_util.tree_map_with_path(leaf, template)

    new_p = [pick(s, "params", p) for s, p in zip(specs, params)]
    new_o = [pick(s, "opt", o) for s, o in zip(specs, opt_states)]
    return new_p, new_o


class Checkpointer:
    """Saves/restores the run state every `every` steps under `directory` (last `keep` kept).

    Args:
      directory: checkpoint root (created).
      keep: checkpoints kept (older ones deleted).
      async_save: write in a background thread (the step loop continues).
    """

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(), item_names=("state", "meta"), options=options
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, specs, params, opt_states, meta: dict[str, Any]) -> None:
        """Starts saving (async); `meta` must be JSON-serializable."""
        tree = model_tree(specs, params, opt_states)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(dict(meta, step=step))
            ),
        )

    def restore(self, specs, params, opt_states, step: int | None = None):
        """Restores onto the CURRENT stages' shapes and shardings (any layout of the same model).

        Returns:
          (params per stage, opt state per stage, meta dict).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.manager.directory}")
        target = model_tree(specs, params, opt_states)
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), target
        )
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        new_p, new_o = stage_trees(specs, params, opt_states, out.state)
        return new_p, new_o, out.meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _wait_for_files(paths: list[Path], timeout_s: float, poll_s: float = 0.05) -> None:
    """Returns once every path exists; raises TimeoutError naming the missing ones after timeout_s."""
    deadline = time.monotonic() + timeout_s
    missing = list(paths)
    while True:
        missing = [p for p in missing if not p.exists()]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"checkpoint: {', '.join(p.name for p in missing)} not written under "
                f"{missing[0].parent} within {timeout_s}s (a process died or the directory is "
                "not shared by all processes)"
            )
        time.sleep(poll_s)


class OwnerCheckpointer:
    """Multi-process checkpoints for layouts whose stage meshes each live on ONE process.

    orbax refuses such host-local arrays in multi-process runs (DESIGN section 11), so here every
    process writes the arrays it owns: `step_<N>/process_<i>.npz` (temp file, then rename, so the
    file's appearance means "done"); process 0 waits (bounded, polling) until every process's file
    is there and writes `step_<N>/meta.json` last, which marks the step complete (atomic). The
    barrier goes through the shared directory, not a device collective or JAX internals: it cannot
    queue behind device work, and the restore needs that shared directory anyway. The arrays are the same layout-independent model tree as
    `Checkpointer`'s, so restoring reads every process's file and places each leaf onto the CURRENT
    stages' shardings (any layout). Needs a directory all processes share.
    """

    def __init__(self, directory: str | Path, keep: int = 3, timeout_s: int = 600):
        self.directory, self.keep, self.timeout_s = Path(directory).absolute(), keep, timeout_s
        self.directory.mkdir(parents=True, exist_ok=True)

    def latest_step(self) -> int | None:
        steps = [int(p.parent.name[5:]) for p in self.directory.glob("step_*/meta.json")]
        return max(steps) if steps else None

    def save(self, step: int, specs, params, opt_states, meta: dict[str, Any]) -> None:
        """Writes this process's arrays, then (process 0) the meta once every process is done."""
        import json

        import numpy as np

        me, n = jax.process_index(), jax.process_count()
        out = self.directory / f"step_{step}"
        out.mkdir(exist_ok=True)
        mine = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            model_tree(specs, params, opt_states)
        )[0]:
            owners = {d.process_index for d in leaf.sharding.device_set}
            if len(owners) > 1:
                raise ValueError(
                    f"checkpoint: {'/'.join(key_name(k) for k in path)} spans processes {sorted(owners)}; "
                    "owner-writes checkpoints need every stage mesh on one process"
                )
            if me in owners:
                mine["/".join(key_name(k) for k in path)] = np.asarray(leaf)
        tmp = out / f".process_{me}.npz"
        with tmp.open("wb") as f:
            np.savez(f, **mine)
        tmp.rename(out / f"process_{me}.npz")
        if me == 0:  # each renamed file is that process's "done"; meta.json last marks the step
            _wait_for_files([out / f"process_{i}.npz" for i in range(n)], self.timeout_s)
            (out / ".meta.json").write_text(json.dumps(dict(meta, step=step)))
            (out / ".meta.json").rename(out / "meta.json")
            self._prune()

    def _prune(self) -> None:
        import shutil

        done = sorted(int(p.parent.name[5:]) for p in self.directory.glob("step_*/meta.json"))
        for step in done[: -self.keep]:
            shutil.rmtree(self.directory / f"step_{step}", ignore_errors=True)

    def restore(self, specs, params, opt_states, step: int | None = None):
        """Returns (params per stage, opt state per stage, meta) on the current stages' shardings."""
        import json

        import numpy as np

        from dflop_jax.runtime.stages import put_host

        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.directory}")
        src = self.directory / f"step_{step}"
        flat: dict[str, Any] = {}
        for f in sorted(src.glob("process_*.npz")):
            with np.load(f) as data:
                flat.update({k: data[k] for k in data.files})
        target = model_tree(specs, params, opt_states)

        def leaf(path, t):
            key = "/".join(key_name(k) for k in path)
            if key not in flat:
                raise KeyError(f"checkpoint step {step} has no entry {key}")
            return put_host(flat[key].astype(t.dtype), t.sharding)

        tree = jax.tree_util.tree_map_with_path(leaf, target)
        new_p, new_o = stage_trees(specs, params, opt_states, tree)
        return new_p, new_o, json.loads((src / "meta.json").read_text())

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None
