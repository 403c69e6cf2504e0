import hashlib
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest


def tree_hash(path: Path) -> str:
    """Hash of every file's name and content under ``path`` (LOCK excluded)."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            if name == "LOCK":
                continue
            full = Path(root) / name
            h.update(str(full.relative_to(path)).encode())
            with open(full, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """Compile (or load from numba's cache) the kernels once, before any test starts
    processes: with an empty cache every new process would compile them at once, a
    few seconds each, inside tests that time a writer against its readers.

    One pytest worker at a time compiles them (an exclusive lock): the two workers of
    ``-n 2`` each compiled the same kernels into the same cache at once, about 35 s of
    a fresh checkout's run each. A worker that finds the lock taken goes on with its
    tests and loads what the other has cached by the time it needs it."""
    import fcntl
    import importlib
    import tempfile

    import mmbuffer

    key = hashlib.sha256(str(Path(mmbuffer.__file__).resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"mmbuffer-kernels-{key}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        importlib.import_module("mmbuffer._feed.warm")  # warms on import (uniform, slices, priorities)


_START_METHOD = multiprocessing.get_start_method(allow_none=True)


@pytest.fixture(autouse=True)
def starts_with_the_default_start_method():
    """Every test starts with this process's default multiprocessing start method.
    Importing torchrl sets ``spawn`` for the whole process (``torchrl/__init__.py``): every
    later ``DataLoader`` of the same pytest worker then started its workers as new
    interpreters, which took ``tests/feed/test_data.py`` 50 s instead of 1 s."""
    yield
    if multiprocessing.get_start_method(allow_none=True) != _START_METHOD:
        multiprocessing.set_start_method(_START_METHOD, force=True)


@pytest.fixture(autouse=True)
def keeps_the_scheduling_policy():
    """Fail a test that leaves this process on another scheduling policy (and restore
    it). SVT-AV1, run as root, puts the thread that opens an encoder on SCHED_FIFO
    priority 99; every process started afterwards inherited it, and two real-time
    readers spinning on two cores starved the writer of a later test for good."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    yield
    after, after_param = os.sched_getscheduler(0), os.sched_getparam(0)
    if (after, after_param.sched_priority) != (policy, param.sched_priority):
        os.sched_setscheduler(0, policy, param)
        pytest.fail(f"the test changed this process's scheduling policy from {policy} to {after} "
                    f"(priority {after_param.sched_priority}); restore it where it is changed")
