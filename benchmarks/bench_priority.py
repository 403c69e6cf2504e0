"""Prioritized replay benchmark: sample 256 + update 256 as the store grows to 6e8 rows.

For each capacity a store (one uint8 column, episodes of 1000 rows, full) with a
priority tree is built on disk (kept between runs). Its tree files are then
dropped from the page cache (``posix_fadvise(DONTNEED)``: what the kernel does
to a file nobody maps, after ~30 s idle on the VM of HISTORY.md) and a fresh
process opens the store and times ``sample_indices(256, prioritized=True)``
(the sampler alone): its first 50 samples separately (cold: a random disk read
per tree page), then ``buf.warm()`` (the tree read at sequential disk speed and
mapped), then ``sample_indices`` and ``update_priorities`` of the sampled rows
in a loop of ``--seconds`` whose later half is timed (median and 90th
percentile: the steady state of a learner, whose tree is mapped and dirty);
then ``sample`` with the gather, an update that lowers the row holding the max
(the default for new rows must follow the live max), and reports its RSS,
split into anonymous memory (the process's own) and file-backed pages (the
page cache of the store's maps, shared and reclaimable). It also counts the page
faults per sample + update step in the timed half, and the machine's dirty and
under-writeback page cache then, beside the kernel's writeback settings printed at
the start: a store into a mapped tree page that the kernel has written back since
the last store faults again (the page is write-protected once clean), so the
update's cost depends on how long the kernel lets the tree's pages stay dirty
(``vm.dirty_background_*``, ``vm.dirty_expire_centisecs``; HISTORY.md, issue 12).
``--commit-every N`` commits
every N steps of that loop (a learner that wants its priorities durable; each
commit's time is reported apart, the steps after it carry whatever it costs them:
page faults). When TorchRL's
PrioritizedSampler is available (see ``_torchrl_baseline.py``) it runs at the
capacities up to ``--torchrl-max``.

    python benchmarks/bench_priority.py                  # 1e6, 1e8, 6e8 (needs ~5 GB free per 1e9 rows)
    python benchmarks/bench_priority.py --capacities 1e6  # quick

``--rounds N`` alternates the mmbuffer worker and TorchRL N times per capacity (a
shared, loaded machine drifts: each round's ratio compares neighbours in time)
and reports every round and the medians; the ratio is TorchRL's (sample +
update) time over mmbuffer's, so above 1 means mmbuffer is faster. With
``--commit-every N`` a second ratio charges each step its share of the commits
(mean commit / N, over every commit of the run plus the checkpoint they owe at its
end: a store with a priority log checkpoints every K commits, and a run shorter than
K commits pays a whole checkpoint): TorchRL's trees in RAM never write anything. ``--code DIR``
(repeatable) runs the mmbuffer worker once per round for each folder holding an
``mmbuffer`` package (a before/after comparison in the same rounds).

First, unless ``--create-capacity 0``: ``mb.create`` of an empty prioritized
store of ``--create-capacity`` rows (3e9) in a fresh process: its time, the
disk it allocates (``st_blocks``, not file sizes) and the process's peak RSS.

``--slices`` times prioritized slices instead (``slice_indices(256, 64,
prioritized=True)``, warm, in-process) on stores of episodes of 100 or 1000
rows with a given share of the priority mass on valid window starts: 0.9 is
served by rejection alone, 0.3 by rejection rounds and then the exact draw,
0.01 by the exact draw at once (O(live episodes * log N), see
``sampling.prioritized``); plain prioritized transitions for comparison.

    python benchmarks/bench_priority.py --slices --capacities 1e6,1e7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torchrl_baseline as trl  # noqa: E402
from _common import count, counts, drop_file_cache, header, run_python, scratch, table  # noqa: E402

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


def writeback_settings() -> str:
    """The kernel's page-cache writeback settings, and the memory they scale with."""
    def read(name: str) -> str:
        try:
            return Path(f"/proc/sys/vm/{name}").read_text().strip()
        except OSError:
            return "n/a"

    names = ("dirty_background_ratio", "dirty_background_bytes", "dirty_expire_centisecs", "dirty_writeback_centisecs")
    try:
        avail = next(int(line.split()[1]) // 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        avail = -1
    return "writeback: " + ", ".join(f"{n} {read(n)}" for n in names) + f"; MemAvailable {avail} MiB"


WORKER = """
import json, resource, statistics, sys, time
import numpy as np, torch
import mmbuffer as mb
from mmbuffer import tree
def dirty_bytes():
    with open("/proc/vmstat") as f:  # one read for both counters
        return sum(int(v) * 4096 for k, v in map(str.split, f) if k in ("nr_dirty", "nr_writeback"))
t0 = time.perf_counter()
buf = mb.open(sys.argv[1])
t_open = time.perf_counter() - t0
reps = int(sys.argv[2])
g = torch.Generator().manual_seed(0)
rng = np.random.default_rng(0)
t_cold = []
for _ in range(50):  # tree not in the page cache: every page touched the first time is a disk read
    t0 = time.perf_counter(); buf.sample_indices(256, g, prioritized=True); t_cold.append(time.perf_counter() - t0)
t0 = time.perf_counter()
buf.warm()  # the whole tree at sequential disk speed, mapped
t_warm = time.perf_counter() - t0
# steady state: a learner samples and updates for a while, so the tree's pages are
# mapped and dirty; time the later half of a fixed-duration loop
t_idx, t_tot, t_upd, faults, dirty, t_commit = [], [], [], [], [], []
every = int(sys.argv[4])  # commit every this many steps (0: never); commits are timed apart
end = time.time() + float(sys.argv[3])
while time.time() < end or len(t_idx) < reps:
    if every and len(t_idx) % every == 0:
        t0 = time.perf_counter(); buf.commit(); t_commit.append(time.perf_counter() - t0)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter(); rows, w, _ = buf.sample_indices(256, g, prioritized=True); t1 = time.perf_counter()
    buf.update_priorities(torch.from_numpy(rows), torch.from_numpy(rng.random(256))); t2 = time.perf_counter()
    t_idx.append(t1 - t0); t_upd.append(t2 - t1)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if len(t_idx) % 1000 == 0:  # the kernel's dirty page-cache bytes, machine-wide
        dirty.append(dirty_bytes())
# the checkpoint the commits since the last one owe (a store with a priority log: its
# commits append to the log and a checkpoint writes the tree's pages every K commits):
# charged to the commits of this run, so a run shorter than K commits pays it in full
writer = getattr(buf, "_writer", None)
t_final = 0.0
marks = getattr(writer, "_marks", None)
if every and hasattr(writer, "checkpoint"):
    t0 = time.perf_counter(); writer.checkpoint(); t_final = time.perf_counter() - t0
checkpoints = getattr(marks, "checkpoints", len(t_commit))
half = len(t_idx) // 2
steps = len(t_idx)
faults_per_step = sum(faults[half:]) / len(faults[half:])
p90_idx, p90_upd = np.percentile(t_idx[half:], 90), np.percentile(t_upd[half:], 90)
t_idx, t_upd = t_idx[half:], t_upd[half:]
for _ in range(reps):
    t0 = time.perf_counter(); b = buf.sample(256, g, prioritized=True); t_tot.append(time.perf_counter() - t0)
# lower the row holding the max: the next default must follow the new live max
t_max = []
for _ in range(20):
    top = int(tree.find_prefix(buf.view().tree, np.array([0.0]))[0])  # any live row
    buf.update_priorities(torch.tensor([top]), torch.tensor([1e6]))
    t0 = time.perf_counter()
    buf.update_priorities(torch.tensor([top]), torch.tensor([0.5]))
    default = min(tree.max_live(buf.view().tree), buf.priorities.max_priority ** buf.priorities.alpha)  # a new row's
    t_max.append(time.perf_counter() - t0)
buf.close()
with open("/proc/self/status") as f:
    mem = {l.split(":")[0]: int(l.split()[1]) / 1024 for l in f if l.startswith(("VmRSS:", "RssAnon:", "RssFile:"))}
med = statistics.median
print(json.dumps({"code": mb.__file__, "open": t_open, "cold_index": med(t_cold), "warm": t_warm, "steps": steps, "p90_index": p90_idx, "p90_update": p90_upd, "index": med(t_idx), "total": med(t_tot), "update": med(t_upd),
                  "update_max": med(t_max), "faults_per_step": faults_per_step,
                  "commit": med(t_commit[len(t_commit) // 2:]) if t_commit else float("nan"),
                  "commit_mean": (sum(t_commit) + t_final) / len(t_commit) if t_commit else float("nan"),
                  "commit_max": max(t_commit + [t_final]) if t_commit else float("nan"), "commits": len(t_commit),
                  "checkpoints": checkpoints, "final_checkpoint": t_final,
                  "dirty_mib": statistics.median(dirty[len(dirty) // 2:] or [0]) / 2**20, "rss": mem["VmRSS"], "anon": mem["RssAnon"], "file": mem["RssFile"]}))
"""

CREATE = """
import json, os, resource, sys, time
import mmbuffer as mb
create = mb.create  # mmbuffer imports torch lazily, on its first use: not part of create's time
t0 = time.perf_counter()
create(sys.argv[1], {"x": ((), "uint8")}, capacity=int(float(sys.argv[2])), next_keys=(),
          priorities=mb.PriorityConfig(alpha=0.6)).close()
t = time.perf_counter() - t0
disk = sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(sys.argv[1]) for f in fs)
size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(sys.argv[1]) for f in fs)
print(json.dumps({"create_s": t, "disk": disk, "size": size,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def create_cost(root: Path, capacity: int) -> None:
    """Time, disk and peak RSS of creating an empty prioritized store (a fresh process)."""
    path = root / f"create_{capacity}"
    shutil.rmtree(path, ignore_errors=True)
    base = float(run_python(IMPORT_RSS.replace("RssAnon:", "VmHWM:")))
    res = json.loads(run_python(CREATE, str(path), str(capacity)))
    shutil.rmtree(path, ignore_errors=True)
    print(f"mb.create(capacity={capacity:,}, priorities=...): {res['create_s']:.3f} s, "
          f"{res['disk'] / 2**20:.1f} MiB of disk allocated (files' apparent size "
          f"{res['size'] / 2**30:.1f} GiB), peak RSS {res['peak_rss']:.0f} MiB "
          f"(a process that only imports torch and mmbuffer: {base:.0f} MiB)\n")


IMPORT_RSS = "import torch, mmbuffer\nprint([int(l.split()[1]) / 1024 for l in open('/proc/self/status') if l.startswith('RssAnon:')][0])"


def store_for(code: Path, path: Path) -> Path:
    """``path``, or for code that cannot open its format version (code from before
    format 5 and a store of version 5) a copy beside it rewritten as version 4 (its
    priority log empty: the store was closed), made once: the older code then writes
    its own store."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    readable = json.loads(subprocess.run([sys.executable, "-c", "import json; from mmbuffer._disk import format as f; "
                                          "print(json.dumps(list(f.READABLE_VERSIONS)))"],
                                         capture_output=True, text=True, check=True, env=env).stdout)
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest["format_version"] in readable:
        return path
    old = path.with_name(path.name + f"_v{max(readable)}")
    if not (old / "manifest.json").exists():
        shutil.rmtree(old, ignore_errors=True)
        subprocess.run(["cp", "-a", "--sparse=always", str(path), str(old)], check=True)
        assert manifest.get("priority_log", {"bytes": 0})["bytes"] == 0, "a store with a non-empty log"
        manifest.pop("priority_log", None)
        manifest["format_version"] = max(readable)
        (old / "manifest.json").write_text(json.dumps(manifest))
    return old


