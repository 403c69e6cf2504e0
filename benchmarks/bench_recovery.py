"""What a SIGKILL costs: committed rows lost, and reopen + first prioritized sample.

A prioritized store of ``--rows`` rows of capacity (one stream) is filled past its
capacity in blocks of 1000-row episodes, committing every block, so the ring has
wrapped. A child process then opens it, updates 100,000 priorities, extends 2,000
rows, reports, and is SIGKILLed (the issue-22 scenario). Measured in a fresh
process, with the store's pages dropped from the page cache first (each file
fdatasync'ed, then ``POSIX_FADV_DONTNEED``: the store only, not the machine's cache):
the time of ``mb.open`` (recovery included) and of the first ``sample(32, prioritized=True)``,
in a process that has imported torch and loaded the kernels (a tiny store's prioritized
sample) before the clock starts (``--no-preload``: from process start, import of torch and
numba's kernel load included), and the committed rows still live against the rows the last
commit held. ``--fill N`` writes N rows instead of 1.25 x ``--rows`` (a sparse store: the
capacity's tree, N rows of it live). ``--code DIR`` runs the writer, the kill and the reopen with
the ``mmbuffer`` package found in ``DIR`` (a checkout of another commit: ``git archive
REV mmbuffer | tar -x -C DIR``), so a baseline is measured in the same run.

``--log-commits N``: the child then makes N commits of 25,600 updated priorities each
before the kill (with the priority log, format 5: a log of ~300 KB per commit, replayed
at the reopen); a reader process opened before the reopen reports its first prioritized
sample's time (the log's replay) and the anonymous memory that replay added.

Also the cost per ``extend`` of one row (the writer's hot path), median of 5 runs of
20,000 extends, for the same code.

    python benchmarks/bench_recovery.py --rows 1e8 --code /tmp/before --code .
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, header, table  # noqa: E402

FILL = """
import sys, numpy as np, mmbuffer as mb
path, rows, fill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = mb.create(path, {"x": ((), "int64")}, capacity=rows, next_keys=(), priorities=mb.PriorityConfig())
block = min(1_000_000, max(fill // 4, 1000))
done = np.arange(block) % 1000 == 999
w = 0
while w < fill:
    buf.extend({"x": w + np.arange(block), "terminated": done})
    buf.commit()
    w += block
buf.close()
"""

KILLED = """
import os, sys, time, numpy as np, mmbuffer as mb
path = sys.argv[1]
buf = mb.open(path)
rng = np.random.default_rng(0)
b = buf.sample(100_000)
buf.update_priorities(b, rng.random(100_000) + 0.5)
w = int(buf.view().written[0])
buf.extend({"x": w + np.arange(2000), "terminated": np.arange(2000) % 1000 == 999})
for _ in range(int(sys.argv[2])):  # --log-commits: PER-like commits of 25,600 priorities each
    b = buf.sample(25_600)
    buf.update_priorities(b, rng.random(25_600) + 0.5)
    buf.commit()
print("ready", flush=True)
time.sleep(600)
"""

REOPEN = """
import json, sys, tempfile, time
t0 = time.perf_counter()
import numpy as np, torch, mmbuffer as mb
if sys.argv[2] == "preload":  # torch imported and the kernels loaded (a tiny store's sample) before the clock
    with mb.create(tempfile.mkdtemp() + "/t", {"x": ((), "int64")}, capacity=4096, next_keys=(),
                   priorities=mb.PriorityConfig()) as tiny:
        tiny.extend({"x": np.arange(3000), "terminated": np.arange(3000) % 100 == 99})
        tiny.update_priorities(tiny.sample(32), np.ones(32))
        tiny.commit()
        tiny.sample(32, prioritized=True)
t1 = time.perf_counter()
buf = mb.open(sys.argv[1])
t2 = time.perf_counter()
buf.sample(32, prioritized=True)
t3 = time.perf_counter()
print(json.dumps({"before open s": t1 - t0, "open s": t2 - t1, "first prioritized sample s": t3 - t2,
                  "live rows": len(buf), "code": mb.__file__}))
buf.close()
"""

READER = """
import json, sys, time
import numpy as np, torch, mmbuffer as mb
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) / 1024
ro = mb.open(sys.argv[1], mode="r")
ro.sample(32)  # uniform: reads no priority log
a0 = anon()
t0 = time.perf_counter()
ro.sample(32, prioritized=True)  # the first prioritized use replays the committed log
t1 = time.perf_counter()
print(json.dumps({"reader first PER sample s": t1 - t0, "reader anon MiB added": anon() - a0}))
"""

EXTEND = """
import sys, tempfile, time, numpy as np, mmbuffer as mb
buf = mb.create(tempfile.mkdtemp() + "/e", {"x": ((), "int64")}, capacity=1 << 20, next_keys=())
one = {"x": np.zeros(1, np.int64)}
out = []
for _ in range(6):
    t0 = time.perf_counter()
    for _ in range(20_000):
        buf.extend(one)
    out.append((time.perf_counter() - t0) / 20_000)
    buf.commit()
print(sorted(out[1:])[2])
"""


def run(code: Path, script: str, *args: object, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                          check=True, cwd=tempfile.gettempdir(), **kw)  # not this checkout's folder: "" leads sys.path


def drop_store_cache(path: Path) -> None:
    for dirpath, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def committed_rows(code: Path, path: Path) -> dict[str, int]:
    """The last commit's rows (from the manifest) and what the reservation window keeps."""
    script = """
import json, sys, numpy as np
from pathlib import Path
from mmbuffer._ledger import index
import mmbuffer as mb
with mb.open(sys.argv[1], mode="r") as ro:
    st, n = ro.store.ledger.lanes[0], ro.lane_size
    starts, lengths = index.starts_lengths(ro.store.ends, 0, n, st)
    floor = int(ro.reservation()[0]) - n
    print(json.dumps({"committed rows": int(lengths.sum()),
                      "window keeps": int(lengths[starts >= floor].sum())}))
"""
    return json.loads(run(code, script, path).stdout)


def one(code: Path, rows: int, tmp: Path, warm: bool, fill: int, preload: bool, log_commits: int = 0) -> dict[str, object]:
    path = tmp / f"s{abs(hash(str(code))) % 10_000}"
    t0 = time.perf_counter()
    run(code, FILL, path, rows, fill)
    fill_s = time.perf_counter() - t0
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path), str(log_commits)], env={**os.environ, "PYTHONPATH": str(code)},
                            stdout=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = committed_rows(code, path)
    log = json.loads((path / "manifest.json").read_text()).get("priority_log", {"bytes": 0})["bytes"]
    if not warm:
        drop_store_cache(path)
    reader = json.loads(run(code, READER, path).stdout)
    if not warm:
        drop_store_cache(path)
    out = json.loads(run(code, REOPEN, path, "preload" if preload else "cold").stdout)
    extend_us = float(run(code, EXTEND).stdout) * 1e6
    lost = before["committed rows"] - out["live rows"]
    assert out["code"].startswith(str(code)), (out["code"], code)  # the code asked for ran
    return {"code": str(code), "rows": rows, "rows written": fill, "cache": "warm" if warm else "cold",
            "clock from": "mb.open (torch, kernels loaded)" if preload else "process start",
            "fill s": round(fill_s, 1), "commits before the kill": log_commits, "log MiB at the kill": round(log / 2**20, 1),
            **{k: round(v, 3) for k, v in reader.items()}, **before, "import (+ kernel load) s": round(out["before open s"], 3),
            "kept after reopen": out["live rows"], "committed rows lost": lost,
            "open s": round(out["open s"], 3), "first PER sample s": round(out["first prioritized sample s"], 3),
            "open + first sample s": round(out["open s"] + out["first prioritized sample s"], 3),
            "extend(1 row) us": round(extend_us, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=count, default=1_000_000, help="capacity (1e8 notation accepted)")
    p.add_argument("--code", type=Path, action="append", help="a folder holding the mmbuffer package (repeatable)")
    p.add_argument("--warm", action="store_true", help="keep the store's pages cached (a kill and an open at once)")
    p.add_argument("--dir", type=Path, default=None, help="where to put the stores (default: a temporary folder)")
    p.add_argument("--fill", type=count, default=None, help="rows written before the kill (default 1.25 x --rows: "
                   "the ring wrapped); fewer: a sparse store")
    p.add_argument("--log-commits", type=int, default=0, help="commits of 25,600 priorities each the child makes "
                   "before the kill (a priority log of ~300 KB each, 32 MiB by default checkpoints)")
    p.add_argument("--no-preload", action="store_true", help="start the clock at process start (import torch, "
                   "numba's kernel load included), not at mb.open in a process that has both")
    args = p.parse_args()
    fill = args.fill if args.fill is not None else args.rows + args.rows // 4
    codes = [c.resolve() for c in (args.code or [Path(__file__).resolve().parents[1]])]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = [one(code, args.rows, Path(tmp), args.warm, fill, not args.no_preload, args.log_commits) for code in codes]
    header("bench_recovery")
    table(results)


if __name__ == "__main__":
    main()
