"""Store benchmark: append throughput, get latency, reopen time and RSS.

Every figure is compared with plain ``numpy`` memory maps of the same columns
written and read the same way in the same run (the baseline).

    python benchmarks/bench_store.py              # 100M-row store (~7 GB of scratch disk)
    python benchmarks/bench_store.py --rows 2e6   # quick
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, episode_flags, header, median_time, rss_mb, run_python, scratch, table  # noqa: E402

import mmbuffer as mb  # noqa: E402

COLUMNS = {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32")}
ROW_BYTES = 17 * 4 + 6 * 4 + 4 + 2  # + terminated, truncated


def make_block(rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "obs": rng.random((rows, 17), dtype=np.float32),
        "action": rng.random((rows, 6), dtype=np.float32),
        "reward": rng.random(rows, dtype=np.float32),
        "terminated": episode_flags(rows, 1000),
        "truncated": np.zeros(rows, dtype=bool),
    }


def plain_memmaps(path: Path, capacity: int) -> dict[str, np.ndarray]:
    path.mkdir(parents=True)
    out = {}
    for name, (shape, dtype) in {**COLUMNS, "terminated": ((), "bool"), "truncated": ((), "bool")}.items():
        out[name] = np.lib.format.open_memmap(path / f"{name}.npy", mode="w+", dtype=dtype, shape=(capacity, *shape))
    return out


def _append_store(root: Path, data: dict[str, np.ndarray], final: dict[str, np.ndarray] | None, n: int) -> tuple[float, float]:
    store = root / "append_store"
    shutil.rmtree(store, ignore_errors=True)
    block = len(data["reward"])
    buf = mb.create(store, COLUMNS, capacity=n * block)
    t0 = time.perf_counter()
    for _ in range(n):
        buf.extend(data, final_obs=final)
    elapsed = time.perf_counter() - t0
    t0 = time.perf_counter()
    buf.commit()
    commit = time.perf_counter() - t0
    buf.close()
    shutil.rmtree(store)
    return elapsed, commit


def _append_plain(root: Path, data: dict[str, np.ndarray], n: int) -> float:
    plain = root / "append_plain"
    shutil.rmtree(plain, ignore_errors=True)
    block = len(data["reward"])
    maps = plain_memmaps(plain, n * block)
    t0 = time.perf_counter()
    for i in range(n):
        for name, arr in maps.items():
            arr[i * block : (i + 1) * block] = data[name]
    elapsed = time.perf_counter() - t0
    for arr in maps.values():
        arr.flush()
    del maps
    shutil.rmtree(plain)
    return elapsed


def bench_append(root: Path, block: int, total: int, rng: np.random.Generator, reps: int = 3) -> dict[str, object]:
    """Fresh files each time, mmbuffer and the plain memmaps alternating (page-cache
    writeback makes back-to-back runs of one kind unfair to the other)."""
    data = make_block(block, rng)
    ends = int(data["terminated"].sum())
    final = {"obs": rng.random((ends, 17), dtype=np.float32)} if ends else None
    n = max(1, total // block)
    t_store, t_plain, t_commit = [], [], []
    for _ in range(reps):
        s, c = _append_store(root, data, final, n)
        t_store.append(s)
        t_commit.append(c)
        t_plain.append(_append_plain(root, data, n))
    rows = n * block
    ts, tp = statistics.median(t_store), statistics.median(t_plain)
    return {
        "block rows": block,
        "mmbuffer rows/s": rows / ts,
        "mmbuffer MB/s": rows * ROW_BYTES / ts / 1e6,
        "memmap rows/s": rows / tp,
        "ratio": tp / ts,
        "commit ms": statistics.median(t_commit) * 1e3,
    }


def build_big(path: Path, rows: int) -> None:
    if (path / "manifest.json").exists() and len(mb.open(path, mode="r")) == rows:
        return
    shutil.rmtree(path, ignore_errors=True)
    rng = np.random.default_rng(0)
    block = min(1_000_000, rows)
    data = make_block(block, rng)
    with mb.create(path, COLUMNS, capacity=rows) as buf:
        for start in range(0, rows, block):  # the last block may be shorter
            part = {k: v[: rows - start] for k, v in data.items()}
            ends = int(part["terminated"].sum())
            buf.extend(part, final_obs={"obs": rng.random((ends, 17), dtype=np.float32)})


def bench_get(path: Path, rows: int, rng: np.random.Generator) -> list[dict[str, object]]:
    buf = mb.open(path, mode="r")
    # the baseline: the same files, mapped by numpy without mmbuffer
    plain = {name: np.memmap(path / "columns" / name / "c" / ("0/0" if name in ("obs", "action") else "0"),
                             dtype=np.dtype(COLUMNS.get(name, ((), "bool"))[1]), mode="r",
                             shape=(rows, *COLUMNS.get(name, ((), "bool"))[0]))
             for name in ("obs", "action", "reward", "terminated", "truncated")}
    keys = ["obs", "action", "reward", "terminated", "truncated"]
    out = []
    random_rows = rng.integers(0, rows, 4096)
    starts = rng.integers(0, rows - 64, 256)
    slices = starts[:, None] + np.arange(64)[None, :]
    for label, idx in (("4096 random rows", random_rows), ("256 x 64 slices", slices)):
        t_mb = median_time(lambda: buf.get(idx, keys=keys), reps=50)
        t_np = median_time(lambda: {k: np.asarray(v[idx]) for k, v in plain.items()}, reps=50)
        t_next = median_time(lambda: buf.get(idx, keys=keys + ["next_obs"]), reps=50)
        out.append({"gather": label, "mmbuffer ms": t_mb * 1e3, "+ next_obs ms": t_next * 1e3,
                    "numpy memmap ms": t_np * 1e3, "ratio": t_np / t_mb})
    return out


REOPEN = """
import sys, time
t0 = time.perf_counter()
import mmbuffer as mb
t1 = time.perf_counter()
with open("/proc/self/status") as f:
    rss0 = [int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:")][0]
buf = mb.open(sys.argv[1], mode="r")
n, e = len(buf), buf.num_episodes
t2 = time.perf_counter()
with open("/proc/self/status") as f:
    rss = [int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:")][0]
b = buf.sample_slices(256, 64)
t3 = time.perf_counter()
print(t2 - t1, rss, t3 - t2, n, e, rss0)
"""


def bench_reopen(paths: list[Path], reopens: int) -> list[dict[str, object]]:
    out = []
    for path in paths:
        samples = [run_python(REOPEN, str(path)).split() for _ in range(reopens)]
        med = sorted(samples, key=lambda s: float(s[0]))[reopens // 2]
        out.append({"store rows": int(med[3]), "episodes": int(med[4]), "open ms": float(med[0]) * 1e3,
                    "RSS after import MiB": float(med[5]), "RSS after open MiB": float(med[1]),
                    "first sample (256x64) ms": float(med[2]) * 1e3})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=count, default=100_000_000, help="rows of the large store (1e8 notation accepted)")
    parser.add_argument("--append-rows", type=count, default=20_000_000,
                        help="rows appended per block size (blocks of 1, 1000 and 100k rows, each at most this)")
    parser.add_argument("--reopens", type=int, default=5, help="fresh processes that open each store (the median is shown)")
    args = parser.parse_args()
    rows = args.rows
    root = scratch()
    rng = np.random.default_rng(0)
    header("bench_store")
    total = args.append_rows
    table([bench_append(root, 1, min(total, 20_000), rng), bench_append(root, min(total, 1000), min(total, 2_000_000), rng),
           bench_append(root, min(total, 100_000), total, rng)])
    small, big = root / "store_1M", root / f"store_{rows}"
    build_big(small, min(rows, 1_000_000))
    t0 = time.perf_counter()
    build_big(big, rows)
    print(f"built the {rows:,}-row store in {time.perf_counter() - t0:.1f} s (RSS of this process {rss_mb():.0f} MiB)\n")
    table(bench_get(big, rows, rng))
    table(bench_reopen([small, big], args.reopens))


if __name__ == "__main__":
    main()
