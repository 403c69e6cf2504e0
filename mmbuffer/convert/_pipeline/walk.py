"""Walking a store in export order: shared by the exports and :func:`~mmbuffer.convert.copy`.

The walk goes lane by lane, each lane's live complete episodes oldest first,
then (where kept) the lane's open episode, reading about ``chunk_rows`` rows at
a time with one ``read_range`` per contiguous run, so memory stays flat.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError, StoreNotFoundError
from ...opening import open_buffer as open_buffer
from .frame import SEGMENT_BYTES
from .reader import DEFAULT_CHUNK_BYTES, FLAGS
from .sniff import sniff

__all__ = [
    "OpenedStore",
    "Piece",
    "Plan",
    "chunk_rows_for",
    "data_columns",
    "plan_episodes",
    "read_runs",
    "row_bytes",
    "to_numpy",
    "walk",
]


@dataclass(frozen=True)
class Plan:
    """Episodes in export order: global start row, length, complete?, lane."""

    starts: np.ndarray
    lengths: np.ndarray
    complete: np.ndarray
    lanes: np.ndarray
    lane_size: int

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())


def _open_episodes(buf: Any) -> list[tuple[int, int, int]]:
    """(lane, global start, length) of every lane's open episode with rows."""
    out = []
    view = buf.view()
    for lane, lv in enumerate(view.lanes):
        written = int(view.written[lane])
        n = written - int(lv.open_start)
        if n > 0:
            out.append((lane, int(buf.layout.rows(lane, lv.open_start)), n))
    return out


def plan_episodes(buf: Any, open_episodes: str) -> tuple[Plan, int]:
    """Episodes to walk; ``open_episodes`` is "all", "single-lane" or "none".

    Returns the plan and the number of open-episode rows left out.
    """
    starts_t, lengths_t = buf.episodes()
    starts = starts_t.numpy().astype(np.int64)
    lengths = lengths_t.numpy().astype(np.int64)
    ls = int(buf.lane_size)
    lanes = starts // ls
    opened = _open_episodes(buf)
    keep_open = open_episodes == "all" or (open_episodes == "single-lane" and buf.num_streams == 1)
    skipped = 0
    parts_s, parts_l, parts_c, parts_lane = [], [], [], []
    for lane in range(buf.num_streams):
        sel = lanes == lane
        parts_s.append(starts[sel])
        parts_l.append(lengths[sel])
        parts_c.append(np.ones(int(sel.sum()), bool))
        parts_lane.append(np.full(int(sel.sum()), lane, np.int64))
        for ol, os_, on in opened:
            if ol != lane:
                continue
            if keep_open:
                parts_s.append(np.array([os_], np.int64))
                parts_l.append(np.array([on], np.int64))
                parts_c.append(np.zeros(1, bool))
                parts_lane.append(np.array([lane], np.int64))
            else:
                skipped += on
    plan = Plan(
        np.concatenate(parts_s), np.concatenate(parts_l), np.concatenate(parts_c),
        np.concatenate(parts_lane), ls,
    )
    return plan, skipped


@dataclass
class Piece:
    lane: int
    rows: np.ndarray  # global row ids
    episode: np.ndarray  # plan index per row
    offset: np.ndarray  # row offset inside its episode
    data: dict[str, np.ndarray]
    last: np.ndarray  # bool: last row of a *complete* episode
    final: dict[str, np.ndarray]  # next-derived column -> rows for ``last``


def walk(buf: Any, plan: Plan, keys: list[str], chunk_rows: int, *, release: bool = False) -> Iterator[Piece]:
    """Read the plan's rows in order, ``chunk_rows`` at a time, never across lanes.

    Stored columns are read with ``Buffer.read_range`` (a lane's live episodes
    are consecutive in its ring: one or two runs a chunk); derived ``next_*``
    keys are gathered. With ``release`` (a read-only handle this module
    opened), the pages the gathers mapped are unmapped every ``SEGMENT_BYTES``
    of rows, so resident memory stays flat.
    """
    next_keys = list(buf.next_keys)
    stored = [n for n in keys if n in buf.columns]
    derived = [n for n in keys if n not in buf.columns]
    segment = max(chunk_rows, SEGMENT_BYTES // max(1, row_bytes(buf)))
    since = 0
    for lane in np.unique(plan.lanes) if len(plan.lanes) else []:
        idx = np.flatnonzero(plan.lanes == lane)
        lengths = plan.lengths[idx]
        cum = np.cumsum(lengths)
        total = int(cum[-1]) if len(cum) else 0
        base = int(lane) * plan.lane_size
        for p0 in range(0, total, chunk_rows):
            p1 = min(total, p0 + chunk_rows)
            pos = np.arange(p0, p1, dtype=np.int64)
            k = np.searchsorted(cum, pos, side="right")
            off = pos - (cum[k] - lengths[k])
            rows = base + (plan.starts[idx][k] - base + off) % plan.lane_size
            ep = idx[k]
            data = read_runs(buf, rows, stored)
            if derived:
                data.update({n: to_numpy(v) for n, v in buf.get(rows, keys=derived).items()})
            last = (off == lengths[k] - 1) & plan.complete[ep]
            final: dict[str, np.ndarray] = {}
            if next_keys and last.any():
                got = buf.get(rows[last], keys=[f"next_{n}" for n in next_keys])
                final = {n: to_numpy(got[f"next_{n}"]) for n in next_keys}
            yield Piece(int(lane), rows, ep, off, data, last, final)
            since += len(rows)
            if release and since >= segment:
                buf.release_memory()
                since = 0


def read_runs(buf: Any, rows: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """``names`` at ``rows``, read a contiguous run at a time."""
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cuts) if len(r)]
    out = {}
    for name in names:
        parts = [buf.read_range(name, a, b) for a, b in runs]
        out[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


def to_numpy(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def data_columns(buf: Any) -> list[str]:
    """The store's columns without the two flags (which every store has)."""
    return [c for c in buf.columns if c not in FLAGS]


def row_bytes(buf: Any) -> int:
    total = 2
    for col in (buf.columns[c] for c in data_columns(buf)):
        total += int(np.prod(col.shape, dtype=np.int64)) * np.dtype(col.dtype).itemsize
    return total


def chunk_rows_for(buf: Any, chunk_rows: int | None) -> int:
    """``chunk_rows`` checked, or about ``DEFAULT_CHUNK_BYTES`` of ``buf``'s rows."""
    if chunk_rows is not None:
        if int(chunk_rows) < 1:
            raise InvalidArgumentError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
        return int(chunk_rows)
    return max(1024, DEFAULT_CHUNK_BYTES // max(1, row_bytes(buf)))


class OpenedStore:
    """``mb.open(path, "r")`` for a path, or the caller's open buffer (left open)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.buf: Any = None

    @property
    def owned(self) -> bool:
        """Whether this module opened the store (read-only), so it may reopen it."""
        return self.buf is not None

    def open(self) -> Any:
        """The buffer: opened read-only for a path, else the caller's."""
        if isinstance(store_path := self.store, (str, os.PathLike)):
            if not os.path.isdir(store_path):
                raise StoreNotFoundError(f"{store_path}: expected an mmbuffer store directory, found {sniff(store_path)}")
            self.buf = open_buffer(str(store_path), mode="r")
            return self.buf
        return self.store

    def close(self) -> None:
        """Close the buffer if this object opened it (idempotent)."""
        if self.buf is not None:
            self.buf.close()
