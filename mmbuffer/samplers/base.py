"""The sampler contract: a frozen spec that maps a snapshot to indices.

A sampler is a value (a frozen dataclass: hashable, picklable, comparable) with one
method, :meth:`Sampler.indices`, that maps ``(snapshot, n, generator, state)`` to a
:class:`Draw`: the rows to read, their importance weights, the slice mask and the
lane cursors the rows were drawn against. Its rows are live rows of the snapshot (in
each lane, at or after ``first_start``; a reader skips its re-check on that: ``View.intact_up_to``).
It never reads column data. ``state`` is a
:class:`SamplerState` owned by the buffer, where specs keep what they derive between
calls, each kind in a typed field of its own (slice counts, epoch cursors); the spec
itself holds none, so one spec serves any number of buffers, threads and DataLoader
workers. What a spec can do is said by attributes, never by its class: ``slices``,
``prioritized`` (needs a priority tree), ``stateful`` (advances a cursor saved in the
store: draws exactly, never through a remote pool, one stream per cursor).

Adding a sampler is one file in this package and one line in ``__init__.py``.

>>> import mmbuffer as mb
>>> s = mb.samplers.Slices(slice_len=4)
>>> s == mb.samplers.Slices(4) and hash(s) == hash(mb.samplers.Slices(4))
True
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import errors
from .._ledger.snapshot import Draw, ReadableStore, View
from ._counts import SliceCounts


@dataclass(slots=True)
class SamplerState:
    """What specs derive and keep between draws on one buffer, by kind.

    ``slice_counts``: eligible window starts per ``(length, strict, per_episode)``;
    ``epochs``: the cursor of each ``Epoch`` name (``samplers.epoch.EpochCursor``);
    ``recent``: the state of a ``Recent`` wrapper's inner spec, per episode count (its
    counts cover the recent episodes only, so they cannot be shared).
    """

    slice_counts: dict[tuple[int, bool, bool], SliceCounts] = field(default_factory=dict)
    epochs: dict[str, Any] = field(default_factory=dict)
    recent: dict[int, SamplerState] = field(default_factory=dict)

    def clear(self) -> None:
        """Forget what was derived from the index (after a repair or a new snapshot)."""
        self.slice_counts.clear()
        self.recent.clear()


class Sampler(abc.ABC):
    """Base of every sampler spec. Subclasses are ``@dataclass(frozen=True)``."""

    #: ``[B, L]`` windows (True) or ``[B]`` transitions (False)
    slices: bool = False
    #: rows per window (None for transitions)
    slice_len: int | None = None
    #: draws by priority: needs a store with a priority tree
    prioritized: bool = False
    #: advances a cursor kept in the store (an epoch): reads exactly, one cursor per name
    stateful: bool = False

    @abc.abstractmethod
    def indices(
        self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState
    ) -> Draw:
        """``n`` items drawn from ``snapshot`` (see the module docstring)."""

    def draw_with_ends(
        self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState
    ) -> tuple[Draw, np.ndarray | None]:
        """:meth:`indices`, and for windows the position in each of its complete
        episode's last row (``-1``: not in the window), or None where not known (the
        default). The done flags are False on every other row of a live episode, so a
        gather reads them only there (``_read/batch.py: read_spec``)."""
        return self.indices(snapshot, n, generator, state), None

    def mass(self, snapshot: View, state: SamplerState) -> float:
        """The total weight this spec gives the sampleable items of ``snapshot`` (rows,
        windows, episodes or priority): a union of stores (a writer group,
        ``mmbuffer.groups``) draws from each in proportion to it. The default refuses."""
        raise errors.InvalidArgumentError(
            f"sampler: expected Uniform, Slices, Prioritized or PrioritizedSlices to draw from a union of stores, "
            f"got {type(self).__name__}")

    def check(self, store: ReadableStore) -> None:
        """Refuse, with a typed error, a store this sampler cannot draw from
        (called before drawing; the default accepts every store)."""

    def plan(
        self, buf: ReadableStore, n: int, generator: torch.Generator | None, state: SamplerState
    ) -> Callable[[np.ndarray], Draw]:
        """The draws of one batch of ``n`` items from ``buf`` (a ``Buffer``):
        ``draw(positions)`` gives the items at those batch positions, drawn against
        ``buf.view()`` as it is when called (a reader calls it again for the items
        the writer rewrote while they were read). The default draws
        ``len(positions)`` fresh items with :meth:`indices`; a sampler with state
        (``Epoch``) advances it here, once per batch."""

        def draw(positions: np.ndarray) -> Draw:
            return self.indices(buf.view(), len(positions), generator, state)

        return draw


def tree_of(snapshot: View) -> Any:
    """The snapshot's priority tree, or the typed refusal of a store without one."""
    if snapshot.tree is None:
        require_priorities(None)
    return snapshot.tree


def require_priorities(store: ReadableStore | None) -> None:
    if getattr(store, "priorities", None) is None:
        raise errors.InvalidArgumentError(
            "prioritized: expected a store created with priorities=mb.PriorityConfig(...), got priorities=None"
        )


_ONES = np.ones(1024, dtype=np.float32)


def ones(n: int) -> np.ndarray:
    """Unit importance weights for ``n`` items (a new array: a copy of cached ones,
    a third of ``np.ones``'s time on a small batch)."""
    if n > _ONES.shape[0]:
        return np.ones(n, dtype=np.float32)
    return _ONES[:n].copy()


def check_beta(beta: object) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not np.isfinite(beta) or beta < 0:
        raise errors.InvalidArgumentError(f"beta: expected a finite number >= 0, got {beta!r}")
    return float(beta)

