"""Frame-stacked sampling from frames stored once (issue 23 item 5): cost of ``stack=``.

A raw store of 84x84 uint8 frames (``pixels``, next-derived, so ``next_pixels``
is read too) with an int64 action and a float32 reward, episodes of random
lengths (Atari-like: 30 to 3,000 steps), ``--streams`` lanes, the ring wrapped
once. ``sample(B)`` with ``stack={"pixels": 4}`` ("first" and "zero" padding) is
timed against the same call without a stack, page cache warm (every column read
once through its map before timing), medians of interleaved repetitions (a loaded host moves the
figures; interleaving keeps the ratio honest). "cpu" columns are the calling
thread's CPU time (``time.thread_time``): on a shared host a call of a few ms is
often descheduled for a time slice, which the wall-clock median shows and the CPU
time does not. "frames/item" is the 84x84 frames
copied per item (2 without a stack: pixels and next_pixels; 8 with a 4-stack).

    python benchmarks/bench_pixels.py                  # 100k rows (~1.4 GB scratch)
    python benchmarks/bench_pixels.py --rows 2e4 --reps 50   # quick
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, header, scratch, table

import mmbuffer as mb

FRAME = (84, 84)
CHUNK = 10_000


def build(path: Path, rows: int, streams: int, seed: int = 0) -> mb.Buffer:
    """A store of ``rows`` rows of capacity ``rows * 4 // 5`` (the ring wraps once)."""
    shutil.rmtree(path, ignore_errors=True)
    capacity = (rows * 4 // 5) // streams * streams
    rng = np.random.default_rng(seed)
    buf = mb.create(path, {"pixels": (FRAME, "uint8"), "action": ((), "int64"), "reward": ((), "float32")},
                    capacity=capacity, num_streams=streams, next_keys=("pixels",))
    per_lane = rows // streams
    chunk, longest = min(CHUNK, buf.lane_size // 2), min(3000, buf.lane_size // 2)
    for lane in range(streams):
        left = 0
        for lo in range(0, per_lane, chunk):
            n = min(chunk, per_lane - lo)
            done = np.zeros(n, bool)
            at = 0
            while True:
                if left == 0:
                    left = int(rng.integers(30, longest))
                if at + left > n:
                    left -= n - at
                    break
                at += left
                done[at - 1] = True
                left = 0
            frames = rng.integers(0, 256, (n, *FRAME), dtype=np.uint8)
            buf.extend(
                {"pixels": frames, "action": rng.integers(0, 18, n), "reward": rng.standard_normal(n).astype(np.float32),
                 "truncated": done},
                stream=lane, final_obs={"pixels": rng.integers(0, 256, (int(done.sum()), *FRAME), dtype=np.uint8)},
            )
        buf.commit()
    return buf


def warm(buf: mb.Buffer) -> None:
    """Touch every page of every column through this process's maps, in order: the
    page cache holds the data and the maps have their page-table entries, as in a
    learner that has been sampling a while (a ``pread`` pass fills the cache but
    leaves a minor fault per page for the first gathers; the stacked reads touch
    other pages than the unstacked ones, which made the first figures bimodal)."""
    for name in ("pixels", "action", "reward", "terminated", "truncated", "final/pixels"):
        mapped = np.asarray(buf.column(name).mapped()).reshape(-1).view(np.uint8)
        for lo in range(0, mapped.size, 1 << 24):
            int(mapped[lo : lo + (1 << 24) : 4096].sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=count, default=100_000, help="rows written (capacity is 4/5 of them)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--batches", default="32,256")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = scratch() / "pixels"
    t0 = time.perf_counter()
    buf = build(path, args.rows, args.streams)
    built = time.perf_counter() - t0
    warm(buf)
    header(f"bench_pixels: sample(B) with a 4-stack of 84x84 uint8 frames vs no stack ({args.rows:,} rows written)")
    print(f"capacity {buf.capacity:,} rows in {buf.num_streams} lanes (ring wrapped), {buf.num_episodes:,} live episodes, "
          f"built in {built:.1f} s; page cache warm; torch threads 1\n")
    cases = {
        "no stack": {},
        "stack 4, first": {"stack": {"pixels": 4}, "stack_pad": "first"},
        "stack 4, zero": {"stack": {"pixels": 4}, "stack_pad": "zero"},
    }
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        g = torch.Generator().manual_seed(0)
        times: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        for name, kw in cases.items():  # warm-up (compiles nothing: kernels are cached)
            for _ in range(5):
                buf.sample(b, g, **kw)
        for _ in range(args.reps):
            for name, kw in cases.items():
                t, c = time.perf_counter(), time.thread_time()
                batch = buf.sample(b, g, **kw)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
                del batch
        base = statistics.median(times["no stack"])
        for name, kw in cases.items():
            med = statistics.median(times[name])
            rows.append({
                "batch": b, "case": name, "frames/item": 8 if kw else 2,
                "median ms": med * 1e3, "min ms": min(times[name]) * 1e3, "x no stack": med / base,
                "cpu median ms": statistics.median(cpu[name]) * 1e3,
                "cpu x no stack": statistics.median(cpu[name]) / statistics.median(cpu["no stack"]),
                "cpu us/frame": statistics.median(cpu[name]) * 1e6 / (b * (8 if kw else 2)),
            })
    table(rows)
    buf.close()
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
