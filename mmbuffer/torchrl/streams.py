"""Which stream each part of a batch goes to, and which streams' last episodes are
ended provisionally between batches (rules in :mod:`mmbuffer.torchrl`'s docstring).
Pure functions over that state: nothing here writes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import errors


@dataclass(slots=True)
class Held:
    """A stream whose last episode ends provisionally (truncated at its last row, its
    ``("next", ...)`` kept as final observation) until the next batch says whether it
    goes on; then that end is undone (``_ledger.appending``) and the episode continues."""

    traj: int | None
    length: int  # rows of the episode so far


@dataclass(slots=True)
class Piece:
    """Rows ``[start, stop)`` of environment row ``env`` of a batch, for one stream."""

    env: int
    start: int
    stop: int
    stream: int = -1
    continues: bool = False


@dataclass(slots=True)
class Segment:
    """What one piece writes: its rows' episode ends (the last row ends provisionally
    when its episode goes on: ``after``), and whether it first undoes the provisional
    end of its stream (``reopen``); its rows are :meth:`rows` of the batch."""

    piece: Piece
    end: np.ndarray
    trunc: np.ndarray
    after: Held | None
    reopen: bool

    def rows(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The piece's rows of the batch's ``values`` (views)."""
        p = self.piece
        return {k: v[p.env, p.start : p.stop] for k, v in values.items()}


def plan(ends: np.ndarray, traj: np.ndarray | None, num_streams: int, held: dict[int, Held]) -> list[Piece]:
    """Cut a batch (``ends``/``traj``: ``[E, T]``) into pieces, one stream each.

    >>> ends = np.array([[False, True, False, False]])
    >>> [(p.start, p.stop, p.stream) for p in plan(ends, np.array([[0, 0, 1, 2]]), 2, {})]
    [(0, 3, 0), (3, 4, 1)]
    """
    n_env, t = ends.shape
    if traj is None:
        if n_env not in (1, num_streams):
            raise errors.SchemaError(
                f"data: expected [{num_streams}, T] batches (the store's streams) or ('collector', 'traj_ids'), got [{n_env}, {t}]"
            )
        return [Piece(e, 0, t, e) for e in range(n_env)]
    direct = n_env == num_streams > 1  # environment e is stream e
    # a trajectory id that changes with no episode end: the piece before ends truncated
    cut = (traj[:, 1:] != traj[:, :-1]) & ~ends[:, :-1]
    if not cut.any():
        pieces = [Piece(e, 0, t, e if direct else -1) for e in range(n_env)]
    else:
        pieces = []
        for e in range(n_env):
            bounds = [0, *(np.flatnonzero(cut[e]) + 1).tolist(), t]
            pieces += [Piece(e, a, b, e if direct else -1) for a, b in itertools.pairwise(bounds)]
    if direct:
        return pieces
    # a piece continues the stream whose open (provisionally ended) episode has its
    # first trajectory id, else takes a stream with none open, else the one whose
    # open episode waited longest (that episode then ends, truncated, where it is)
    order = {s: i for i, s in enumerate(held)}
    free = [s for s in range(num_streams) if s not in held]
    owner = {h.traj: s for s, h in held.items() if h.traj is not None}
    taken: set[int] = set()
    for p in pieces:
        s = owner.get(int(traj[p.env, p.start]))
        if s is not None and s not in taken:
            p.stream, p.continues = s, True
        elif free:
            p.stream = free.pop(0)
        else:
            p.stream = min(range(num_streams), key=lambda s: (s in taken, order.get(s, -1)))
        taken.add(p.stream)
        owner = {k: v for k, v in owner.items() if v != p.stream}
        if p.stop == t and not ends[p.env, t - 1]:
            owner[int(traj[p.env, t - 1])] = p.stream
    return pieces


def segments(
    pieces: list[Piece],
    ends: np.ndarray,
    truncated: np.ndarray,
    traj: np.ndarray | None,
    held: dict[int, Held],
    *,
    lane_size: int,
    dangling: set[int],
    where: Path,
) -> list[Segment]:
    """Per piece, in order: what it writes to its stream, its rows' flags (the last
    row ends provisionally when its episode is open), and whether the stream's
    provisional end is undone first (the episode goes on, and still fits a lane);
    every refusal is raised here, before anything is written."""
    out = []
    held = dict(held)
    totals: dict[int, int] = {}
    whole = len(pieces) == ends.shape[0] and all(p.env == e and p.start == 0 and p.stop == ends.shape[1] for e, p in enumerate(pieces))
    if whole:  # one piece a row (a collector's usual batch): the flags' summaries in a few numpy calls
        end2, trunc2 = ends.copy(), truncated.copy()
        has: list[bool] = np.asarray(end2.any(axis=1)).tolist()
        first: list[int] = end2.argmax(axis=1).tolist()
        last: list[int] = (ends.shape[1] - 1 - end2[:, ::-1].argmax(axis=1)).tolist()
        traj_first = None if traj is None else traj[:, 0].tolist()
        traj_last = None if traj is None else traj[:, -1].tolist()
    for i, p in enumerate(pieces):
        if whole:
            end, trunc = end2[i], trunc2[i]
            tf = None if traj_first is None else traj_first[i]
            tl = None if traj_last is None else traj_last[i]
            d_first, d_last = (first[i], last[i]) if has[i] else (None, None)
        else:
            end = ends[p.env, p.start : p.stop].copy()
            trunc = truncated[p.env, p.start : p.stop].copy()
            done = np.flatnonzero(end)
            d_first, d_last = (int(done[0]), int(done[-1])) if done.size else (None, None)
            tf = None if traj is None else int(traj[p.env, p.start])
            tl = None if traj is None else int(traj[p.env, p.stop - 1])
        n = len(end)
        before = held.pop(p.stream, None)
        reopen = before is not None and (
            (p.continues or traj is None or before.traj == tf)
            and before.length + (d_first + 1 if d_first is not None else n) <= lane_size  # rows up to the first end
        )
        after = None
        if not end[-1]:
            length = n - d_last - 1 if d_last is not None else n + (before.length if reopen and before is not None else 0)
            after = Held(tl, length)
            end[-1] = trunc[-1] = True  # provisional: undone if the episode goes on
            held[p.stream] = after
        totals[p.stream] = totals.get(p.stream, 0) + n
        if totals[p.stream] > lane_size:
            raise errors.CapacityError(
                f"data: expected at most a lane of {lane_size} rows per stream per extend, got {totals[p.stream]} "
                f"for stream {p.stream} of the store at {where}"
            )
        if n and p.stream in dangling:
            raise errors.SchemaError(
                f"data: stream {p.stream} of the store at {where} ends in an open episode written by other code; "
                "expected none (its next observation is unknown, so no new episode can follow it)"
            )
        out.append(Segment(p, end, trunc, after, reopen))
    return out
