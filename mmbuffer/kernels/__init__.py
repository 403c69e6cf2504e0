"""Compiled hot-path kernels: the one place mmbuffer's numba code lives.

Each submodule holds the kernels of one layer (``tree`` and ``descent``: update and
descent of the priority tree; ``priority``: a prioritized draw, an update's checks;
``sampling``: index sampling; ``gather``: copying rows into caller buffers) as
``@numba.njit(nogil=True, cache=True)`` functions over plain numpy arrays (memory
maps included), plus a thin typed Python wrapper per kernel that the
layer above calls. The tests hold a naive reference for every kernel.

Rules (why they exist):

- Nothing here is imported by ``import mmbuffer``: importing numba costs ~0.3 s and
  the CLI must start fast. Callers import a submodule inside the function that needs
  it (``from .kernels import tree as tree_kernels``), so a store without priorities
  never loads numba's tree kernels, and ``mmbuffer --help`` never loads numba.
  A hot path that would pay an import statement per call takes :func:`load`
  (``load("gather")``: after the first call, a dict lookup).
- ``cache=True`` keeps the compiled code on disk beside the module (numba falls back
  to its user cache directory where the package is read-only); the first call in a
  fresh environment compiles, later processes load.
- ``nogil=True``: a gather or a tree descent runs beside the training step in a
  background thread without holding the GIL.
- Kernels take only arrays and scalars, never store objects, so a later backend
  (a GPU kernel, say) is a second implementation behind the same wrapper — the
  dispatch point flashbax's ``SET_BATCH_FN`` table is the model for.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["load"]

_loaded: dict[str, ModuleType] = {}


def load(name: str) -> ModuleType:
    """The kernel submodule ``name`` (``"gather"``, ``"split"``, ``"priority"``,
    ``"tree"``, ``"descent"``, ``"sampling"``), imported on its first use and kept.

    >>> from mmbuffer import kernels
    >>> kernels.load("gather") is kernels.load("gather")
    True
    """
    module = _loaded.get(name)
    if module is None:
        module = _loaded[name] = importlib.import_module(f"{__name__}.{name}")
    return module
