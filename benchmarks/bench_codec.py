"""Columns with a codec (issue 23 items 1-3) on real ALE frames: disk, decode, sample, extend.

Frames: ``ALE/MsPacman-v5`` through Gymnasium's ``AtariPreprocessing`` (grayscale 84x84,
frame skip 4, no-op starts), a random policy, ``--steps`` transitions (kept in the scratch
directory as ``mspacman_frames.npz`` for the next run). Every figure is taken in one run,
page cache warm (every store read once before timing), medians of interleaved repetitions:

1. the inner-chunk curve: for 1, 2, 4, 8 and 16 rows per inner chunk, bytes per transition
   on disk (shard files over the rows in complete shards) and ``sample(32, stack 4)``;
2. decode: 256 random inner chunks through the batched path (``ShardedArray.read``, one
   compiled call), decoded-chunk cache emptied before each call: frames/s on one core
   (the calling thread's CPU time, ``time.thread_time``, and wall time), against
   python-zstandard's ``multi_decompress_to_buffer`` on the same chunks (extra ``bench``)
   and against the same read served from the cache;
3. ``sample(32)`` and ``sample(32, stack={"pixels": 4})`` from a zstd column against the same
   calls on a raw store of the same frames (decoded-chunk cache warm);
4. per-step ``extend`` (one row per call, a commit every 1,000 rows) into a zstd column
   against a raw one, fresh stores, rows/s;
5. page cache cold: ``sample(32, stack 4)`` from the zstd store against the raw store, each
   timed call preceded by ``Buffer.release_memory()`` (this process's maps and decoded-chunk
   cache dropped) and ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of both stores
   (the guest's page cache; a VM's host may still hold the blocks);
6. ``mb.stream`` with prefetch (4 batches, one worker thread) feeding a training step of
   ``--step-ms`` (busy torch matmuls on one thread, as bench_stream): the consumer's wait in
   ``next()`` per batch and the loop's time per batch, zstd store against raw, alternated.

    python benchmarks/bench_codec.py                 # ~2 min on the dev VM
    python benchmarks/bench_codec.py --steps 2000 --reps 20
    python benchmarks/bench_codec.py --parts 5,6     # only the cold and the stream figures
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header, scratch, table

import mmbuffer as mb
from mmbuffer._disk.columns import sharding

FRAME = (84, 84)
ROW = 84 * 84


def frames(path: Path, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(frames [steps, 84, 84], episode ends [steps], final frames [episodes, 84, 84]) of MsPacman."""
    cached = path / f"mspacman_frames_{steps}.npz"
    if cached.exists():
        z = np.load(cached)
        return z["obs"], z["done"], z["final"]
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.wrappers.AtariPreprocessing(gym.make("ALE/MsPacman-v5", frameskip=1), frame_skip=4, screen_size=84,
                                          grayscale_obs=True, noop_max=30)
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    out, done, final = [], [], []
    for _ in range(steps):
        nxt, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        out.append(obs)
        done.append(term or trunc)
        if term or trunc:
            final.append(nxt)
            obs, _ = env.reset()
        else:
            obs = nxt
    env.close()
    if not done[-1]:
        done[-1] = True
        final.append(obs)
    result = np.stack(out), np.array(done), np.stack(final)
    np.savez(cached, obs=result[0], done=result[1], final=result[2])
    return result


def build(path: Path, data: tuple[np.ndarray, np.ndarray, np.ndarray], codec: str | None, *, step: int = 2000) -> mb.Buffer:
    obs, done, final = data
    shutil.rmtree(path, ignore_errors=True)
    col = mb.Column(FRAME, "uint8", codec=codec) if codec else (FRAME, "uint8")
    buf = mb.create(path, {"pixels": col, "action": ((), "int64")}, capacity=len(obs), next_keys=("pixels",))
    ends = np.cumsum(done)
    for lo in range(0, len(obs), step):
        hi = min(lo + step, len(obs))
        first = 0 if lo == 0 else ends[lo - 1]
        buf.extend({"pixels": obs[lo:hi], "action": np.zeros(hi - lo, np.int64), "terminated": done[lo:hi]},
                   final_obs={"pixels": final[first : ends[hi - 1]]})
    buf.commit()
    return buf


