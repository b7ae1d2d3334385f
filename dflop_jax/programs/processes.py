"""Multi-process start-up: `jax.distributed` from config or environment, with a bounded wait.

Every process runs the same driver loop. Settings come from `TrainConfig.distributed`, else from the
environment variables DFLOP_COORDINATOR (host:port), DFLOP_NUM_PROCESSES and DFLOP_PROCESS_ID (what
`scripts/run_training.sh` exports). Stage transfers are collectives over the union of two stages'
devices (`transfer.py`); host values (schedule digests, stage times, files) travel through the
coordination service's key-value store (`exchange_host`), never through device queues.

Failure is bounded (`watchdog.py`): before joining, every process meets a small TCP hub that process 0
serves at the coordinator's host on `watchdog_port`; a peer that never starts, dies or hangs makes every
process exit within seconds with one line naming it and the step. jax's own heartbeat timeout is set
above the watchdog's, as a backstop that names the task but not the step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.config import require
from dflop_jax.programs.executable_store import ExecutableStore, hand_over
from dflop_jax.programs.lowering import KeptProgram, Lowering
from dflop_jax.programs.transfer import lower_transfer, transfer
from dflop_jax.programs.watchdog import JobError, Watchdog, WatchdogSettings, install

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Attributes:
    coordinator: "host:port" of process 0's coordinator ("" = env DFLOP_COORDINATOR, or single process).
    num_processes, process_id: 0 = from env DFLOP_NUM_PROCESSES / DFLOP_PROCESS_ID.
    timeout_s: how long to wait for every peer to arrive before failing (every process then exits
      naming the missing ones).
    watchdog_port: port of the failure watchdog's hub on the coordinator's host (coordinator port + 1
      when 0; `watchdog.py`).
    heartbeat_timeout_s: a process silent this long (hung, host unreachable) is lost; a killed process
      is seen at once (its connection closes). jax's own heartbeat timeout is this + 15 s.
    stall_timeout_s: no new step on a process for this long (all peers alive) fails the job
      (0 = never); it must exceed the slowest step, compiles included.
    """

    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    timeout_s: int = 50
    watchdog_port: int = 0
    heartbeat_timeout_s: int = 30
    stall_timeout_s: int = 1800

    def __post_init__(self):
        require(self.timeout_s >= 1, "distributed.timeout_s", self.timeout_s, "must be >= 1 second")
        require(self.num_processes >= 0, "distributed.num_processes", self.num_processes, ">= 0")
        require(0 <= self.watchdog_port < 65536, "distributed.watchdog_port", self.watchdog_port,
                "0 (coordinator port + 1) or a TCP port")  # fmt: skip
        require(self.heartbeat_timeout_s >= 2, "distributed.heartbeat_timeout_s",
                self.heartbeat_timeout_s, "must be >= 2 seconds (beats go every second)")  # fmt: skip
        require(self.stall_timeout_s >= 0, "distributed.stall_timeout_s", self.stall_timeout_s,
                "0 (never) or seconds without a new step")  # fmt: skip


def resolve(cfg: DistributedConfig, env: Mapping[str, str]) -> DistributedConfig | None:
    """The effective settings (config first, then env); None for a single-process run."""
    coordinator = cfg.coordinator or env.get("DFLOP_COORDINATOR", "")
    n = cfg.num_processes or int(env.get("DFLOP_NUM_PROCESSES", "1"))
    pid = cfg.process_id if cfg.process_id >= 0 else int(env.get("DFLOP_PROCESS_ID", "0"))
    if n <= 1:
        return None
    if not coordinator or ":" not in coordinator:
        raise ValueError(
            f"distributed: {n} processes need a coordinator host:port, got {coordinator!r}"
        )
    if not 0 <= pid < n:
        raise ValueError(f"distributed.process_id={pid}: must be in [0, {n})")
    return dataclasses.replace(cfg, coordinator=coordinator, num_processes=n, process_id=pid)


