"""What readers and samplers see of a store: a frozen snapshot of the ledger, and draws.

A :class:`Ledger` is what is live: every lane's cursors, the last commit's, and its
generation, one frozen value that the writer (or a reader's refresh) publishes in one
assignment; nothing holds a list another object mutates. A :class:`View`
(``Snapshot``) is one consistent value: the lanes' cursors, the ring of
episode ends, the ring layout, the rows written per lane, the generation and the
priority tree. The writer publishes a new one at every change; readers and samplers
only ever hold one, never the writer's mutable state. A sampler maps a View to a
:class:`Draw` (indices, never column data); :class:`ReadableStore` is what the read
side needs of a store.

>>> import numpy as np
>>> d = Draw(np.arange(3), np.ones(3, np.float32), None, np.array([3]))
>>> d.rows.tolist(), d.mask is None
([0, 1, 2], True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from ..schema import PriorityConfig
from .index import Lane
from .layout import Layout

if TYPE_CHECKING:
    from .. import tree

__all__ = ["Draw", "LaneView", "Ledger", "ReadableStore", "Snapshot", "View"]


@dataclass(frozen=True, slots=True)
class Ledger:
    """Every lane's cursors now (``lanes``: the writer's extended rows, a reader's last
    commit), the last commit's (``committed``) and its ``generation``.

    >>> led = Ledger.of((Lane(),), generation=3).with_lane(0, Lane(written=5))
    >>> led.lanes[0].written, led.committed[0].written, led.committed_as(4).committed[0].written
    (5, 0, 5)
    """

    lanes: tuple[Lane, ...]
    committed: tuple[Lane, ...]
    generation: int
    _cursors: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def cursors(self) -> np.ndarray:
        """``written`` and ``ep_tail`` of every lane, interleaved (int64 ``[2 *
        num_streams]``, computed once per ledger; never write it): what the gather
        kernels need to find an episode's final observation (``finals.py``)."""
        found = self._cursors
        if found is None:
            found = np.array([(st.written, st.ep_tail) for st in self.lanes], dtype=np.int64).reshape(-1)
            object.__setattr__(self, "_cursors", found)
        return found

    @classmethod
    def of(cls, lanes: tuple[Lane, ...], generation: int) -> Ledger:
        """The ledger of a commit: nothing extended since."""
        return cls(tuple(lanes), tuple(lanes), generation)

    def with_lane(self, lane: int, state: Lane) -> Ledger:
        """This ledger with lane ``lane`` at ``state`` (not committed)."""
        return Ledger((*self.lanes[:lane], state, *self.lanes[lane + 1 :]), self.committed, self.generation)

    def committed_as(self, generation: int) -> Ledger:
        """This ledger once its lanes are committed as ``generation``."""
        return Ledger(self.lanes, self.lanes, generation)

    @property
    def has_changes(self) -> bool:
        return self.lanes != self.committed


@dataclass(frozen=True, slots=True)
class LaneView:
    """What a sampler may use of one lane (absolute row counters)."""

    first_start: int  # start of the oldest live episode
    ep_head: int
    ep_tail: int
    open_start: int  # start of the open episode (== visible_end when none)
    visible_end: int  # one past the last sampleable row


@dataclass(frozen=True, slots=True)
class View:
    """A consistent snapshot of the index for samplers: cursors plus the ring, and
    the priority tree (None without priorities). Samplers read nothing else."""

    lanes: tuple[LaneView, ...]
    ends: np.ndarray
    layout: Layout
    written: np.ndarray  # int64 [num_streams], rows ever written per lane
    generation: int
    #: the priority tree, or (a reader's) a function returning it once the committed
    #: priority log is applied (``Store._synced_tree``): see :attr:`tree`
    tree_source: tree.PriorityTree | Callable[[], tree.PriorityTree | None] | None = None
    #: derived per lane, once per view (uniform draws read them on every call):
    #: sampleable transitions ``visible_end - first_start``, their total, ``first_start``
    #: (writable, as numba's dispatch types writable arrays fastest: never write them)
    transitions: np.ndarray = field(init=False, repr=False, compare=False)
    total_transitions: int = field(init=False, repr=False, compare=False)
    first_starts: np.ndarray = field(init=False, repr=False, compare=False)
    #: per lane, the writer's reservation up to which no row a sampler draws from this
    #: view can be being rewritten: ``first_start + lane_size`` (a reader re-checks its
    #: items only past it: ``_read/recheck.py``)
    intact_up_to: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        counts = np.array([lv.visible_end - lv.first_start for lv in self.lanes], dtype=np.int64)
        first = np.array([lv.first_start for lv in self.lanes], dtype=np.int64)
        object.__setattr__(self, "transitions", counts)
        object.__setattr__(self, "total_transitions", int(counts.sum()))
        object.__setattr__(self, "first_starts", first)
        object.__setattr__(self, "intact_up_to", first + self.layout.lane_size)

    @property
    def tree(self) -> tree.PriorityTree | None:
        """The priority tree (None without priorities), the committed log applied: a
        reader replays it at the first prioritized use, not at open."""
        src = self.tree_source
        return src() if callable(src) else src

    @property
    def lane_size(self) -> int:
        return self.layout.lane_size


Snapshot = View  # docs/design.md's name


class Draw(NamedTuple):
    """The index half of one batch: what a sampler returns (no column data)."""

    rows: np.ndarray  # int64 [B] or [B, L]: global row ids
    weights: np.ndarray  # float32 [B]: importance weights
    mask: np.ndarray | None  # bool [B, L] for windows (False: padding), else None
    written: np.ndarray  # int64 [num_streams]: the lane cursors the rows were drawn against


class ReadableStore(Protocol):
    """What a sampler spec reads of a store (``Store`` and ``Buffer`` are one): its view,
    its directory (an epoch's state file) and whether it keeps priorities."""

    @property
    def path(self) -> Path: ...

    @property
    def priorities(self) -> PriorityConfig | None: ...

    @property
    def capacity(self) -> int: ...

    @property
    def num_streams(self) -> int: ...

    def view(self) -> View: ...
