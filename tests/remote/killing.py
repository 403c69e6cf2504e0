"""Publishers SIGKILLed at random instants: the loop the kill tests of both engines share."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import warm


def publisher(script: str, url: str) -> Callable[[Path], warm.Child]:
    """A starter of ``python -c script STORE url``, forked warm (``tests/warm.py``: its
    imports are done, so the random instants land in the publish), that returns once the
    child printed ``ready`` (the publish begins)."""

    def start(store: Path) -> warm.Child:
        p = warm.start(script, [str(store), url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        p.stdout.close()
        return p

    return start


def timed(start: Callable[[Path], warm.Child], store: Path) -> float:
    """Seconds one whole publish of ``store`` takes (it must succeed)."""
    p = start(store)
    t0 = time.perf_counter()
    assert p.wait() == 0
    return time.perf_counter() - t0


def kill_at_random_instants(start: Callable[[Path], warm.Child], stores: list[Path], read: Callable[[], np.ndarray],
                            states: list[np.ndarray], kills: int, span: float, fraction: tuple[float, float]) -> int:
    """Publish ``stores`` in turn, SIGKILLing each publisher still running after a random
    ``fraction`` of ``span`` seconds, until ``kills`` were killed and one publish completed
    (at most 3 tries per kill; once the kills are done, a try waits 4 times as long: on a
    loaded machine a publish can outlast every drawn instant); after each, ``read()``
    must be one of ``states`` whole, never a mix. A publish that succeeds faster than
    ``span`` becomes the span (so the instants stay inside a publish). Returns how many
    publishes completed between the kills."""
    rng = np.random.default_rng(0)
    killed = published = i = 0
    while (killed < kills or not published) and i < 3 * kills:
        p, i = start(stores[i % len(stores)]), i + 1
        t0 = time.perf_counter()
        try:
            p.wait(timeout=float(rng.uniform(*fraction)) * span * (1 if killed < kills else 4))
            if p.returncode == 0:
                published += 1
                span = min(span, time.perf_counter() - t0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed += 1
        got = read()
        assert any(np.array_equal(got, s) for s in states), i  # one store whole, never a mix
    assert killed >= kills, f"{killed} of {kills} publishers killed in {i} tries"
    return published
