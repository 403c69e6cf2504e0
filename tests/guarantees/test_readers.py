"""Readers in other processes never return rows the writer has begun rewriting.

Every row encodes where it belongs, and a reader's batch is checked against the
encoding and against its own commit (``racing.py``: the encoding, the writer and
reader processes of a race, and what they show the test).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from racing import (
    COMMITS,
    GENERATION,
    HANG_S,
    IN_COMMIT,
    UNCOMMITTED,
    Board,
    Writer,
    committed_written,
    draw,
    make_store,
    run_race,
    seed_store,
    start,
    violations,
    wide_of,
)

import mmbuffer as mb
import mmbuffer._read.batch as batch_module
import mmbuffer._read.recheck as recheck_module
from mmbuffer._ledger.verify import verify


@pytest.mark.parametrize("kind", ["uniform", "slices", "padded", "prioritized"])
def test_writer_lapping_between_index_and_gather_is_never_returned(tmp_path, kind, monkeypatch):
    """The deterministic repro: the writer adds ~40 rows per lane (past its reservation)
    after the reader drew its indices and before it copied the rows."""
    writer_buf = make_store(tmp_path / "s", lane_size=128)
    writer = Writer(writer_buf, seed=0)
    for _ in range(6):  # wrap both lanes once, committed
        for s in range(2):
            writer.extend(s, 40)
    writer_buf.commit()
    reader = mb.open(tmp_path / "s", mode="r")
    real_gather = recheck_module.gather
    calls = {"n": 0}

    def racing_gather(store, rows, keys=None, out=None, done_at=None):
        if store is reader.store and calls["n"] == 0:
            for s in range(2):  # the writer rewrites the oldest rows of the reader's commit
                writer.extend(s, 40)
        calls["n"] += 1
        return real_gather(store, rows, keys, out, done_at)

    for module in (recheck_module, batch_module):  # every gather a reader's batch may take
        monkeypatch.setattr(module, "gather", racing_gather)
    g = torch.Generator().manual_seed(3)
    total = 0
    for _ in range(20):
        writer_buf.commit()
        reader.refresh()
        committed = committed_written(reader)
        calls["n"] = 0
        total += violations(draw(reader, kind, 256, g), reader.lane_size, committed)
    assert calls["n"] > 0
    assert total == 0


def test_check_is_needed_for_the_repro(tmp_path, monkeypatch):
    """Without the re-check after the copy the same repro returns overwritten rows
    (this keeps the repro above honest: it does race)."""
    writer_buf = make_store(tmp_path / "s", lane_size=128, priorities=False)
    writer = Writer(writer_buf, seed=0)
    for _ in range(6):
        for s in range(2):
            writer.extend(s, 40)
    writer_buf.commit()
    reader = mb.open(tmp_path / "s", mode="r")
    committed = committed_written(reader)
    g = torch.Generator().manual_seed(3)
    rows, weights, written = reader.sample_indices(256, g)
    for s in range(2):
        writer.extend(s, 40)
    data = reader.get(rows)  # the unchecked copy
    batch = mb.Batch({**data}, torch.from_numpy(rows), torch.from_numpy(weights))
    assert violations(batch, reader.lane_size, committed) > 0


def test_writer_reopened_after_a_crash_keeps_the_dead_writers_reservation(tmp_path):
    """A reader holding an older commit must not see rows a dead writer rewrote, also
    after a new writer recovered the store (recovery used to lower the reservation)."""
    buf = make_store(tmp_path / "s", lane_size=128, priorities=False)
    writer = Writer(buf, seed=1)
    for _ in range(4):
        writer.extend(0, 30)
        writer.extend(1, 30)
    writer.extend(0, 1, end=True)
    buf.close()
    reader = mb.open(tmp_path / "s", mode="r")
    committed = committed_written(reader)
    assert start("run_ahead_and_die", tmp_path / "s").wait(timeout=60) == 0
    mb.open(tmp_path / "s").close()  # recovery by a new writer, then a clean close
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert violations(reader.sample(128, generator=g), reader.lane_size, committed) == 0
        assert violations(reader.sample_slices(16, 4, generator=g), reader.lane_size, committed) == 0


# -- many processes ------------------------------------------------------------------------

@pytest.mark.parametrize("priorities", [True, False])
def test_concurrent_readers_see_no_overwritten_rows(tmp_path, priorities):
    """A writer wraps a small ring (2 lanes of 256 rows) 8 times while 2 readers draw
    at least 100 batches each, sampling every way; no batch holds a row that is torn,
    misplaced or newer than the reader's commit, and verify passes while it runs."""
    seed_store(tmp_path / "s", 256, priorities)
    r = run_race(tmp_path / "s", laps=8, batches=100, readers=2)
    assert r["rows_written"] >= 8 * 512 and r["batches"] >= 200  # the goals were reached, not a time
    assert r["fewest_generations"] >= 10  # each reader drew from commits the writer made during the race
    assert r["verified"] >= 4  # every 50 batches, each reader
    assert r["bad_rows"] == 0 and r["bad_batches"] == 0 and r["verify_failed"] == 0
    with mb.open(tmp_path / "s", mode="r") as reader:
        assert verify(reader)["ok"] and len(reader) > 0


