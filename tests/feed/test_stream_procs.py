"""``mb.stream(..., processes=N)``: producers in worker processes, a shared ring, slot numbers only.

Worker processes start from a forkserver (the first stream of a test session pays
its start, later ones ~0.1 s), so the tests share one store and keep streams few.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import mmbuffer as mb

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


def _rings() -> list[str]:
    """This process's ring files (shared memory) still present."""
    import tempfile

    folders = [p for p in (SHM, Path(tempfile.gettempdir())) if p is not None]
    return [f.name for d in folders for f in d.glob(f"mmbuffer-ring-{os.getpid()}-*")]


def _workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("mmbuffer-stream-proc")]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> mb.Buffer:
    path = tmp_path_factory.mktemp("procs") / "s"
    buf = mb.create(path, {"obs": ((3,), "float32"), "r": ((), "int64")}, capacity=2000, num_streams=2,
                    priorities=mb.PriorityConfig())
    n = 400
    buf.extend({"obs": np.random.default_rng(0).random((n, 3), dtype=np.float32), "r": np.arange(n),
                "truncated": np.arange(n) % 50 == 49}, stream=0, final_obs={"obs": np.zeros((8, 3))})
    buf.commit()
    yield buf
    buf.close()


def _run(buf: mb.Buffer, seed: int, n: int, **kw: object) -> list[mb.Batch]:
    with mb.stream(buf, 8, slice_len=4, generator=torch.Generator().manual_seed(seed), num_batches=n,
                   processes=2, **kw) as s:
        return list(s)


def test_batches_are_the_stores_rows_deterministic_and_outlive_slot_reuse(store: mb.Buffer) -> None:
    # prefetch=1: 2 slots a worker, so 12 batches reuse every slot three times
    a = _run(store, 0, 12, prefetch=1)
    b = _run(store, 0, 12, prefetch=1)
    c = _run(store, 1, 12, prefetch=1)
    assert len(a) == 12
    assert all(torch.equal(x.indices, y.indices) and torch.equal(x["obs"], y["obs"]) for x, y in zip(a, b))
    assert not all(torch.equal(x.indices, y.indices) for x, y in zip(a, c))
    for x in a:  # read after every slot was refilled: each batch is its own copy
        assert x["obs"].device.type == "cpu" and tuple(x["obs"].shape) == (8, 4, 3)
        rows = store.get(x.indices.reshape(-1))
        assert torch.equal(x["obs"], rows["obs"].reshape(8, 4, 3))
        assert torch.equal(x["r"], rows["r"].reshape(8, 4))
        assert torch.equal(x["next_obs"][:, :-1], x["obs"][:, 1:])  # strict windows inside episodes
        assert bool(x.mask.all()) and torch.equal(x.weights, torch.ones(8))
        assert x.written_at is not None and x.written_at.tolist() == [400, 0]


def test_prioritized_batches_update_priorities_on_the_writer(store: mb.Buffer) -> None:
    with mb.stream(store, 16, prioritized=True, generator=torch.Generator().manual_seed(3), num_batches=4,
                   processes=1) as s:
        for b in s:
            assert b.indices.shape == (16,) and bool((b.weights > 0).all())
            store.update_priorities(b, torch.full((16,), 7.0))
    rows = b.indices.numpy()
    cfg = store.priorities
    assert cfg is not None
    np.testing.assert_allclose(store.leaf_priorities(rows), (7.0 + cfg.eps) ** cfg.alpha, rtol=1e-6)


def test_uncommitted_rows_are_not_streamed_and_the_workers_error_is_reraised(tmp_path: Path) -> None:
    with mb.create(tmp_path / "e", {"obs": ((2,), "float32")}, capacity=64) as buf:
        buf.extend({"obs": np.zeros((20, 2), np.float32), "truncated": np.arange(20) % 10 == 9},
                   final_obs={"obs": np.zeros((2, 2), np.float32)})
        assert len(buf) == 20  # extended in this process, not committed
        s = mb.stream(buf, 4, processes=1, num_batches=2)
        with pytest.raises(mb.errors.EmptyBufferError):
            next(s)
        s.close()
        buf.commit()  # a new generation: a new stream sees the rows
        with mb.stream(buf, 4, processes=1, num_batches=2) as s:
            assert [tuple(b["obs"].shape) for b in s] == [(4, 2), (4, 2)]


def test_a_commit_in_the_main_process_reaches_the_workers(tmp_path: Path) -> None:
    with mb.create(tmp_path / "g", {"x": ((), "int64")}, capacity=1000, next_keys=()) as buf:
        buf.extend({"x": np.zeros(100, np.int64), "truncated": np.arange(100) % 10 == 9})
        buf.commit()
        with mb.stream(buf, 16, processes=1, prefetch=1, generator=torch.Generator().manual_seed(0)) as s:
            assert int(next(s)["x"].max()) == 0
            buf.extend({"x": np.ones(800, np.int64), "truncated": np.arange(800) % 10 == 9})
            buf.commit()  # the next slot handed back carries the new generation: the worker refreshes
            seen = [int(next(s)["x"].max()) for _ in range(6)]
    # at most the batches already made (2 slots) predate the refresh; 16 draws from
    # rows 8/9 new then hit a new row (seed fixed: this sequence is deterministic)
    assert seen[2:] == [1, 1, 1, 1]


