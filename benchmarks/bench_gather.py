"""Gather benchmark: a sampled batch against memcpy and against an in-RAM buffer.

A store of ``--rows`` rows (2M; obs 17 float32, action 6 float32, reward float32,
episodes of 1000 steps: TD-MPC2's layout), dropped from the page cache and read back by
``warm(columns=True)`` (``--warm read``: as the page cache holds it), read once and mapped by this
process. Two workloads, each against a baseline timed in the same run:

* ``256 x 64`` slices, every column and ``next_obs`` (2.7 MB), with
  ``buf.sample_slices`` (index + gather + batch), against ``np.copyto`` of the
  same bytes between two preallocated in-RAM arrays: the floor for contiguous
  runs. Also the gather alone (rows drawn beforehand), with and without ``out=``
  buffers, and the index alone. The gather and ``sample_slices`` run twice: as
  configured (up to ``parallel.threads()`` threads: 2 on this VM), on one thread
  (``torch.set_num_threads(1)`` around the call), and always offered to the
  helper (the default offers it where that has been faster, ``parallel.Chooser``).
  ``sweep``: the gather of ``B x 64`` slices on one thread against always offered,
  where the threshold pays.
* ``4096`` random transitions, every column and ``next_obs``, with ``buf.sample``,
  against numpy fancy indexing (``np.take``) of the same rows from in-RAM
  arrays of every column, ``next_obs`` included (what an in-RAM buffer that
  stores ``next_obs`` pays for its gather alone).

Every call reads rows (or bytes) that the calls just before it did not: a row set
reused call after call sits in the CPU caches and flatters either side. Timed in
interleaved rounds (``interleaved``). Ratios are baseline time / mmbuffer time
(``>= 1``: mmbuffer is as fast).
Then the first-call compile time of the kernels in a fresh process, with an
empty numba cache (``NUMBA_CACHE_DIR`` pointed at a new directory), and loaded
from that cache in a second fresh process.

    python benchmarks/bench_gather.py            # ~0.4 GB scratch in $MMBUFFER_BENCH_DIR
    python benchmarks/bench_gather.py --parts slices,sweep --reps 400
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import build_world_model_store, drop_file_cache, header, scratch, settle, table  # noqa: E402

import mmbuffer as mb  # noqa: E402
from mmbuffer._read import gather as gather_module, parallel  # noqa: E402
from mmbuffer._read.gather import gather  # noqa: E402


def build(path: Path, rows: int, episode: int) -> None:
    if (path / "manifest.json").exists():
        ro = mb.open(path, mode="r")
        if len(ro) == rows:
            return
    shutil.rmtree(path, ignore_errors=True)
    build_world_model_store(path, rows, episode)


def in_ram(buf: mb.Buffer) -> dict[str, np.ndarray]:
    """Every column and next_obs as in-RAM arrays (the in-RAM buffer's layout); reading
    them also warms the page cache and maps the store in this process."""
    rows = np.arange(buf.capacity)
    arrays = {k: v.numpy().copy() for k, v in buf.get(rows).items()}
    for name in buf.columns:
        np.asarray(buf.column(name).mapped()).sum()
    for name in buf.next_keys:
        np.asarray(buf.column(f"final/{name}").mapped()).sum()
    return arrays


def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each function, timed in rounds that call every one once in
    a random order: load from other processes on a shared machine then slows all
    of them alike, and the ratios hold where the absolute figures drift."""
    order = np.random.default_rng(0)
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(2):
        for f in fns.values():
            f()
    for _ in range(reps):
        for i in order.permutation(len(names)):
            t0 = time.perf_counter()
            fns[names[i]]()
            times[names[i]].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


class Cycle:
    """Call ``fn`` on the next of ``items`` each time: every timed call reads rows
    (or bytes) the previous calls did not, as a training loop does."""

    def __init__(self, items: list[object]) -> None:
        self.items, self.i = items, 0

    def next(self) -> object:
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


class OneThread:
    """``fn`` with ``torch.set_num_threads(1)`` around it: the gather on the calling
    thread alone (``mmbuffer/_read/parallel.py``; the switch costs well under 1 us)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def __call__(self) -> object:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.fn()
        finally:
            torch.set_num_threads(before)


class Offered:
    """``fn`` with every large gather offered to the helper threads, whatever
    ``parallel.CHOOSER`` has learnt (the threshold ``_PART`` lowered to ``part``)."""

    def __init__(self, fn: Callable[[], object], part: int = gather_module._PART) -> None:
        self.fn, self.part = fn, part

    def __call__(self) -> object:
        offer, part = parallel.CHOOSER.offer, gather_module._PART
        parallel.CHOOSER.offer = lambda nbytes: True  # type: ignore[method-assign]
        gather_module._PART = self.part
        try:
            return self.fn()
        finally:
            parallel.CHOOSER.offer = offer  # type: ignore[method-assign]
            gather_module._PART = part


def slices(buf: mb.Buffer, reps: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(0)
    b = buf.sample_slices(256, 64, generator=g)
    nbytes = sum(v.numpy().nbytes for v in b.data.values())
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    big = np.random.default_rng(1).integers(0, 255, 128 * nbytes, dtype=np.uint8)  # ~350 MB, as the store
    chunks = Cycle([big[i * nbytes : (i + 1) * nbytes] for i in range(128)])
    rows = Cycle([buf.slice_indices(256, 64, generator=g)[0] for _ in range(64)])
    out = {k: torch.empty_like(v) for k, v in b.data.items()}
    t_hot = interleaved({"hot": lambda: np.copyto(dst, src)}, reps)["hot"]  # alone: src stays in cache
    t = interleaved({
        "ram": lambda: np.copyto(dst, chunks.next()),
        "index": lambda: buf.slice_indices(256, 64, generator=g),
        "gather": lambda: gather(buf, rows.next()),
        "gather1": OneThread(lambda: gather(buf, rows.next())),
        "gather2": Offered(lambda: gather(buf, rows.next())),
        "out": lambda: gather(buf, rows.next(), out=out),
        "total": lambda: buf.sample_slices(256, 64, generator=g),
        "total1": OneThread(lambda: buf.sample_slices(256, 64, generator=g)),
        "total2": Offered(lambda: buf.sample_slices(256, 64, generator=g)),
    }, reps)
    t_ram = t["ram"]

    def row(what: str, t: float) -> dict[str, object]:
        return {"what": what, "ms": t * 1e3, "% of copyto (cache)": 100 * t_hot / t, "% of copyto (RAM)": 100 * t_ram / t}

    n = parallel.threads()
    return [
        row("np.copyto of the same bytes, source in cache (baseline 1)", t_hot),
        row("np.copyto of the same bytes, a new 2.7 MB of a 350 MB array each call (baseline 2)", t_ram),
        row(f"**sample_slices(256, 64): index + gather, default (up to {n} threads, learnt)**", t["total"]),
        row("**sample_slices(256, 64), one thread**", t["total1"]),
        row(f"**sample_slices(256, 64), always offered to {n - 1} helper(s)**", t["total2"]),
        row("  index alone (slice_indices)", t["index"]),
        row("  gather alone (rows drawn beforehand), default", t["gather"]),
        row("  gather alone, one thread", t["gather1"]),
        row("  gather alone, always offered", t["gather2"]),
        row("  gather alone, into out= buffers (one thread: a kernel call per column)", t["out"]),
        {"what": f"({nbytes / 1e6:.2f} MB a batch; {n} = parallel.threads(): MMBUFFER_GATHER_THREADS, torch threads)"},
    ]


def sweep(buf: mb.Buffer, reps: int) -> list[dict[str, object]]:
    """Where two threads pay: ``gather`` of ``B x 64`` slices on one thread and always
    offered to a helper whatever its size (the threshold lowered), interleaved."""
    g = torch.Generator().manual_seed(2)
    out = []
    for b in (8, 16, 32, 64, 128, 256):
        rows = Cycle([buf.slice_indices(b, 64, generator=g)[0] for _ in range(64)])
        t = interleaved({"one": OneThread(lambda: gather(buf, rows.next())),
                         "two": Offered(lambda: gather(buf, rows.next()), 1 << 12)}, reps)
        nbytes = sum(v.numpy().nbytes for v in gather(buf, rows.next()).values())
        out.append({"slices": f"{b} x 64", "KB": nbytes / 1e3, "one thread ms": t["one"] * 1e3,
                    "offered to a helper ms": t["two"] * 1e3, "one thread / offered": t["one"] / t["two"]})
    return out


def transitions(buf: mb.Buffer, arrays: dict[str, np.ndarray], reps: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(1)
    rows = Cycle([buf.sample_indices(4096, generator=g)[0] for _ in range(64)])

    def fancy() -> None:
        r = rows.next()
        for a in arrays.values():
            np.take(a, r, axis=0)

    t = interleaved({
        "fancy": fancy,
        "index": lambda: buf.sample_indices(4096, generator=g),
        "gather": lambda: gather(buf, rows.next()),
        "total": lambda: buf.sample(4096, generator=g),
    }, reps)
    t_fancy, t_index, t_gather, t_total = (t[k] for k in ("fancy", "index", "gather", "total"))
    return [
        {"what": "numpy fancy indexing (np.take) of in-RAM arrays (baseline)", "ms": t_fancy * 1e3, "ratio": 1.0},
        {"what": "sample(4096): index + gather", "ms": t_total * 1e3, "ratio": t_fancy / t_total},
        {"what": "  index alone (sample_indices)", "ms": t_index * 1e3, "ratio": float("nan")},
        {"what": "  gather alone", "ms": t_gather * 1e3, "ratio": t_fancy / t_gather},
    ]


COMPILE = """
import sys, time
t0 = time.perf_counter()
import numpy as np, torch, mmbuffer as mb
buf = mb.open(sys.argv[1], mode="r")
t1 = time.perf_counter()
buf.sample_slices(256, 64, generator=torch.Generator().manual_seed(0))
buf.sample(4096, generator=torch.Generator().manual_seed(0))
t2 = time.perf_counter()
buf.sample_slices(256, 64, generator=torch.Generator().manual_seed(1))
buf.sample(4096, generator=torch.Generator().manual_seed(1))
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def compile_times(path: Path) -> list[dict[str, object]]:
    out = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        for label in ("fresh process, empty numba cache", "fresh process, numba cache filled"):
            res = subprocess.run([sys.executable, "-c", COMPILE, str(path)], env=env, capture_output=True, text=True, check=True)
            imp, first, second = map(float, res.stdout.split())
            out.append({"run": label, "import + open ms": imp * 1e3, "first samples ms": first * 1e3,
                        "second samples ms": second * 1e3})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=float, default=2e6)
    parser.add_argument("--episode", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--warm", choices=("read", "columns"), default="columns",
                        help="columns: the store dropped from the page cache, then read back by warm(columns=True) "
                        "(a learner opening it from disk); read: as the page cache holds it, read once")
    parser.add_argument("--parts", default="slices,transitions,compile,sweep", help="sections to run")
    args = parser.parse_args()
    path = scratch() / f"gather_{int(args.rows)}"
    build(path, int(args.rows), args.episode)
    header("bench_gather")
    gc.collect()  # the builder's maps: the page cache drops only unmapped pages
    if args.warm == "columns":
        drop_file_cache(path)
    buf = mb.open(path, mode="r")
    if args.warm == "columns":
        buf.warm(columns=True)
    arrays = in_ram(buf)
    parts = args.parts.split(",")
    settle(lambda: buf.sample_slices(256, 64))
    print(f"load {open('/proc/loadavg').read().split()[:3]}, torch threads {torch.get_num_threads()}\n")
    if "slices" in parts:
        print(f"### 256 x 64 slices, every column + next_obs, {int(args.rows):,} rows, warm\n")
        table(slices(buf, args.reps))
    if "sweep" in parts:
        print("### gather of B x 64 slices: one thread against two (where the threshold pays)\n")
        table(sweep(buf, args.reps))
    if "transitions" in parts:
        print("### 4096 random transitions, every column + next_obs\n")
        table(transitions(buf, arrays, args.reps))
    if "compile" in parts:
        print("### first call: compile (empty cache) and load (cache filled)\n")
        table(compile_times(path))
    print(f"load {open('/proc/loadavg').read().split()[:3]}")

if __name__ == "__main__":
    main()
