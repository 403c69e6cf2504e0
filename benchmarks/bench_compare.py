"""This tree against another checkout of mmbuffer on the same hot paths, same run.

For a change that must not slow anything (a redesign, a safety check): each
operation runs in a fresh interpreter per side, the sides alternate ``--rounds``
times, and the table gives each side's median and the ratio this / baseline. The
store (2M rows, warm, 17+6+1 float32 columns, episodes of 500, priorities) is
built once per side and round.

    git worktree add /tmp/base <commit>
    python benchmarks/bench_compare.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import count, header, run_in_checkout, table  # noqa: E402

WORKER = r"""
import json, sys, time, statistics, tempfile
import numpy as np, torch, mmbuffer as mb
rows = int(sys.argv[1])
path = tempfile.mkdtemp() + "/s"
# the extends below grow one open episode by ~220k rows: a ring must hold it whole
buf = mb.create(path, {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32")},
                capacity=max(rows, 250_000) + 4096, priorities=mb.PriorityConfig())
rng = np.random.default_rng(0)
done = np.zeros(rows, bool); done[499::500] = True
for a in range(0, rows, 1 << 18):
    b = min(rows, a + (1 << 18)); d = done[a:b]
    buf.extend({"obs": rng.random((b - a, 17), dtype=np.float32), "action": rng.random((b - a, 6), dtype=np.float32),
                "reward": rng.random(b - a, dtype=np.float32), "terminated": d},
               final_obs={"obs": np.zeros((int(d.sum()), 17), np.float32)})
buf.commit()
ro = mb.open(path, mode="r")
g = torch.Generator().manual_seed(0)
one = {"obs": np.zeros((1, 17), np.float32), "action": np.zeros((1, 6), np.float32), "reward": np.zeros(1, np.float32)}
thousand = {k: np.repeat(v, 1000, axis=0) for k, v in one.items()}
def per_step():
    b = buf.sample(256, g, prioritized=True, keys=["reward"])
    buf.update_priorities(b.indices, torch.rand(256, generator=g))
ops = {
    "writer sample(256)": lambda: buf.sample(256, g),
    "reader sample(256)": lambda: ro.sample(256, g),
    "writer sample_slices(256, 64)": lambda: buf.sample_slices(256, 64, generator=g),
    "reader sample_slices(256, 64)": lambda: ro.sample_slices(256, 64, generator=g),
    "slice_indices(256, 4)": lambda: buf.slice_indices(256, 4, generator=g),
    "PER sample 256 + update 256": per_step,
    "extend 1 row": lambda: buf.extend(one),
    "extend 1000 rows": lambda: buf.extend(thousand),
}
out = {}
for name, fn in ops.items():
    for _ in range(20): fn()
    t = []
    for _ in range(200):
        t0 = time.perf_counter(); fn(); t.append(time.perf_counter() - t0)
    out[name] = statistics.median(t)
print(json.dumps(out))
"""


def run(tree: Path, rows: int) -> dict[str, float]:
    return run_in_checkout(tree, WORKER, str(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, required=True, help="root of another mmbuffer checkout")
    p.add_argument("--rows", type=count, default=2_000_000, help="rows of the store (1e6 notation accepted)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each measurement")
    args = p.parse_args()
    this = HERE.parent
    header(f"This tree ({this}) against {args.baseline}, {int(args.rows):,} rows, {args.rounds} rounds")
    results: dict[str, dict[str, list[float]]] = {"this": {}, "base": {}}
    for _ in range(args.rounds):
        for side, tree in (("base", args.baseline), ("this", this)):
            for k, v in run(tree, int(args.rows)).items():
                results[side].setdefault(k, []).append(v)
    rows = []
    for k in results["this"]:
        b, t = statistics.median(results["base"][k]), statistics.median(results["this"][k])
        rows.append({"operation": k, "baseline ms": b * 1e3, "this ms": t * 1e3, "this / baseline": t / b})
    table(rows)


if __name__ == "__main__":
    main()
