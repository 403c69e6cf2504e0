"""Does the training loop wait on data? ``mb.stream`` vs sampling in the loop.

A synthetic training step of ``--step-ms`` (5 ms) runs after each batch of
``--slices`` x ``--slice-len`` (256 x 64) slices of a store of ``--rows`` rows
(obs 17 float32, action 6 float32, reward; every column and ``next_obs`` read).
Reported: batches per second of

* ``compute only``: the step alone (the ceiling),
* ``sync``: ``buf.sample_slices`` then the step, in the loop,
* ``stream``: ``for b in mb.stream(...)`` then the step (prefetch thread), with
  CPython's default 5 ms thread switch interval and with the stream's default
  (0.5 ms while it runs; see ``mmbuffer._feed.stream``),
* prioritized: ``stream(..., prioritized=True)`` with ``update_priorities`` after
  each step, against its own ceiling (the step plus ``update_priorities``),

each as a fraction of its ceiling (target: stream >= 95%), and for the streams
the time per batch the loop spent blocked in ``next()``, i.e. waiting on data.
On a machine where other processes take the second core the step itself slows
down (the worker's 2-3 ms per batch must run somewhere): the wait column tells
that apart from waiting on data.

``--step launch`` stands in for a launch-bound GPU step (small layers): a
calibrated number of tiny in-place torch ops, so the training thread spends the
step in Python and torch's dispatcher, holding the GIL between ops; whatever GIL
time the stream's workers take comes straight off its rate. It is the CPU-side
proxy of ``bench_gpu.py``'s TD-MPC2 loop.

The step. ``--step busy`` (default) multiplies matrices with torch on one
intra-op thread, calibrated to the step time: like a real forward/backward it
occupies a core and releases the GIL inside its kernels, so the prefetch thread
must do its sampling on the other core and contend for the GIL only between
kernels. ``--step sleep`` (``time.sleep``) frees both the CPU and the GIL and so
flatters any background loader; it is reported for comparison only.

Run: ``python benchmarks/bench_stream.py`` (builds a temporary store of 4M rows,
about 0.4 GB, and reads it once so that the page cache is warm). ``--path``
reuses a store built earlier by this script. Modes run interleaved, best of
``--repeats``, so that load from other processes affects them alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_world_model_store, count  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mmbuffer as mb
from mmbuffer._feed.stream import stream as mb_stream  # mb.stream once exported


def build(path: Path, rows: int, episode: int, seed: int = 0) -> None:
    build_world_model_store(path, rows, episode, seed=seed, priorities=mb.PriorityConfig(), chunk=250_000)


def warm(path: Path) -> None:
    """Read every file of the store once: the figures are for a warm page cache."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def make_step(kind: str, ms: float):
    """A callable taking about ``ms`` milliseconds."""
    if kind == "sleep":
        return lambda: time.sleep(ms / 1e3)
    a = torch.randn(128, 128)
    b = torch.randn(128, 128)
    x = torch.zeros(16)
    reps = 1

    def step() -> None:
        for _ in range(reps):
            if kind == "launch":
                x.add_(1.0)  # tiny: the thread spends its time in Python and torch's dispatch
            else:
                torch.mm(a, b)

    for _ in range(8):  # calibrate: scale the repetitions until 40 steps take 40 * ms
        t = time.perf_counter()
        for _ in range(40):
            step()
        per = (time.perf_counter() - t) / 40
        reps = max(1, round(reps * (ms / 1e3) / per))
    return step


SLOW = "stream, switch interval 5 ms (CPython default)"
FAST = "stream (switch interval 0.5 ms, the default)"
PER = "stream, prioritized, + update_priorities"
TWO = "stream, 2 workers (gathers outside the buffer lock)"


