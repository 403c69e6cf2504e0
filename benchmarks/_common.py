"""Shared helpers of the benchmark scripts: timing, memory, machine, tables."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def count(text: str) -> int:
    """An ``argparse`` type for row counts: ``100000``, ``100_000``, ``1e5`` or ``2.5e6``
    (a whole number >= 1), else an argparse error naming the value."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 100000 or 1e5, got {text!r}") from None
    if not value.is_integer() or value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 such as 1e5, got {text!r}")
    return int(value)


def counts(text: str) -> list[int]:
    """Comma-separated :func:`count` values (``1e6,1e8``)."""
    return [count(t) for t in text.split(",") if t.strip()]


def median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds over ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def settle(fn: Callable[[], object], min_s: float = 2.0, max_s: float = 60.0, window_s: float = 1.0) -> float:
    """Call ``fn`` until its median time per ``window_s`` stops falling (two windows in a
    row within 10%), at least ``min_s`` and at most ``max_s`` seconds; return the seconds
    it took. On the dev VM a process's first calls at 1e8-1e9 rows run slowly for 1-10 s
    after its pages were read in (no page faults in the guest: benchmarks/HISTORY.md,
    2026-11-26), which a median of a few tens of calls does not hide."""
    start = time.perf_counter()
    last = []
    while True:
        end = time.perf_counter() + window_s
        times = []
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        last = [*last[-1:], statistics.median(times)]
        took = time.perf_counter() - start
        if took >= max_s or (took >= min_s and len(last) == 2 and abs(last[1] - last[0]) <= 0.1 * last[0]):
            return took


def rss_mb() -> float:
    """Resident set size of this process now, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def machine() -> str:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}"


def header(title: str) -> None:
    print(f"## {title}")
    print(f"{datetime.date.today().isoformat()} — {machine()}")
    print()


def table(rows: list[dict[str, object]]) -> None:
    """Print rows as a markdown table."""
    if not rows:
        return
    cols = list(dict.fromkeys(c for row in rows for c in row))
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(c, float("nan"))) for c in cols) + " |")
    print()


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def scratch(default: str | None = None) -> Path:
    """Scratch directory for benchmark stores (MMBUFFER_BENCH_DIR or benchmarks/_data)."""
    path = Path(os.environ.get("MMBUFFER_BENCH_DIR", default or HERE / "_data"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_python(code: str, *args: str) -> str:
    """Run ``code`` in a fresh interpreter (a cold process) and return its stdout."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return out.stdout


def run_in_checkout(tree: Path, source: str, *args: str) -> dict[str, Any]:
    """Run ``source`` in a fresh interpreter with the checkout ``tree`` on ``PYTHONPATH``
    and return the JSON object its last line of output prints. It runs from a file in a
    temporary folder (so that neither this tree's folder nor ``-c`` decides what imports:
    a forkserver re-imports the main module from its file); a failure exits naming the
    tree, with the end of the child's stderr."""
    import json
    import tempfile

    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as cwd:
        script = Path(cwd) / "bench_child.py"
        script.write_text(source)
        out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=cwd, check=False)
    if out.returncode:
        raise SystemExit(f"the child on {tree} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def drop_file_cache(path: Path) -> None:
    """Evict ``path``'s files from the page cache: written back first (a dirty page is
    not dropped), then posix_fadvise DONTNEED (a page some process maps stays)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def episode_flags(rows: int, length: int) -> np.ndarray:
    done = np.zeros(rows, dtype=bool)
    done[length - 1 :: length] = True
    return done


#: The world-model store of bench_gather, bench_gpu and bench_stream: a TD-MPC2-sized
#: proprioceptive task (17-dim observation, 6-dim action, reward).
WORLD_MODEL_COLUMNS = {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32")}


def build_world_model_store(path: Path, rows: int, episode: int, *, seed: int = 0, priorities: object = None,
                            chunk: int = 500_000) -> None:
    """Create ``path`` with ``rows`` random rows of :data:`WORLD_MODEL_COLUMNS` in episodes of
    ``episode`` rows (each ended as truncated, its final observation stored), committed."""
    import mmbuffer as mb

    rng = np.random.default_rng(seed)
    with mb.create(path, WORLD_MODEL_COLUMNS, capacity=rows, priorities=priorities) as buf:  # type: ignore[arg-type]
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            done = (np.arange(start, start + n) % episode) == episode - 1
            buf.extend(
                {
                    "obs": rng.standard_normal((n, 17), dtype=np.float32),
                    "action": rng.standard_normal((n, 6), dtype=np.float32),
                    "reward": rng.standard_normal(n, dtype=np.float32),
                    "truncated": done,
                },
                final_obs={"obs": rng.standard_normal((int(done.sum()), 17), dtype=np.float32)},
            )
        buf.commit()
