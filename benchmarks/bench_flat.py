"""Flat in store size: slice sampling at 1e9 stored rows against 1e6, interleaved.

Issue 26 item 7: the slice index and the online loop (extend one 1000-row episode,
then ``sample_slices(256, 4)``) at 1e9 stored rows within 1.2x of the same at 1e6.
Both stores (one uint8 ``obs``, episodes of 1000 rows, capacity 1.2x the stored
rows) are open in this process; each round times every measure on the small store,
then on the large one (the order alternates by round), and the ratio of each round
is large / small, so a machine that slows down between rounds moves both sides. The
last measure is what a step's misses cost the code after them: the online step of a
third 1e6 store (the probe, with room never to wrap), timed right after an online step
on the large store, against right after one on the probe itself (a 1e6 store); the
same code and data in both, only the step before it differs. ``--phases`` splits the
online step's time by the calls it makes (``extend``, ``store.view``, the slice index's
kernel, the gather's ``prefetch_rows`` and ``gather_small``, the rest), each timed by a
wrapper around it: every figure of such a run carries the wrappers' cost, the same at
both sizes, so read its growth, not its level.
The large store takes ~3.6 GB of disk (sparse beyond the stored rows); its columns
are dropped from the page cache and read back by ``buf.warm(columns=True)`` before
timing (``--warm read``: read once through the maps, as the writer left them), and
both stores are sampled until their times settle, as in a learner that has been running a while.

    python benchmarks/bench_flat.py                       # 1e6 against 1e9
    python benchmarks/bench_flat.py --big 1e8 --rounds 5  # quicker
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, drop_file_cache, header, median_time, scratch, settle  # noqa: E402
from bench_sampling import build, warm  # noqa: E402

import mmbuffer as mb  # noqa: E402

EPISODE = {"obs": np.zeros(1000, np.uint8), "truncated": np.arange(1000) == 999}
SPENT: dict[str, float] = {}  # seconds inside each wrapped call of the last online step (--phases)


def split_phases() -> None:
    """Wrap the calls an online step makes so that each one's time adds into ``SPENT``."""
    from mmbuffer._ledger.store import Store
    from mmbuffer.kernels import load

    gather, sampling = load("gather"), load("sampling")
    for owner, name, label in ((mb.Buffer, "extend", "extend"), (Store, "view", "store.view"),
                               (sampling, "slice_rows", "slice index kernel"),
                               (gather, "prefetch_rows", "prefetch_rows"), (gather, "gather_small", "gather_small")):
        setattr(owner, name, _timed(getattr(owner, name), label))


def _timed(f: Any, label: str) -> Any:
    def timed(*a: object, **k: object) -> object:
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[label] = SPENT.get(label, 0.0) + time.perf_counter() - t0
    return timed


def online_step(buf: mb.Buffer, g: torch.Generator) -> float:
    """Seconds of one online step: extend one episode, then ``sample_slices(256, 4)``."""
    SPENT.clear()
    t0 = time.perf_counter()
    buf.extend(EPISODE)
    buf.sample_slices(256, 4, generator=g)
    return time.perf_counter() - t0


def measures(buf: mb.Buffer, before: mb.Buffer, probe: mb.Buffer, g: torch.Generator, reps: int,
             online: int) -> dict[str, float]:
    """Median seconds of the slice index, the sample, extend + sample (online), and the
    probe's online step right after one on ``before`` (``buf``, or the probe itself
    for the small size: the probe never wraps, the small store must not wrap sooner)."""
    index = median_time(lambda: buf.slice_indices(256, 4, generator=g), reps)
    total = median_time(lambda: buf.sample_slices(256, 4, generator=g), reps)
    loop, split = [], []  # split: per step, seconds in each wrapped call and in the rest (--phases)
    for _ in range(online):
        loop.append(online_step(buf, g))
        if SPENT:
            split.append({**SPENT, "the rest": loop[-1] - sum(SPENT.values())})
    phases = {f"online: {k}": statistics.median(p.get(k, 0.0) for p in split) for k in (split[0] if split else ())}
    buf.commit()
    after = []
    for _ in range(online):
        online_step(before, g)
        after.append(online_step(probe, g))
    before.commit()
    probe.commit()
    return {"index": index, "sample": total, "extend + sample": statistics.median(loop), **phases,
            "a 1e6 probe's extend + sample after this size's": statistics.median(after)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=count, default=1_000_000)
    p.add_argument("--big", type=count, default=1_000_000_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=200, help="timed calls per measure and round")
    p.add_argument("--online", type=int, default=40, help="episodes appended per round (online loop)")
    p.add_argument("--warm", choices=("read", "columns"), default="columns",
                   help="read: the columns as the writer left them in the page cache, read once through the maps; "
                   "columns: dropped from the page cache, then read back by buf.warm(columns=True)")
    p.add_argument("--phases", action="store_true", help="split the online step by the calls it makes (timed by wrappers)")
    args = p.parse_args()
    if args.phases:
        split_phases()
    root = scratch() / "flat"
    bufs = {}
    for size in (args.small, args.big):
        path = root / f"s{size}"
        t0 = time.perf_counter()
        build(path, size, int(size * 1.2), 1000)
        if args.warm == "columns":
            gc.collect()  # the builder's maps: the page cache drops only unmapped pages
            drop_file_cache(path)
        buf = mb.open(path)
        t1 = time.perf_counter()
        if args.warm == "read":
            warm(buf)
        else:
            buf.warm(columns=True)
        print(f"{size:,} rows: built/opened in {t1 - t0:.1f} s, warmed ({args.warm}) in {time.perf_counter() - t1:.1f} s",
              flush=True)
        bufs[size] = buf
    probe_path = root / "probe"  # a third 1e6 store with room for every probe step of the run
    build(probe_path, args.small, args.small + 2 * args.rounds * args.online * len(EPISODE["obs"]), 1000)
    probe = mb.open(probe_path)
    probe.warm(columns=True)
    header(f"bench_flat: slices 256 x 4, episodes of 1000, {args.rounds} rounds x {args.reps} calls, warm: {args.warm}")
    g = torch.Generator().manual_seed(0)
    took = settle(lambda: [buf.sample_slices(256, 4, generator=g) for buf in bufs.values()])
    print(f"settled in {took:.0f} s (the first calls of a process run slowly for a while: _common.settle)\n")
    ratios: dict[str, list[float]] = {}
    growths: dict[str, list[float]] = {}  # large - small, per round
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        order = [args.small, args.big] if r % 2 == 0 else [args.big, args.small]
        got = {size: measures(bufs[size], probe if size == args.small else bufs[size], probe, g, args.reps,
                              args.online) for size in order}
        for k in got[args.small]:
            ratios.setdefault(k, []).append(got[args.big][k] / got[args.small][k])
            growths.setdefault(k, []).append(got[args.big][k] - got[args.small][k])
            for size in order:
                times.setdefault((size, k), []).append(got[size][k])
    print(f"| measure | {args.small:,} rows, ms | {args.big:,} rows, ms | ratio per round (median; min-max) |")
    print("|---|---|---|---|")
    for k, rs in ratios.items():
        small = statistics.median(times[(args.small, k)]) * 1e3
        big = statistics.median(times[(args.big, k)]) * 1e3
        growth = f"; {1e6 * statistics.median(growths[k]):+.1f} us a round" if args.phases else ""
        print(f"| {k} | {small:.3f} | {big:.3f} | {statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}){growth} |")
    for buf in (*bufs.values(), probe):
        buf.close()


if __name__ == "__main__":
    main()
