"""mmbuffer: reinforcement-learning trajectories on disk, memory-mapped, sampled as if in RAM.

The public API lives in this namespace (docs/api.md); submodules ``errors``, ``data``
and ``losses`` are public too.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/r", {"obs": ((2,), "float32")}, capacity=100)
>>> buf.extend({"obs": np.ones((10, 2)), "truncated": np.arange(10) == 9},
...            final_obs={"obs": np.zeros((1, 2))})
>>> buf.sample(4).data["next_obs"].shape
torch.Size([4, 2])

Every name is imported on first use (PEP 562): ``import mmbuffer`` costs only
``errors``, so the command line's ``--help``, ``info`` and ``verify`` never import
torch (tests/cli/test_cli.py checks it). ``mb.create`` and friends are the same
objects however they are reached.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors

if TYPE_CHECKING:
    from . import convert, data, losses, samplers
    from .buffer import Buffer
    from ._feed.epochs import EpochSampler
    from ._read.gather import Batch
    from .opening import create, open, open_group
    from ._disk.columns.jpeg import register_zarr_codecs
    from ._ledger.store import Column, PriorityConfig
    from ._feed.stream import Stream, stream

__version__ = "0.1.0"

# public name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "Batch": ("._read.gather", "Batch"),
    "Buffer": (".buffer", "Buffer"),
    "Column": (".schema", "Column"),
    "convert": (".convert", None),
    "create": (".opening", "create"),
    "data": (".data", None),
    "EpochSampler": ("._feed.epochs", "EpochSampler"),
    "losses": (".losses", None),
    "open": (".opening", "open"),
    "open_group": (".opening", "open_group"),
    "PriorityConfig": (".schema", "PriorityConfig"),
    "register_zarr_codecs": ("._disk.columns.jpeg", "register_zarr_codecs"),
    "samplers": (".samplers", None),
    "stream": ("._feed.stream", "stream"),
    "Stream": ("._feed.stream", "Stream"),
}

__all__ = [
    "Batch",
    "Buffer",
    "Column",
    "convert",
    "EpochSampler",
    "PriorityConfig",
    "register_zarr_codecs",
    "samplers",
    "create",
    "data",
    "errors",
    "losses",
    "open",
    "open_group",
    "stream",
    "Stream",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """Import a public name on first use and keep it in the namespace.

    ``mb.convert`` depends on the core, never the reverse; the rest is lazy so
    that a process that only inspects a store never pays for ``import torch``.
    """
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(target[0], __name__)
    value = module if target[1] is None else getattr(module, target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
