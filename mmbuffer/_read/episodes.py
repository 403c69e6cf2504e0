"""Episodes as a read: ``buf.episode(i)`` and ``buf.iter_episodes()``, as Minari users expect.

Episode ``i`` is the ``i``-th of ``buf.episodes()``: live complete episodes lane
by lane, oldest first inside each lane (lanes have no common clock); negative
``i`` counts from the end, as for a list. An episode is returned as
``{key: tensor [length, *shape]}`` with its steps in order, the ring's wrap
undone; ``keys`` as for ``buf.get`` (default: every column and every
``next_<col>``, whose last row is the episode's final observation).

A reader (``mode="r"``) checks every episode after reading it against the
writer's reservation (the rule of ``Buffer.read_batch``): an episode the writer
began rewriting meanwhile is read again from a fresh view (``episode``) or
skipped, having been evicted (``iter_episodes``). Only public names of the
store are used: ``view``, ``episode_bounds``, ``layout``, ``reservation``, and ``gather``.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/e", {"x": ((), "int64")}, capacity=8, next_keys=())
>>> for a in (0, 5):                      # episodes of 3 rows in a ring of 8: it wraps
...     buf.extend({"x": a + np.arange(5), "terminated": (a + np.arange(5)) % 3 == 2})
>>> buf.episodes()[0].tolist()            # start rows; the second episode wraps round
[3, 6]
>>> buf.episode(1)["x"].tolist(), buf.episode(-1)["terminated"].tolist()
([6, 7, 8], [False, False, True])
>>> [len(ep["x"]) for ep in buf.iter_episodes()]
[3, 3]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from .. import errors
from .gather import gather

if TYPE_CHECKING:
    import torch

    from .._ledger.snapshot import View
    from .._ledger.store import Store

__all__ = ["episode", "iter_episodes"]

_MAX_REREADS = 64


def episode(store: Store, i: int, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The ``i``-th live episode of ``store`` (module docstring)."""
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise errors.InvalidArgumentError(f"i: expected an integer episode number, got {i!r}")
    keys = None if keys is None else list(keys)
    for _ in range(_MAX_REREADS):
        view = store.view()
        starts, lengths = store.episode_bounds(view)
        n = len(starts)
        if not -n <= int(i) < n:
            raise errors.InvalidArgumentError(f"i: expected an episode number in [{-n}, {n}), got {i}")
        ep = _read(store, view, int(starts[i]), int(lengths[i]), keys)
        if ep is not None:
            return ep
    raise errors.EmptyBufferError(
        f"episode({i}): expected rows that stay put while they are read, got rows overwritten by the writer "
        f"in {_MAX_REREADS} reads in a row"
    )


def iter_episodes(store: Store, keys: Iterable[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Every live episode of ``store`` as of the call, in the order of ``episode(i)``.

    The episodes are fixed when iteration starts; a reader skips those the
    writer evicts before they are read (the writer itself never evicts while it
    iterates, unless the loop extends).
    """
    keys = None if keys is None else list(keys)
    view = store.view()
    starts, lengths = store.episode_bounds(view)
    for start, length in zip(starts.tolist(), lengths.tolist()):
        ep = _read(store, view, start, length, keys)
        if ep is not None:
            yield ep


def _read(store: Store, view: View, start: int, length: int, keys: list[str] | None) -> dict[str, torch.Tensor] | None:
    """The rows of the episode starting at global row ``start``, or None when a
    writer may have rewritten its first row by the end of the read (a reader)."""
    layout = store.layout
    lane = start // layout.lane_size
    with store.lock:
        data = gather(store, layout.rows(lane, start + np.arange(length, dtype=np.int64)), keys)
    if store.mode == "r":
        first = int(layout.absolute_at(np.array([start]), np.array([view.written[lane]]))[0])
        if first < int(store.reservation()[lane]) - layout.lane_size:
            return None
    return data