def disk_per_row(buf: mb.Buffer) -> tuple[float, int]:
    """Bytes of shard files per row they hold, and the staging area's bytes."""
    col = buf.store.column("pixels")
    root = buf.path / "columns" / "pixels" / "c"
    files = [p for p in root.rglob("*") if p.is_file()]
    shard_bytes = sum(p.stat().st_size for p in files)
    staging = sum(p.stat().st_size for p in (buf.path / "staging").rglob("*") if p.is_file())
    return shard_bytes / (len(files) * col._shard), staging


def timed(fn, reps: int) -> tuple[float, float]:
    """Median wall and thread-CPU seconds of ``fn``."""
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall), statistics.median(cpu)


def interleaved(fns: dict[str, object], reps: int) -> dict[str, float]:
    """Median wall seconds of each function, called in turn ``reps`` times."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def zstandard_baseline(obs: np.ndarray, chunks: np.ndarray, inner: int, reps: int) -> float:
    """Frames/s (thread CPU) of python-zstandard's ``multi_decompress_to_buffer`` decoding the
    same chunks (level 3, one call, no thread pool); NaN when zstandard is not installed."""
    try:
        import zstandard
    except ImportError:
        return float("nan")
    c = zstandard.ZstdCompressor(level=3)
    blobs = [c.compress(obs[i * inner : (i + 1) * inner].tobytes()) for i in chunks.tolist()]
    sizes = np.array([len(b) for b in blobs], np.uint64)
    segments = np.stack([np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64), sizes], 1)
    frames = zstandard.BufferWithSegments(b"".join(blobs), segments.tobytes())
    d = zstandard.ZstdDecompressor()
    out = np.full(len(blobs), inner * ROW, np.uint64).tobytes()
    _, cpu = timed(lambda: d.multi_decompress_to_buffer(frames, decompressed_sizes=out, threads=0), reps)
    return len(blobs) * inner / cpu


def warm(buf: mb.Buffer) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        buf.sample(256, stack={"pixels": 4}, generator=g)
    buf.get(np.arange(len(buf)), keys=["pixels"])


def evict(*bufs: mb.Buffer) -> None:
    """Page cache cold for ``bufs``: this process's maps and decoded chunks dropped, then
    every file's pages dropped from the page cache (``POSIX_FADV_DONTNEED``)."""
    for buf in bufs:
        buf.release_memory()
        for f in buf.path.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def cold(raw: mb.Buffer, z: mb.Buffer, reps: int) -> None:
    """5. ``sample(32, stack 4)`` with the page cache cold, alternated, medians."""
    g = {k: torch.Generator().manual_seed(3) for k in ("raw", "zstd", "raw256", "zstd256")}
    times: dict[str, list[float]] = {k: [] for k in g}
    for _ in range(reps):
        for k, buf in (("raw", raw), ("zstd", z), ("raw256", raw), ("zstd256", z)):
            evict(raw, z)
            t0 = time.perf_counter()
            buf.sample(256 if k.endswith("256") else 32, stack={"pixels": 4}, generator=g[k])
            times[k].append(time.perf_counter() - t0)
    m = {k: statistics.median(v) for k, v in times.items()}
    print("### 5. Sampling, page cache cold (release_memory + POSIX_FADV_DONTNEED on every file before "
          f"each call; median of {reps} alternated)\n")
    table([{"call": name, "zstd ms": m["zstd" + k] * 1e3, "raw ms": m["raw" + k] * 1e3,
            "ratio": m["zstd" + k] / m["raw" + k]} for name, k in (("sample(32, stack 4)", ""),
                                                                   ("sample(256, stack 4)", "256"))])


