"""The sampler contract: a frozen spec that maps a snapshot to indices.

A sampler is a value (a frozen dataclass: hashable, picklable, comparable) with one
method, :meth:`Sampler.indices`, that maps ``(snapshot, n, generator, cache)`` to a
:data:`Draw`: the rows to read, their importance weights, the slice mask and the
lane cursors the rows were drawn against. It never reads column data. ``cache`` is
a dict owned by the buffer, where a sampler keeps derived state between calls
(slice counts, say) under a key of its own; the spec itself holds none, so one
spec serves any number of buffers, threads and DataLoader workers.

Adding a sampler is one file in this package and one line in ``__init__.py``.

>>> import mmbuffer as mb
>>> s = mb.samplers.Slices(slice_len=4)
>>> s == mb.samplers.Slices(4) and hash(s) == hash(mb.samplers.Slices(4))
True
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import errors
from .._ledger.snapshot import Draw, View


class Sampler(abc.ABC):
    """Base of every sampler spec. Subclasses are ``@dataclass(frozen=True)``."""

    #: ``[B, L]`` windows (True) or ``[B]`` transitions (False)
    slices: bool = False

    @abc.abstractmethod
    def indices(
        self, snapshot: View, n: int, generator: torch.Generator | None, cache: dict[Any, Any]
    ) -> Draw:
        """``n`` items drawn from ``snapshot`` (see the module docstring)."""

    def check(self, store: Any) -> None:
        """Refuse, with a typed error, a store this sampler cannot draw from
        (called before drawing; the default accepts every store)."""

    def plan(
        self, buf: Any, n: int, generator: torch.Generator | None, cache: dict[Any, Any]
    ) -> Callable[[np.ndarray], Draw]:
        """The draws of one batch of ``n`` items from ``buf`` (a ``Buffer``):
        ``draw(positions)`` gives the items at those batch positions, drawn against
        ``buf.view()`` as it is when called (a reader calls it again for the items
        the writer rewrote while they were read). The default draws
        ``len(positions)`` fresh items with :meth:`indices`; a sampler with state
        (``Epoch``) advances it here, once per batch."""

        def draw(positions: np.ndarray) -> Draw:
            return self.indices(buf.view(), len(positions), generator, cache)

        return draw


def tree_of(snapshot: View) -> Any:
    """The snapshot's priority tree, or the typed refusal of a store without one."""
    if snapshot.tree is None:
        require_priorities(None)
    return snapshot.tree


def require_priorities(store: Any) -> None:
    if getattr(store, "priorities", None) is None:
        raise errors.InvalidArgumentError(
            "prioritized: expected a store created with priorities=mb.PriorityConfig(...), got priorities=None"
        )


def ones(n: int) -> np.ndarray:
    """Unit importance weights for ``n`` items."""
    return np.ones(n, dtype=np.float32)


def check_beta(beta: object) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not np.isfinite(beta) or beta < 0:
        raise errors.InvalidArgumentError(f"beta: expected a finite number >= 0, got {beta!r}")
    return float(beta)

