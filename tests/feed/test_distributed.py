"""Many learners on one store: ``BufferDataset`` under ``torch.distributed`` (gloo, 2 processes).

Each rank is a real process in a real gloo process group; the dataset takes its rank
and world size from the group. On a local store and on one published to a real S3
server on loopback: per-rank random streams are deterministic and differ between
ranks, epochs are split into disjoint per-rank parts that together cover every item
once, and an epoch interrupted mid-way resumes where it stopped.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mmbuffer as mb
from s3server import moto_s3, new_bucket

WORLD = 2
ROWS = 300


def _rank_main(rank: int, path: str, out: str, remote: dict) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=WORLD)
        res: dict = {}

        def stream() -> list[list[int]]:
            ds = mb.data.BufferDataset(path, 16, num_batches=4, seed=7, **remote)
            return [b.indices.tolist() for b in ds]

        res["stream"], res["again"] = stream(), stream()
        ds = mb.data.BufferDataset(path, 10, epoch=True, seed=3, name="ep", **remote)
        first = []
        for i, b in enumerate(ds):  # stop mid-epoch, as a killed run would
            first += b["x"].tolist()
            if i == 2:
                break
        rest = [x for b in mb.data.BufferDataset(path, 10, epoch=True, seed=3, name="ep", **remote) for x in b["x"].tolist()]
        res["first"], res["rest"] = first, rest
        gathered: list = [None] * WORLD
        dist.all_gather_object(gathered, res["first"] + res["rest"])  # the collective works across ranks
        res["all"] = gathered
        dist.barrier()
        dist.destroy_process_group()
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(path: str, out: Path, **remote) -> list[dict]:
    # spawn, not fork: forking this multi-threaded process (a loopback S3 server, fsspec
    # and zarr I/O threads) can copy a lock another thread holds, and a rank then hangs
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, path, str(out), remote)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    errs = [f.read_text() for f in sorted(out.glob("*.err"))]
    assert not errs, errs[0]
    assert all(p.exitcode == 0 for p in procs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def make_store(path: Path) -> None:
    with mb.create(path, {"x": ((), "int64"), "obs": ((4,), "float32")}, capacity=1024, num_streams=2) as buf:
        for lane in range(2):
            x = np.arange(ROWS // 2) + lane * (ROWS // 2)
            buf.extend({"x": x, "obs": np.random.rand(len(x), 4), "terminated": x % 15 == 14}, stream=lane,
                       final_obs={"obs": np.zeros((len(x) // 15, 4))})


def check(results: list[dict], block_rows: int | None = None) -> None:
    for r in results:
        assert r["stream"] == r["again"]  # deterministic per rank
        assert len(r["first"]) == 30 and r["rest"]  # stopped after 3 batches, then resumed
        assert len(set(r["first"] + r["rest"])) == len(r["first"] + r["rest"])  # no item twice
    assert results[0]["stream"] != results[1]["stream"]  # ranks draw differently
    a = set(results[0]["first"] + results[0]["rest"])
    b = set(results[1]["first"] + results[1]["rest"])
    assert not a & b and sorted(a | b) == list(range(ROWS))  # disjoint, and together the whole epoch
    assert results[0]["all"] == results[1]["all"]
    if block_rows is not None:  # the chunk pool: each rank samples its own blocks
        blocks = [set((np.array(r["stream"]) // block_rows).ravel().tolist()) for r in results]
        assert blocks[0] and blocks[1] and not blocks[0] & blocks[1]


@pytest.mark.slow
def test_distributed_local_store(tmp_path):
    make_store(tmp_path / "store")
    (tmp_path / "out").mkdir()
    check(run_ranks(str(tmp_path / "store"), tmp_path / "out"))


@pytest.mark.slow
def test_distributed_remote_store(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    import dataclasses

    from mmbuffer._disk import format as fmt

    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=512))  # many small blocks
    make_store(tmp_path / "store")
    (tmp_path / "out").mkdir()
    with moto_s3() as endpoint:
        url = f"s3://{new_bucket(endpoint)}/store"
        mb.convert.copy(tmp_path / "store", url, progress=False)
        from mmbuffer.remote import PoolConfig

        results = run_ranks(url, tmp_path / "out", cache_dir=str(tmp_path / "cache"),
                            pool=PoolConfig(blocks=1, block_bytes=1))
    check(results, block_rows=64)  # chunks of 512 bytes: 64 rows of x, 32 of obs
