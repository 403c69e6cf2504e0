"""Remote sampling against the transport's ceiling, and a new reader's cold start by store size.

On an S3-compatible server on loopback (moto's server mode, started here), in one run:

* **sampling vs a plain GET** (``--rows`` rows, obs 17 float32, action 6, reward, published
  zstd, the ``bench_remote.py`` store): a reader with an empty cache (``cache_dir`` new, cache
  cold) draws ``--batches`` x ``sample_slices(B, L)``, exact (``pool=None``: chunks fetched on
  demand) and through the default pool (the first fill: ``pool.advance()``); its figure is the
  bytes of the objects it fetched (what landed in ``cache_dir/objects``) per second of
  sampling. The baseline fetches the *same* objects from the same server with fsspec: one
  ranged GET each (``cat_file(path, start=0, end=size)``), one whole-object GET each
  (``cat_file(path)``), both one after the other as the sampler asks, and all at once
  (``fs.cat(paths)``, concurrent). Contender and baselines alternate ``--repeats`` times. Beside
  each, the CPU seconds of the reader (or of this process's GETs one by one) and of the server
  process: moto and the s3fs client each spend ~2.5 ms of CPU a request, whatever its size.
  The server runs in a process of its own; each reader runs in a fresh process (its kernels
  loaded on a small local store before the clock starts), so ``--base PATH`` (another checkout,
  e.g. ``git worktree add /tmp/base main``) runs that tree's reader against the same server,
  alternating with this one's; the GETs run in this process.
* **codec columns** (``--codec-rows``, 84x84 uint8 frames, zstd): ``sample(32, stack 4)`` from
  the published store against the local one, alternating (host cache warm), and its first
  call with the cache cold.
* **cold start** at each of ``--sizes`` (default 1e5 and 1e6 rows): ``mb.open(url)`` with a
  new ``cache_dir``, then the first ``sample_slices(B, L)``; exact and with the default pool;
  the bytes it fetched before the first sample (mirror + objects).

* **refresh beside sampling** (``--part refresh``, ``--refresh-rows`` rows of the same columns,
  default pool): a learner thread draws ``sample_slices(B, L)`` back to back; the reader moves
  from snapshot 1 to snapshot 2 (1% new rows) while it samples: ``refresh()`` in a second thread
  ("thread"), ``refresh(wait=False)`` polled by the learner between draws ("poll"), or
  ``refresh()`` called by the learner itself ("learner", a single thread that waits). The sample
  latencies (p50/p99/max) from the refresh's start to 20 draws after it returned are set against
  those of the same number of draws just before, without a refresh (same reader, same run); with
  the time the refresh took, and the bytes it fetched (mirror + chunk objects, through the pool's
  refill) against those of the reader's cold open (open + first fill). ``--code DIR`` (repeated)
  runs each reader in a fresh interpreter importing mmbuffer from ``DIR`` (e.g. a checkout of the
  previous commit: before/after in one run, codes and repeats alternating); the reader's cache is
  new each run (cold), the page cache warm.

moto is a Python server: its throughput, not S3's, bounds every figure here.
Run: ``python benchmarks/bench_remote_ceiling.py [--rows 1e6] [--sizes 1e5,1e6]``;
``python benchmarks/bench_remote_ceiling.py --part refresh --code /tmp/base --code .``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

if "--refresh-worker" not in sys.argv:  # a worker imports mmbuffer from its PYTHONPATH (--code)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mmbuffer as mb  # noqa: E402
from _common import count, counts  # noqa: E402
from bench_remote import build  # noqa: E402


def tree_bytes(path: Path) -> int:
    """The disk the files under ``path`` take, as the host cache counts it (a rebuilt index
    is a sparse file: its holes do not count)."""
    from mmbuffer.remote._cache import disk_bytes

    return sum(disk_bytes(os.lstat(os.path.join(r, f))) for r, _, fs in os.walk(path) for f in fs) if path.exists() else 0


def mirror_bytes(cache: Path) -> int:
    """The disk the snapshot mirrors under ``cache`` take (not the chunk objects, nor a pool's block files)."""
    return sum(tree_bytes(root / entry) for root in cache.iterdir() if root.is_dir() and root.name not in ("objects", "locks")
               for entry in os.listdir(root) if not entry.startswith("pool-"))


_CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
import mmbuffer as mb
url, cache, batches, b, length, pool = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:7])
with tempfile.TemporaryDirectory() as d:  # the compiled kernels loaded before the clock starts
    with mb.create(Path(d) / "w", {"x": ((), "float32")}, capacity=256) as w:
        w.extend({"x": np.arange(200), "terminated": np.arange(200) % 50 == 49})
        w.sample_slices(8, length, generator=torch.Generator().manual_seed(0))
