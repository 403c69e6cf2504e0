"""A refresh beside sampling, against a real S3 server on loopback (moto) with a gate.

The gate is WSGI middleware in front of the server: while it is closed, every request
for the newer snapshot's objects waits at the server. So a test knows for certain that
a refresh is in the middle of preparing the new snapshot (its request has arrived and
has not been answered) while other calls run: samples complete and return the old
snapshot's rows, ``refresh(wait=False)`` returns False, ``close()`` waits for it and then
leaves nothing open. After the gate opens, the swap moves the buffer to the new rows.
"""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer import errors
from s3server import moto_s3, new_bucket
from s3server import small_chunks  # noqa: F401 - fixture

pytest.importorskip("s3fs")
from mmbuffer.remote import PoolConfig  # noqa: E402

SMALL = PoolConfig(blocks=2, block_bytes=1, rotate_every=2, prefetch=1)  # a block = one chunk of 128 rows
NEW = 10_000  # x of the rows the second snapshot adds


class Gate:
    """Holds every request whose path contains :attr:`marker` while closed;
    :attr:`entered` is set when one arrives."""

    def __init__(self, app):
        self.app, self.marker = app, None
        self.entered, self.opened = threading.Event(), threading.Event()
        self.opened.set()

    def close(self, marker: str) -> None:
        self.marker = marker
        self.entered.clear()
        self.opened.clear()

    def open(self) -> None:
        self.opened.set()

    def __call__(self, environ, start_response):
        if self.marker is not None and self.marker in environ.get("PATH_INFO", ""):
            self.entered.set()
            self.opened.wait(120)
        return self.app(environ, start_response)


@pytest.fixture(scope="module")
def gated():
    gates = []

    def wrap(app):
        gates.append(Gate(app))
        return gates[0]

    with moto_s3(wrap=wrap) as endpoint:
        yield endpoint, gates[0]


@pytest.fixture
def gate(gated):
    yield gated[1]
    gated[1].open()


def write(path: Path, first: int, rows: int, *, extra: bool = False) -> None:
    """Episodes of 10 rows with ``x`` = ``first``, ``first + 1``, ... (``extra``: another schema)."""
    schema = {"x": ((), "int64")} | ({"y": ((), "int64")} if extra else {})
    buf = mb.create(path, schema, capacity=2048, next_keys=()) if not path.exists() else mb.open(path)
    with buf:
        x = np.arange(first, first + rows)
        buf.extend({"x": x, "terminated": x % 10 == 9} | ({"y": x} if extra else {}))


def two_snapshots(tmp_path: Path, gated, gate: Gate, *, pool, extra: bool = False) -> tuple[mb.Buffer, str, str]:
    """A reader on snapshot 1 (x < 400); snapshot 2 published (x up to NEW + 100, or
    another schema), its objects held by the gate. Returns (reader, url, snapshot 2)."""
    url = f"s3://{new_bucket(gated[0])}/store"
    write(tmp_path / "local", 0, 400)
    mb.convert.copy(tmp_path / "local", url, compression="zstd", progress=False)
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "cache", pool=pool)
    assert int(ro.sample(64).data["x"].max()) < 400  # a pool starts here: the refresh will fill the new one
    if extra:
        write(tmp_path / "other", 0, 400, extra=True)
        second = mb.convert.copy(tmp_path / "other", url, compression="zstd", progress=False)["snapshot"]
    else:
        write(tmp_path / "local", NEW, 100)
        second = mb.convert.copy(tmp_path / "local", url, compression="zstd", progress=False)["snapshot"]
    gate.close(f"/snapshots/{second}/")
    return ro, url, second


def cache_fds(cache: Path) -> list[str]:
    """This process's open files under ``cache`` (pins, pool files, mirror files; a map
    keeps its file open while an object refers to it, so collect those first)."""
    gc.collect()
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(cache.resolve())):
            found.append(target)
    return found


def refresh_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mmbuffer-refresh"]


