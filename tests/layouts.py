"""Stores with a known episode layout, shared by the sampler and gather tests."""

from __future__ import annotations

import numpy as np

import mmbuffer as mb


def write_layout(path, rng, streams=8, lane=6000, steps=40, with_next=True):
    """Episodes of 1 to ~5000 rows, rings that wrap, an open episode per lane.

    Returns the buffer and, per lane, the list of (absolute start, length, is_open).
    """
    buf = mb.create(path, {"obs": ((), "float32")}, capacity=streams * lane, num_streams=streams,
                    next_keys=("obs",) if with_next else ())
    written = [0] * streams
    open_start = [0] * streams
    episodes = [[] for _ in range(streams)]
    for _ in range(steps):
        s = int(rng.integers(streams))
        kind = rng.random()
        n_eps = int(rng.integers(1, 6))
        lengths = np.where(kind < 0.4, rng.integers(1, 6, n_eps), np.where(kind < 0.8, rng.integers(6, 200, n_eps), rng.integers(1000, 2500, n_eps)))
        done = np.zeros(int(lengths.sum()) + int(rng.integers(0, 30)), dtype=bool)
        done[np.cumsum(lengths) - 1] = True
        if written[s] - open_start[s] + np.argmax(done) + 1 > lane:
            continue
        while len(done) > lane:
            done = done[:lane]
        rows = np.arange(written[s], written[s] + len(done))
        final = {"obs": np.zeros(int(done.sum()), np.float32)} if with_next else None
        buf.extend({"obs": rows.astype(np.float32), "truncated": done}, stream=s, final_obs=final)
        for a in rows[done]:
            episodes[s].append((open_start[s], int(a) + 1 - open_start[s]))
            open_start[s] = int(a) + 1
        written[s] += len(done)
    layout = []
    for s in range(streams):
        live = [(st, n, False) for st, n in episodes[s] if st >= written[s] - lane]
        n_open = written[s] - open_start[s] - (1 if with_next and written[s] > open_start[s] else 0)
        live.append((open_start[s], max(n_open, 0), True))
        layout.append(live)
    return buf, layout
