import hashlib
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
    few seconds each, inside tests that time a writer against its readers."""
    import importlib

    importlib.import_module("mmbuffer._feed.warm")  # warms on import (uniform, slices, priorities)