@pytest.mark.parametrize("pool", [None, SMALL], ids=["exact", "pool"])
def test_samples_read_the_old_snapshot_while_a_refresh_prepares_the_new_one(tmp_path, gated, gate, pool):
    ro, _, second = two_snapshots(tmp_path, gated, gate, pool=pool)
    first = ro.remote.snapshot
    result: list[bool] = []
    refresher = threading.Thread(target=lambda: result.append(ro.refresh()))
    refresher.start()
    assert gate.entered.wait(60)  # the refresh is fetching the new snapshot, held at the server
    seen = [ro.sample(32).data["x"] for _ in range(20)]  # meanwhile, from this thread
    assert refresher.is_alive() and not gate.opened.is_set()  # all 20 ran while the prepare was held
    assert ro.remote.snapshot == first and all(int(x.max()) < 400 for x in seen)
    gate.open()
    refresher.join(60)
    assert result == [True] and ro.remote.snapshot == second
    if pool is not None:  # the new pool's first blocks came with the prepare, not in a draw after the swap
        assert ro.remote.pool.fetched_bytes > 0
    assert ro.num_episodes == 50
    x = np.concatenate([ro.sample(64).data["x"].numpy() for _ in range(40)])
    assert (x >= NEW).any() and set(x[x >= NEW]) <= set(range(NEW, NEW + 100))
    assert ro.get(np.arange(400, 500))["x"].tolist() == list(range(NEW, NEW + 100))
    ro.close()
    del ro  # a closed buffer's maps stay valid (and their files open) while it is referenced
    assert cache_fds(tmp_path / "cache") == []


def test_refresh_wait_false_returns_at_once_and_a_later_call_adopts(tmp_path, gated, gate):
    ro, _, second = two_snapshots(tmp_path, gated, gate, pool=SMALL)
    first = ro.remote.snapshot
    assert ro.refresh(wait=False) is False  # returned while its prepare cannot finish (gate closed)
    assert gate.entered.wait(60) and len(refresh_threads()) == 1
    assert ro.refresh(wait=False) is False and ro.remote.snapshot == first  # still preparing: no second one
    assert len(refresh_threads()) == 1 and int(ro.sample(32).data["x"].max()) < 400
    gate.open()
    for t in refresh_threads():
        t.join(60)
    assert ro.refresh(wait=False) is True and ro.remote.snapshot == second and refresh_threads() == []
    assert ro.get(np.arange(400, 500))["x"].tolist() == list(range(NEW, NEW + 100))
    assert ro.refresh(wait=False) is False  # nothing newer: looks again in the background
    assert ro.refresh() is False and ro.remote.snapshot == second and refresh_threads() == []
    with pytest.raises(errors.InvalidArgumentError, match="wait: expected True or False"):
        ro.refresh(wait="no")
    ro.close()


@pytest.mark.parametrize("wait", [True, False])
def test_a_snapshot_with_another_schema_leaves_the_buffer_where_it_was(tmp_path, gated, gate, wait):
    ro, _, second = two_snapshots(tmp_path, gated, gate, pool=SMALL, extra=True)
    first, held = ro.remote.snapshot, sorted(cache_fds(tmp_path / "cache"))
    gate.open()
    with pytest.raises(errors.CorruptStoreError, match=f"snapshot {second}: expected the schema opened"):
        if wait:
            ro.refresh()
        else:
            assert ro.refresh(wait=False) is False
            for t in refresh_threads():
                t.join(60)
            ro.refresh(wait=False)  # the background prepare's error, raised here
    assert ro.remote.snapshot == first and set(ro.columns) == {"x", "terminated", "truncated"}
    assert int(ro.sample(32).data["x"].max()) < 400 and refresh_threads() == []
    assert sorted(cache_fds(tmp_path / "cache")) == held  # the refused snapshot's pin closed
    with pytest.raises(errors.CorruptStoreError):  # refused again, not forgotten
        ro.refresh()
    ro.close()
    del ro
    assert cache_fds(tmp_path / "cache") == []