size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0
ro = mb.open(url, mode="r", cache_dir=cache, pool="default" if pool else None)
g = torch.Generator().manual_seed(1)
before = size(cache / "objects")
cpu0 = time.process_time()
t0 = time.perf_counter()
if pool:
    ro.remote.pool.advance()  # the first fill, fetched in order
for _ in range(batches):
    ro.sample_slices(b, length, generator=g)
sec = time.perf_counter() - t0
cpu = time.process_time() - cpu0
got = size(cache / "objects") - before
held = {p.name for p in (cache / "objects").rglob("*") if p.is_file()}
table = ro.remote.table
names = [f"{table.holder(rel)}/{rel}" for rel, (_, key) in table.entries.items() if key in held]
ro.close()
print(json.dumps({"sec": sec, "cpu": cpu, "bytes": got, "names": names}))
"""

_SERVER = r"""
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def server_process(pids: list[int] | None = None) -> Iterator[str]:
    """moto's S3 server in a process of its own (not sharing this one's GIL); the ``AWS_*``
    environment pointed at it; yields the endpoint (its pid appended to ``pids``)."""
    from s3server import aws_env

    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    if pids is not None:
        pids.append(proc.pid)
    try:
        with aws_env(proc.stdout.readline().strip()) as endpoint:
            yield endpoint
    finally:
        proc.stdin.close()
        proc.wait(30)


