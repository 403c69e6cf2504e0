"""Imported only by the forkserver of ``mb.stream(processes=N)`` (its preload).

Loading the compiled kernels from numba's cache costs each new process about a
second; done once here, in the server the workers fork from, every worker starts
with them loaded. A failure here only means the workers load them themselves.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile


def warm() -> None:
    """Sample uniform, slices and by priority from a tiny throwaway store."""
    import numpy as np

    from ..opening import create
    from ..opening import open_buffer as open_store
    from ..schema import PriorityConfig

    folder = tempfile.mkdtemp(prefix="mmbuffer-warm-")
    try:
        with create(folder + "/s", {"obs": ((2,), "float32")}, capacity=64, priorities=PriorityConfig()) as buf:
            buf.extend({"obs": np.zeros((40, 2), np.float32), "truncated": np.arange(40) % 10 == 9},
                       final_obs={"obs": np.zeros((4, 2), np.float32)})
        with open_store(folder + "/s", mode="r") as buf:  # read-only maps: other kernel signatures
            buf.sample(4)
            buf.sample_slices(4, 3)
            buf.sample(4, prioritized=True)
            buf.sample_slices(4, 3, prioritized=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


with contextlib.suppress(Exception):  # an optimisation only: the forkserver must not die of it
    warm()
