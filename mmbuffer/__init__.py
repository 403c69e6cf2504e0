"""mmbuffer: reinforcement-learning trajectories on disk, memory-mapped, sampled as if in RAM.

The public API lives in this namespace (API.md); submodules ``errors``, ``data``
and ``losses`` are public too.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/r", {"obs": ((2,), "float32")}, capacity=100)
>>> buf.extend({"obs": np.ones((10, 2)), "truncated": np.arange(10) == 9},
...            final_obs={"obs": np.zeros((1, 2))})
>>> buf.sample(4).data["next_obs"].shape
torch.Size([4, 2])
"""

from typing import TYPE_CHECKING, Any

from . import (
    data,  # noqa: E402 - needs the names above
    errors,
    losses,
    samplers,
)
from .buffer import Buffer
from .epoch import EpochSampler
from .gather import Batch
from .opening import create, open
from .store import Column, PriorityConfig
from .stream import Stream, stream

if TYPE_CHECKING:
    from . import convert

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Buffer",
    "Column",
    "convert",
    "EpochSampler",
    "PriorityConfig",
    "samplers",
    "create",
    "data",
    "errors",
    "losses",
    "open",
    "stream",
    "Stream",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """``mb.convert`` is imported on first use: it depends on the core, never the reverse."""
    if name == "convert":
        import importlib

        return importlib.import_module(f"{__name__}.convert")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
