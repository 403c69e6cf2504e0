"""The lossy ``jpeg`` codec on camera-like frames (issue 23 item 1, decode target): bytes, error, decode rate.

Frame sets, 224x224 RGB, real content (never noise):

* ``photo``: a camera panning over a real photograph (matplotlib's ``grace_hopper.jpg``,
  a random walk of a 256-pixel window scaled to 224), the camera-like case;
* ``photos``: the same over five photographs that scikit-image ships (astronaut, coffee,
  chelsea, the Middlebury stereo motorcycle, rocket), when scikit-image is installed;
* ``carracing``: Gymnasium's ``CarRacing-v3`` rendered with ``rgb_array`` (random steering),
  when box2d is installed; rendered, flat colours;
* ``ale``: ``ALE/MsPacman-v5`` RGB frames (210x160) upscaled to 224x224 (ale-py bundles the
  ROM); synthetic hard edges, the case JPEG is wrong for.

For each set and codec (raw, ``zstd``, ``jpeg:95``, ``jpeg:75``), one run, page cache warm
(every store written and read once before timing), medians of interleaved repetitions:

1. bytes per frame on disk (shard files over the rows they hold) and the ratio to raw;
2. error against the frames written: PSNR over the set, mean absolute error, worst frame's;
3. decode, batched path (``ShardedArray.read`` of ``--batch`` distinct random rows, the
   decoded-chunk cache emptied before each call): frames/s per core (decoding on the calling
   thread only, ``images.THREADS = 1``; its CPU time, ``time.thread_time``) and wall frames/s
   with the default pool; baseline in the same run: a plain loop of
   ``imagecodecs.jpeg8_decode`` over the same JPEG blobs (no mmbuffer), and the zstd column's
   batched read of the same rows;
4. ``sample(32)`` with the cache emptied against the same call on the raw store;
5. per-step ``extend`` (one frame a call, as SB3 and TorchRL collectors add) into ``jpeg:95``
   against a raw column, fresh stores, alternated every 64 rows (one shard), rows/s: the
   JPEG encoding of each complete shard (on the pool) is the write-time cost.

    python benchmarks/bench_jpeg.py                      # ~1-2 min on the dev VM
    python benchmarks/bench_jpeg.py --sets photo --frames 256 --reps 5
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
from mmbuffer.kernels import images

SIZE = 224


def _resize(frame: np.ndarray) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(frame).resize((SIZE, SIZE), Image.BILINEAR))


def _pan(photos: list[np.ndarray], n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    per = -(-n // len(photos))
    for i in range(n):
        img = photos[i // per]
        h, w = img.shape[:2]
        s = min(h, w, 256)
        if i % per == 0:
            x, y = (w - s) // 2, (h - s) // 2
        x = int(np.clip(x + rng.integers(-8, 9), 0, w - s))
        y = int(np.clip(y + rng.integers(-8, 9), 0, h - s))
        out[i] = _resize(np.ascontiguousarray(img[y : y + s, x : x + s, :3]))
    return out


def frame_set(name: str, n: int) -> np.ndarray | None:
    """``n`` frames of set ``name``, or None when its package is missing."""
    if name == "photo":
        import matplotlib.cbook
        from PIL import Image

        with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
            return _pan([np.asarray(Image.open(f).convert("RGB"))], n)
    if name == "photos":
        try:
            import skimage.data as d
        except ImportError:
            return None
        return _pan([d.astronaut(), d.coffee(), d.chelsea(), d.stereo_motorcycle()[0], d.rocket()], n)
    import gymnasium as gym

    if name == "carracing":
        try:
            env = gym.make("CarRacing-v3", render_mode="rgb_array")
        except Exception:  # noqa: BLE001 - box2d or pygame missing
            return None
        env.reset(seed=0)
        rng = np.random.default_rng(0)
        out = []
        for i in range(n + 50):  # the first 50 steps zoom in
            env.step(np.array([rng.uniform(-1, 1), 0.3, 0.0], np.float32))
            if i >= 50:
                out.append(_resize(env.render()))
        env.close()
        return np.stack(out)
    if name == "ale":
        import ale_py

        gym.register_envs(ale_py)
        env = gym.make("ALE/MsPacman-v5")
        env.reset(seed=0)
        env.action_space.seed(0)
        out = []
        for i in range(n + 100):
            obs, _, term, trunc, _ = env.step(env.action_space.sample())
            if term or trunc:
                env.reset()
            if i >= 100:
                out.append(_resize(obs))
        env.close()
        return np.stack(out)
    raise SystemExit(f"unknown set {name!r}")


def build(path: Path, frames: np.ndarray, codec: str | None) -> mb.Buffer:
    shutil.rmtree(path, ignore_errors=True)
    buf = mb.create(path, {"cam": mb.Column(frames.shape[1:], "uint8", codec=codec)}, capacity=len(frames), next_keys=())
    buf.extend({"cam": frames, "terminated": np.arange(len(frames)) % 200 == 199})
    buf.commit()
    return buf


def shard_bytes(path: Path, rows: int) -> float:
    files = [p for p in (path / "columns" / "cam" / "c").rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="photo,photos,carracing,ale")
    p.add_argument("--frames", type=int, default=512, help="frames per set (a multiple of 64)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    import imagecodecs

    root = scratch() / "bench_jpeg"
    header("jpeg codec on camera-like frames (bench_jpeg.py)")
    print(f"load before: {open('/proc/loadavg').read().split()[:3]}; imagecodecs {imagecodecs.__version__}, "
          f"{imagecodecs.jpeg8_version()}; decode pool THREADS={images.THREADS}; page cache warm\n")
    rows_out: list[dict[str, object]] = []
    dec_out: list[dict[str, object]] = []
    ext_out: list[dict[str, object]] = []
    for name in args.sets.split(","):
        frames = frame_set(name, args.frames)
        if frames is None:
            print(f"(set {name!r} skipped: its package is not installed)\n")
            continue
        n = len(frames)
        raw = build(root / f"{name}_raw", frames, None)
        stores = {c: build(root / f"{name}_{c.replace(':', '')}", frames, c) for c in ("zstd", "jpeg:95", "jpeg:75")}
        for codec, buf in [("raw", raw), *stores.items()]:
            got = buf.read_range("cam", 0, n)
            err = np.abs(got.astype(np.int16) - frames)
            mse = float((err.astype(np.float64) ** 2).mean())
            per = shard_bytes(buf.path, n) if codec != "raw" else float(frames[0].nbytes)
            rows_out.append({"set": name, "codec": codec, "B/frame": per, "ratio to raw": frames[0].nbytes / per,
                             "PSNR dB": 10 * np.log10(255**2 / mse) if mse else float("inf"),
                             "MAE": float(err.mean()), "worst frame MAE": float(err.reshape(n, -1).mean(axis=1).max())})
        rng = np.random.default_rng(1)
        batches = [rng.choice(n, min(args.batch, n), replace=False) for _ in range(args.reps)]
        blobs = [bytes(imagecodecs.jpeg8_encode(f, level=95)) for f in frames]
        jcol, zcol = stores["jpeg:95"].store.column("cam"), stores["zstd"].store.column("cam")
        t = {k: [] for k in ("jpeg cpu", "jpeg wall 1 thread", "jpeg wall pool", "plain loop cpu", "zstd cpu", "sample jpeg", "sample raw")}
        scratch_out = np.empty((SIZE, SIZE, 3), np.uint8)
        for rows in batches:  # interleaved: every contender once per round
            images.THREADS = 1
            jcol._cache.clear()
            w0, c0 = time.perf_counter(), time.thread_time()
            jcol.read(rows)
            t["jpeg cpu"].append(time.thread_time() - c0)
            t["jpeg wall 1 thread"].append(time.perf_counter() - w0)
            images.THREADS = max(1, min(4, os.cpu_count() or 1))
            jcol._cache.clear()
            w0 = time.perf_counter()
            jcol.read(rows)
            t["jpeg wall pool"].append(time.perf_counter() - w0)
            c0 = time.thread_time()
            for r in rows.tolist():  # the baseline: libjpeg-turbo alone, one Python call per frame
                imagecodecs.jpeg8_decode(blobs[r], out=scratch_out)
            t["plain loop cpu"].append(time.thread_time() - c0)
            zcol._cache.clear()
            c0 = time.thread_time()
            zcol.read(rows)
            t["zstd cpu"].append(time.thread_time() - c0)
            g = torch.Generator().manual_seed(len(t["sample raw"]))
            jcol._cache.clear()
            w0 = time.perf_counter()
            stores["jpeg:95"].sample(32, generator=g)
            t["sample jpeg"].append(time.perf_counter() - w0)
            w0 = time.perf_counter()
            raw.sample(32, generator=torch.Generator().manual_seed(len(t["sample raw"])))
            t["sample raw"].append(time.perf_counter() - w0)
        med = {k: statistics.median(v) for k, v in t.items()}
        b = len(batches[0])
        dec_out.append({"set": name, "batch": b,
                        "jpeg:95 frames/s per core (cpu)": b / med["jpeg cpu"],
                        "same, wall, 1 thread": b / med["jpeg wall 1 thread"],
                        f"wall, pool of {max(1, min(4, os.cpu_count() or 1))}": b / med["jpeg wall pool"],
                        "plain jpeg8_decode loop frames/s (cpu)": b / med["plain loop cpu"],
                        "mmbuffer / plain": med["plain loop cpu"] / med["jpeg cpu"],
                        "zstd column frames/s (cpu)": b / med["zstd cpu"],
                        "sample(32) jpeg ms (cache cold)": 1e3 * med["sample jpeg"],
                        "sample(32) raw ms": 1e3 * med["sample raw"]})
        for buf in [raw, *stores.values()]:
            buf.close()
        ext = {None: 0.0, "jpeg:95": 0.0}
        fresh = {c: mb.create(root / f"{name}_ext{c}", {"cam": mb.Column(frames.shape[1:], "uint8", codec=c)},
                              capacity=n, next_keys=()) for c in ext}
        for s0 in range(0, n, 64):  # alternated shard by shard
            for c, buf in fresh.items():
                t0 = time.perf_counter()
                for i in range(s0, s0 + 64):
                    buf.extend({"cam": frames[i : i + 1]})
                ext[c] += time.perf_counter() - t0
        for buf in fresh.values():
            buf.close()
        ext_out.append({"set": name, "rows": n, "jpeg:95 rows/s": n / ext["jpeg:95"], "raw rows/s": n / ext[None],
                        "jpeg / raw": ext[None] / ext["jpeg:95"]})
    print("### bytes and error against the frames written\n")
    table(rows_out)
    print("### decode, batched path, decoded-chunk cache emptied before each call\n")
    table(dec_out)
    print("### per-step extend (one frame a call), fresh stores, alternated shard by shard\n")
    table(ext_out)
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
