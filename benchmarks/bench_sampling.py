"""Slice sampling benchmark: cost against store size, static, online and reopened.

Settings: TD-MPC2's (256 x 4 and 1024 x 4 slices) and a sequence model's (64 x 64),
at 5M stored / 6M capacity and 346M stored / 600M capacity (pytorch/rl#2669),
episodes of 501 and 1000 steps. Columns are small (the index cost does not depend
on them): ``obs`` one uint8. "index" is the sampler alone (indices, no read);
"total" adds the gather of the columns; both are timed warm, in two regimes: the
columns as the writer left them in the page cache, read once through the maps
(``warm``), then dropped from the page cache and read back by a new reader's
``buf.warm(columns=True)`` (a learner opening a store from disk: the kernel reads
it ahead in large folios, which take fewer TLB misses); the "reopened" table times
a fresh process's first samples. When ``torchrl`` imports, its
SliceSampler runs on the same layout in the same process and the ratio is printed.

    python benchmarks/bench_sampling.py                 # both sizes (~1.5 GB scratch)
    python benchmarks/bench_sampling.py --sizes 5e6:6e6 # quick
    python benchmarks/bench_sampling.py --sizes 1e8:1.2e8 --ep-lens 1000  # issue 12's 100M figure

"torchrl cached sample" is TorchRL's ``rb.sample()`` with ``SliceSampler(cache_values=True)``
(index and gather of its in-RAM storage), compared with mmbuffer's "total"; its
median and its fastest rep both, since on a loaded host the cached figure moved
from under 1 ms to tens of ms between runs.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torchrl_baseline as trl  # noqa: E402
from _common import (  # noqa: E402
    count,
    drop_file_cache,
    header,
    median_time,
    run_python,
    scratch,
    settle,
    table,
)

import mmbuffer as mb  # noqa: E402

SETTINGS = [(256, 4), (1024, 4), (64, 64)]
BLOCK = 4_000_000


def build(path: Path, stored: int, capacity: int, ep_len: int) -> None:
    if (path / "manifest.json").exists():
        ro = mb.open(path, mode="r")
        if len(ro) == stored and ro.capacity == capacity:
            return
    shutil.rmtree(path, ignore_errors=True)
    with mb.create(path, {"obs": ((), "uint8")}, capacity=capacity, next_keys=()) as buf:
        for lo in range(0, stored, BLOCK):
            rows = np.arange(lo, min(stored, lo + BLOCK), dtype=np.int64)
            done = rows % ep_len == ep_len - 1
            done[-1] |= rows[-1] == stored - 1  # the last episode ends at the last row
            buf.extend({"obs": (rows % 251).astype(np.uint8), "truncated": done})


def warm(buf: mb.Buffer) -> float:
    """Read every stored column once, in order: the page cache holds the data and
    this process has it mapped, as in a learner that has been running a while
    (cold figures are the "reopened" table's first sample)."""
    t0 = time.perf_counter()
    for name in buf.columns:
        for lo in range(0, buf.capacity, BLOCK):
            buf.read(name, np.arange(lo, min(lo + BLOCK, buf.capacity))).sum()  # through the map
    return time.perf_counter() - t0


def static(buf: mb.Buffer, reps: int) -> list[dict[str, object]]:
    """Index and total times of each setting, once sampling has settled (``settle``: at
    1e8 rows the first call of a process builds the sampler's tables, ~1 s, and the next
    ones ran at 1-6 ms for a second or more on 2026-11-26, which a median of 30 calls
    did not hide)."""
    out = []
    g = torch.Generator().manual_seed(0)
    print(f"settled in {settle(lambda: [buf.sample_slices(n, L, generator=g) for n, L in SETTINGS]):.0f} s\n")
    for n, L in SETTINGS:
        t_index = median_time(lambda: buf.slice_indices(n, L, generator=g), reps)
        t_total = median_time(lambda: buf.sample_slices(n, L, generator=g), reps)
        out.append({"slices": f"{n} x {L}", "index ms": t_index * 1e3, "total ms": t_total * 1e3})
    return out


def online(buf: mb.Buffer, episodes: int, n: int, L: int) -> dict[str, float]:
    """The online learner's loop: extend one 1000-row episode, sample; commit every 100.
    The sample is the first call after the write (it brings the slice counts up to date),
    as TorchRL's "sample after a write" is."""
    g = torch.Generator().manual_seed(1)
    episode = {"obs": np.zeros(1000, np.uint8), "truncated": np.arange(1000) == 999}
    t_ext, t_smp, t_commit = [], [], []
    for i in range(episodes):
        t0 = time.perf_counter()
        buf.extend(episode)
        t1 = time.perf_counter()
        buf.sample_slices(n, L, generator=g)
        t_ext.append(t1 - t0)
        t_smp.append(time.perf_counter() - t1)
        if i % 100 == 99:
            t0 = time.perf_counter()
            buf.commit()
            t_commit.append(time.perf_counter() - t0)
    med = statistics.median
    both = [a + b for a, b in zip(t_ext, t_smp)]
    return {"extend ms": med(t_ext) * 1e3, "sample after the write ms": med(t_smp) * 1e3,
            "extend + sample ms": med(both) * 1e3, "commit ms": med(t_commit) * 1e3 if t_commit else float("nan")}


REOPEN = """
import sys, time
import torch, mmbuffer as mb
t0 = time.perf_counter()
buf = mb.open(sys.argv[1], mode="r")
t1 = time.perf_counter()
buf.sample_slices(256, 4, generator=torch.Generator().manual_seed(0))
t2 = time.perf_counter()
buf.sample_slices(256, 4, generator=torch.Generator().manual_seed(1))
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def reopened(path: Path) -> dict[str, float]:
    runs = [list(map(float, run_python(REOPEN, str(path)).split())) for _ in range(3)]
    o, f, s = (statistics.median(r[i] for r in runs) for i in range(3))
    return {"open ms": o * 1e3, "first sample ms": f * 1e3, "second sample ms": s * 1e3}


def torchrl_side(path: Path, stored: int, capacity: int, n: int, L: int, reps: int) -> dict | None:
    if not trl.torchrl_available():
        return None
    done = np.zeros(stored, dtype=bool)
    ro = mb.open(path, mode="r")
    for lo in range(0, stored, BLOCK):  # the same flags, read back from the store
        hi = min(stored, lo + BLOCK)
        done[lo:hi] = ro.get(np.arange(lo, hi), keys=["truncated"])["truncated"].numpy()
    return trl.slice_sampler_times(done, None, n, L, reps=reps, capacity=capacity, online_reps=max(3, reps // 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="5e6:6e6,346e6:600e6", help="stored:capacity pairs, comma-separated (1e6 notation)")
    parser.add_argument("--ep-lens", default="1000,501", help="episode lengths, comma-separated")
    parser.add_argument("--reps", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--online-episodes", type=int, default=300, help="episodes appended in the online run")
    parser.add_argument("--torchrl-max-stored", type=count, default=400_000_000, help="largest store run against TorchRL")
    args = parser.parse_args()
    root = scratch()
    header("bench_sampling")
    for pair in args.sizes.split(","):
        stored, capacity = (int(float(x)) for x in pair.split(":"))
        for ep_len in (int(x) for x in args.ep_lens.split(",")):
            path = root / f"slices_{stored}_{capacity}_{ep_len}"
            t0 = time.perf_counter()
            build(path, stored, capacity, ep_len)
            print(f"### {stored:,} stored / {capacity:,} capacity, episodes of {ep_len} "
                  f"(built in {time.perf_counter() - t0:.0f} s)\n")
            buf = mb.open(path, mode="r")
            print(f"warm-up read of the columns: {warm(buf):.1f} s\n")
            rows = [{"regime": "read in by faults", **r} for r in static(buf, args.reps)]
            del buf
            gc.collect()  # its maps: the page cache drops only unmapped pages
            drop_file_cache(path)  # a learner opening the store from disk, then warming it
            buf = mb.open(path, mode="r")
            t0 = time.perf_counter()
            buf.warm(columns=True)
            print(f"from disk, `warm(columns=True)`: {time.perf_counter() - t0:.1f} s\n")
            rows += [{"regime": "warm(columns=True)", **r} for r in static(buf, args.reps)]
            if stored <= args.torchrl_max_stored:
                side: dict[tuple[int, int], dict | None] = {}
                for row, (n, L) in zip(rows, SETTINGS * 2):
                    if (n, L) != (256, 4) and stored >= 1e7:
                        continue
                    if (n, L) not in side:  # one TorchRL run per setting, for both regimes
                        side[(n, L)] = torchrl_side(path, stored, capacity, n, L, reps=5)
                    res = side[(n, L)]
                    if res is None:
                        continue
                    row["torchrl uncached index ms"] = res.get("uncached_index_s", float("nan")) * 1e3
                    row["torchrl cached index ms"] = res.get("cached_index_s", float("nan")) * 1e3
                    row["torchrl cached sample ms"] = res.get("cached_total_s", float("nan")) * 1e3
                    row["torchrl cached sample min ms"] = res.get("cached_total_min_s", float("nan")) * 1e3
                    row["torchrl cached sample / mmbuffer total"] = res.get("cached_total_s", float("nan")) / (row["total ms"] / 1e3)
                    row["(min) / mmbuffer total"] = res.get("cached_total_min_s", float("nan")) / (row["total ms"] / 1e3)
                    row["torchrl online sample ms"] = res.get("online_sample_s", float("nan")) * 1e3
                    row["uncached / mmbuffer index"] = res.get("uncached_index_s", float("nan")) / (row["index ms"] / 1e3)
            table(rows)
            print("reopened (fresh process):")
            table([reopened(path)])
            del buf
            print("online (extend one 1000-row episode, then sample 256 x 4; commit every 100):")
            writer = mb.open(path)
            warm(writer)
            on = online(writer, args.online_episodes, 256, 4)
            writer.close()
            table([on])
            for row in rows[:1]:  # the online figure is TorchRL's after a write, the same for both regimes
                if "torchrl online sample ms" in row and row["slices"] == "256 x 4":
                    after = on["sample after the write ms"]
                    print(f"online: TorchRL sample after a write {row['torchrl online sample ms']:.1f} ms vs "
                          f"mmbuffer's {after:.3f} ms -> {row['torchrl online sample ms'] / after:.0f}x "
                          f"({row['torchrl online sample ms'] / on['extend + sample ms']:.0f}x counting our extend too)\n")


if __name__ == "__main__":
    main()