def initialize(cfg: DistributedConfig, compilation_cache: str | None = None) -> None:
    """Joins the job (before any other JAX call); a peer that never arrives fails after timeout_s.

    First every process meets the watchdog hub (a missing peer is named there, `watchdog.py`), then
    `jax.distributed.initialize` runs with every peer known to be up. `compilation_cache`: the
    run's (`TrainConfig.compilation_cache`), whose executable store gives the processes other than
    0 the start-up's host read in a second run. JAX's own cache turns on later, after the plan
    (`runtime.trainer.train`: a model profile times cold compiles), so process 0 compiles the
    start-up's few transfer programs in every run.
    """
    host, port = cfg.coordinator.rsplit(":", 1)
    # Said up front: when a peer never arrives the runtime may abort the process from C++ (no Python
    # exception), so this line is the context the user sees next to its fatal message.
    print(
        f"process {cfg.process_id}/{cfg.num_processes}: joining the job at {cfg.coordinator}, waiting "
        f"at most {cfg.timeout_s}s for every peer",
        file=sys.stderr,
        flush=True,
    )
    settings = WatchdogSettings(host, cfg.watchdog_port or int(port) + 1, cfg.timeout_s,
                                cfg.heartbeat_timeout_s, cfg.stall_timeout_s)  # fmt: skip
    dog = Watchdog(settings, cfg.process_id, cfg.num_processes)
    dog.rendezvous()
    install(dog)  # from here an uncaught error or an early exit is reported to the peers
    # XLA:CPU runs cheap programs inline on the dispatching thread (which then waits for their
    # inputs) and expensive ones on a pool: a process can block dispatching a cheap program whose
    # input needs a cross-process program its peers dispatch only after a program of their own
    # that waits for this process. With every program run in dispatch order the processes
    # meet in the one order every process dispatches in (DESIGN 11). Affects the CPU client only.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    try:
        jax.distributed.initialize(
            cfg.coordinator,
            cfg.num_processes,
            cfg.process_id,
            initialization_timeout=cfg.timeout_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s + 15,
        )
    except Exception as e:  # the runtime raises various XlaRuntimeErrors; say what it means
        raise JobError(
            f"process {cfg.process_id}/{cfg.num_processes}: could not join the job at "
            f"{cfg.coordinator} within {cfg.timeout_s}s (a peer never arrived or the coordinator is "
            f"unreachable): {str(e).splitlines()[0]}"
        ) from None
    # Sets up the all-device communicator of `host_scalars` now, while every process is here.
    first = min(jax.devices(), key=lambda d: d.id)
    zero = NamedSharding(Mesh(np.array([first]), ("all",)), P())
    value = jax.make_array_from_callback((), zero, lambda _: np.float32(0), dtype=np.float32)
    hand_over(lower_reads([value]), ExecutableStore.for_this_process(compilation_cache))
    host_scalars([value], "start-up", cfg.timeout_s)


def host_scalars(values: list[jax.Array], tag: str, timeout_s: int = 600) -> np.ndarray:
    """Host float64 values of scalars (or small vectors, flattened) that may live on other processes'
    devices, concatenated in order.

    Every value is moved, as a vector, onto every device of the job with `transfer`
    (`programs/transfer.py`: the device-to-device program that carries activations between pipeline
    stages, valid for any device counts) and each process reads its own copy. Every process must call
    this at the same point of the same driver loop, as the trainer does at its log steps (each move is
    one program over all devices). A process that does not hold a value passes a stand-in
    (`transfer.stand_in`) with its sharding. The reads are bounded by `timeout_s`; `tag` (e.g.
    "step3/stats") names the exchange in the timeout message. Single process: a plain read.
    """
    if jax.process_count() == 1:
        return np.concatenate([np.asarray(v, np.float64).ravel() for v in values])
    mine = [transfer(_as_vector(v), _readers()) for v in values]
    return _bounded(
        lambda: np.concatenate(
            [np.asarray(c.addressable_shards[0].data, np.float64).ravel() for c in mine]
        ),
        tag,
        timeout_s,
    )


