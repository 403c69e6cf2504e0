"""Undo a provisional episode end: the newest episode of a lane, ended at the
lane's last row and not committed yet, becomes the lane's open episode again.

A writer that knows the next observation of an open episode's last row (a TorchRL
collector batch carries it under ``("next", ...)``) can end the episode there as
truncated, with that observation as its final one, so the row is sampleable at
once; when the episode goes on, it undoes that end before writing the next rows,
whose first observation is the one stored as final (``mmbuffer.torchrl``).

Only an uncommitted end is undone: a reader (or a reopen after a crash) may hold
the slot of a committed one, and readers never see the uncommitted rows whose flag
changes here. Lives apart from ``writer.py``: it changes the same state (the
``truncated`` flag of one row, the lane's ``ep_tail``) under the same lock; the
slice counts samplers keep notice the changed end themselves
(``samplers/_draw.py: SliceCounts.sync``).

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/r", {"obs": ((), "float32")}, capacity=8)
>>> buf.extend({"obs": np.arange(3), "truncated": [False, False, True]}, final_obs={"obs": [3.0]})
>>> buf.num_episodes, reopen_last_episode(buf.store, 0), buf.num_episodes
(1, True, 0)
>>> end_open_episode(buf.store, 0), buf.episodes()[1].tolist()  # and back: its final observation is kept
(True, [3])
>>> reopen_last_episode(buf.store, 0)
True
>>> buf.extend({"obs": [3.0], "terminated": [True]}, final_obs={"obs": [4.0]})
>>> buf.episodes()[1].tolist(), buf.get(np.arange(4), ["next_obs"])["next_obs"].tolist()
([4], [1.0, 2.0, 3.0, 4.0])
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import errors
from . import index
from .store import Store

__all__ = ["end_open_episode", "reopen_last_episode"]


def reopen_last_episode(store: Store, lane: int) -> bool:
    """Undo the end of ``lane``'s newest episode if it ends at the lane's last row,
    as truncated, after the last commit; return whether it was undone (nothing
    changes otherwise). The row's ``truncated`` flag is cleared and the lane's
    episode count goes back by one, so the next ``extend`` of the lane continues
    that episode (its stale ``final/<col>`` row is never read again).
    Raises ``ReadOnlyError`` on a store opened with ``mode="r"``."""
    if store.mode != "a":
        raise errors.ReadOnlyError(f"reopen: store {store.path} is opened with mode='r'")
    with store.lock:
        st, was = store.lanes[lane], store.committed[lane]
        if st.ep_tail <= max(st.ep_head, was.ep_tail):
            return False  # no live complete episode, or its end is committed
        end = int(index.ends_at(store.ends, lane, store.lane_size, np.array(st.ep_tail - 1)))
        row = store.layout.rows(lane, np.array([st.written - 1], dtype=np.int64))
        if end != st.written or not store.column("truncated").read(row).all() or store.column("terminated").read(row).any():
            return False
        store.column("truncated").write_at(row, np.zeros(1, dtype=bool))
        store.ledger = store.ledger.with_lane(lane, replace(st, ep_tail=st.ep_tail - 1))
    return True


def end_open_episode(store: Store, lane: int) -> bool:
    """End ``lane``'s open episode at the lane's last row, as truncated, with the
    ``final/<col>`` rows already there as its final observation: the inverse of
    :func:`reopen_last_episode`, for a writer that wrote that final observation
    before (``mmbuffer.torchrl`` keeps episodes open across its commits this way).
    Returns whether an episode was ended (False: no open episode). The end is
    uncommitted; the row's flag is written through at once, so a commit of the end
    never reaches the disk before it."""
    if store.mode != "a":
        raise errors.ReadOnlyError(f"end_open_episode: store {store.path} is opened with mode='r'")
    with store.lock:
        st = store.lanes[lane]
        if st.written <= st.open_start(store.ends, lane, store.lane_size):
            return False
        row = store.layout.rows(lane, np.array([st.written - 1], dtype=np.int64))
        store.column("truncated").write_at(row, np.ones(1, dtype=bool))
        store.array("columns/truncated").flush(int(row[0]), int(row[0]) + 1)
        store.ends[index.slots(lane, store.lane_size, np.array([st.ep_tail]))] = st.written
        store.ledger = store.ledger.with_lane(lane, replace(st, ep_tail=st.ep_tail + 1))
    return True
