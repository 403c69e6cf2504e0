"""Writers on many hosts through Ray: rows/s ingested from N actors, learner sample latency meanwhile.

A local Ray cluster (``--cpus`` CPUs); one :func:`mmbuffer.ray.serve` owner; N env
actors, each sending ``--episodes`` episodes of ``--episode`` rows (obs 17 float32,
action 6 float32, reward) through a ``Sender`` into its own stream. Reported per N:
rows/s ingested (first send to the last row written, commit included), and the
learner's ``sample(256)`` latency (median, p95) from ``mb.open(path, "r")`` while
the actors write, against the same with no writer (the baseline, measured first in
the same run). Episodes are generated before timing: this measures transport and
writing, not environments. The owner commits every 0.2 s; lanes hold twice what is
sent (a writer that laps a lane between two commits leaves readers nothing to sample).

Run: ``python benchmarks/bench_ray.py [--actors 1 2 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ray

import mmbuffer as mb
import mmbuffer.ray as mbray

COLS = {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32")}


@ray.remote(num_cpus=0)
class Env:
    def __init__(self, owner, stream: int, episodes: int, length: int) -> None:
        rng = np.random.default_rng(stream)
        self.sender = mbray.Sender(owner, stream, batch_rows=4096, max_in_flight=2)
        t = np.arange(length)
        self.steps = [{"obs": rng.standard_normal((length, 17), dtype=np.float32),
                       "action": rng.standard_normal((length, 6), dtype=np.float32),
                       "reward": rng.standard_normal(length, dtype=np.float32), "terminated": t == length - 1}
                      for _ in range(min(episodes, 16))]
        self.final = {"obs": np.zeros((1, 17), np.float32)}
        self.episodes = episodes

    def run(self) -> int:
        for i in range(self.episodes):
            self.sender.extend(self.steps[i % len(self.steps)], final_obs=self.final)
        return self.sender.wait()


def latencies(ro: mb.Buffer, until: float | None, n: int) -> list[float]:
    out = []
    while (until is None and len(out) < n) or (until is not None and time.perf_counter() < until):
        ro.refresh()
        t0 = time.perf_counter()
        ro.sample(256)
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.002)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--episode", type=int, default=250)
    ap.add_argument("--cpus", type=int, default=2)
    args = ap.parse_args()
    ray.init(num_cpus=args.cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    root = Path(__file__).resolve().parents[1]
    print(f"| actors | rows | rows/s ingested | sample(256) ms median (p95) while ingesting | idle median (p95) |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.actors:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "replay")
            owner = mbray.serve(path, columns=COLS, capacity=2 * n * args.episodes * args.episode, num_streams=n,
                                commit_interval=0.2)
            warm = Env.remote(owner, 0, 4, args.episode)  # a store with rows to sample, and warm actors
            ray.get(warm.run.remote())
            ray.get(owner.commit.remote())
            ray.kill(warm)
            ro = mb.open(path, mode="r")
            idle = latencies(ro, None, 200)
            envs = [Env.remote(owner, s, args.episodes, args.episode) for s in range(n)]
            ray.get([e.__ray_ready__.remote() for e in envs])
            rows0 = ray.get(owner.info.remote())["rows_received"]
            t0 = time.perf_counter()
            runs = [e.run.remote() for e in envs]
            busy: list[float] = []
            while len(ray.wait(runs, num_returns=len(runs), timeout=0)[0]) < len(runs):
                busy += latencies(ro, time.perf_counter() + 0.2, 0)
            ray.get(runs)
            ray.get(owner.commit.remote())
            dt = time.perf_counter() - t0
            rows = ray.get(owner.info.remote())["rows_received"] - rows0
            q = lambda xs: (statistics.median(xs), float(np.percentile(xs, 95)))  # noqa: E731
            (bm, bp), (im, ip) = q(busy or [float("nan")]), q(idle)
            print(f"| {n} | {rows:,} | {rows / dt:,.0f} | {bm:.2f} ({bp:.2f}) | {im:.2f} ({ip:.2f}) |")
            ro.close()
            ray.get(owner.close.remote())
            for a in (*envs, owner):
                ray.kill(a)
    ray.shutdown()
    del root


if __name__ == "__main__":
    main()
