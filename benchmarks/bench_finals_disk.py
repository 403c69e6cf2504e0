"""Disk of a raw pixel store: frames against final observations (issue 23 item 4).

An 84x84 uint8 ``pixels`` column (next-derived), one stream, ``--rows`` capacity,
filled with Atari-length episodes (lengths uniform in 30..3000, each ended as
truncated with its final frame) in extends of 4 rows as a vectorized collector adds
them, ``--laps`` times the capacity (so the ring wraps and episodes are evicted),
committed every 10,000 rows. Frames come from a pool of random frames (content does
not change the raw bytes). Reports the allocated bytes (``st_blocks``) of the frame
column, the final-observation array and the whole store, per transition of capacity.

Each tree (``--baseline`` and this checkout) runs in its own process, one after the
other, on a fresh store that is deleted afterwards (peak disk: about 2x the frames).

    python benchmarks/bench_finals_disk.py --rows 1e6 --baseline /work/main
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, run_in_checkout  # noqa: E402

CHILD = r"""
import json, os, sys, time
import numpy as np
import mmbuffer as mb
print(mb.__file__, file=sys.stderr)
path, rows, laps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = np.random.default_rng(0)
pool = rng.integers(0, 256, (4096, 84, 84), dtype=np.uint8)
buf = mb.create(path, {"pixels": ((84, 84), "uint8")}, capacity=rows, next_keys=("pixels",))
total, since, t0 = int(rows * laps), 0, time.perf_counter()
written = 0
while written < total:
    n = min(int(rng.integers(30, 3001)), total - written)
    for a in range(0, n, 4):
        b = min(n, a + 4)
        at = (written + np.arange(a, b)) % len(pool)
        last = b == n
        buf.extend({"pixels": pool[at], "truncated": np.arange(a, b) == n - 1},
                   final_obs={"pixels": pool[at[-1:]] if last else np.zeros((0, 84, 84), np.uint8)})
        since += b - a
        if since >= 10_000:
            buf.commit()
            since = 0
    written += n
buf.close()
seconds = time.perf_counter() - t0

def blocks(p):
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total

with mb.open(path, mode="r") as ro:
    episodes = ro.num_episodes
print(json.dumps({"rows": rows, "written": written, "episodes_live": episodes, "seconds": seconds,
                  "frames": blocks(os.path.join(path, "columns", "pixels")),
                  "finals": blocks(os.path.join(path, "final", "pixels")), "store": blocks(path)}))
"""


def run(tree: Path, rows: int, laps: float, scratch: Path) -> dict[str, float]:
    path = scratch / "store"
    shutil.rmtree(path, ignore_errors=True)
    try:
        return run_in_checkout(tree, CHILD, str(path), str(rows), str(laps))
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=count, default=1_000_000)
    p.add_argument("--laps", type=float, default=1.25, help="rows written, in capacities")
    p.add_argument("--baseline", type=Path, help="root of another mmbuffer checkout (run first)")
    p.add_argument("--scratch", type=Path, default=None)
    args = p.parse_args()
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="mmbuffer-finals-"))
    scratch.mkdir(parents=True, exist_ok=True)
    trees = ([("baseline", args.baseline)] if args.baseline else []) + [("this", Path(__file__).resolve().parents[1])]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  rows={int(args.rows)}  laps={args.laps}")
    print(f"{'tree':<9} {'frames B/tr':>12} {'finals B/tr':>12} {'store B/tr':>11} {'store/frames':>13} {'live eps':>9} {'fill s':>7}")
    for name, tree in trees:
        r = run(tree, int(args.rows), args.laps, scratch)
        n = r["rows"]
        print(f"{name:<9} {r['frames'] / n:12.1f} {r['finals'] / n:12.1f} {r['store'] / n:11.1f} "
              f"{r['store'] / r['frames']:13.4f} {r['episodes_live']:9d} {r['seconds']:7.1f}")
        print("  " + json.dumps(r))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
