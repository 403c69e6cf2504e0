"""Flat in store size: slice sampling at 1e9 stored rows against 1e6, interleaved.

Issue 26 item 7: the slice index and the online loop (extend one 1000-row episode,
then ``sample_slices(256, 4)``) at 1e9 stored rows within 1.2x of the same at 1e6.
Both stores (one uint8 ``obs``, episodes of 1000 rows, capacity 1.2x the stored
rows) are open in this process; each round times every measure on the small store,
then on the large one (the order alternates by round), and the ratio of each round
is large / small, so a machine that slows down between rounds moves both sides.
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, drop_file_cache, header, median_time, scratch, settle  # noqa: E402
from bench_sampling import build, warm  # noqa: E402

import mmbuffer as mb  # noqa: E402

EPISODE = {"obs": np.zeros(1000, np.uint8), "truncated": np.arange(1000) == 999}


def measures(buf: mb.Buffer, g: torch.Generator, reps: int, online: int) -> dict[str, float]:
    """Median seconds of the slice index, the sample, and extend + sample (online)."""
    index = median_time(lambda: buf.slice_indices(256, 4, generator=g), reps)
    total = median_time(lambda: buf.sample_slices(256, 4, generator=g), reps)
    loop = []
    for _ in range(online):
        t0 = time.perf_counter()
        buf.extend(EPISODE)
        buf.sample_slices(256, 4, generator=g)
        loop.append(time.perf_counter() - t0)
    buf.commit()
    return {"index": index, "sample": total, "extend + sample": statistics.median(loop)}


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
    args = p.parse_args()
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
    header(f"bench_flat: slices 256 x 4, episodes of 1000, {args.rounds} rounds x {args.reps} calls, warm: {args.warm}")
    g = torch.Generator().manual_seed(0)
    took = settle(lambda: [buf.sample_slices(256, 4, generator=g) for buf in bufs.values()])
    print(f"settled in {took:.0f} s (the first calls of a process run slowly for a while: _common.settle)\n")
    ratios: dict[str, list[float]] = {}
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        order = [args.small, args.big] if r % 2 == 0 else [args.big, args.small]
        got = {size: measures(bufs[size], g, args.reps, args.online) for size in order}
        for k in got[args.small]:
            ratios.setdefault(k, []).append(got[args.big][k] / got[args.small][k])
            for size in order:
                times.setdefault((size, k), []).append(got[size][k])
    print(f"| measure | {args.small:,} rows, ms | {args.big:,} rows, ms | ratio per round (median; min-max) |")
    print("|---|---|---|---|")
    for k, rs in ratios.items():
        small = statistics.median(times[(args.small, k)]) * 1e3
        big = statistics.median(times[(args.big, k)]) * 1e3
        print(f"| {k} | {small:.3f} | {big:.3f} | {statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}) |")
    for buf in bufs.values():
        buf.close()


if __name__ == "__main__":
    main()