def run_worker(code: Path, *args: str) -> str:
    """Run ``WORKER`` in a fresh interpreter importing mmbuffer from ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", WORKER, *args], capture_output=True, text=True, check=True, env=env)
    return out.stdout


def slices(root: Path, capacities: list[int], reps: int) -> None:
    """Prioritized slices when the priority mass sits on rows that cannot start a window."""
    import torch

    L, rows = 64, []
    for cap in capacities:
        for ep_len in (1000, 100):
            path = root / f"pslices_{cap}_{ep_len}"
            shutil.rmtree(path, ignore_errors=True)
            with mb.create(path, {"x": ((), "uint8")}, capacity=cap, next_keys=(),
                           priorities=mb.PriorityConfig(alpha=1.0, eps=0.0)) as buf:
                for lo in range(0, cap, BLOCK):
                    ids = np.arange(lo, min(lo + BLOCK, cap))
                    buf.extend({"x": np.zeros(len(ids), np.uint8), "truncated": ids % ep_len == ep_len - 1})
                ids = np.arange(cap)
                tail = ids % ep_len > ep_len - L  # no window of L rows starts there
                for share in (0.9, 0.3, 0.01):
                    p = np.where(tail, 1.0, share / (1 - share) * tail.sum() / (~tail).sum())
                    buf.set_leaf_priorities(ids, p.astype(np.float32))
                    g = torch.Generator().manual_seed(0)
                    t_s, t_t = [], []
                    for i in range(reps + 5):
                        t0 = time.perf_counter()
                        buf.slice_indices(256, L, True, g, prioritized=True)
                        t1 = time.perf_counter()
                        buf.sample_indices(256, g, prioritized=True)
                        if i >= 5:
                            t_s.append(t1 - t0)
                            t_t.append(time.perf_counter() - t1)
                    row = {"capacity": cap, "episodes": cap // ep_len, "valid mass share": share,
                           "slices idx ms": float(np.median(t_s)) * 1e3,
                           "p90 slices ms": float(np.percentile(t_s, 90)) * 1e3,
                           "transitions idx ms": float(np.median(t_t)) * 1e3}
                    rows.append(row)
                    print(json.dumps(row))
            shutil.rmtree(path, ignore_errors=True)
    print()
    table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capacities", type=counts, default="1e6,1e8,6e8", help="store capacities, comma-separated")
    parser.add_argument("--reps", type=int, default=500, help="timed calls per measurement")
    parser.add_argument("--seconds", type=float, default=45.0, help="steady-state sample+update loop per capacity")
    parser.add_argument("--torchrl-max", type=count, default=100_000_000, help="largest capacity run against TorchRL")
    parser.add_argument("--slices", action="store_true", help="prioritized slices under low acceptance instead")
    parser.add_argument("--rounds", type=int, default=1, help="alternate mmbuffer and TorchRL this many times")
    parser.add_argument("--commit-every", type=int, default=0, help="commit every N sample+update steps "
                        "(0: never); the commits are timed apart, the steps after them are in the step times")
    parser.add_argument("--create-capacity", type=float, default=3e9, help="0: skip the create measurement")
    parser.add_argument("--code", type=Path, action="append", help="a folder holding the mmbuffer package to "
                        "run the worker with (repeatable; default: this checkout)")
    args = parser.parse_args()
    codes = [c.resolve() for c in (args.code or [Path(__file__).resolve().parents[1]])]
    root = scratch()
    header("bench_priority")
    print(writeback_settings() + "\n")
    if args.slices:
        slices(root, args.capacities, min(args.reps, 50))
        return
    if args.create_capacity:
        create_cost(root, int(args.create_capacity))
    base_rss = float(run_python(IMPORT_RSS))
    print(f"anonymous RSS of a process that only imported torch and mmbuffer: {base_rss:.0f} MiB\n")
    rows = []
    for cap in args.capacities:
        free = shutil.disk_usage(root).free
        need = cap * (3 + tree.nbytes(cap) / cap) * 1.2
        if free < need:
            print(f"skipping {cap:,}: {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")
            continue
        path = root / f"priority_{cap}"
        built = build(path, cap)
        rounds = args.rounds if cap <= args.torchrl_max else 1
        for r in range(rounds):
            trl_t = trl.prioritized_sampler_times(cap, 256, reps=50) if cap <= args.torchrl_max else None
            for code in codes:
                at = store_for(code, path)
                drop_file_cache(at / "priority")
                res = json.loads(run_worker(code, str(at), str(args.reps), str(args.seconds), str(args.commit_every)))
                row = {
                    "capacity": cap,
                    "round": r + 1,
                    "code": res["code"].removesuffix("/mmbuffer/__init__.py"),
                    "build s": built,
                    "tree B/row": tree.nbytes(cap) / cap,
                    "open ms": res["open"] * 1e3,
                    "first 50 samples idx ms": res["cold_index"] * 1e3,
                    "warm s": res["warm"],
                    "steps": res["steps"],
                    "sample idx ms": res["index"] * 1e3,
                    "p90 idx ms": res["p90_index"] * 1e3,
                    "sample+gather ms": res["total"] * 1e3,
                    "update ms": res["update"] * 1e3,
                    "p90 update ms": res["p90_update"] * 1e3,
                    "commit every": args.commit_every or "never",
                    "commit ms (median)": res["commit"] * 1e3,
                    "commit ms (mean, checkpoints incl.)": res.get("commit_mean", res["commit"]) * 1e3,
                    "commit ms (max)": res.get("commit_max", float("nan")) * 1e3,
                    "commits": res.get("commits", 0),
                    "checkpoints": res.get("checkpoints", 0),
                    "final checkpoint ms": res.get("final_checkpoint", 0.0) * 1e3,
                    "page faults / step": res["faults_per_step"],
                    "dirty + writeback MiB (machine)": res["dirty_mib"],
                    "lower max ms": res["update_max"] * 1e3,
                    "RSS MiB": res["rss"],
                    "anon RSS - imports MiB": res["anon"] - base_rss,
                    "file-backed RSS MiB": res["file"],
                }
                step = res["index"] + res["update"]
                share = res.get("commit_mean", res["commit"])  # every commit's cost, checkpoints included
                with_commits = step + (share / args.commit_every if args.commit_every else 0.0)
                row["step incl. commit share ms"] = with_commits * 1e3
                if trl_t is not None:
                    t = trl_t
                    row["torchrl sample ms"] = t["sample_index_s"] * 1e3
                    row["torchrl update ms"] = t["update_s"] * 1e3
                    row["torchrl lower-max ms"] = t.get("update_touching_max_s", float("nan")) * 1e3
                    row["torchrl RSS MiB"] = t["rss_bytes"] / 2**20
                    row["x TorchRL (sample+update)"] = (t["sample_index_s"] + t["update_s"]) / step
                    row["x TorchRL incl. commit share"] = (t["sample_index_s"] + t["update_s"]) / with_commits
                elif cap <= args.torchrl_max:
                    print("torchrl not installed")
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    table(rows)


if __name__ == "__main__":
    main()
