"""Compiled programs kept on disk for the processes JAX's persistent cache does not write from.

    store = ExecutableStore.for_this_process(cfg.compilation_cache)   # None on process 0
    compiled, source = store.compile(lowered, devices)   # "loaded", "compiled" or "held"

Why: JAX's persistent compilation cache reads on every process but writes only from process 0 (to
spare shared filesystems concurrent writers; jax/_src/compiler.py). In a pipeline every process runs
its own stages, so the programs of stages without a device on process 0 were compiled again by every
run: a second run of the same plan was as slow to start on those processes as the first. The store
closes that gap with jax's public AOT serialization (`jax.experimental.serialize_executable`): a
process other than 0 writes each program it compiles through the store to
`<compilation_cache>/dflop_executables/<key>.pkl`, and a later run deserializes it instead of
compiling. A program deserialized this way is a `jax.stages.Compiled`, which no jit cache knows
about, so its owner calls it itself: a stage (`StageProgram`'s table of compiled programs), a
program of one signature (`programs/lowering.py`'s `KeptProgram`, `LeafProgram.run`), or the one
call of an initialization (`call_once`).

The key is a hash of what decides the executable: the lowered module's text (shapes, shardings,
donation, the program itself), the devices it runs on (by global id: stages alike but for their
devices lower to the same text), jax's and the backend's versions, and `XLA_FLAGS`. A file that
does not load (truncated, another jax's) is logged, compiled again and rewritten. A program JAX's
persistent cache serves (one process 0 also compiles) is left to that cache and not written: on
XLA:CPU (jax 0.10.2) an executable JAX loaded from its cache serializes into a file that loads but
fails to run ("Function ... not found"). Writes go through a temporary file and a rename, so a
reader never sees half a file, and two processes writing one key (a program spanning both) leave
one whole file. Within a process, threads asking for one key at once wait for the first, which
builds it once.

Loading a file runs what it holds (pickle, and an executable): point `compilation_cache` only at a
folder you trust, as with JAX's own cache.

What goes through it: the stage programs (forward, backward, the last stage's fused step and
loss-token count, evaluation), which take longest to compile (8-41 s each for the 7B and 32B x64
plans' stages on a 2-core CPU, docs/benchmarks.md); each stage's parameter and optimizer-state
initialization (and a restore's padding of it); the optimizers' per-step programs, the update's
statistics and a tied embedding's gradient sums; the transfers and host reads, those compiled
ahead (`runtime/precompile.py`) and those the start-up runs before it (`hand_over`); the learning
rate's program. On the tiny 2-process LLaVA-OV run, process 1's second run compiles nothing, where
its first compiled 41 programs in 41 s (`bench multihost second_run=true`, docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from dflop_jax.programs.lowering import Lowering

log = logging.getLogger(__name__)
SUBDIR = "dflop_executables"
# jax.monitoring's event for one program deserialized from a store: `runtime.precompile`'s count of
# the programs a run builds counts it as built and found in a cache, as JAX's own cache hits.
STORE_LOAD_EVENT = "/dflop_jax/executable_store/load"
# jax.monitoring's event for a program found in JAX's persistent cache (jax/_src/compiler.py).
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Per compiling thread: whether JAX's persistent cache served the compile in progress (its event
# fires on the thread that compiles; `precompile` compiles in a pool of threads).
_compiling = threading.local()
_listening = threading.Lock()  # held while the one listener is registered (listeners stay)
_listener: list[bool] = []


def _on_event(event: str, **_) -> None:
    if event == JAX_CACHE_HIT_EVENT and getattr(_compiling, "watched", False):
        _compiling.served = True


def _compile_fresh_or_served(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """`lowered` compiled, and whether JAX's persistent cache served it (a process other than 0
    reads that cache: a program process 0 also compiles, one spanning both, may be there)."""
    with _listening:
        if not _listener:
            jax.monitoring.register_event_listener(_on_event)
            _listener.append(True)
    _compiling.watched, _compiling.served = True, False
    try:
        return lowered.compile(), _compiling.served
    finally:
        _compiling.watched = False


class ExecutableStore:
    """Serialized compiled programs under `root` (module docstring).

    Attributes:
      loaded, saved: programs this store deserialized / wrote so far.
      failed: files that did not load (compiled again) or programs that did not serialize.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.loaded = self.saved = self.failed = 0
        self._lock = threading.Lock()  # precompile's pool compiles in threads
        # key -> the program this process compiled or loaded: a re-plan (which keeps the store)
        # lowers again programs its predecessor already has, and gets the same executable back
        self._held: dict[str, jax.stages.Compiled] = {}
        # key -> the lock its first caller holds while it loads or compiles: two threads of the
        # pool asking for one program (two stages' identical initializations) build it once
        self._building: dict[str, threading.Lock] = {}

    @classmethod
    def for_this_process(cls, cache_dir: str | Path | None) -> ExecutableStore | None:
        """The store of a multi-process run's processes other than 0 when the run has a compilation
        cache (`compilation_cache`); None where JAX's own cache writes (process 0, one process)
        or there is no cache."""
        if not cache_dir or jax.process_count() == 1 or jax.process_index() == 0:
            return None
        return cls(Path(cache_dir) / SUBDIR)

    def key(self, lowered: jax.stages.Lowered, devices: Sequence[int]) -> str:
        """The file name of `lowered` compiled for the devices of global ids `devices`, in the
        order of its device assignment (the flat order of the mesh it was lowered on)."""
        backend = jax.devices()[0].client
        h = hashlib.sha256()
        for part in (jax.__version__, backend.platform, backend.platform_version,
                     os.environ.get("XLA_FLAGS", ""), repr(tuple(devices)), lowered.as_text()):  # fmt: skip
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def compile(
        self, lowered: jax.stages.Lowered, devices: Sequence[int]
    ) -> tuple[jax.stages.Compiled, str]:
        """`lowered` compiled, and where it came from: "loaded" from the store's folder,
        "compiled" (by XLA, and written there; or found in JAX's persistent cache, which keeps it)
        or "held" (this store gave it before)."""
        key = self.key(lowered, devices)
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:
            if key in self._held:
                return self._held[key], "held"
            return self._build(key, lowered, devices)

    def _build(
        self, key: str, lowered: jax.stages.Lowered, devices: Sequence[int]
    ) -> tuple[jax.stages.Compiled, str]:
        """`compile` for a key this store holds nothing for yet (its caller holds the key's lock)."""
        path = self.root / f"{key}.pkl"
        compiled = self._load(path, devices) if path.is_file() else None
        loaded = compiled is not None
        if loaded:
            self._count("loaded")
            jax.monitoring.record_event(STORE_LOAD_EVENT)
        else:
            compiled, served = _compile_fresh_or_served(lowered)
            # What JAX's cache served stays there, and is not written here: on XLA:CPU (jax
            # 0.10.2) an executable JAX loaded from its cache serializes into a file that loads but
            # fails to run ("Function ... not found").
            if not served:
                self._save(path, compiled)
        self._held[key] = compiled
        return compiled, "loaded" if loaded else "compiled"

    def _load(self, path: Path, devices: Sequence[int]) -> jax.stages.Compiled | None:
        # the executable's own devices, in its order (the stage mesh's): without them jax would
        # load it for every device of the backend
        by_id = {d.id: d for d in jax.devices()}
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[by_id[i] for i in devices]
            )
        except Exception as e:  # a file of another jax, or cut short: compile it again
            self._count("failed")
            log.warning("compiled program %s did not load (%s: %s); compiling it again",
                        path.name, type(e).__name__, e)  # fmt: skip
            return None

    def _save(self, path: Path, compiled: jax.stages.Compiled) -> None:
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # a program the backend cannot serialize: it compiles every run
            self._count("failed")
            log.warning("compiled program not stored (%s: %s)", type(e).__name__, e)
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only disk: the run goes on, the next one compiles
            self._count("failed")
            log.warning("compiled program not stored in %s (%s)", self.root, e)
            return
        self._count("saved")

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)


def call_once(jit, args: tuple, devices: Sequence[jax.Device], store: ExecutableStore | None):
    """`jit(*args)` for a program a run calls once (a stage's parameter initialization, an
    optimizer's fresh state), through `store` where there is one: loaded from it, or compiled and
    written to it. `devices`: the program's mesh's, in its order."""
    if store is None:
        return jit(*args)
    compiled, _ = store.compile(jit.lower(*args), [d.id for d in devices])
    return compiled(*args)


def hand_over(lowerings: Sequence[Lowering], store: ExecutableStore | None) -> None:
    """Gives each lowering's owner (`Lowering.keep`) the program `store` loads or compiles for it,
    one after the other: for the few programs a run calls before `precompile` (the transfers that
    set up the processes' communicators). Nothing without a store."""
    if store is None:
        return
    for lw in lowerings:
        if lw.keep is not None and lw.devices is not None:
            lw.keep(store.compile(lw.lowered, lw.devices)[0])
