"""Prioritized replay benchmark: sample 256 + update 256 as the store grows to 6e8 rows.

For each capacity a store (one uint8 column, episodes of 1000 rows, full) with a
priority tree is built on disk; a fresh process then opens it and times
``sample_indices(256, prioritized=True)`` (the sampler alone; the first 50
samples of the fresh process separately, then warm: after one sequential read of
the tree has mapped its pages, as in a learner that has run a while), ``sample``
(with the gather) and ``update_priorities`` of the sampled rows, an update that lowers
the row holding the max (the default for new rows must follow the live max), and
reports its RSS, split into anonymous memory (the process's own) and file-backed
pages (the page cache of the store's maps, shared and reclaimable). When TorchRL's PrioritizedSampler is available (see
``_torchrl_baseline.py``) it runs at the capacities up to ``--torchrl-max``.

    python benchmarks/bench_priority.py                  # 1e6, 1e8, 6e8 (needs ~5 GB free per 1e9 rows)
    python benchmarks/bench_priority.py --capacities 1e6  # quick
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torchrl_baseline as trl  # noqa: E402
from _common import header, run_python, scratch, table  # noqa: E402

import mmbuffer as mb  # noqa: E402
from mmbuffer import tree  # noqa: E402

BLOCK = 4_000_000


def build(path: Path, capacity: int) -> float:
    if (path / "manifest.json").exists() and len(mb.open(path, mode="r")) == capacity:
        return 0.0
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    with mb.create(path, {"x": ((), "uint8")}, capacity=capacity, next_keys=(),
                   priorities=mb.PriorityConfig(alpha=0.6)) as buf:
        for lo in range(0, capacity, BLOCK):
            n = min(BLOCK, capacity - lo)
            rows = np.arange(lo, lo + n)
            buf.extend({"x": (rows % 251).astype(np.uint8), "truncated": rows % 1000 == 999})
            # random priorities, as a learner would have set them
            buf.update_priorities(rows, rng.random(n))
    return time.perf_counter() - t0


WORKER = """
import json, statistics, sys, time
import numpy as np, torch
import mmbuffer as mb
from mmbuffer import tree
t0 = time.perf_counter()
buf = mb.open(sys.argv[1])
t_open = time.perf_counter() - t0
reps = int(sys.argv[2])
g = torch.Generator().manual_seed(0)
rng = np.random.default_rng(0)
t_cold = []
for _ in range(50):  # a fresh process: every tree page touched the first time faults
    t0 = time.perf_counter(); buf.sample_indices(256, g, prioritized=True); t_cold.append(time.perf_counter() - t0)
t0 = time.perf_counter()
for arr in (buf._tree.sums, buf._tree.mins, buf._tree.maxs, buf._tree.leaves, buf._data["x"]):
    for lo in range(0, len(arr), 1 << 24):
        np.asarray(arr[lo : lo + (1 << 24)]).sum()  # a learner that has run a while has these mapped
t_warm = time.perf_counter() - t0
t_idx, t_tot, t_upd = [], [], []
for _ in range(reps):
    t0 = time.perf_counter(); rows, w, _ = buf.sample_indices(256, g, prioritized=True); t1 = time.perf_counter()
    b = buf.sample(256, g, prioritized=True); t2 = time.perf_counter()
    buf.update_priorities(b.indices, torch.from_numpy(rng.random(256))); t3 = time.perf_counter()
    t_idx.append(t1 - t0); t_tot.append(t2 - t1); t_upd.append(t3 - t2)
# lower the row holding the max: the next default must follow the new live max
t_max = []
for _ in range(20):
    top = int(tree.find_prefix(buf._tree, np.array([0.0]))[0])  # any live row
    buf.update_priorities(torch.tensor([top]), torch.tensor([1e6]))
    t0 = time.perf_counter()
    buf.update_priorities(torch.tensor([top]), torch.tensor([0.5]))
    default = buf._default_priority()
    t_max.append(time.perf_counter() - t0)
buf.close()
with open("/proc/self/status") as f:
    mem = {l.split(":")[0]: int(l.split()[1]) / 1024 for l in f if l.startswith(("VmRSS:", "RssAnon:", "RssFile:"))}
med = statistics.median
print(json.dumps({"open": t_open, "cold_index": med(t_cold), "warm_up": t_warm, "index": med(t_idx), "total": med(t_tot), "update": med(t_upd),
                  "update_max": med(t_max), "rss": mem["VmRSS"], "anon": mem["RssAnon"], "file": mem["RssFile"]}))
"""

IMPORT_RSS = "import torch, mmbuffer\nprint([int(l.split()[1]) / 1024 for l in open('/proc/self/status') if l.startswith('RssAnon:')][0])"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capacities", default="1e6,1e8,6e8")
    parser.add_argument("--reps", type=int, default=500)
    parser.add_argument("--torchrl-max", type=float, default=1e8)
    args = parser.parse_args()
    root = scratch()
    header("bench_priority")
    base_rss = float(run_python(IMPORT_RSS))
    print(f"anonymous RSS of a process that only imported torch and mmbuffer: {base_rss:.0f} MiB\n")
    rows = []
    for cap in (int(float(c)) for c in args.capacities.split(",")):
        free = shutil.disk_usage(root).free
        need = cap * (3 + tree.nbytes(cap) / cap) * 1.2
        if free < need:
            print(f"skipping {cap:,}: {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")
            continue
        path = root / f"priority_{cap}"
        built = build(path, cap)
        res = json.loads(run_python(WORKER, str(path), str(args.reps)))
        row = {
            "capacity": cap,
            "build s": built,
            "tree B/row": tree.nbytes(cap) / cap,
            "open ms": res["open"] * 1e3,
            "first 50 samples idx ms": res["cold_index"] * 1e3,
            "sample idx ms": res["index"] * 1e3,
            "sample+gather ms": res["total"] * 1e3,
            "update ms": res["update"] * 1e3,
            "lower max ms": res["update_max"] * 1e3,
            "RSS MiB": res["rss"],
            "anon RSS - imports MiB": res["anon"] - base_rss,
            "file-backed RSS MiB": res["file"],
        }
        if cap <= args.torchrl_max:
            t = trl.prioritized_sampler_times(cap, 256, reps=50)
            if t is not None:
                row["torchrl sample ms"] = t["sample_index_s"] * 1e3
                row["torchrl update ms"] = t["update_s"] * 1e3
                row["torchrl lower-max ms"] = t.get("update_touching_max_s", float("nan")) * 1e3
                row["torchrl RSS MiB"] = t["rss_bytes"] / 2**20
        rows.append(row)
        print(json.dumps(row))
    print()
    table(rows)


if __name__ == "__main__":
    main()
