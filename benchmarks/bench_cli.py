"""Start-up time of ``mmbuffer --help``, ``info`` and ``verify`` (issue 13 §4).

Each command runs as a fresh ``python -m mmbuffer ...`` process, ``--reps`` times;
the table gives the median wall time and the median CPU time (user + system of
the child: on a machine shared with other work, CPU time is the steadier figure).
Baselines in the same run: ``python -c pass`` (the interpreter alone) and
``python -c "import torch"`` (what every command cost while the package imported
torch at ``import mmbuffer``).

    python benchmarks/bench_cli.py [--reps 15] [--baseline OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], reps: int, root: Path = ROOT) -> tuple[float, float]:
    """Median wall and CPU seconds of ``reps`` runs of ``cmd`` with the checkout ``root``
    first on the path (after one warm-up)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    walls, cpus = [], []
    for i in range(reps + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, cwd=root)  # -m looks in cwd first
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if i:  # the first run warms the page cache
            walls.append(wall)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=15, help="runs of each command; medians are shown")
    p.add_argument("--baseline", type=Path, default=None, help="another mmbuffer checkout whose commands are timed too")
    args = p.parse_args()
    import numpy as np

    import mmbuffer as mb

    with tempfile.TemporaryDirectory() as tmp:
        stores = {}
        for name, priorities in (("plain", None), ("prioritized", mb.PriorityConfig(alpha=0.6))):
            stores[name] = str(Path(tmp) / name)
            with mb.create(stores[name], {"obs": ((17,), "float32"), "reward": ((), "float32")}, capacity=100_000,
                           num_streams=4, priorities=priorities) as buf:
                for s in range(4):
                    buf.extend({"obs": np.zeros((20_000, 17)), "reward": np.zeros(20_000),
                                "terminated": np.arange(20_000) % 500 == 499}, stream=s,
                               final_obs={"obs": np.zeros((40, 17))})
        py = sys.executable
        cases = {
            "python -c pass": [py, "-c", "pass"],
            'python -c "import torch" (baseline)': [py, "-c", "import torch"],
            "mmbuffer --help": [py, "-m", "mmbuffer", "--help"],
            "mmbuffer info STORE": [py, "-m", "mmbuffer", "info", stores["plain"]],
            "mmbuffer info STORE (priorities)": [py, "-m", "mmbuffer", "info", stores["prioritized"]],
            "mmbuffer verify STORE": [py, "-m", "mmbuffer", "verify", stores["plain"]],
            "mmbuffer verify STORE (priorities: the tree check)": [py, "-m", "mmbuffer", "verify", stores["prioritized"]],
        }
        results = {name: timed(cmd, args.reps) for name, cmd in cases.items()}
        if args.baseline is not None:
            for name, cmd in list(cases.items()):
                if name.startswith("mmbuffer"):
                    results[f"{name} [{args.baseline}]"] = timed(cmd, args.reps, args.baseline.resolve())
    header("bench_cli")
    base = results['python -c "import torch" (baseline)']
    table([{"command": name, "wall ms": w * 1e3, "cpu ms": c * 1e3, "wall / import torch": w / base[0],
            "cpu / import torch": c / base[1]} for name, (w, c) in results.items()])
    print(f"\nstores: 80,000 rows of 4 streams, with and without priorities; {args.reps} runs each, medians")


if __name__ == "__main__":
    main()
