"""Processes forked from a test, each running the same reader: their results, gathered."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def results_of(target: Callable[..., None], args: tuple[Any, ...], n: int = 3) -> list[Any]:
    """Run ``target(*args, queue)`` in ``n`` forked processes; what each put on ``queue``
    (one item each), once every process exited cleanly."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results
