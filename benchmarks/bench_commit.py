"""What refreshing the Zarr attributes costs a commit (``mmbuffer/zarr_view.py``).

A store of 4 streams; each round extends 1000 rows per stream and commits. Rounds
alternate between the real commit and one whose ``zarr_view.publish`` is replaced
by a no-op (the baseline: the commit as it was before the attributes), so both
see the same disk and the same load. Medians over ``--rounds`` rounds of each.

    python benchmarks/bench_commit.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, header, table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mmbuffer as mb  # noqa: E402
from mmbuffer._ledger import zarr_view  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200, help="commits of each kind")
    p.add_argument("--capacity", type=count, default=1_000_000, help="rows of the store (1e6 notation accepted)")
    args = p.parse_args()
    real = zarr_view.publish
    times: dict[str, list[float]] = {"with attributes": [], "without (baseline)": []}
    rng = np.random.default_rng(0)
    block = {"obs": rng.random((1000, 17), dtype=np.float32), "terminated": np.arange(1000) % 250 == 249}
    final = {"obs": np.zeros((4, 17), np.float32)}
    with tempfile.TemporaryDirectory() as tmp:
        buf = mb.create(Path(tmp) / "s", {"obs": ((17,), "float32")}, capacity=args.capacity, num_streams=4)
        try:
            for i in range(2 * args.rounds + 2):
                for s in range(4):
                    buf.extend(block, stream=s, final_obs=final)
                kind = "with attributes" if i % 2 else "without (baseline)"
                zarr_view.publish = real if i % 2 else (lambda *a, **k: None)  # type: ignore[assignment]
                t0 = time.perf_counter()
                buf.commit()
                if i >= 2:  # two warm-up rounds
                    times[kind].append(time.perf_counter() - t0)
        finally:
            zarr_view.publish = real
            buf.close()
    header("bench_commit")
    base = statistics.median(times["without (baseline)"])
    table([{"commit": k, "median ms": statistics.median(v) * 1e3, "p90 ms": float(np.percentile(v, 90)) * 1e3,
            "ratio to baseline": statistics.median(v) / base} for k, v in times.items()])
    print(f"\n4 streams x 1000 rows of obs 17 float32 per commit, capacity {args.capacity:,}, {args.rounds} commits each")


if __name__ == "__main__":
    main()
