"""The watchdog on its own (a one-process hub in a subprocess, no jax): a stall and an uncaught error
end the process with the watchdog's status and one line naming the step; any other error keeps its
traceback above that line."""

import re
import subprocess
import sys
import textwrap
import time

from dflop_jax.programs.watchdog import EXIT_CODE

SETUP = """
    import socket
    from dflop_jax.programs.watchdog import JobError, Watchdog, WatchdogSettings, install
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dog = Watchdog(WatchdogSettings("127.0.0.1", port, 5, 5, {stall}), 0, 1)
    dog.rendezvous()
    install(dog)
    dog.progress(7)
"""


def _run(body: str, stall: float = 0) -> subprocess.CompletedProcess:
    code = textwrap.dedent(SETUP.format(stall=stall)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_stalled_step_ends_the_process_naming_it():
    t0 = time.monotonic()
    p = _run("import time; time.sleep(60)", stall=2)
    assert p.returncode == EXIT_CODE
    assert re.fullmatch(
        r"process 0/1: no progress for [234]s at step 7 \(no peers\)", p.stderr.strip()
    )
    assert time.monotonic() - t0 < 50


def test_a_job_error_is_one_line_and_the_status_is_the_watchdogs():
    p = _run("raise JobError('step 7: the processes disagree')")
    assert p.returncode == EXIT_CODE
    assert p.stderr.strip() == (
        "process 0/1: failed at step 7: JobError: step 7: the processes disagree"
    )


def test_another_error_keeps_its_traceback_then_the_line():
    p = _run("dog.progress(8, 'checkpoint'); {}['missing']")
    assert p.returncode == EXIT_CODE
    assert "Traceback" in p.stderr and "KeyError: 'missing'" in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "process 0/1: failed at step 8 (checkpoint): KeyError: 'missing'"
    )


def test_an_exit_before_finishing_is_a_failure_and_after_it_is_not():
    p = _run("import sys; sys.exit(0)")
    assert p.returncode == EXIT_CODE
    assert "failed at step 7: exited before finishing its run" in p.stderr
    assert _run("dog.finish()").returncode == 0


def test_a_lost_peers_line_names_the_command_that_resumes_without_it():
    """A hub of two processes whose peer (a plain socket here) says hello, then dies: the hub's one
    line names the loss and how the process that remains resumes the run."""
    code = textwrap.dedent("""
        import socket, threading, time
        from dflop_jax.programs.watchdog import Watchdog, WatchdogSettings, install, resume_from
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        def peer():
            while True:
                try:
                    conn = socket.create_connection(("127.0.0.1", port), timeout=2)
                    break
                except OSError:
                    time.sleep(0.1)
            conn.sendall(b"hello 1\\n")
            conn.recv(16)  # "start"
            time.sleep(1)
            conn.close()  # killed
        threading.Thread(target=peer, daemon=True).start()
        dog = Watchdog(WatchdogSettings("127.0.0.1", port, 20, 20, 0), 0, 2)
        dog.rendezvous()
        install(dog)
        resume_from("/runs/x/config.yaml")
        dog.progress(12)
        time.sleep(60)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_CODE
    assert p.stderr.strip() == (
        "process 0/2: lost process 1 (its connection closed: killed or crashed; it was at step ?); "
        "this process was at step 12; to resume on the 1 process(es) that remain: "
        "python -m dflop_jax.train --config /runs/x/config.yaml distributed.num_processes=1 "
        "(coordinator one of them; plan=auto, analytic or a layout that fits their devices)"
    )
