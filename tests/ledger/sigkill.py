"""A writer in a child process SIGKILLed once it reached a state: the loop the ledger's
kill tests share (``tests/remote/killing.py`` is the publishers')."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

HANG_S = 300  # only reports a hang (a child that never gets there), not a speed requirement


def wait_for(proc: subprocess.Popen, ready: Callable[[], bool], waiting_for: str, poll: float = 0.005) -> None:
    """Return once ``ready()`` holds; the child ``proc`` (stderr piped, text) must still run."""
    deadline = time.monotonic() + HANG_S
    while not ready():
        assert proc.poll() is None, f"the writer exited before {waiting_for}:\n{proc.stderr.read()}"
        assert time.monotonic() < deadline, f"hang: no {waiting_for} in {HANG_S} s (only reports a hang)"
        time.sleep(poll)


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], then: Callable[[], None] | None = None, *,
              waiting_for: str = "its report", poll: float = 0.005) -> None:
    """Wait for ``ready()`` (:func:`wait_for`), call ``then()`` (a further wait: a random
    instant, a state to reach), SIGKILL the child and check that the kill landed while it
    was still running; its stderr is closed either way."""
    try:
        wait_for(proc, ready, waiting_for, poll)
        if then is not None:
            then()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL  # it was still writing when the kill landed