@pytest.mark.slow
def test_concurrent_readers_soak(tmp_path):
    """The longer soak: 4 readers of 500 batches each, the writer wrapping 2 lanes of
    512 rows 20 times."""
    seed_store(tmp_path / "s", 512, True)
    r = run_race(tmp_path / "s", laps=20, batches=500, readers=4)
    assert r["rows_written"] >= 20 * 1024 and r["batches"] >= 2000 and r["fewest_generations"] >= 10
    assert r["bad_rows"] == 0 and r["verify_failed"] == 0


def check_committed_rows(reader: mb.Buffer) -> int:
    """Every committed row no writer may have reached holds its encoding: in lane ``l``,
    absolute rows ``[max(first_start, reserved - lane_size), written)``. The count checked."""
    view, reserved, n = reader.view(), reader.reservation(), reader.lane_size
    checked = 0
    for lane in range(reader.num_streams):
        written = int(view.written[lane])
        absolute = np.arange(max(view.lanes[lane].first_start, int(reserved[lane]) - n, written - n), written)
        got = reader.get(lane * n + absolute % n, keys=["obs", "wide"])
        ids = got["obs"].numpy()
        assert (ids[:, 0] == lane).all() and np.array_equal(ids[:, 3], absolute), f"lane {lane}: committed rows changed"
        assert np.array_equal(got["wide"].numpy(), wide_of(ids)), f"lane {lane}: a committed row is torn"
        checked += len(absolute)
    return checked


def test_verify_after_a_writer_is_killed(tmp_path):
    """A live writer (it has committed, and goes on extending, committing and updating
    priorities) is killed at a random instant; a reader's verify passes, every committed
    row no writer may have reached holds its encoding, and a new writer recovers.

    It asserts that all 6 kills landed after the child's first commit and at least 5
    mid-write, with rows extended since its last explicit commit (extend's own commits,
    one per lane of rows, are not counted); measured 6 of 6, 3 of them
    inside ``commit`` itself (its fsyncs are much of the writer's time). Since the
    writer commits about every two laps, a kill often leaves no committed row out of
    the dead writer's reach (measured: 4 of 6 trials had rows left to check)."""
    seed_store(tmp_path / "s", 256, True)
    rng = np.random.default_rng(0)
    trials, after_commit, mid_write, in_commit = 6, 0, 0, 0
    for trial in range(trials):
        board = Board.create(tmp_path / f"board{trial}", streams=2)
        state = board.state
        with mb.open(tmp_path / "s", mode="r") as ro:
            before = ro.generation
        proc = start("write", tmp_path / "s", trial, board.path, 0.02, tmp_path / "never")  # commits every ~2 laps
        try:
            deadline = time.monotonic() + HANG_S
            while state[COMMITS] == 0:  # the writer is live: it has committed once
                assert proc.poll() is None, f"the writer exited with {proc.returncode} before its first commit"
                assert time.monotonic() < deadline, f"hang: no commit in {HANG_S} s (a limit that only reports a hang)"
                time.sleep(0.005)
            time.sleep(float(rng.random()))  # 0-1 s: about 0-4 commits later
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()  # also when an assert above failed: never leave it writing
            proc.wait()
        assert proc.returncode == -signal.SIGKILL  # it was still writing
        mid_write += state[UNCOMMITTED] > 0
        in_commit += state[IN_COMMIT]
        reader = mb.open(tmp_path / "s", mode="r")
        after_commit += reader.generation > before
        assert reader.generation >= state[GENERATION]  # extend's own commits may have come after it
        assert all(reader.view().written >= board.written)
        report = verify(reader)
        assert report["ok"], report
        assert check_committed_rows(reader) >= len(reader)  # the check covered every row a reader may read
        committed = reader.view().written.tolist()
        reader.close()
        with mb.open(tmp_path / "s") as writer:  # recovery, then the strict check of the writer
            report = verify(writer)
            assert report["ok"] and not report["notes"], report
            assert writer.view().written.tolist() == committed
            assert check_committed_rows(writer) >= len(writer)
        with mb.open(tmp_path / "s") as writer:  # a new writer starts new episodes
            Writer(writer, seed=trial).extend(0, 1, end=True)
            Writer(writer, seed=trial).extend(1, 1, end=True)
    assert after_commit == trials, f"{after_commit} of {trials} kills landed after the child's first commit"
    assert mid_write >= trials - 1, f"only {mid_write} of {trials} kills landed mid-write ({in_commit} inside commit)"