def measure(buf, step, B: int, L: int, n: int, prefetch: int, repeats: int, g: torch.Generator) -> list:
    """Batches/s of each loop and its fraction of the loop's ceiling."""
    def compute(k: int) -> None:
        for _ in range(k):
            step()

    def sync(k: int) -> None:
        for _ in range(k):
            buf.sample_slices(B, L, generator=g)
            step()

    waits: dict[str, float] = {}

    def streamed(k: int, interval: float | None = 5e-4, name: str = "", workers: int = 1) -> None:
        with mb_stream(buf, B, slice_len=L, prefetch=prefetch, num_batches=k, generator=g,
                       switch_interval=interval, workers=workers) as s:
            waited = 0.0
            for _ in range(k):
                t = time.perf_counter()
                next(s)
                waited += time.perf_counter() - t
                step()
        waits.setdefault(name, []).append(waited / k)

    fixed = buf.sample_slices(B, L, prioritized=True, generator=g).indices[:, 0].clone()

    def compute_per(k: int) -> None:  # the ceiling with a priority update per step
        for _ in range(k):
            step()
            buf.update_priorities(fixed, torch.rand(B) + 0.1)

    def streamed_per(k: int) -> None:
        with mb_stream(buf, B, slice_len=L, prioritized=True, prefetch=prefetch,
                       num_batches=k, generator=g) as s:
            waited = 0.0
            for _ in range(k):
                t = time.perf_counter()
                b = next(s)
                waited += time.perf_counter() - t
                step()
                buf.update_priorities(b.indices[:, 0], torch.rand(B) + 0.1)
        waits.setdefault(PER, []).append(waited / k)

    modes = [
        ("compute only", compute, "compute only"),
        ("sync: sample_slices + step", sync, "compute only"),
        (SLOW, lambda k: streamed(k, None, SLOW), "compute only"),
        (FAST, lambda k: streamed(k, 5e-4, FAST), "compute only"),
        (TWO, lambda k: streamed(k, 5e-4, TWO, workers=2), "compute only"),
        ("compute + update_priorities", compute_per, "compute + update_priorities"),
        (PER, streamed_per, "compute + update_priorities"),
    ]
    best = {name: 0.0 for name, _, _ in modes}
    for _ in range(repeats):  # interleaved, best of: load from other processes hits all alike
        for name, fn, _ in modes:
            best[name] = max(best[name], timed(fn, n))
    # median time per batch spent blocked in next(), over the repeats
    wait = {name: float(np.median(w)) for name, w in waits.items()}
    return [(name, best[name], best[name] / best[ceiling], wait.get(name)) for name, _, ceiling in modes]


def timed(fn, n: int) -> float:
    t = time.perf_counter()
    fn(n)
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=count, default=4_000_000, help="rows of the store (4e6 notation accepted)")
    p.add_argument("--episode", type=int, default=1000, help="episode length")
    p.add_argument("--slices", type=int, default=256, help="slices per batch")
    p.add_argument("--slice-len", type=int, default=64, help="steps per slice")
    p.add_argument("--step-ms", type=float, default=5.0, help="simulated training step, ms")
    p.add_argument("--step", choices=("busy", "sleep", "launch", "both"), default="both",
                   help="how the training step spends its time (launch: many small torch ops, like a launch-bound GPU step)")
    p.add_argument("--batches", type=int, default=400, help="batches per run")
    p.add_argument("--prefetch", type=int, default=4, help="batches prepared ahead")
    p.add_argument("--repeats", type=int, default=3, help="best of")
    p.add_argument("--path", type=Path, default=None, help="reuse (or build) the store here")
    args = p.parse_args()
    torch.set_num_threads(1)

    tmp = None
    path = args.path
    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench_stream_"))
        path = tmp / "store"
    try:
        if not path.exists():
            t = time.perf_counter()
            build(path, args.rows, args.episode)
            print(f"built {args.rows:,} rows in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        warm(path)
        buf = mb.open(path)  # the writer: update_priorities needs it
        n, L, B = args.batches, args.slice_len, args.slices
        g = torch.Generator().manual_seed(0)
        for _ in range(200):  # warm the page cache and the slice counts
            buf.sample_slices(B, L, generator=g)
        t = time.perf_counter()
        for _ in range(50):
            buf.sample_slices(B, L, generator=g)
        gather_ms = (time.perf_counter() - t) / 50 * 1e3

        kinds = ["busy", "sleep"] if args.step == "both" else [args.step]
        rows = []
        for kind in kinds:
            step = make_step(kind, args.step_ms)

            for name, bps, ratio, wait in measure(buf, step, B, L, n, args.prefetch, args.repeats, g):
                rows.append((kind, name, bps, 1e3 / bps, ratio, wait))
        buf.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"\n{args.rows:,} rows, {B}x{L} slices of obs 17 float32 (+ action 6, reward, next_obs, flags), "
        f"{args.step_ms:g} ms step, prefetch {args.prefetch}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}; one sample+gather alone: {gather_ms:.2f} ms\n"
    )
    print("| step | loop | batches/s | ms/batch | of its ceiling | ms/batch waiting in next() |")
    print("|---|---|---:|---:|---:|---:|")
    for kind, name, bps, ms, ratio, wait in rows:
        waited = "" if wait is None else f"{wait * 1e3:.3f}"
        print(f"| {kind} | {name} | {bps:.1f} | {ms:.2f} | {ratio:.1%} | {waited} |")


if __name__ == "__main__":
    main()