def _readers() -> NamedSharding:
    """Every device of the job, replicated: each exchange runs over all devices, so all of them share
    the one communicator `initialize` sets up while the processes start together (a communicator
    first used later waits only 30 s for late peers: gloo's rendezvous)."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    return NamedSharding(Mesh(np.array(devices), ("all",)), P())


def _as_vector(value: jax.Array):
    """A replicated value as a vector on its mesh (its shape only, where this process holds none)."""
    sharding = NamedSharding(value.sharding.mesh, P())
    shape = (max(int(np.prod(value.shape)), 1),)
    if value.addressable_shards:
        with jax.set_mesh(value.sharding.mesh):
            return _vector_program(sharding, shape).run(value)
    return jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)


@functools.cache
def _vector_program(sharding: NamedSharding, shape: tuple[int, ...]) -> KeptProgram:
    """The jitted reshape of a value into a replicated vector on `sharding` (one program: an eager
    reshape would compile at its first read, out of `lower_reads`' reach)."""
    jit = jax.jit(lambda v: v.reshape(shape), out_shardings=sharding)
    return KeptProgram(jit, list(sharding.mesh.devices.flat))


def lower_reads(values: list[jax.ShapeDtypeStruct | jax.Array]) -> list[Lowering]:
    """The programs `host_scalars(values)` runs on this process, lowered from the values' shapes
    (none in a single-process run, which reads its values directly)."""
    if jax.process_count() == 1:
        return []
    out = []
    for v in values:
        sharding = NamedSharding(v.sharding.mesh, P())
        shape = (max(int(np.prod(v.shape)), 1),)
        vector = jax.ShapeDtypeStruct(shape, v.dtype, sharding=sharding)
        if any(d.process_index == jax.process_index() for d in v.sharding.device_set):
            with jax.set_mesh(v.sharding.mesh):
                out.append(_vector_program(sharding, shape).lowering("read", v))
        out += lower_transfer(vector, _readers())
    return out


def exchange_host(local: np.ndarray, tag: str, timeout_s: int = 600) -> np.ndarray:
    """Every process's `local` (same shape and dtype on every process), stacked: [processes, *shape].

    Bit-exact (the bytes travel), so values computed from the result agree on every process. The bytes
    go through the `jax.distributed` coordination service's key-value store, not through devices: a
    host exchange never queues behind (or deadlocks with) the pipeline's device programs. Every
    process calls this with the same `tag`, unique within the job (e.g. "step3/schedule"; a reused tag
    is an error); each waits at most `timeout_s` for the others' bytes, and the last reader removes
    the tag's keys. Single process: `local[None]`.
    """
    if jax.process_count() == 1:
        return np.asarray(local)[None]
    client = ocp.multihost.get_jax_distributed_client()
    me, n, key = jax.process_index(), jax.process_count(), f"dflop/exchange/{tag}"
    client.key_value_set_bytes(f"{key}/{me}", np.ascontiguousarray(local).tobytes())
    rows = []
    for q in range(n):
        try:
            raw = client.blocking_key_value_get_bytes(f"{key}/{q}", timeout_s * 1000)
        except Exception as e:  # the runtime raises XlaRuntimeError(DEADLINE_EXCEEDED, ...)
            raise TimeoutError(
                f"process {me}/{n}: exchange {tag!r} did not complete within {timeout_s}s "
                f"(process {q} never sent its part: it died, hung or runs another step)"
            ) from e
        rows.append(np.frombuffer(raw, local.dtype).reshape(local.shape))
    if client.key_value_increment(f"{key}/read", 1) == n:  # everyone has read: free the store
        client.key_value_delete(key)
    return np.stack(rows)


def share_files(paths: list[Path], tag: str, timeout_s: int) -> None:
    """Process 0's files, written on every other process (same paths): what one process made for all
    (e.g. the `plan: auto` plan and cost table), so every process reads the same bytes whether or not
    the hosts share a file system. Every process calls this at the same point; the others wait at most
    `timeout_s` for process 0 (which may still be working) and fail naming `tag`."""
    if jax.process_count() == 1:
        return
    me = jax.process_index()
    for path in paths:
        data = np.frombuffer(path.read_bytes(), np.uint8) if me == 0 else np.zeros(0, np.uint8)
        size = int(exchange_host(np.array([data.size], np.int64), f"{tag}/{path.name}/size",
                                 timeout_s)[0, 0])  # fmt: skip
        padded = np.zeros(size, np.uint8)
        padded[: data.size] = data
        rows = exchange_host(padded, f"{tag}/{path.name}", timeout_s)
        if me != 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{me}.tmp")
            tmp.write_bytes(rows[0].tobytes())
            os.replace(tmp, path)  # atomic: hosts sharing a file system may write it together


def _bounded(fn: Callable[[], np.ndarray], tag: str, timeout_s: int) -> np.ndarray:
    """fn() run in a daemon thread, waited for at most timeout_s (a dead peer never joins)."""
    box: dict[str, object] = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # handed to the caller below
            box["err"] = e

    worker = threading.Thread(target=target, name=f"dflop-exchange-{tag}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(
            f"process {jax.process_index()}/{jax.process_count()}: exchange {tag!r} did not "
            f"complete within {timeout_s}s (a peer process died, hung or runs another step)"
        )
    if "err" in box:
        raise box["err"]  # type: ignore[misc]
    return box["out"]  # type: ignore[return-value]
