"""Dropping each episode's last transition, for flat sources without next observations.

Without a source's next observations the final observation of an episode is
unknown; ``drop_last_transition=True`` (``--drop-last-transition``) accepts losing
each complete episode's last transition instead, as ``d4rl.qlearning_dataset``
does: the row before it ends the episode, truncated (the data stops there, the MDP
did not end), and the dropped row's observation is its final observation (the
source's next observation of that row, where the column has one). An episode of
one row is dropped whole; rows after the last flagged row (an open episode) are
all kept. Used by :class:`~._pipeline.flat.FlatReader`.

>>> import numpy as np
>>> term, trunc = np.array([0, 0, 1, 1, 0, 0]), np.array([0, 0, 0, 0, 0, 0])
>>> keep = kept_rows(term, trunc, 6, 4)
>>> keep.tolist(), one_row_episodes(keep)
([True, True, False, False, True, True], 1)
>>> obs = np.arange(6) * 10
>>> [(c.steps["obs"].tolist(), c.steps["truncated"].tolist(), c.final_obs["obs"].tolist())
...  for c in chunks({"obs": obs}, set(), {}, ("obs",), keep, 4)]
[([0, 10], [False, True], [20]), ([40, 50], [False, False], [])]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .reader import Chunk, as_flag

__all__ = ["chunks", "kept_rows", "one_row_episodes"]


def kept_rows(terminated: Any, truncated: Any, n: int, step: int) -> np.ndarray:
    """The rows kept (``[n]`` bool): every row but those flagged as an episode's end;
    the flags are read ``step`` rows at a time."""
    done = np.zeros(n, bool)
    step = max(1, step)
    for a in range(0, n, step):
        b = min(n, a + step)
        done[a:b] = as_flag(terminated[a:b]) | as_flag(truncated[a:b])
    keep: np.ndarray = ~done
    return keep


def one_row_episodes(keep: np.ndarray) -> int:
    """Episodes dropped whole: a dropped row right after another (or first)."""
    done = ~keep
    return int((done & np.concatenate([[True], done[:-1]])).sum())


def chunks(
    columns: Mapping[str, Any], squeeze: set[str], next_arrays: Mapping[str, Any], next_keys: tuple[str, ...],
    keep: np.ndarray, chunk_rows: int,
) -> Iterator[Chunk]:
    """The kept rows in chunks of at most ``chunk_rows`` source rows: a kept row followed
    by a dropped one ends its episode as truncated, with the dropped row's observation
    as final observation. Reads one row past each chunk to see that."""
    n = len(keep)
    for a in range(0, n, chunk_rows):
        b = min(n, a + chunk_rows)
        kept = keep[a:b]
        if not kept.any():
            continue
        follows = np.zeros(b - a, bool)  # the next source row is a dropped last transition
        follows[:-1] = ~keep[a + 1 : b]
        follows[-1] = b < n and not keep[b]
        ends = follows & kept
        steps: dict[str, np.ndarray] = {}
        for name, arr in columns.items():
            rows = np.asarray(arr[a:b])
            if name in squeeze:
                rows = rows.reshape(b - a)
            steps[name] = rows[kept]
        steps["terminated"] = np.zeros(int(kept.sum()), bool)
        steps["truncated"] = ends[kept]
        at = np.flatnonzero(ends)
        final: dict[str, np.ndarray] = {}
        for k in next_keys:
            if k in next_arrays:
                final[k] = np.asarray(next_arrays[k][a:b])[at]
            else:  # the dropped row's observation: inside the chunk, or the row after it
                final[k] = np.asarray(columns[k][a : min(n, b + 1)])[at + 1]
        yield Chunk(steps, final)