def _path_first(code: Path) -> str:
    """``PYTHONPATH`` with ``code`` first (its mmbuffer is imported; the rest keeps packages
    installed there, as on a host without the project installed)."""
    return os.pathsep.join([str(code), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (0.0 without one)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample_child(code: Path, url: str, cache: Path, batches: int, b: int, length: int,
                 pool: bool) -> tuple[float, float, int, list[str]]:
    """In a fresh process importing mmbuffer from ``code`` (a checkout), with an empty cache: seconds
    of ``batches`` x ``sample_slices(b, length)`` (with ``pool``: after the pool's first fill), the
    reader's CPU seconds over them, bytes of the objects fetched (what landed in ``cache/objects``),
    and their names."""
    out = subprocess.run([sys.executable, "-c", _CHILD, url, str(cache), str(batches), str(b), str(length),
                          str(int(pool))], env={**os.environ, "PYTHONPATH": _path_first(code)}, capture_output=True,
                         text=True, check=False, cwd=code)  # cwd: "-c" puts it first on sys.path
    if out.returncode:
        raise RuntimeError(f"the reader of {code} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["sec"]), float(got["cpu"]), int(got["bytes"]), list(got["names"])


def gets(fs: object, root: str, names: list[str], server: int | None = None,
         cpu: dict[str, list[tuple[float, float]]] | None = None) -> dict[str, float]:
    """Seconds to fetch ``names`` with plain GETs: ranged, whole, and all at once (whole, ranged);
    with ``cpu``, the client's and the ``server`` process's CPU seconds over the ranged GETs one
    by one appended to it."""
    paths = [f"{root}/snapshots/{n}" for n in names]
    sizes = {p: fs.size(p) for p in paths}  # type: ignore[attr-defined]
    out = {}
    own, theirs, t0 = time.process_time(), cpu_seconds(server), time.perf_counter()
    for p in paths:
        fs.cat_file(p, start=0, end=sizes[p])  # type: ignore[attr-defined]
    out["ranged GET, one by one"] = time.perf_counter() - t0
    if cpu is not None:
        cpu.setdefault("ranged GET, one by one", []).append((time.process_time() - own, cpu_seconds(server) - theirs))
    t0 = time.perf_counter()
    for p in paths:
        fs.cat_file(p)  # type: ignore[attr-defined]
    out["whole-object GET, one by one"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fs.cat(paths)  # type: ignore[attr-defined]
    out["whole-object GETs, concurrent (fs.cat)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fs.cat_ranges(paths, [0] * len(paths), [sizes[p] for p in paths])  # type: ignore[attr-defined]
    out["ranged GETs, concurrent (fs.cat_ranges)"] = time.perf_counter() - t0
    return out


def cold_start(url: str, cache: Path, b: int, length: int, pool: bool) -> tuple[float, float, float, int, int, int]:
    """With an empty cache: seconds to open, from open to the end of a first ``sample_slices(1, L)``
    and of a first ``sample_slices(B, L)``; bytes of the mirror (small parts) after the first
    slice and at the end, and of the objects fetched."""
    t0 = time.perf_counter()
    ro = mb.open(url, mode="r", cache_dir=cache, pool="default" if pool else None)
    opened = time.perf_counter() - t0
    ro.sample_slices(1, length, generator=torch.Generator().manual_seed(0))
    one = time.perf_counter() - t0
    first = mirror_bytes(cache)
    ro.sample_slices(b, length, generator=torch.Generator().manual_seed(1))
    full = time.perf_counter() - t0
    ro.close()
    return opened, one, full, first, mirror_bytes(cache), tree_bytes(cache / "objects")


def codec_sampling(tmp: Path, endpoint: str, rows: int, reps: int) -> None:
    """``sample(32, stack={"frames": 4})`` from a zstd 84x84 column: local store against the
    published one (``pool=None``: shard objects mapped from the host cache, decoded by the
    local reader's kernels), alternating; the remote one first with its cache cold."""
    from s3server import new_bucket

    local = tmp / "pixels"
    with mb.create(local, {"frames": mb.Column((84, 84), "uint8", codec="zstd"), "action": ((), "int64")},
                   capacity=rows, next_keys=("frames",)) as buf:
        step = np.arange(rows)
        img = np.zeros((rows, 84, 84), np.uint8)
        img[:, 70:74, 20:64] = 200
        img[np.arange(rows), 14 + step % 50, 4 + (step * 3) % 76] = 255
        img[:, 0, 0] = step % 251
        done = step % 500 == 499
        buf.extend({"frames": img, "action": step % 6, "terminated": done},
                   final_obs={"frames": np.zeros((int(done.sum()), 84, 84), np.uint8)})
    url = f"s3://{new_bucket(endpoint)}/pixels"
    mb.convert.publish(local, url, progress=False)
    lo = mb.open(local, mode="r")
    ro = mb.open(url, mode="r", cache_dir=tmp / "pixels-cache", pool=None)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # the kernels loaded, the local decode cache warm
        lo.sample(256, g, stack={"frames": 4})
    t0 = time.perf_counter()
    ro.sample(32, g, stack={"frames": 4})
    cold = time.perf_counter() - t0
    for _ in range(50):  # every shard object in the host cache and mapped
        ro.sample(256, g, stack={"frames": 4})
    times: dict[str, list[float]] = {"local": [], "remote": []}
    for _ in range(reps):
        for name, buf in (("local", lo), ("remote", ro)):
            t0 = time.perf_counter()
            for _ in range(20):
                buf.sample(32, g, stack={"frames": 4})
            times[name].append((time.perf_counter() - t0) / 20)
    loc, rem = statistics.median(times["local"]), statistics.median(times["remote"])
    print(f"\nzstd 84x84 frames, {rows:,} rows: sample(32, stack 4) local {loc * 1e3:.2f} ms, remote (host cache "
          f"warm) {rem * 1e3:.2f} ms ({rem / loc:.2f}x local); remote first call, cache cold: {cold * 1e3:.0f} ms")
    lo.close(), ro.close()


def refresh_worker(spec: dict) -> dict:
    """One reader on snapshot 1 of ``spec["url"]`` moving to snapshot 2 while it samples (``--part refresh``)."""
    from mmbuffer.remote import PoolConfig, RemoteSource

    cache, cur = Path(spec["cache"]), [spec["p1"]]
    src = RemoteSource(spec["url"], cache_dir=cache, pool=PoolConfig(), pointer=lambda: cur[0])
    ro = mb.Buffer(spec["url"], "r", source=src)
    g, b, length, n = torch.Generator().manual_seed(0), spec["batch"], spec["slice_len"], spec["draws"]

    def one() -> float:
        t = time.perf_counter()
        ro.sample_slices(b, length, generator=g)
        return time.perf_counter() - t

    one()  # the pool's first fill
    cold = src.files.mirror_bytes + tree_bytes(cache / "objects")
    for _ in range(10):
        one()
    base = [one() for _ in range(n)]
    cur[0] = spec["p2"]
    mirror0, objects0 = src.files.mirror_bytes, tree_bytes(cache / "objects")
    lat: list[float] = []
    t0 = time.perf_counter()
    if spec["mode"] == "thread":
        took: list[float] = []
        th = threading.Thread(target=lambda: (ro.refresh(), took.append(time.perf_counter() - t0)))
        th.start()
        while th.is_alive():
            lat.append(one())
        th.join()
        sec = took[0]
    elif spec["mode"] == "poll":
        while not ro.refresh(wait=False):
            lat.append(one())
        sec = time.perf_counter() - t0
    else:  # the learner calls refresh() itself: its draw waits for it
        ro.refresh()
        sec = time.perf_counter() - t0
        lat.append(sec + one())
    lat += [one() for _ in range(20)]
    assert src.sequence == spec["p2"]["sequence"], "the reader did not move"
    mirror = src.files.mirror_bytes - mirror0
    fetched = mirror + tree_bytes(cache / "objects") - objects0
    ro.close()

    def stats(v: list[float]) -> list[float]:
        return [float(np.percentile(v, 50)) * 1e3, float(np.percentile(v, 99)) * 1e3, max(v) * 1e3]

    return {"base": stats(base), "during": stats(lat),
            "draws": len(lat), "refresh_s": sec, "fetched": fetched, "mirror": mirror,
            "cold": cold}


def refresh_part(tmp: Path, endpoint: str, args: argparse.Namespace) -> None:
    """Publish snapshot 1 and 2 (1% new rows), then alternate codes and modes (``refresh_worker``)."""
    import fsspec

    from s3server import new_bucket

    rows, episode = args.refresh_rows, args.episode
    local, url = tmp / "refresh-local", f"s3://{new_bucket(endpoint)}/refresh"
    fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False)
    rng = np.random.default_rng(0)
    pointers = []
    with mb.create(local, {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32")},
                   capacity=rows + rows // 50 + episode) as buf:
        for n in (rows, rows // 100):
            t = np.arange(n)
            buf.extend({"obs": rng.standard_normal((n, 17), dtype=np.float32),
                        "action": rng.standard_normal((n, 6), dtype=np.float32),
                        "reward": rng.standard_normal(n, dtype=np.float32), "terminated": t % episode == episode - 1},
                       final_obs={"obs": np.zeros((int((t % episode == episode - 1).sum()), 17), np.float32)})
            buf.commit()
            mb.convert.copy(local, url, progress=False)
            pointers.append(json.loads(fs.cat_file(url[5:] + "/current.json")))
    codes = [str(c.resolve()) for c in (args.code or [Path(__file__).resolve().parents[1]])]
    runs: dict[tuple[str, str], list[dict]] = {}
    k = 0
    for rep in range(args.repeats):
        for code in codes:
            new = "def refresh(self, wait" in (Path(code) / "mmbuffer/buffer.py").read_text()
            for mode in ("thread", "poll", "learner") if new else ("thread", "learner"):
                k += 1
                spec = {"url": url, "p1": pointers[0], "p2": pointers[1], "cache": str(tmp / f"rcache-{k}"),
                        "batch": args.batch, "slice_len": args.slice_len, "draws": 200, "mode": mode}
                out = subprocess.run([sys.executable, __file__, "--refresh-worker", json.dumps(spec)], check=True,
                                     capture_output=True, text=True,
                                     env={**os.environ, "PYTHONPATH": _path_first(Path(code))})
                res = json.loads(out.stdout.strip().splitlines()[-1])
                runs.setdefault((code, mode), []).append(res)
                print(f"rep {rep} {code} {mode}: {res}")
    print(f"\nrefresh of {rows:,} rows to a snapshot with 1% new rows, default pool, sample_slices({args.batch}, "
          f"{args.slice_len}) in the learner thread; latencies ms (median over {args.repeats} runs)")
    print("| code | refresh | draws during | p50 / p99 / max without | p50 / p99 / max during | refresh (s) | "
          "fetched (MB): mirror + objects | cold open (MB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (code, mode), res in runs.items():
        med = lambda key, i=None: statistics.median(r[key] if i is None else r[key][i] for r in res)  # noqa: E731
        print(f"| {code} | {mode} | {med('draws'):.0f} | {med('base', 0):.2f} / {med('base', 1):.2f} / "
              f"{med('base', 2):.2f} | {med('during', 0):.2f} / {med('during', 1):.2f} / {med('during', 2):.2f} | "
              f"{med('refresh_s'):.2f} | {med('fetched') / 1e6:.2f}: {med('mirror') / 1e6:.2f} + "
              f"{(med('fetched') - med('mirror')) / 1e6:.2f} | {med('cold') / 1e6:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=count, default=1_000_000, help="rows of the store sampled against the GETs")
    ap.add_argument("--sizes", type=counts, default=[100_000, 1_000_000], help="store sizes of the cold start")
    ap.add_argument("--episode", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--slice-len", type=int, default=16)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--part", choices=("all", "ceiling", "cold", "codec", "refresh"), default="all")
    ap.add_argument("--refresh-rows", type=count, default=200_000, help="rows of the store refreshed (--part refresh)")
    ap.add_argument("--code", type=Path, action="append", help="--part refresh: a folder holding the mmbuffer "
                    "package to run the readers with (repeat it to compare; default: this checkout)")
    ap.add_argument("--refresh-worker", help=argparse.SUPPRESS)
    ap.add_argument("--codec-rows", type=count, default=100_000, help="rows of the zstd pixel store (--part codec)")
    ap.add_argument("--base", type=Path, default=None,
                    help="another checkout whose reader alternates with this one's (--part ceiling)")
    ap.add_argument("--server", choices=("process", "inprocess"), default="process",
                    help="moto in a process of its own, or a thread of this one (before 2026-11-26 04:00)")
    args = ap.parse_args()
    if args.refresh_worker:
        print(json.dumps(refresh_worker(json.loads(args.refresh_worker))))
        return
    import fsspec

    from s3server import moto_s3, new_bucket

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    print(f"load before: {open('/proc/loadavg').read().strip()}")
    pids: list[int] = []
    with tempfile.TemporaryDirectory() as tmp, (server_process(pids) if args.server == "process" else moto_s3()) as endpoint:
        server = pids[0] if pids else None  # in this process (``--server inprocess``): not counted apart
        urls: dict[int, str] = {}
        if args.part in ("all", "refresh"):
            refresh_part(Path(tmp), endpoint, args)
        if args.part in ("all", "codec"):
            codec_sampling(Path(tmp), endpoint, args.codec_rows, 2 * args.repeats + 1)
        sizes = set(args.sizes) if args.part in ("all", "cold") else set()
        for rows in sorted(sizes | ({args.rows} if args.part in ("all", "ceiling") else set())):
            build(Path(tmp) / f"local-{rows}", rows, args.episode)
            urls[rows] = f"s3://{new_bucket(endpoint)}/store"
            t0 = time.perf_counter()
            mb.convert.copy(Path(tmp) / f"local-{rows}", urls[rows], progress=False)
            print(f"rows={rows}: published in {time.perf_counter() - t0:.1f} s")
        fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False)
        url, root = urls.get(args.rows, ""), urls.get(args.rows, "")[5:]
        runs: dict[str, list[float]] = {}
        cpu: dict[str, list[tuple[float, float]]] = {}  # CPU seconds: the reader's (or client's), the server's
        n = 0
        codes = [("this tree", Path(__file__).resolve().parents[1])] + ([("base", args.base)] if args.base else [])
        for rep in range(args.repeats if args.part in ("all", "ceiling") else 0):  # contenders and baselines alternate
            for pool in (False, True):
                mode = "default pool, first fill + draws" if pool else "exact (pool=None)"
                for name, code in codes if rep % 2 == 0 else codes[::-1]:
                    n += 1
                    theirs = cpu_seconds(server)  # over the whole child: its open and warm-up too (small)
                    sec, used, got, names = sample_child(code, url, Path(tmp) / f"cache-{n}", args.batches,
                                                         args.batch, args.slice_len, pool)
                    runs.setdefault(f"mb sampling, {mode}, {name}", []).append(got / sec)
                    cpu.setdefault(f"mb sampling, {mode}, {name}", []).append((used, cpu_seconds(server) - theirs))
                    print(f"rep {rep} {mode} {name}: {len(names)} objects, {got / 1e6:.1f} MB in {sec:.2f} s "
                          f"(reader CPU {used:.2f} s)")
                spent: dict[str, list[tuple[float, float]]] = {}
                for what, s in gets(fs, root, names, server, spent).items():
                    runs.setdefault(f"{what} ({mode}'s objects)", []).append(got / s)
                for what, v in spent.items():
                    cpu.setdefault(f"{what} ({mode}'s objects)", []).extend(v)
                print(f"  {open('/proc/loadavg').read().strip()}")
        if runs:
            print(f"\nrows={args.rows}, {args.batches} x sample_slices({args.batch}, {args.slice_len}), cache cold, "
                  f"median of {args.repeats}; server: {args.server}")
            print("| what | MB/s (objects' bytes) | / ranged GET | / whole GET |")
            print("|---|---:|---:|---:|")
        for what, v in runs.items():
            mode = what.split(", ", 1)[1].rsplit(", ", 1)[0] if what.startswith("mb ") else ""
            ranged = runs.get(f"ranged GET, one by one ({mode}'s objects)")
            whole = runs.get(f"whole-object GET, one by one ({mode}'s objects)")
            ratio = (f" | {statistics.median(v) / statistics.median(ranged):.2f} | "
                     f"{statistics.median(v) / statistics.median(whole):.2f}") if ranged and whole else " | | "
            print(f"| {what} | {statistics.median(v) / 1e6:.1f}{ratio} |")
        if cpu:  # a reader with requests in flight against one taking turns with the server
            print(f"\nCPU seconds, median of {args.repeats} (the server's only with --server process)")
            print("| what | reader / client | server |")
            print("|---|---:|---:|")
        for what, pairs in cpu.items():
            print(f"| {what} | {statistics.median(a for a, _ in pairs):.2f} | {statistics.median(b for _, b in pairs):.2f} |")
        if sizes:
            print(f"\n| rows | pool | open (s) | open to 1st sample_slices(1, {args.slice_len}) (s) | open to 1st "
                  f"sample_slices({args.batch}, {args.slice_len}) (s) | mirror on disk after the 1st slice / at the "
                  "end (MB) | objects fetched (MB) |")
            print("|---:|---|---:|---:|---:|---:|---:|")
        for rep in range(args.repeats if args.part in ("all", "cold") else 0):
            for rows in sorted(args.sizes):  # sizes alternate
                for pool in (False, True):
                    n += 1
                    o, one, full, first, mirror, got = cold_start(urls[rows], Path(tmp) / f"cache-{n}", args.batch,
                                                                  args.slice_len, pool)
                    print(f"| {rows:,} | {'default' if pool else 'None'} | {o:.2f} | {one:.2f} | {full:.2f} | "
                          f"{first / 1e6:.1f} / {mirror / 1e6:.1f} | {got / 1e6:.1f} |")
    print(f"load after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
