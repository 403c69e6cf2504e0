"""Writer groups: what a group publish and a group reader cost against one store, same run.

On an S3-compatible server on loopback (moto's server mode, started here), three local
stores of ``--rows`` rows each (obs 17 float32, reward; episodes of ``--episode`` rows):

* publish, steady state: 1% new rows in a store, then ``mb.convert.publish(store, url)``
  to a plain URL (the baseline) and ``mb.convert.publish(store, group, writer="host-0")``
  of the same state, alternated over ``--rounds`` rounds (the group adds the claim and
  the pointer compare-and-swaps: two GET + two conditional PUT of ``group.json``);
* reader open: ``mb.open(url)`` of one store of 3 x ``--rows`` rows (the baseline) against
  ``mb.open(group)`` of the three writers (three mirrors), alternated, each into a fresh
  ``cache_dir`` (cold: every small part fetched);
* ``sample(256)`` (exact reads, ``pool=None``) from both, alternated, after a warm-up.

``--engine icechunk`` publishes both the plain store and the group through Icechunk (the
group: one repository, a commit per publish under the writer's folder; no ``group.json``).
Medians; moto is a Python server: its throughput, not S3's, bounds the absolute figures.
Run: ``python benchmarks/bench_groups.py [--rows 100000] [--rounds 5] [--engine icechunk]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mmbuffer as mb  # noqa: E402
from _common import count  # noqa: E402


def add(buf: mb.Buffer, start: int, n: int, episode: int, rng: np.random.Generator) -> None:
    done = (np.arange(start, start + n) % episode) == episode - 1
    buf.extend({"obs": rng.standard_normal((n, 17), dtype=np.float32),
                "reward": rng.standard_normal(n, dtype=np.float32), "terminated": done},
               final_obs={"obs": np.zeros((int(done.sum()), 17), np.float32)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=count, default=100_000)
    ap.add_argument("--episode", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", choices=("snapshots", "icechunk"), default="snapshots")
    args = ap.parse_args()
    from s3server import moto_s3, new_bucket

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    rng = np.random.default_rng(0)
    cols = {"obs": ((17,), "float32"), "reward": ((), "float32")}
    rows, ep, step = args.rows, args.episode, args.rows // 100
    with tempfile.TemporaryDirectory() as d, moto_s3() as endpoint:
        tmp = Path(d)
        cap = rows + step * (args.rounds + 1) + ep
        for w in range(3):
            with mb.create(tmp / f"w{w}", cols, capacity=cap) as buf:
                add(buf, 0, rows, ep, rng)
        with mb.create(tmp / "all", cols, capacity=3 * cap) as buf:
            add(buf, 0, 3 * rows, ep, rng)
        single, group, big = (f"s3://{new_bucket(endpoint)}/s" for _ in range(3))
        engine = args.engine
        mb.convert.publish(tmp / "w0", single, progress=False, engine=engine)
        for w in range(3):
            mb.convert.publish(tmp / f"w{w}", group, writer=f"host-{w}", progress=False, engine=engine)
        mb.convert.publish(tmp / "all", big, progress=False, engine=engine)
        pub: dict[str, list[float]] = {"single": [], "group": []}
        for r in range(args.rounds):
            with mb.open(tmp / "w0") as buf:
                add(buf, len(buf), step, ep, rng)
            order = [("single", {}), ("group", {"writer": "host-0"})]
            for name, kw in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                mb.convert.publish(tmp / "w0", single if name == "single" else group, progress=False, engine=engine, **kw)
                pub[name].append(time.perf_counter() - t0)
        opened: dict[str, list[float]] = {"single": [], "group": []}
        sampled: dict[str, list[float]] = {"single": [], "group": []}
        for r in range(args.rounds):
            order = ["single", "group"] if r % 2 == 0 else ["group", "single"]
            for name in order:
                t0 = time.perf_counter()
                ro = (mb.open(big, mode="r", cache_dir=tmp / f"c-{name}-{r}", pool=None) if name == "single"
                      else mb.open_group(group, cache_dir=tmp / f"c-{name}-{r}", pool=None))
                opened[name].append(time.perf_counter() - t0)
                g = torch.Generator().manual_seed(r)
                ro.sample(256, generator=g)
                t0 = time.perf_counter()
                for _ in range(5):
                    ro.sample(256, generator=g)
                sampled[name].append((time.perf_counter() - t0) / 5)
                ro.close()
    print(f"rows per writer {rows:,}, 3 writers; engine {args.engine}; rounds {args.rounds}; medians")
    print("| measure | group | one store | ratio |")
    print("|---|---:|---:|---:|")
    for label, table, unit in (("publish after 1% new rows (s)", pub, 1.0), ("open, cold cache (ms)", opened, 1e3),
                               ("sample(256), pool=None (ms)", sampled, 1e3)):
        a, b = statistics.median(table["group"]) * unit, statistics.median(table["single"]) * unit
        print(f"| {label} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
