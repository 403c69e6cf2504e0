"""The parallel gather (``mmbuffer._read.parallel``): the same bytes as one thread, its
threshold and its thread knobs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from mmbuffer._read import gather as gather_module, parallel
from mmbuffer._read.gather import gather
from mmbuffer.kernels import gather as kernels, split
from test_gather import KEYS, fill, reference


@pytest.fixture
def calls(monkeypatch):
    """Each ``gather_runs`` call as (thread name, chunk); two threads allowed. The
    caller's call waits (up to 10 s) for a helper to enter, so that both copy."""
    seen: list[tuple[str, int]] = []
    real = split.gather_runs

    def spy(*args):
        shared, chunk = args[-2], args[-1]
        name = threading.current_thread().name
        seen.append((name, chunk))
        if not name.startswith("mmbuffer-gather"):
            deadline = time.monotonic() + 10
            while shared[1] == 0 and time.monotonic() < deadline and len(seen) > 0 and chunk < len(args[7]) - 1:
                time.sleep(0.001)
        real(*args)

    monkeypatch.setattr(split, "gather_runs", spy)
    monkeypatch.setattr(parallel.CHOOSER, "offer", lambda nbytes: True)  # always offered to the helper
    monkeypatch.setattr(parallel, "_MAX", 2)
    monkeypatch.setattr(parallel, "_NUMBA", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield seen
    torch.set_num_threads(before)


def one_thread(buf, rows, keys):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return gather(buf, rows, keys)
    finally:
        torch.set_num_threads(before)


def test_two_threads_return_the_one_thread_bytes(tmp_path, rng, calls, monkeypatch):
    """Wrapped rings, episode ends, lane boundaries, every dtype and row shape: each
    batch shared by the caller and a helper matches one thread and the reference."""
    monkeypatch.setattr(gather_module, "_SMALL", 0)  # no batch takes the small batch's kernel
    monkeypatch.setattr(gather_module, "_PART", 1 << 10)  # and every one is shared
    buf = fill(tmp_path / "s", rng, streams=3, lane=40, steps=60)
    slices = buf.slice_indices(300, 7, strict=False, generator=torch.Generator().manual_seed(1))[0]
    wrapped = np.array([[38, 39, 0, 1, 2], [78, 79, 80, 81, 82]] * 200)  # a lane wraps; lane 0 runs into lane 1
    for rows in (rng.integers(0, buf.capacity, 1500), slices, wrapped):
        for keys in (KEYS, ["next_obs"], ["next_img", "img", "half"], ["count", "flag"]):
            calls.clear()
            got = gather(buf, rows, keys)
            assert {name for name, _ in calls} == {"mmbuffer-gather-1", threading.current_thread().name}
            count = len(kernels.runs(rows.reshape(-1), buf.capacity)[0]) - 1
            assert calls[0][1] < count  # in chunks: more than one to share
            calls.clear()
            alone = one_thread(buf, rows, keys)
            assert calls == [(threading.current_thread().name, count)]  # one thread, one chunk
            want = reference(buf, rows, keys)
            for key in keys:
                np.testing.assert_array_equal(got[key].numpy(), alone[key].numpy(), err_msg=key)
                np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)


def test_a_batch_under_the_threshold_stays_on_one_thread(tmp_path, rng, calls):
    assert 2 * gather_module._PART == 1 << 20  # docs/design.md: "at least 1 MiB"
    buf = fill(tmp_path / "s", rng)
    plan = gather_module._plan(buf.store, KEYS)
    row = gather_module._block(plan, (64,)).nbytes // 64  # 64 rows: no key padded to a cache line
    under = (2 * gather_module._PART) // row - 8  # past the small batch's kernel, under two parts
    over = (2 * gather_module._PART) // row + 8
    assert gather_module._SMALL < gather_module._block(plan, (under,)).nbytes < 2 * gather_module._PART
    assert gather_module._block(plan, (over,)).nbytes >= 2 * gather_module._PART
    for n, threads in ((under, 1), (over, 2)):
        calls.clear()
        rows = rng.integers(0, buf.capacity, n)
        got = gather(buf, rows, KEYS)
        assert len({name for name, _ in calls}) == len(calls) == threads
        want = reference(buf, rows, KEYS)
        for key in KEYS:
            np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)


def test_torch_threads_bound_the_gather_threads(calls):
    assert parallel.threads() == 2
    torch.set_num_threads(1)
    assert parallel.threads() == 1


def test_environment_knobs_bound_the_gather_threads():
    code = "import torch; torch.set_num_threads(2); from mmbuffer._read import parallel; print(parallel.threads())"
    base = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "MMBUFFER_GATHER_THREADS")}
    got = [subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.split()
           for env in ({}, {"NUMBA_NUM_THREADS": "1"}, {"MMBUFFER_GATHER_THREADS": "1"})]
    assert got == [["2"], ["1"], ["1"]]


