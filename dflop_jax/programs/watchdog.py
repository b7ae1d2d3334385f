"""Failure is loud and bounded in multi-process runs: a watchdog per process, one TCP hub on process 0.

    dog = Watchdog(WatchdogSettings(...), process_id, num_processes)
    dog.rendezvous()          # before jax.distributed.initialize: names a peer that never starts
    dog.progress(step)        # the trainer says where it is (named in every failure message)
    dog.finish()              # this process completed the run: its exit is no longer a loss

Why a side channel: when a peer dies, jax's coordination service notices only after its heartbeat
timeout (100 s by default), then aborts every other process from C++ with a message that names the
task but not the step (DESIGN section 11); meanwhile the main thread may sit in a cross-process
transfer or a gloo collective that never returns. A plain TCP connection from every process to a hub
on process 0 (at the coordinator's host, `watchdog_port`) is closed by the kernel the moment its
process dies, SIGKILL included, so the loss is seen at once and named.

Protocol (one text line per message): a peer sends `hello <id>`, then `beat <step>` every
second, `done` when its run completed, `fail <step> <text>` when it is about to exit on an error.
The hub answers `start` once every peer said hello, then `beat <step>`, `done`, and `lost <text>` to
relay another process's loss. Whoever sees a loss (a closed connection without `done`, no beat for
`heartbeat_timeout_s`, a relayed `lost`, a `fail`) or its own stall (no new step for
`stall_timeout_s`) prints one line naming the process and the step, kills its own child processes
(grain workers) and leaves with `os._exit(EXIT_CODE)`: no Python shutdown, which would wait in jax's
shutdown barrier for the dead peer. The hub relays before it leaves, so every process names the
process that was really lost. A lost peer's line also names the command that resumes the run on the
processes that remain (`resume_from`: the trainer names its run's config.yaml).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import os
import socket
import sys
import threading
import time

EXIT_CODE = 3  # the watchdog's exit status: a peer was lost, or this process stalled or failed
_BEAT_S = 1.0
_SETTLE_S = 2.0  # wait before reporting an error of this process: a peer's loss is named first


@dataclasses.dataclass(frozen=True)
class WatchdogSettings:
    """Attributes:
    host, port: the hub's address (process 0 listens there, every other process connects).
    join_timeout_s: how long the hub waits for every peer, and a peer for the hub, at start-up.
    heartbeat_timeout_s: a process silent this long (hung, or its host unreachable) is lost.
    stall_timeout_s: no new step on this process for this long is a failure (0 = never).
    """

    host: str
    port: int
    join_timeout_s: float
    heartbeat_timeout_s: float
    stall_timeout_s: float


class Watchdog:
    """This process's side of the hub: a daemon thread per connection plus one ticker thread."""

    def __init__(self, settings: WatchdogSettings, process_id: int, num_processes: int):
        self.s, self.me, self.n = settings, process_id, num_processes
        self.step, self.what = 0, "start-up"
        self._step_since = time.monotonic()
        self._conns: dict[int, socket.socket] = {}  # hub: peer id -> socket; peer: {0: hub}
        self._seen: dict[int, float] = {}  # last message time per connected process
        self._their_step: dict[int, int] = {}
        self._done: set[int] = set()  # processes that completed their run
        self._finished = False
        self._send_lock, self._exit_lock = threading.Lock(), threading.Lock()
        self.resume_config: str | None = None  # the run's config.yaml (`resume_from`)

    # ---- what the trainer calls ----

    def progress(self, step: int, what: str = "step") -> None:
        """Records the current step (and phase); a new step resets the stall clock."""
        if step != self.step:
            self._step_since = time.monotonic()
        self.step, self.what = step, what

    def finish(self) -> None:
        """This process completed its run: tells the others, so its exit is not a loss."""
        self._finished = True
        self._broadcast("done")

    def fail(self, text: str) -> None:
        """Tells the others that this process exits on an error (`text`, one line), then exits."""
        self._broadcast(f"fail {self.step} {_one_line(text)}")
        self._exit(f"failed at {self._where()}: {_one_line(text)}")

    # ---- start-up ----

    def rendezvous(self) -> None:
        """Every process reaches the hub within `join_timeout_s`, or every one exits naming who did not."""
        if self.me == 0:
            self._serve()
        else:
            self._join()
        for q in self._conns:
            threading.Thread(
                target=self._read, args=(q,), daemon=True, name=f"watchdog-{q}"
            ).start()
        threading.Thread(target=self._tick, daemon=True, name="watchdog-tick").start()

    def _serve(self) -> None:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        server = socket.create_server(("", self.s.port), family=family,
                                      dualstack_ipv6=family == socket.AF_INET6)  # fmt: skip
        deadline = time.monotonic() + self.s.join_timeout_s
        while len(self._conns) < self.n - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                conn, _ = server.accept()
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                word, q = _recv_line(conn).split()
            except (TimeoutError, OSError, ValueError):
                if time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(1, self.n)) - set(self._conns))
                names = ", ".join(str(q) for q in missing)
                self._broadcast(f"lost process {names} never joined the job")
                self._exit(f"process {names} never joined the job within "
                           f"{self.s.join_timeout_s:g}s (start-up, watchdog port {self.s.port})")  # fmt: skip
            conn.settimeout(None)
            self._conns[int(q)] = conn
            self._seen[int(q)] = time.monotonic()
        server.close()
        self._broadcast("start")

    def _join(self) -> None:
        deadline = time.monotonic() + self.s.join_timeout_s
        while True:
            try:
                conn = socket.create_connection((self.s.host, self.s.port), timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self._exit(f"process 0 (the coordinator) did not answer at {self.s.host}:"
                               f"{self.s.port} within {self.s.join_timeout_s:g}s (start-up)")  # fmt: skip
                time.sleep(0.2)
        conn.sendall(f"hello {self.me}\n".encode())
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            line = _recv_line(conn)
        except (TimeoutError, OSError):
            line = "lost process 0 (the coordinator) did not start the job"
        if line != "start":
            self._exit(line.removeprefix("lost ") + " (start-up)")
        conn.settimeout(None)
        self._conns[0] = conn
        self._seen[0] = time.monotonic()

    # ---- running ----

    def _read(self, q: int) -> None:
        """Reads process q's messages (the hub's, on a peer) until its connection closes."""
        buf = self._conns[q].makefile("r")
        try:
            for line in buf:
                self._seen[q] = time.monotonic()
                word, _, rest = line.strip().partition(" ")
                if word == "beat":
                    self._their_step[q] = int(rest)
                elif word == "done":
                    self._done.add(q)
                elif word == "lost":
                    self._exit(f"{rest}; this process was at {self._where()}{self._resume()}")
                elif word == "fail":
                    step, _, text = rest.partition(" ")
                    self._lose(q, f"process {q} failed at step {step}: {text}")
        except (OSError, ValueError):
            pass
        if q not in self._done:
            last = self._their_step.get(q, "?")
            self._lose(q, f"lost process {q} (its connection closed: killed or crashed; it was at "
                          f"step {last})")  # fmt: skip

    def _tick(self) -> None:
        while True:
            time.sleep(_BEAT_S)
            self._broadcast(f"beat {self.step}")
            now = time.monotonic()
            for q, seen in list(self._seen.items()):
                if q not in self._done and now - seen > self.s.heartbeat_timeout_s:
                    self._lose(q, f"lost process {q} (silent for {now - seen:.0f}s: hung or "
                                  f"unreachable; it was at step {self._their_step.get(q, '?')})")  # fmt: skip
            stalled = now - self._step_since
            if self.s.stall_timeout_s and not self._finished and stalled > self.s.stall_timeout_s:
                peers = ", ".join(f"process {q} at step {s}" for q, s in self._their_step.items())
                text = f"no progress for {stalled:.0f}s at {self._where()} ({peers or 'no peers'})"
                self._broadcast(f"fail {self.step} {text}")
                self._exit(text)

    def _lose(self, q: int, text: str) -> None:
        """Process q is gone: the hub relays it to the others; everyone exits naming it."""
        if self.me == 0:
            self._broadcast(f"lost {text}", skip=q)
        self._exit(f"{text}; this process was at {self._where()}{self._resume()}")

    def _resume(self) -> str:
        """How the processes that remain resume the run (`resume_from`), or nothing."""
        if self.resume_config is None:
            return ""
        return "; " + resume_command(self.resume_config, self.n - 1)

    def _broadcast(self, line: str, skip: int = -1) -> None:
        with self._send_lock:
            for q, conn in self._conns.items():
                if q != skip:
                    with contextlib.suppress(OSError):  # that connection's reader reports it
                        conn.sendall((line + "\n").encode())

    def _where(self) -> str:
        return f"step {self.step}" + ("" if self.what == "step" else f" ({self.what})")

    def _exit(self, text: str) -> None:
        """One line on stderr, this process's children killed, then out (no Python shutdown)."""
        if not self._exit_lock.acquire(blocking=False):
            time.sleep(60)  # another thread is already on its way out
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()  # what the run printed so far: os._exit flushes nothing
        for child in multiprocessing.active_children():
            child.kill()
        # jax's coordination agent sees the same loss from its own C++ threads and logs it to fd 2
        # in the very moments this thread reports it: fd 2 goes to /dev/null first, and the line
        # goes to the stream fd 2 was, so it is this process's last word there.
        line = f"process {self.me}/{self.n}: {text}\n".encode()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        try:
            err = os.dup(2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        except OSError:
            err = 2
        with contextlib.suppress(OSError):
            os.write(err, line)
        os._exit(EXIT_CODE)


def _recv_line(conn: socket.socket) -> str:
    """One line, read a byte at a time: what follows it stays in the socket for `_read`."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    return data.decode().strip()


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class JobError(RuntimeError):
    """An error every process of the job can name in one line (no traceback), e.g. schedules that
    differ between processes."""


_ACTIVE: Watchdog | None = None


def install(dog: Watchdog) -> None:
    """Makes `dog` this process's watchdog: `progress`/`finish` reach it, and an uncaught exception or
    an exit before `finish` tells the other processes and leaves at once (`Watchdog.fail`)."""
    global _ACTIVE
    _ACTIVE = dog
    previous = sys.excepthook

    def excepthook(tp, value, tb):
        # A lost peer often surfaces first as a transfer error in the main thread; give its
        # connection's reader the moment it needs to name the peer instead.
        time.sleep(_SETTLE_S)
        if not issubclass(tp, JobError):
            previous(tp, value, tb)
        dog.fail(f"{tp.__name__}: {value}")

    sys.excepthook = excepthook
    # Registered after jax's own handler, so it runs first: an unfinished process must not wait in
    # jax's shutdown barrier for peers that are waiting for it.
    atexit.register(lambda: None if dog._finished else dog.fail("exited before finishing its run"))


def resume_command(config: str, processes: int) -> str:
    """The command that resumes a run from its latest checkpoint on `processes` processes (a lost
    peer's line names it): its own config, fewer processes, a plan for the devices that remain."""
    return (
        f"to resume on the {processes} process(es) that remain: python -m dflop_jax.train "
        f"--config {config} distributed.num_processes={processes} (coordinator one of them; "
        "plan=auto, analytic or a layout that fits their devices)"
    )


def resume_from(config: str) -> None:
    """Names the run's config.yaml: a lost peer's exit line then says how to resume without it."""
    if _ACTIVE is not None:
        _ACTIVE.resume_config = config


def progress(step: int, what: str = "step") -> None:
    """Tells this process's watchdog (if any: multi-process runs) the current step and phase."""
    if _ACTIVE is not None:
        _ACTIVE.progress(step, what)


def finish() -> None:
    """This process completed its run (multi-process runs; a no-op otherwise)."""
    if _ACTIVE is not None:
        _ACTIVE.finish()