def streamed(raw: mb.Buffer, z: mb.Buffer, step_ms: float, batches: int, repeats: int) -> None:
    """6. The consumer's wait on ``mb.stream`` (prefetch 4) with a training step, zstd against raw."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_stream import make_step

    torch.set_num_threads(1)
    step = make_step("busy", step_ms)
    rows = []
    for batch in (32, 256):
        waits: dict[str, list[float]] = {"raw": [], "zstd": []}
        loops: dict[str, list[float]] = {"raw": [], "zstd": []}
        for r in range(repeats):
            for name, buf in (("raw", raw), ("zstd", z)) if r % 2 == 0 else (("zstd", z), ("raw", raw)):
                g = torch.Generator().manual_seed(4 + r)
                waited = 0.0
                t0 = time.perf_counter()
                with mb.stream(buf, batch, stack={"pixels": 4}, prefetch=4, num_batches=batches, generator=g) as s:
                    for _ in range(batches):
                        t = time.perf_counter()
                        next(s)
                        waited += time.perf_counter() - t
                        step()
                loops[name].append((time.perf_counter() - t0) / batches)
                waits[name].append(waited / batches)
        w = {k: statistics.median(v) for k, v in waits.items()}
        lp = {k: statistics.median(v) for k, v in loops.items()}
        rows.append({"batch": f"sample({batch}, stack 4)", "zstd wait us/batch": w["zstd"] * 1e6,
                     "raw wait us/batch": w["raw"] * 1e6, "wait ratio": w["zstd"] / w["raw"],
                     "zstd loop ms/batch": lp["zstd"] * 1e3, "raw loop ms/batch": lp["raw"] * 1e3,
                     "loop ratio": lp["zstd"] / lp["raw"]})
    print(f"### 6. mb.stream, prefetch 4, training step {step_ms} ms (busy, one thread), {batches} batches, "
          f"median of {repeats} alternated runs, page cache warm\n")
    table(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--parts", default="1,2,3,4,5,6", help="sections to run, e.g. 5,6 (any of 1-4 runs all four)")
    p.add_argument("--step-ms", type=float, default=3.0, help="training step of section 6")
    p.add_argument("--batches", type=int, default=300, help="batches per stream run in section 6")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    root = scratch() / "codec"
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = frames(root, args.steps)
    header(f"Columns with a codec: {len(data[0])} MsPacman frames (84x84 grayscale, random policy, "
           f"{int(data[1].sum())} episodes), page cache warm")
    print(f"frames collected/loaded in {time.perf_counter() - t0:.1f} s\n")

    raw = build(root / "raw", data, None)
    warm(raw)
    if parts & {"5", "6"}:
        z = build(root / "z", data, "zstd")
        if "5" in parts:
            cold(raw, z, max(5, args.reps // 2))
        if "6" in parts:
            warm(raw)
            warm(z)
            streamed(raw, z, args.step_ms, args.batches, max(3, args.reps // 8))
        z.close()
    if not parts & {"1", "2", "3", "4"}:
        raw.close()
        print(f"total {time.perf_counter() - t0:.0f} s")
        return

    # 1. the inner-chunk curve
    curve = []
    default = sharding.INNER_BYTES
    for inner in (1, 2, 4, 8, 16):
        sharding.INNER_BYTES = inner * ROW
        z = build(root / f"z{inner}", data, "zstd")
        assert z.store.column("pixels")._inner == inner
        warm(z)
        per_row, _ = disk_per_row(z)
        g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        t = interleaved({"raw": lambda: raw.sample(32, stack={"pixels": 4}, generator=g1),
                         "zstd": lambda: z.sample(32, stack={"pixels": 4}, generator=g2)}, args.reps)
        col = z.store.column("pixels")
        rng = np.random.default_rng(0)
        rows = (rng.integers(0, len(z) // inner, 256) * inner)[:, None] + np.arange(inner)

        def cold_decode() -> None:
            col._cache.clear()
            col.read(rows.reshape(-1))

        wall, cpu = timed(cold_decode, max(5, args.reps // 4))
        hit_wall, hit_cpu = timed(lambda: col.read(rows.reshape(-1)), max(5, args.reps // 4))
        base = zstandard_baseline(data[0], rows[:, 0] // inner, inner, max(5, args.reps // 4))
        curve.append({"rows/chunk": inner, "B/transition": per_row, "vs raw frame": ROW / per_row,
                      "sample(32,stack4) ms": t["zstd"] * 1e3, "raw ms": t["raw"] * 1e3, "ratio": t["zstd"] / t["raw"],
                      "decode frames/s/core": rows.size / cpu, "(wall)": rows.size / wall,
                      "zstandard multi_decompress frames/s/core": base, "cache hits frames/s/core": rows.size / hit_cpu})
        z.close()
        shutil.rmtree(root / f"z{inner}", ignore_errors=True)
    sharding.INNER_BYTES = default
    print("### 1-2. Inner-chunk curve (shards of up to 64 chunks; decode: 256 random chunks, cache emptied)\n")
    table(curve)

    # 3. sample from the default geometry against raw
    z = build(root / "z", data, "zstd")
    warm(z)
    per_row, staging = disk_per_row(z)
    g = {k: torch.Generator().manual_seed(2) for k in ("r1", "z1", "r4", "z4", "r256", "z256")}
    t = interleaved({
        "r1": lambda: raw.sample(32, generator=g["r1"]), "z1": lambda: z.sample(32, generator=g["z1"]),
        "r4": lambda: raw.sample(32, stack={"pixels": 4}, generator=g["r4"]),
        "z4": lambda: z.sample(32, stack={"pixels": 4}, generator=g["z4"]),
        "r256": lambda: raw.sample(256, stack={"pixels": 4}, generator=g["r256"]),
        "z256": lambda: z.sample(256, stack={"pixels": 4}, generator=g["z256"]),
    }, args.reps)
    print(f"### 3. Sampling, default geometry ({z.store.column('pixels')._inner} rows per inner chunk, "
          f"{z.store.column('pixels')._shard} per shard): {per_row:.0f} B per transition in shard files "
          f"(staging, a fixed {staging / 2**20:.1f} MiB per lane)\n")
    table([{"call": name, "zstd ms": t["z" + k] * 1e3, "raw ms": t["r" + k] * 1e3, "ratio": t["z" + k] / t["r" + k]}
           for name, k in (("sample(32)", "1"), ("sample(32, stack 4)", "4"), ("sample(256, stack 4)", "256"))])
    z.close()
    raw.close()

    # 4. per-step extend
    obs, done, final = data
    n = min(len(obs), 3000)

    def per_step(codec: str | None) -> float:
        path = root / f"step-{codec}"
        shutil.rmtree(path, ignore_errors=True)
        col = mb.Column(FRAME, "uint8", codec=codec) if codec else (FRAME, "uint8")
        buf = mb.create(path, {"pixels": col, "action": ((), "int64")}, capacity=4096, next_keys=("pixels",))
        fi = 0
        t0 = time.perf_counter()
        for i in range(n):
            d = bool(done[i])
            buf.extend({"pixels": obs[i : i + 1], "action": [0], "terminated": [d]},
                       final_obs={"pixels": final[fi : fi + d]})
            fi += d
            if i % 1000 == 999:
                buf.commit()
        buf.close()
        dt = time.perf_counter() - t0
        shutil.rmtree(path, ignore_errors=True)
        return n / dt

    rates: dict[str, list[float]] = {"raw": [], "zstd": []}
    for _ in range(3):
        rates["raw"].append(per_step(None))
        rates["zstd"].append(per_step("zstd"))
    r, zr = statistics.median(rates["raw"]), statistics.median(rates["zstd"])
    print(f"### 4. Per-step extend ({n} rows, one per call, commit every 1,000; median of 3 alternated, fresh files)\n")
    table([{"column": "zstd", "rows/s": zr, "raw rows/s": r, "ratio": zr / r}])
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