@pytest.mark.parametrize("rows", [1, 20, 100])
def test_recovery_gives_up_only_the_dead_writers_reach(tmp_path, rows):
    """After a writer dies having written ``rows`` rows past its last commit, the next
    writer keeps every committed episode that starts at or above ``committed + rows -
    lane_size`` (the rows the dead writer reached, from ``index/progress``), with its
    data, and drops exactly the others; the reservation (a window ahead, durable) is
    lowered to that reach, never below."""
    from mmbuffer.config import config

    lane_size = 128
    buf = make_store(tmp_path / "s", lane_size=lane_size, streams=1, priorities=False)
    writer = Writer(buf, seed=4)
    for _ in range(10):  # wraps: the ring is full of committed episodes
        writer.extend(0, 30)
    writer.extend(0, 1, end=True)
    buf.close()
    before = mb.open(tmp_path / "s", mode="r")
    committed = int(before.view().written[0])
    starts, lengths = (t.numpy() for t in before.episodes())
    data = before.get(starts)["obs"].numpy()
    assert start("extend_and_die", tmp_path / "s", rows).wait(timeout=60) == 0
    reserved = int(before.reservation()[0])
    ahead = max(1, int(lane_size * config.reserve_fraction))
    assert committed + rows <= reserved <= committed + rows + ahead
    absolute = data[:, 3]  # each kept episode's first absolute row, from its encoding
    keep = absolute >= committed + rows - lane_size
    by_window = absolute >= reserved - lane_size  # what the reservation alone would keep
    assert keep.sum() >= by_window.sum() and (rows > 1 or keep.sum() > by_window.sum())  # 1 row: the window cost more
    after = mb.open(tmp_path / "s")
    s2, n2 = (t.numpy() for t in after.episodes())
    assert keep.any() and (rows < 100 or not keep.all())  # the 100-row death does cost episodes
    assert np.array_equal(s2, starts[keep]) and np.array_equal(n2, lengths[keep])
    assert np.array_equal(after.get(s2)["obs"].numpy(), data[keep])
    assert int(after.reservation()[0]) == committed + rows  # lowered to the reach
    after.close()
    assert int(before.reservation()[0]) == committed + rows  # released at the cursor by the clean close
    before.close()


def test_a_writer_never_leaves_more_than_a_lane_uncommitted(tmp_path):
    """extend commits before a lane's uncommitted rows exceed a lane, so a writer killed
    at any instant leaves a reservation within written + 2 * lane_size of the last
    commit (the bound an open checks), and the next writer opens the store."""
    buf = make_store(tmp_path / "s", lane_size=128, streams=1, priorities=False)
    writer = Writer(buf, seed=7)
    generation = buf.generation
    for _ in range(40):
        writer.extend(0, 16)
        committed = int(mb.open(tmp_path / "s", mode="r").view().written[0])
        assert writer.written[0] - committed <= 128
        assert committed <= int(buf.reservation()[0]) <= committed + 2 * 128
    assert buf.generation > generation
    buf.close()
    assert start("write_laps_and_die", tmp_path / "s").wait(timeout=60) == 0
    with mb.open(tmp_path / "s") as again:  # the open's bound holds after the kill
        assert verify(again)["ok"]