def test_close_during_a_background_refresh_leaves_nothing_open(tmp_path, gated, gate):
    ro, _, second = two_snapshots(tmp_path, gated, gate, pool=SMALL)
    cache = tmp_path / "cache"
    assert cache_fds(cache)  # the snapshot's pin and the pool's files: what the count sees
    assert ro.refresh(wait=False) is False and gate.entered.wait(60)
    closer = threading.Thread(target=ro.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # close waits for the prepare held at the server
    gate.open()
    closer.join(60)
    assert not closer.is_alive() and refresh_threads() == []
    left = cache_fds(cache)  # the closed buffer's maps of its own snapshot, while it is referenced
    assert not [f for f in left if second in f or f.endswith(".pin") or "/pool-" in f]
    assert not list(cache.rglob("pool-*"))  # the prepared pool was closed, its directory removed
    assert ro.refresh(wait=False) is False and refresh_threads() == []  # closed: nothing starts
    del ro
    assert cache_fds(cache) == []  # neither snapshot's pin, mirror or pool stays open


def test_two_refreshes_at_once_swap_once(tmp_path, gated, gate):
    ro, _, second = two_snapshots(tmp_path, gated, gate, pool=None)
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(ro.refresh())) for _ in range(2)]
    for t in threads:
        t.start()
    assert gate.entered.wait(60)
    gate.open()
    for t in threads:
        t.join(60)
    assert sorted(results) == [False, True] and ro.remote.snapshot == second
    assert not [f for f in cache_fds(tmp_path / "cache") if second not in f]  # the old one's all closed
    assert len([f for f in cache_fds(tmp_path / "cache") if f.endswith(".pin")]) == 1  # one pin
    ro.close()


def test_a_writer_group_refreshes_in_the_background(tmp_path, gated, gate):
    url = f"s3://{new_bucket(gated[0])}/group"
    for w in range(2):
        write(tmp_path / f"w{w}", 1000 * w, 100)
        mb.convert.publish(tmp_path / f"w{w}", url, writer=f"host-{w}", progress=False)
    g = mb.open_group(url, cache_dir=tmp_path / "cache")
    write(tmp_path / "w1", NEW, 50)
    second = mb.convert.publish(tmp_path / "w1", url, writer="host-1", progress=False)["snapshot"]
    gate.close(f"/writers/host-1/snapshots/{second}/")
    assert g.refresh(wait=False) is False and gate.entered.wait(60)
    assert len(g) == 200 and int(g.sample(64).data["x"].max()) < 2000  # the old writers serve meanwhile
    assert g.refresh(wait=False) is False and len(g) == 200
    gate.open()
    for t in refresh_threads():
        t.join(60)
    assert g.refresh(wait=False) is True and len(g) == 250 and refresh_threads() == []
    assert g.buffers["host-1"].remote.snapshot == second
    x = np.concatenate([g.sample(64).data["x"].numpy() for _ in range(20)])
    assert (x >= NEW).any() and (x < 1000).any()  # both writers, host-1 on its new snapshot
    write(tmp_path / "w0", NEW + 100, 10)
    mb.convert.publish(tmp_path / "w0", url, writer="host-0", progress=False)
    assert g.refresh(wait=False) is False
    g.close()  # waits for that prepare, closes what it opened
    assert refresh_threads() == []
    del g
    assert cache_fds(tmp_path / "cache") == []


def test_a_thread_holding_the_buffers_lock_may_wait_for_a_refresh(tmp_path, gated, gate):
    """A prepare never takes the buffer's lock: a thread that holds it (several calls as one
    step) may call refresh() or close() while a background prepare runs."""
    ro, _, second = two_snapshots(tmp_path, gated, gate, pool=SMALL)
    done: list[object] = []

    def step() -> None:
        with ro.lock:
            assert ro.refresh(wait=False) is False and gate.entered.wait(60)
            gate.open()
            done.append(ro.refresh())  # waits for the background prepare, adopts it
            done.append(ro.remote.snapshot)
            write(tmp_path / "local", NEW + 100, 10)
            mb.convert.copy(tmp_path / "local", ro.remote.url, compression="zstd", progress=False)
            assert ro.refresh(wait=False) is False
            ro.close()  # waits for that one too, and closes what it opened
            done.append(refresh_threads())

    worker = threading.Thread(target=step, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive() and done == [True, second, []]
    del ro
    assert cache_fds(tmp_path / "cache") == []