def test_workers_refresh_every_refresh_every_batches_for_commits_made_elsewhere(tmp_path: Path) -> None:
    from mmbuffer._feed import processes as _procring

    with mb.create(tmp_path / "p", {"x": ((), "int64")}, capacity=1000, next_keys=()) as w:
        w.extend({"x": np.zeros(100, np.int64), "truncated": np.arange(100) % 10 == 9})
        w.commit()
        with mb.open(tmp_path / "p", "r") as r:  # a reader: its generation stays, so only the period refreshes
            k = _procring.REFRESH_EVERY
            with mb.stream(r, 16, processes=1, generator=torch.Generator().manual_seed(0)) as s:
                first = int(next(s)["x"].max())
                w.extend({"x": np.ones(800, np.int64), "truncated": np.arange(800) % 10 == 9})
                w.commit()
                seen = [int(next(s)["x"].max()) for _ in range(k + 5)]
    assert first == 0 and seen[: k - 1] == [0] * (k - 1)  # batches 1..k-1: the worker's view of the start
    assert seen[k - 1 :] == [1] * 6  # batch k onwards: drawn after refresh()


def test_a_killed_worker_is_an_error_not_a_hang(store: mb.Buffer) -> None:
    s = mb.stream(store, 8, slice_len=4, processes=2)
    next(s)
    victim = next(p for p in _workers() if p.name == "mmbuffer-stream-proc1")
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    with pytest.raises(ChildProcessError, match="worker process 1"):
        for _ in range(20):  # the batches it made before dying still come out
            next(s)
    s.close()
    assert _workers() == [] and _rings() == []


def test_close_and_garbage_collection_stop_the_workers_and_leave_no_shared_memory(store: mb.Buffer) -> None:
    s = mb.stream(store, 8, slice_len=4, processes=2)
    next(s)
    assert len(_workers()) == 2
    assert _rings() == []  # unlinked once every worker mapped it: nothing can leak
    s.close()
    assert _workers() == []
    s = mb.stream(store, 8, slice_len=4, processes=2)
    next(s)
    del s
    gc.collect()
    assert _workers() == [] and _rings() == []


def test_a_ready_batch_costs_the_training_thread_one_read(store: mb.Buffer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-over runs on the training thread between steps (docs: the CUDA ``get``):
    a ready batch is one ``os.read`` of its worker's pipe (none when an earlier read
    brought it in), no ``Connection`` poll or receive."""
    import time
    from multiprocessing.connection import Connection

    calls: list[str] = []
    read = os.read

    def counted_read(fd: int, n: int) -> bytes:
        calls.append("read")
        return read(fd, n)

    def refused(self: Connection, *args: object) -> None:
        calls.append("connection")

    with mb.stream(store, 8, slice_len=4, processes=2, num_batches=9) as s:
        next(s)  # the workers are up
        ready = 0
        for _ in range(8):
            time.sleep(0.3)  # the worker has its next batch ready by now (on a loaded host: most of the time)
            calls.clear()
            with monkeypatch.context() as m:
                m.setattr(os, "read", counted_read)
                m.setattr(Connection, "poll", refused)
                m.setattr(Connection, "recv_bytes", refused)
                batch = next(s)
            if calls.count("read") == 1 or not calls:  # found ready: nothing more asked of the pipe
                ready += 1
            assert "connection" not in calls
            assert tuple(batch["obs"].shape) == (8, 4, 3)
    assert ready >= 1


def test_options_that_do_not_go_with_processes_are_refused_at_once(store: mb.Buffer) -> None:
    with pytest.raises(mb.errors.InvalidArgumentError, match="workers"):
        mb.stream(store, 8, processes=2, workers=2)
    with pytest.raises(mb.errors.InvalidArgumentError, match="processes"):
        mb.stream(store, 8, processes=0)
    with pytest.raises(mb.errors.InvalidArgumentError, match="sampler"):
        mb.stream(store, 8, processes=1, sampler=mb.samplers.Epoch())
    assert _workers() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_processes_copy_from_a_page_locked_ring(store: mb.Buffer) -> None:
    with mb.stream(store, 8, slice_len=4, device="cuda", processes=2, num_batches=10) as s:
        assert s._pool._memory.is_pinned()  # type: ignore[union-attr]
        batches = list(s)
    torch.cuda.synchronize()
    for b in batches:
        assert b["obs"].device.type == "cuda"
        rows = store.get(b.indices.cpu().reshape(-1))
        assert torch.equal(b["obs"].cpu(), rows["obs"].reshape(8, 4, 3))


def test_the_forkserver_preloads_modules_that_exist() -> None:
    """The forkserver ignores a preload name it cannot import; a renamed module once
    left every worker loading the kernels itself (about a second each)."""
    import importlib.util

    from mmbuffer._feed import processes

    assert processes.PRELOAD
    for name in processes.PRELOAD:
        assert importlib.util.find_spec(name) is not None, name
