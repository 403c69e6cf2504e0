"""Conversion throughput and peak memory: a generated D4RL file into a store.

    python benchmarks/bench_convert.py               # 20M rows (about 2 GB of source)
    python benchmarks/bench_convert.py --rows 1e6    # a quick run

Steps, all in one run on the same disk (``--dir``, default ``$MMBUFFER_BENCH_DIR``
or ``benchmarks/_data``):

1. generate a D4RL-layout HDF5 file (obs and next obs 17 float32, action 6 float32,
   rewards, terminals, timeouts; 1000-step episodes, some terminated early), streamed;
2. *raw disk write*: a ``dd``-style copy of the same file (16 MiB blocks, fsync at
   the end) in a fresh process -- the ceiling of any conversion that writes it;
3. ``mmbuffer.convert.convert_d4rl`` in a fresh process (verification pass on
   and off), reporting rows/s, MB/s of row data, and peak RSS (VmHWM, with its
   anonymous and file-backed parts sampled every 50 ms);
4. TorchRL's in-memory path (the file loaded into a ``LazyTensorStorage`` replay
   buffer, as TorchRL's D4RL loader does) when torchrl is installed.

``--formats`` measures the other readers instead: the same rows written as
``.npz``, a Diffusion Policy Zarr group (v2, blosc, as Diffusion Policy writes
it), a Tianshou ``save_hdf5`` file and a LeRobot v3 parquet dataset, each
converted in a fresh process, with rows/s reported as a ratio to the D4RL
conversion of the same round; and the D4RL conversion into an online layout
(``capacity=2 N, num_streams=8, priorities``) against the plain one. ``--only``
keeps some of them (the plain D4RL conversion stays, as the baseline):

    python benchmarks/bench_convert.py --formats --only lerobot --rows 3e7 --repeat 1

The source file was just written, but a VM may drop idle page cache (the dev VM
pages out unmapped file pages after ~30 s idle), so the source may come from
disk: the raw copies and the conversions read it alike. The write speed of the
dev VM swings 3x from minute to minute, so the measurements run in ``--repeat``
rounds (``sync`` before each measurement): each round runs the raw copy and the
conversions back to back, each conversion is compared with the raw copy of its
own round, and the round with the median ratio is shown, with every round's
ratio and the largest peak memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, header, scratch, table  # noqa: E402

OBS, ACT, EP = 17, 6, 1000


# -- memory sampling (children) ------------------------------------------------------------------
class PeakMemory:
    """Peak VmHWM and peak RssAnon / RssFile+RssShmem of this process, sampled in a thread."""

    def __init__(self, every: float = 0.05) -> None:
        self.every = every
        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _status() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def _sample(self) -> None:
        s = self._status()
        self.anon = max(self.anon, s.get("RssAnon", 0))
        self.file = max(self.file, s.get("RssFile", 0) + s.get("RssShmem", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def report(self) -> dict[str, int]:
        return {"peak_rss": self._status()["VmHWM"], "peak_anon": self.anon, "peak_file": self.file}


# -- the other formats (--formats) ---------------------------------------------------------------
def write_formats(src: Path, work: Path, rows: int, formats: list[str]) -> dict[str, Path]:
    """The D4RL file's rows written in each of ``formats``' layout (streamed)."""
    import h5py

    out = {"d4rl": src}
    with h5py.File(src, "r") as f:
        ends = np.flatnonzero(f["terminals"][()] | f["timeouts"][()]) + 1
        full_ends = np.unique(np.r_[ends, rows]).astype(np.int64)
        for fmt in formats:
            if fmt != "d4rl":
                out[fmt] = WRITERS[fmt](f, work, rows, full_ends)
    return out


def _write_npz(f: Any, work: Path, rows: int, ends: np.ndarray) -> Path:
    """Uncompressed members (np.savez), read with pread."""
    np.savez(work / "src.npz", **{k: f[k][()] for k in ("observations", "next_observations", "actions", "rewards",
                                                         "terminals", "timeouts")})
    return work / "src.npz"


def _write_diffusion_policy(f: Any, work: Path, rows: int, ends: np.ndarray, chunk: int = 1 << 18) -> Path:
    """A Zarr v2 group, data/<key> + meta/episode_ends (zarr's default blosc)."""
    import zarr

    root = zarr.open_group(str(work / "src.zarr"), mode="w", zarr_format=2)
    pairs = (("obs", f["observations"]), ("action", f["actions"]), ("reward", f["rewards"]))
    dp = {k: root.create_array(f"data/{k}", shape=(rows, *a.shape[1:]), dtype=a.dtype, chunks=(chunk, *a.shape[1:]))
          for k, a in pairs}
    for a in range(0, rows, chunk):
        b = min(rows, a + chunk)
        for k, source in pairs:
            dp[k][a:b] = source[a:b]
    root.create_array("meta/episode_ends", data=ends, chunks=(len(ends),))
    return work / "src.zarr"


def _write_tianshou(f: Any, work: Path, rows: int, ends: np.ndarray) -> Path:
    """A full ReplayBuffer(rows).save_hdf5 (_meta group, ring not wrapped)."""
    import h5py

    obs, term, tout = f["observations"], f["terminals"][()], f["timeouts"][()]
    with h5py.File(work / "src_tianshou.hdf5", "w") as g:
        meta = g.create_group("_meta")
        meta.attrs["__data_type__"] = "Batch"
        nxt = f["next_observations"][()]
        for k, v in (("obs", obs[()]), ("act", f["actions"][()]), ("rew", f["rewards"][()]), ("terminated", term),
                     ("truncated", tout), ("done", term | tout), ("obs_next", nxt)):
            meta.create_dataset(k, data=v)
            meta[k].attrs["__data_type__"] = "ndarray"
        g.attrs.update({"maxsize": rows, "_size": rows, "_insertion_idx": 0})
        g["last_index"] = np.array([rows - 1])
    return work / "src_tianshou.hdf5"


def _write_lerobot(f: Any, work: Path, rows: int, ends: np.ndarray, chunk: int = 1 << 18) -> Path:
    """LeRobot v3: data/chunk-000/file-000.parquet (row groups of ``chunk`` frames), meta/episodes, meta/info.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    obs, act, rew = f["observations"], f["actions"], f["rewards"]
    lr = work / "src_lerobot"
    (lr / "data" / "chunk-000").mkdir(parents=True)
    (lr / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    lengths = np.diff(np.r_[0, ends])
    ep_of = np.repeat(np.arange(len(lengths)), lengths)
    schema = pa.schema([("observation.state", pa.list_(pa.float32(), OBS)),
                        ("action", pa.list_(pa.float32(), ACT)), ("next.reward", pa.float32()),
                        ("episode_index", pa.int64()), ("index", pa.int64())])
    with pq.ParquetWriter(lr / "data" / "chunk-000" / "file-000.parquet", schema) as w:
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            w.write_table(pa.table([
                pa.FixedSizeListArray.from_arrays(pa.array(obs[a:b].reshape(-1)), OBS),
                pa.FixedSizeListArray.from_arrays(pa.array(act[a:b].reshape(-1)), ACT),
                pa.array(rew[a:b]), pa.array(ep_of[a:b]), pa.array(np.arange(a, b))], schema=schema))
    pq.write_table(pa.table({"episode_index": np.arange(len(lengths)), "length": lengths}),
                   lr / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    feats = {"observation.state": {"dtype": "float32", "shape": [OBS]},
             "action": {"dtype": "float32", "shape": [ACT]}, "next.reward": {"dtype": "float32", "shape": [1]},
             "episode_index": {"dtype": "int64", "shape": [1]}, "index": {"dtype": "int64", "shape": [1]}}
    (lr / "meta" / "info.json").write_text(json.dumps({
        "codebase_version": "v3.0", "total_episodes": len(lengths), "total_frames": rows, "fps": 10,
        "features": feats}))
    return lr


WRITERS = {"npz": _write_npz, "diffusion_policy": _write_diffusion_policy, "tianshou": _write_tianshou,
           "lerobot": _write_lerobot}


def _format_names(value: str) -> list[str]:
    names = value.split(",")
    if unknown := [n for n in names if n not in ("d4rl", *WRITERS)]:
        raise argparse.ArgumentTypeError(f"expected names among d4rl, {', '.join(WRITERS)}, got {unknown}")
    return names


def child_format(fmt: str, src: str, dst: str, online: bool) -> dict[str, object]:
    import warnings

    import mmbuffer as mb
    from mmbuffer.convert import convert

    layout = {}
    if online:
        layout = {"capacity": 0, "num_streams": 8, "priorities": mb.PriorityConfig(alpha=0.6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            if online:
                from mmbuffer.convert import D4RLReader

                with D4RLReader(src) as r:
                    n = r.schema.num_rows
                layout["capacity"] = 2 * n + (-2 * n) % 8
            s = convert(fmt, src, dst, progress=False, **layout)
            seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": s["rows"], **mem.report()}


def bench_formats(src: Path, work: Path, rows: int, repeat: int, only: list[str] | None) -> None:
    kinds = [("d4rl", False), ("d4rl", True), *((fmt, False) for fmt in WRITERS)]
    if only is not None:  # the D4RL conversion stays: the baseline of every ratio
        kinds = [(fmt, online) for fmt, online in kinds if (fmt, online) == ("d4rl", False) or fmt in only]
    t0 = time.perf_counter()
    sources = write_formats(src, work, rows, [fmt for fmt, _ in kinds])
    print(f"wrote the other formats in {time.perf_counter() - t0:.1f} s\n")
    rounds = []
    for _ in range(repeat):
        r = {}
        for fmt, online in kinds:
            dst = work / "store"
            os.sync()
            r[(fmt, online)] = _child("format", fmt, str(sources[fmt]), str(dst), "1" if online else "0")
            shutil.rmtree(dst, ignore_errors=True)
        base = r[("d4rl", False)]["seconds"]
        for v in r.values():
            v["vs d4rl"] = base / v["seconds"]
        rounds.append(r)
        print("round:", {f"{f}{' online' if o else ''}": f"{v['vs d4rl']:.2f}" for (f, o), v in r.items()})
    results = []
    for fmt, online in kinds:
        runs = sorted((r[(fmt, online)] for r in rounds), key=lambda v: v["vs d4rl"])
        med = runs[len(runs) // 2]
        label = f"convert {fmt}" + (" --capacity 2N --streams 8 --priorities 0.6" if online else "")
        results.append({"path": label, "seconds": med["seconds"], "rows/s": rows / med["seconds"],
                        "vs d4rl (same round)": med["vs d4rl"],
                        "ratios": " ".join(f"{v['vs d4rl']:.2f}" for v in runs),
                        "peak RSS MB": max(v["peak_rss"] for v in runs) / 2**20,
                        "anon MB": max(v["peak_anon"] for v in runs) / 2**20,
                        "file MB": max(v["peak_file"] for v in runs) / 2**20})
    table(results)


# -- steps ---------------------------------------------------------------------------------------
def generate(path: Path, rows: int, chunk: int = 1 << 20) -> float:
    import h5py

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    with h5py.File(path, "w") as f:
        obs = f.create_dataset("observations", (rows, OBS), "float32")
        nxt = f.create_dataset("next_observations", (rows, OBS), "float32")
        act = f.create_dataset("actions", (rows, ACT), "float32")
        rew = f.create_dataset("rewards", (rows,), "float32")
        term = f.create_dataset("terminals", (rows,), "bool")
        tout = f.create_dataset("timeouts", (rows,), "bool")
        ahead = rng.standard_normal(OBS, dtype=np.float32)  # the observation of the chunk's first row
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            n = b - a
            seen = np.vstack([ahead, rng.standard_normal((n, OBS), dtype=np.float32)])  # rows a..b
            ahead = seen[-1]
            act[a:b] = rng.uniform(-1, 1, (n, ACT)).astype(np.float32)
            rew[a:b] = rng.standard_normal(n, dtype=np.float32)
            pos = np.arange(a, b)
            tout[a:b] = timeout = pos % EP == EP - 1
            term[a:b] = done = (pos % 7919 == 0) & ~timeout  # a few early terminations
            # as D4RL's v2 files: the next row's observation inside an episode, its final one at its end
            ends = np.flatnonzero(timeout | done)
            following = seen[1:].copy()
            following[ends] = rng.standard_normal((len(ends), OBS), dtype=np.float32)
            obs[a:b], nxt[a:b] = seen[:-1], following
        f["metadata/algorithm"] = "generated"
    return time.perf_counter() - t0


def dd_copy(src: Path, dst: Path, drop_behind: bool, block: int = 16 << 20) -> dict[str, float]:
    """``dd bs=16M conv=fsync``; with ``drop_behind`` also ``oflag=nocache``: each block
    is written behind and dropped from the page cache a few blocks later, as the
    converter does."""
    buf = bytearray(block)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        off = 0
        while True:
            n = fi.readinto(buf)
            if not n:
                break
            fo.write(view[:n])
            off += n
            if drop_behind:
                lo = max(0, off - 3 * block)
                os.posix_fadvise(fo.fileno(), lo, off - lo, os.POSIX_FADV_DONTNEED)
        os.fsync(fo.fileno())
    return {"seconds": time.perf_counter() - t0, "bytes": dst.stat().st_size}


def child_convert(src: str, dst: str, verify: bool, chunk_rows: int | None) -> dict[str, object]:
    import warnings

    from mmbuffer.convert import convert_d4rl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            s = convert_d4rl(src, dst, progress=False, verify=verify, chunk_rows=chunk_rows)
            seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": s["rows"], "bytes": s["bytes"], "write_seconds": s["write_seconds"],
            "episodes": s["episodes"], **mem.report()}


def child_torchrl(src: str, chunk_rows: int) -> dict[str, object]:
    import h5py
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    with PeakMemory() as mem:
        t0 = time.perf_counter()
        with h5py.File(src, "r") as f:
            n = f["rewards"].shape[0]
            rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n))
            for a in range(0, n, chunk_rows):
                b = min(n, a + chunk_rows)
                t = b - a
                rb.extend(TensorDict({
                    "observation": torch.from_numpy(f["observations"][a:b]),
                    "action": torch.from_numpy(f["actions"][a:b]),
                    "next": {"reward": torch.from_numpy(f["rewards"][a:b]),
                             "terminated": torch.from_numpy(f["terminals"][a:b]),
                             "truncated": torch.from_numpy(f["timeouts"][a:b])},
                }, [t]))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": n, **mem.report()}


def _child(kind: str, *args: str) -> dict[str, object]:
    code = [sys.executable, __file__, "--child", kind, *args]
    env = dict(os.environ, RL_LOGGING_LEVEL="WARNING")
    out = subprocess.run(code, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{kind} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=count, default=20_000_000, help="rows of the generated file (default 20M)")
    p.add_argument("--dir", default=None, help="scratch directory (default $MMBUFFER_BENCH_DIR or benchmarks/_data)")
    p.add_argument("--chunk-rows", type=int, default=None, help="convert_d4rl chunk_rows (default ~32 MiB)")
    p.add_argument("--no-torchrl", action="store_true", help="skip the TorchRL in-memory baseline")
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the median is shown")
    p.add_argument("--keep", action="store_true", help="keep the generated file")
    p.add_argument("--formats", action="store_true",
                   help="measure the other readers (npz, diffusion_policy, tianshou, lerobot) and the online "
                        "layout options against the D4RL conversion, instead of the raw-disk comparison")
    p.add_argument("--only", type=_format_names, default=None, metavar="FORMAT[,FORMAT]",
                   help=f"with --formats: these readers only ({', '.join(WRITERS)}; d4rl for the online layout), "
                        "beside the D4RL conversion every ratio is taken against")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "convert":
            out = child_convert(rest[0], rest[1], rest[2] == "1", int(rest[3]) or None)
        elif kind == "torchrl":
            out = child_torchrl(rest[0], int(rest[1]))
        elif kind == "format":
            out = child_format(rest[0], rest[1], rest[2], rest[3] == "1")
        else:
            out = dd_copy(Path(rest[0]), Path(rest[1]), kind == "dd-nocache")
        print(json.dumps(out))
        return

    rows = int(args.rows)
    root = Path(args.dir) if args.dir else scratch()
    work = root / f"convert_{rows}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "source.hdf5"
    header(f"bench_convert: D4RL HDF5 -> mmbuffer store, {rows:,} rows (obs {OBS} f32, action {ACT} f32)")
    gen = generate(src, rows)
    size = src.stat().st_size
    row_bytes = OBS * 4 + ACT * 4 + 4 + 2
    print(f"generated {src} ({size / 1e9:.2f} GB) in {gen:.1f} s; disk free "
          f"{shutil.disk_usage(work).free / 1e9:.0f} GB\n")
    if args.formats:
        bench_formats(src, work, rows, args.repeat, args.only)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return

    def run(kind: str, *child_args: str, cleanup: Path) -> dict[str, object]:
        os.sync()  # start every measurement with no dirty pages of an earlier step
        out = _child(kind, *child_args)
        if cleanup.is_dir():
            shutil.rmtree(cleanup)
        elif cleanup.exists():
            cleanup.unlink()
        return out

    # The VM's write speed swings 3x between minutes (fresh page-cache pages), so
    # every round measures the raw copy and both conversions back to back, and a
    # conversion's ratio is taken against the raw copy of its own round.
    chunk = str(args.chunk_rows or 0)
    have_torchrl = not args.no_torchrl and importlib.util.find_spec("torchrl") is not None
    rounds: list[dict[str, dict[str, object]]] = []
    for _ in range(args.repeat):
        r = {dd: run(dd, str(src), str(work / "copy.bin"), cleanup=work / "copy.bin") for dd in ("dd", "dd-nocache")}
        for verify in (False, True):
            dst = work / f"store_{int(verify)}"
            r[f"convert{int(verify)}"] = run("convert", str(src), str(dst), "1" if verify else "0", chunk, cleanup=dst)
        if have_torchrl:
            try:
                r["torchrl"] = run("torchrl", str(src), str(1 << 20), cleanup=work / "none")
            except RuntimeError as exc:  # the baseline is optional: report and go on without it
                print(f"torchrl baseline failed: {str(exc)[-500:]}\n")
                have_torchrl = False
        for k, v in r.items():
            v["MB/s"] = v["bytes"] / v["seconds"] / 1e6 if k.startswith("dd") else rows * row_bytes / v["seconds"] / 1e6
        for v in r.values():
            v["vs raw"] = v["MB/s"] / r["dd"]["MB/s"]
            v["vs nocache"] = v["MB/s"] / r["dd-nocache"]["MB/s"]
        rounds.append(r)
        print("round:", {k: f"{v['MB/s']:.0f} MB/s ({v['vs raw']:.2f})" for k, v in r.items()})
    print()

    labels = {"dd": "raw disk write (dd-style copy, fsync)",
              "dd-nocache": "raw disk write, dropped behind (dd oflag=nocache-style)", "convert0": "mmbuffer convert d4rl (no verification)",
              "convert1": "mmbuffer convert d4rl (with verification)", "torchrl": "torchrl LazyTensorStorage (in memory)"}
    results = []
    for key, label in labels.items():
        runs = sorted((r[key] for r in rounds if key in r), key=lambda v: v["vs raw"])
        if not runs:
            continue
        med = runs[len(runs) // 2]  # the round with the median ratio
        res = {"path": label, "seconds": med["seconds"], "rows/s": rows / med["seconds"], "MB/s": med["MB/s"],
               "vs raw": med["vs raw"], "vs nocache": med["vs nocache"],
               "ratios vs raw": " ".join(f"{v['vs raw']:.2f}" for v in runs),
               "ratios vs nocache": " ".join(f"{v['vs nocache']:.2f}" for v in runs)}
        for name, field in (("peak RSS MB", "peak_rss"), ("anon MB", "peak_anon"), ("file MB", "peak_file")):
            res[name] = max(v[field] for v in runs) / 2**20 if field in med else float("nan")
        if key == "convert1":
            res["write only s"] = med["write_seconds"]
        results.append(res)
    for r in results:
        r.setdefault("write only s", float("nan"))
    table(results)
    conv = results[3]
    print(f"conversion with verification: {conv['MB/s']:.0f} MB/s of row data = {conv['vs raw']:.0%} of the raw "
          f"write speed of its round ({results[0]['MB/s']:.0f} MB/s), {conv['vs nocache']:.0%} of a dropped-behind copy's; peak RSS {conv['peak RSS MB']:.0f} MB "
          f"(anonymous {conv['anon MB']:.0f} MB, file-backed maps {conv['file MB']:.0f} MB)")
    print("MB/s counts row bytes (obs, action, reward, two flags); the raw copy moves the whole source file.")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
