"""Export and copy throughput: a store back out as D4RL HDF5, and re-encoded copies.

    python benchmarks/bench_export.py               # 4M rows (about 0.4 GB of rows)
    python benchmarks/bench_export.py --rows 1e6    # a quick run

A one-lane store (obs 17 f32, action 6 f32, reward; 1000-step episodes) is built
in the scratch directory (``$MMBUFFER_BENCH_DIR`` or ``benchmarks/_data``). Each
round then runs, back to back: a ``dd``-style copy of the store's column files
(the same bytes, 16 MiB blocks, fsync: the baseline), ``mmbuffer.convert.copy``
(raw and zstd) and ``export_d4rl``, all with their verification, each in this
process after a ``sync``. Ratios are MB/s of row data against the raw copy of the
same round; the round with the median ratio is shown, with every round's ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, header, scratch, table

import mmbuffer as mb
from mmbuffer.convert import copy, export_d4rl

OBS, ACT, EP = 17, 6, 1000


def build(path: Path, rows: int, block: int = 1_000_000) -> None:
    rng = np.random.default_rng(0)
    with mb.create(str(path), {"obs": ((OBS,), "float32"), "action": ((ACT,), "float32"),
                               "reward": ((), "float32")}, capacity=rows) as buf:
        for a in range(0, rows, block):
            n = min(block, rows - a)
            pos = np.arange(a, a + n)
            done = pos % EP == EP - 1
            buf.extend({"obs": rng.standard_normal((n, OBS), dtype=np.float32),
                        "action": rng.standard_normal((n, ACT), dtype=np.float32),
                        "reward": rng.standard_normal(n, dtype=np.float32), "truncated": done},
                       final_obs={"obs": rng.standard_normal((int(done.sum()), OBS), dtype=np.float32)})


def raw_copy(files: list[Path], out: Path, block: int = 16 << 20) -> float:
    buf = bytearray(block)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(out, "wb", buffering=0) as fo:
        for src in files:
            with open(src, "rb", buffering=0) as fi:
                while n := fi.readinto(buf):
                    fo.write(view[:n])
        os.fsync(fo.fileno())
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=count, default=4_000_000, help="rows of the store to export (4e6 notation accepted)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the median round is shown")
    args = p.parse_args()
    rows = int(args.rows)
    work = scratch() / f"export_{rows}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    header(f"bench_export: store -> copy / D4RL, {rows:,} rows (obs {OBS} f32, action {ACT} f32)")
    src = work / "src"
    build(src, rows)
    row_bytes = (OBS + ACT + 1) * 4 + 2
    files = sorted(f for f in (src / "columns").rglob("*") if f.is_file() and f.name != "zarr.json")
    paths = {"raw copy of the column files": None, "copy (raw)": work / "c", "copy (zstd)": work / "z",
             "export_d4rl": work / "d.hdf5"}
    runs = {
        "copy (raw)": lambda out: copy(str(src), out, progress=False),
        "copy (zstd)": lambda out: copy(str(src), out, compression="zstd", progress=False),
        "export_d4rl": lambda out: export_d4rl(str(src), out, progress=False),
    }
    rounds = []
    for _ in range(args.repeat):
        r = {}
        os.sync()
        r["raw copy of the column files"] = raw_copy(files, work / "raw.bin")
        os.unlink(work / "raw.bin")
        for name, fn in runs.items():
            os.sync()
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert fn(str(paths[name]))["verified"]
            r[name] = time.perf_counter() - t0
            out = paths[name]
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        rounds.append(r)
        print("round:", {k: f"{rows * row_bytes / v / 1e6:.0f} MB/s" for k, v in r.items()})
    print()
    results = []
    for name in paths:
        ratios = sorted((r["raw copy of the column files"] / r[name], r[name]) for r in rounds)
        ratio, seconds = ratios[len(ratios) // 2]
        results.append({"path": name, "seconds": seconds, "MB/s": rows * row_bytes / seconds / 1e6,
                        "vs raw copy": ratio, "rounds vs raw copy": " ".join(f"{x:.2f}" for x, _ in ratios)})
    table(results)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