def test_a_helpers_error_is_raised_in_the_caller_and_a_late_helper_is_not_waited_for(calls):
    entered = threading.Event()

    def fail(shared, chunk):
        if threading.current_thread().name.startswith("mmbuffer-gather"):
            entered.set()
            raise ValueError("in the helper")
        assert entered.wait(10)

    with pytest.raises(ValueError, match="in the helper"):
        parallel.share(fail, (), 1, 1, 1 << 20)
    busy, release = threading.Event(), threading.Event()

    def hold(shared, chunk):  # the helper blocks; the caller waits until it has entered
        if threading.current_thread().name.startswith("mmbuffer-gather"):
            busy.set()
            assert release.wait(10)
        else:
            assert busy.wait(10)

    other = threading.Thread(target=parallel.share, args=(hold, (), 1, 1, 1 << 20))
    other.start()
    assert busy.wait(10)
    done: list[tuple[str, np.ndarray]] = []
    parallel.share(lambda shared, chunk: done.append((threading.current_thread().name, shared)), (), 1, 1, 1 << 20)
    assert [name for name, _ in done] == [threading.current_thread().name]  # did not wait for the busy helper
    assert done[0][1][1] == -1  # closed with no helper in: the helper skips it when it gets to it
    release.set()
    other.join(10)
    parallel.share(lambda shared, chunk: None, (), 1, 1, 1 << 20)
    assert len(done) == 1


def test_shared_runs_copy_what_their_chunks_cover(tmp_path, rng):
    """A call that finds chunks already claimed copies only the runs after them, each
    to its own positions; bad counters or sizes raise and copy nothing."""
    buf = fill(tmp_path / "s", rng)
    plan = gather_module._plan(buf.store, KEYS)
    rows = rng.integers(0, buf.capacity, 2000)
    starts, _ = kernels.runs(rows, buf.capacity)
    layout = gather_module._block(plan, rows.shape)
    small = plan.small
    args = (small.addresses, small.sizes, small.row_bytes, layout.own_at, layout.next_at, buf.store.lane_size, rows,
            starts, buf.capacity)
    cursors = buf.store.ledger.cursors()
    full = np.zeros(layout.nbytes, np.uint8)
    split.gather_runs(*args, full, cursors, plan.by_episode, np.zeros(2, np.int64), 100)
    part = np.zeros(layout.nbytes, np.uint8)
    split.gather_runs(*args, part, cursors, plan.by_episode, np.array([3, 0]), 100)  # chunks 0-2 claimed elsewhere
    first = int(starts[300])  # the position of the first run of chunk 3
    for name, dtype, shape, at, n in layout.keys:
        whole, tail = (np.ndarray(shape, dtype, a, at) for a in (full, part))
        np.testing.assert_array_equal(tail[first:], whole[first:], err_msg=name)
        assert not tail[:first].any()
    want = reference(buf, rows, KEYS)
    for name, dtype, shape, at, n in layout.keys:
        np.testing.assert_array_equal(np.ndarray(shape, dtype, full, at), want[name], err_msg=name)
    out = np.zeros(layout.nbytes, np.uint8)
    for shared, chunk, o in ((np.zeros(3, np.int64), 10, out), (np.zeros(2, np.int64), 0, out),
                             (np.zeros(2, np.int64), 10, out[:-1])):
        with pytest.raises(ValueError):
            split.gather_runs(*args, o, cursors, plan.by_episode, shared, chunk)
    assert not out.any()


def test_enter_and_close_count_the_helpers():
    shared = np.zeros(2, np.int64)
    assert split.enter(shared) and split.enter(shared)
    assert split.close(shared) == 2 and split.close(shared) == 2
    assert not split.enter(shared)


def test_the_chooser_follows_the_faster_way_per_size_and_probes_the_other():
    assert parallel.CHOOSER.probe == 64  # docs/design.md: "re-tries the other way every 64th call"
    c = parallel.Chooser(keep=5, probe=10)
    big, small = 1 << 21, 1 << 18
    assert [c.offer(big) for _ in range(4)] == [True, False, True, False]  # no times: each way in turn
    for _ in range(5):
        c.record(big, True, 3e-3)  # offered: slower (a busy machine)
        c.record(big, False, 1e-3)
        c.record(small, True, 1e-4)  # another size: offered is faster
        c.record(small, False, 2e-4)
    choices = [c.offer(big) for _ in range(40)]
    assert choices.count(True) == 4 and all(choices[i] for i in range(40) if (i + 5) % 10 == 0)  # only the probes
    assert [c.offer(small) for _ in range(9)] == [True] * 9 and c.offer(small) is False  # the 10th probes
    for _ in range(5):  # the machine gets quiet: offering becomes faster, and is followed
        c.record(big, True, 0.5e-3)
    assert [c.offer(big) for _ in range(5)].count(True) >= 4


def test_a_gather_on_a_busy_machine_stays_on_one_thread(tmp_path, rng, monkeypatch):
    """Where offering to a helper has been slower, the gather copies alone (and the
    same bytes)."""
    monkeypatch.setattr(parallel, "_MAX", 2)
    monkeypatch.setattr(parallel, "_NUMBA", 2)
    monkeypatch.setattr(parallel, "CHOOSER", parallel.Chooser(keep=3, probe=1000))
    monkeypatch.setattr(gather_module, "_SMALL", 0)
    monkeypatch.setattr(gather_module, "_PART", 1 << 10)
    buf = fill(tmp_path / "s", rng)
    rows = rng.integers(0, buf.capacity, 2000)
    nbytes = gather_module._block(gather_module._plan(buf.store, KEYS), rows.shape).nbytes
    for _ in range(3):
        parallel.CHOOSER.record(nbytes, True, 1.0)
        parallel.CHOOSER.record(nbytes, False, 1e-6)
    seen: list[str] = []
    real = split.gather_runs
    monkeypatch.setattr(split, "gather_runs", lambda *a: (seen.append(threading.current_thread().name), real(*a)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = gather(buf, rows, KEYS)
    finally:
        torch.set_num_threads(before)
    assert seen == [threading.current_thread().name]
    want = reference(buf, rows, KEYS)
    for key in KEYS:
        np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)
