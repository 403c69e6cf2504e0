"""A store on object storage: chunk-pool refill throughput and samples/s, against local disk.

Builds a store of ``--rows`` rows (obs 17 float32, action 6 float32, reward; episodes
of ``--episode`` rows), publishes it zstd-compressed to an S3-compatible server on
loopback (moto's server mode, started here), and measures, in the same run:

* ``local raw``: ``sample_slices(B, L)`` from the local raw store (page cache warm),
  the baseline of the ratios;
* ``remote pool``: the same draws from ``mb.open(url, "r")`` with
  ``PoolConfig(blocks=--pool-blocks, rotate_every=...)`` (blocks of about 16 MB, one
  replaced every ``--rotate-every`` draws: 8, 32, 128; refills in the background),
  steady state including the waits for blocks;
* ``remote exact``: ``pool=None`` (chunks fetched on demand into a 64 MiB LRU);
* pool refill throughput: decoded MB per second of a block fetch (zstd chunks through
  zarr + s3fs), measured on the first fill of the pool.

With ``--table 1e5,1e6,1e7``, instead: what a publish of ``--new-rows`` new rows writes
of the object table, by store size (chunks of ``--chunk-kib`` KiB give a store the object
count of a larger one); then what a new reader of that snapshot fetches of the table
(GETs counted at the server) and how long it takes, to its open, its first
``sample_slices(1, 16)`` and its first ``sample_slices(256, 16)``.

With ``--publish``, instead: the cost of publishing after 1% new rows (``--steps``
times) against a full publish, for both engines (``snapshots``: objects whose digest
changed, the others named in the table; ``icechunk``: the same, one commit), in the same
run: seconds (the local zstd copy included: whole at the first publish, then the rows
written since appended to the copy the last publish kept), the bytes of every PUT
request the server received (counted by the server: object bodies and multipart parts,
so Icechunk's own snapshot and manifest files count) and bytes added under the URL (the
bucket's size before and after; pruned snapshots make it smaller). ``--wrapped``: the
same on a replay buffer in its steady state (its ring passed its end before the first
publish, each new row evicts an old one).

moto is a Python server: its throughput, not S3's, bounds the remote figures here.
Run: ``python benchmarks/bench_remote.py [--rows 1000000] [--publish]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mmbuffer as mb
from _common import count, counts  # noqa: E402
from mmbuffer.remote import PoolConfig


COLUMNS = {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32")}


def add(buf: mb.Buffer, rng: np.random.Generator, start: int, n: int, episode: int) -> None:
    """Rows ``start .. start + n`` of random transitions in episodes of ``episode`` rows."""
    done = (np.arange(start, start + n) % episode) == episode - 1
    buf.extend({"obs": rng.standard_normal((n, 17), dtype=np.float32),
                "action": rng.standard_normal((n, 6), dtype=np.float32),
                "reward": rng.standard_normal(n, dtype=np.float32), "terminated": done},
               final_obs={"obs": np.zeros((int(done.sum()), 17), np.float32)})


def build(path: Path, rows: int, episode: int, capacity: int | None = None) -> None:
    rng = np.random.default_rng(0)
    with mb.create(path, COLUMNS, capacity=capacity or rows) as buf:
        for start in range(0, rows, 250_000):
            add(buf, rng, start, min(250_000, rows - start), episode)


def publish_costs(tmp: Path, endpoint: str, counter: object, rows: int, episode: int, steps: int,
                  wrapped: bool = False) -> None:
    """Full publish, then 1% new rows and a publish, ``steps`` times, per engine (module
    docstring); ``wrapped``: a ring of ``rows`` rows that passed its end (half a lap more)
    before the first publish, so every later publish evicts episodes."""
    import fsspec

    from s3server import new_bucket

    rng = np.random.default_rng(0)
    local = tmp / "pub"
    filled = rows * 3 // 2 if wrapped else rows
    piece = min(250_000, rows)
    with mb.create(local, COLUMNS, capacity=rows if wrapped else int(rows * (1 + 0.01 * steps) + episode)) as buf:
        for start in range(0, filled, piece):
            add(buf, rng, start, min(piece, filled - start), episode)
    fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True)
    urls = {e: f"s3://{new_bucket(endpoint)}/pub" for e in ("snapshots", "icechunk")}

    def size(url: str) -> int:
        fs.invalidate_cache()
        return int(sum(fs.du(url[5:], total=False).values())) if fs.exists(url[5:]) else 0

    out: dict[tuple[str, str], tuple[float, int, int, int]] = {}
    for step in ["full"] + [f"after 1% new rows ({i})" for i in range(1, steps + 1)]:
        if step != "full":
            with mb.open(local) as buf:
                add(buf, rng, filled, rows // 100, episode)
            filled += rows // 100
        for engine, url in urls.items():  # interleaved: both engines publish the same state
            before, put0, n0 = size(url), counter.put_bytes, counter.puts  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            mb.convert.publish(local, url, engine=engine, progress=False)
            sec = time.perf_counter() - t0
            out[(engine, step)] = (sec, size(url) - before, counter.put_bytes - put0,  # type: ignore[attr-defined]
                                   counter.puts - n0)  # type: ignore[attr-defined]
    print("| engine | publish | seconds | vs full (seconds) | bytes PUT (MB) | PUT requests | vs full (bytes PUT) "
          "| MB added under the URL |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (engine, step), (sec, added, sent, puts) in out.items():
        full_s, _, full, _ = out[(engine, "full")]
        print(f"| {engine} | {step} | {sec:.2f} | {sec / full_s:.3f} | {sent / 1e6:.2f} | {puts} | {sent / full:.3f} "
              f"| {added / 1e6:.2f} |")


def table_costs(tmp: Path, endpoint: str, counter: object, sizes: list[int], new_rows: int, episode: int,
                chunk_kib: int) -> None:
    """Per store size: a full publish, then ``new_rows`` new rows and a publish; what the
    second publish wrote of the object table (``objects.json`` and, from table version 4,
    the parts it sent: ``remote/_parts.py``) against the whole table. ``chunk_kib``: the
    chunk size, small to give a store the object count of a larger one."""
    import dataclasses

    import fsspec

    from mmbuffer._disk import format as fmt
    from s3server import new_bucket, table_objects

    fmt.config = dataclasses.replace(fmt.config, chunk_bytes=chunk_kib << 10)
    fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True)
    print(f"| rows | objects | table (MB) | table written after {new_rows:,} new rows (MB) | share | "
          "that publish: s, MB PUT | a new reader's table fetched (MB) and seconds: open / 1st slice / "
          "1st sample_slices(256, 16) |")
    print("|---:|---:|---:|---:|---:|---|---|")
    for rows in sizes:
        local = tmp / f"t{rows}"
        build(local, rows, episode, capacity=rows + 2 * new_rows)
        root = f"{new_bucket(endpoint)}/pub"
        mb.convert.publish(local, f"s3://{root}", progress=False)
        with mb.open(local) as buf:
            add(buf, np.random.default_rng(1), rows, new_rows, episode)
        put0 = counter.put_bytes  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        snap = mb.convert.publish(local, f"s3://{root}", progress=False)["snapshot"]
        sec, put = time.perf_counter() - t0, counter.put_bytes - put0  # type: ignore[attr-defined]
        fs.invalidate_cache()
        raw = fs.cat_file(f"{root}/snapshots/{snap}/objects.json")
        parts = json.loads(raw).get("parts", {})
        whole = len(raw) + sum(v[0] for v in parts.values())
        written = len(raw) + sum(v[0] for v in parts.values() if v[2] == snap)
        objects = len(table_objects(fs, root, snap))
        sizes_of = {f"/{root}/snapshots/{v[2]}/parts/{k}.json": v[0] for k, v in parts.items()}
        sizes_of[f"/{root}/snapshots/{snap}/objects.json"] = len(raw)
        del counter.gets[:]  # type: ignore[attr-defined]
        reader = []
        t0 = time.perf_counter()
        with mb.open(f"s3://{root}", mode="r", cache_dir=tmp / f"reader-{rows}", pool=None) as ro:
            for b in (0, 1, 256):
                if b:
                    ro.sample_slices(b, 16, generator=torch.Generator().manual_seed(b))
                got = sum(sizes_of.get(p, 0) for p in counter.gets)  # type: ignore[attr-defined]
                reader.append(f"{got / 1e6:.3f} MB {time.perf_counter() - t0:.2f} s")
        print(f"| {rows:,} | {objects:,} | {whole / 1e6:.3f} | {written / 1e6:.4f} | {written / whole:.3f} | "
              f"{sec:.2f}, {put / 1e6:.2f} | {' / '.join(reader)} |", flush=True)
        shutil.rmtree(local)


def rate(buf: mb.Buffer, batches: int, b: int, length: int, seed: int = 0) -> float:
    """Slices per second over ``batches`` draws of ``b`` x ``length``."""
    g = torch.Generator().manual_seed(seed)
    buf.sample_slices(b, length, generator=g)  # warm-up (starts a pool)
    t0 = time.perf_counter()
    for _ in range(batches):
        buf.sample_slices(b, length, generator=g)
    return batches * b / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=count, default=1_000_000)
    ap.add_argument("--episode", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--slice-len", type=int, default=16)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--pool-blocks", type=int, default=2, help="PoolConfig.blocks (default 2: the pool rotates)")
    ap.add_argument("--rotate-every", type=int, nargs="+", default=[8, 32, 128], help="PoolConfig.rotate_every values")
    ap.add_argument("--publish", action="store_true", help="measure publish costs only (full vs after 1%% new rows)")
    ap.add_argument("--steps", type=int, default=2, help="--publish: publishes after 1%% new rows each (default 2)")
    ap.add_argument("--table", type=counts, default=None, metavar="SIZES",
                    help="measure the object table a publish of --new-rows writes, by store size (1e5,1e6,1e7)")
    ap.add_argument("--new-rows", type=count, default=10_000, help="--table: rows added before the measured publish")
    ap.add_argument("--chunk-kib", type=int, default=16, help="--table: chunk size (small: a larger store's objects)")
    ap.add_argument("--wrapped", action="store_true",
                    help="--publish: a full ring (capacity --rows) that wrapped half a lap before the first publish")
    args = ap.parse_args()
    from s3server import counting_moto_s3, moto_s3, new_bucket

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if args.table:
        with tempfile.TemporaryDirectory() as tmp, counting_moto_s3() as (endpoint, counter):
            os.environ["MMBUFFER_CACHE_DIR"] = str(Path(tmp) / "cache")
            table_costs(Path(tmp), endpoint, counter, args.table, args.new_rows, args.episode, args.chunk_kib)
        return
    if args.publish:
        with tempfile.TemporaryDirectory() as tmp, counting_moto_s3() as (endpoint, counter):
            os.environ["MMBUFFER_CACHE_DIR"] = str(Path(tmp) / "cache")  # the copies publishes keep (convert/_pipeline/staged.py)
            publish_costs(Path(tmp), endpoint, counter, args.rows, args.episode, args.steps, args.wrapped)
        return
    with tempfile.TemporaryDirectory() as tmp, moto_s3() as endpoint:
        local = Path(tmp) / "local"
        build(local, args.rows, args.episode)
        url = f"s3://{new_bucket(endpoint)}/bench/store"
        t0 = time.perf_counter()
        summary = mb.convert.copy(local, url, compression="zstd", progress=False)
        publish_s = time.perf_counter() - t0
        row_bytes = (17 + 6 + 1) * 4
        print(f"rows={args.rows} ({args.rows * row_bytes / 1e6:.0f} MB of data columns); publish "
              f"{publish_s:.1f} s ({args.rows * row_bytes / 1e6 / publish_s:.1f} MB/s incl. the zstd copy)"
              f", snapshot {summary['snapshot']}")
        with mb.open(local, mode="r") as lo:
            lo.get(np.arange(0, args.rows, 997))  # touch
            base = rate(lo, args.batches, args.batch, args.slice_len)
        pooled = {}
        for every in args.rotate_every:
            t0 = time.perf_counter()
            ro = mb.open(url, mode="r", cache_dir=Path(tmp) / "cache",
                         pool=PoolConfig(blocks=args.pool_blocks, rotate_every=every))
            open_s = time.perf_counter() - t0
            pool = ro.remote.pool
            assert pool is not None
            t0 = time.perf_counter()
            pool.advance()  # the first fill: blocks + prefetch, fetched in order
            fill_s = time.perf_counter() - t0
            fill_mb = pool.fetched_bytes / 1e6
            pooled[every] = rate(ro, args.batches, args.batch, args.slice_len)
            refill_mb = pool.fetched_bytes / 1e6 - fill_mb
            held = min(pool.config.blocks, len(pool.live)) * pool.block_rows
            ro.close()
            print(f"rotate_every={every}: open {open_s:.2f} s; first fill {fill_mb:.1f} MB decoded in {fill_s:.2f} s "
                  f"= {fill_mb / fill_s:.1f} MB/s; {refill_mb:.1f} MB refilled while sampling")
        ex = mb.open(url, mode="r", cache_dir=Path(tmp) / "cache", pool=None)
        exact = rate(ex, max(3, args.batches // 40), args.batch, args.slice_len)
        ex.close()
        print(f"block = {pool.block_rows} rows ({pool.block_rows * row_bytes / 1e6:.1f} MB decoded), "
              f"{len(pool.live)} live blocks, the pool holds {held} rows")
        print(f"| mode | slices/s ({args.batch} x {args.slice_len}) | vs local raw |")
        print("|---|---:|---:|")
        rows_ = [("local raw (baseline)", base), *((f"remote pool, rotate_every={k}", v) for k, v in pooled.items()),
                 ("remote exact (pool=None)", exact)]
        for name, v in rows_:
            print(f"| {name} | {v:,.0f} | {v / base:.3f} |")


if __name__ == "__main__":
    main()
