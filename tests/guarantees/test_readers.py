"""Readers in other processes never return rows the writer has begun rewriting.

Every row encodes where it belongs: ``id = (stream, episode, step, absolute row)``,
``obs`` repeats the id (so ``next_obs`` is checkable) and ``wide`` is a function of
the id over 64 values (a row torn across columns or inside a row disagrees). A
reader's batch is checked against the encoding and against its own commit: every
row it returns must have been written at or before the commit it reads, at the
ring position it was read from, in one episode per slice, with consecutive steps.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

import mmbuffer as mb
import mmbuffer._read.batch as batch_module
import mmbuffer._read.recheck as recheck_module
from mmbuffer._ledger.verify import verify

WIDE = 64
COLUMNS = {"obs": ((4,), "int64"), "wide": ((WIDE,), "float32"), "reward": ((), "float32")}


def wide_of(ids: np.ndarray) -> np.ndarray:
    """A deterministic 64-wide row of each id (float32-exact small integers)."""
    key = (ids[..., 1] * 7919 + ids[..., 2] * 31 + ids[..., 3]) % 65521
    return ((key[..., None] + np.arange(WIDE)) % 65536).astype(np.float32)


class Writer:
    """Episodes of random length per stream, every row encoding itself."""

    def __init__(self, buf: mb.Buffer, seed: int) -> None:
        self.buf = buf
        self.rng = np.random.default_rng(seed)
        self.written = [buf.view().written[s] for s in range(buf.num_streams)]
        self.episode = [0] * buf.num_streams
        self.step = [0] * buf.num_streams

    def extend(self, stream: int, rows: int, p_end: float = 0.08, end: bool = False) -> None:
        done = self.rng.random(rows) < p_end
        done[-1] |= end
        ids = np.empty((rows, 4), dtype=np.int64)
        finals = []
        ep, st = self.episode[stream], self.step[stream]
        for t in range(rows):  # test data: clarity over speed
            ids[t] = (stream, ep, st, self.written[stream] + t)
            st += 1
            if done[t]:
                finals.append((stream, ep, st, -1))
                ep, st = ep + 1, 0
        self.episode[stream], self.step[stream] = ep, st
        self.written[stream] += rows
        steps = {"obs": ids, "wide": wide_of(ids), "reward": ids[:, 2].astype(np.float32), "terminated": done}
        self.buf.extend(steps, stream=stream, final_obs={"obs": np.array(finals, dtype=np.int64).reshape(-1, 4)})


def violations(batch: mb.Batch, lane_size: int, committed: np.ndarray) -> int:
    """Rows of ``batch`` that break the encoding or were not in the reader's commit."""
    ids = batch.data["obs"].numpy()
    rows = batch.indices.numpy()
    mask = np.ones(rows.shape, bool) if batch.mask is None else batch.mask.numpy()
    bad = (ids[..., 0] != rows // lane_size) | (ids[..., 3] % lane_size != rows % lane_size)
    bad |= ids[..., 3] >= committed[rows // lane_size]  # written after the commit the reader reads
    bad |= (batch.data["wide"].numpy() != wide_of(ids)).any(-1)
    bad |= batch.data["reward"].numpy() != ids[..., 2]
    nxt = batch.data["next_obs"].numpy()
    bad |= (nxt[..., 0] != ids[..., 0]) | (nxt[..., 2] != ids[..., 2] + 1)
    bad |= nxt[..., 1] != ids[..., 1]  # the next row's, or the final observation of the same episode
    if rows.ndim == 2:  # one episode per slice, consecutive steps
        bad[:, 1:] |= (ids[:, 1:, 1] != ids[:, :1, 1]) | (ids[:, 1:, 2] != ids[:, :1, 2] + np.arange(1, rows.shape[1]))
    return int((bad & mask).sum())


def draw(reader: mb.Buffer, kind: str, n: int, g: torch.Generator) -> mb.Batch:
    """A batch of ``n`` transitions, or ``n // 4`` windows, drawn the way ``kind`` names."""
    if kind == "uniform":
        return reader.sample(n, generator=g)
    if kind == "slices":
        return reader.sample_slices(n // 4, 4, generator=g)
    if kind == "padded":
        return reader.sample_slices(n // 4, 8, strict=False, generator=g)
    return reader.sample(n, prioritized=True, generator=g)


def committed_written(reader: mb.Buffer) -> np.ndarray:
    return np.array(reader.view().written)


def make_store(path, lane_size=256, streams=2, priorities=True):
    return mb.create(
        path, COLUMNS, capacity=lane_size * streams, num_streams=streams,
        priorities=mb.PriorityConfig(alpha=0.6) if priorities else None,
    )


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


def _run_ahead_and_die(path: str) -> None:
    buf = mb.open(path)
    writer = Writer(buf, seed=2)
    for _ in range(3):  # past the reservation of the last commit, no commit
        writer.extend(0, 30)
    os._exit(0)  # no close, no commit, no release of the reservation: a crash


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
    proc = mp.get_context("spawn").Process(target=_run_ahead_and_die, args=(str(tmp_path / "s"),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    mb.open(tmp_path / "s").close()  # recovery by a new writer, then a clean close
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert violations(reader.sample(128, generator=g), reader.lane_size, committed) == 0
        assert violations(reader.sample_slices(16, 4, generator=g), reader.lane_size, committed) == 0


# -- many processes ------------------------------------------------------------------------
# No speed is asked of the machine: a race runs until the writer has wrapped the ring a
# stated number of times and every reader has drawn a stated number of batches, however
# long that takes; HANG_S only turns a hang into a failure that says so.
HANG_S = 900

# the writer's shared state, for the parent to read (also after a SIGKILL)
COMMITS, GENERATION, UNCOMMITTED, IN_COMMIT, WRITTEN = 0, 1, 2, 3, 4  # WRITTEN: one slot per lane


def _write_loop(path: str, seed: int, stop, state, out: mp.Queue | None, commit_p: float = 0.3) -> None:
    """Extend every lane, commit with probability ``commit_p`` per round, update
    priorities; until ``stop`` is set (never, when it is None). ``state`` (a shared
    int64 array) shows the parent its commits, the generation and cursors of its last
    commit, its rows extended since then and whether it is inside ``commit``."""
    buf = mb.open(path)
    writer = Writer(buf, seed)
    rng = np.random.default_rng(seed)
    commits = rows = 0
    g = torch.Generator().manual_seed(seed)
    while stop is None or not stop.is_set():
        for s in range(buf.num_streams):
            n = int(rng.integers(1, 24))
            state[UNCOMMITTED] += n  # before the extend: set while any of its rows may be on disk
            writer.extend(s, n)
            rows += n
        if rng.random() < commit_p:
            state[IN_COMMIT] = 1
            generation = buf.commit()
            state[GENERATION] = generation
            for s in range(buf.num_streams):
                state[WRITTEN + s] = writer.written[s]
            state[UNCOMMITTED] = state[IN_COMMIT] = 0
            state[COMMITS] += 1
            commits += 1
        if buf.priorities is not None and rng.random() < 0.3:
            b = buf.sample(32, prioritized=True, generator=g, keys=["reward"])
            buf.update_priorities(b.indices, torch.rand(32, generator=g) * 10)
    buf.close()
    if out is not None:
        out.put(("writer", rows, commits))


def _read_loop(path: str, seed: int, stop, drawn, seen, me: int, out: mp.Queue) -> None:
    reader = mb.open(path, mode="r")
    g = torch.Generator().manual_seed(seed)
    counts = {"batches": 0, "bad_batches": 0, "bad_rows": 0, "verified": 0, "verify_failed": 0}
    generations = set()
    kinds = ["uniform", "slices", "padded"] + (["prioritized"] if reader.priorities else [])
    while not stop.is_set():
        reader.refresh()
        committed = committed_written(reader)
        kind = kinds[counts["batches"] % len(kinds)]
        try:
            b = draw(reader, kind, 128, g)
        except (mb.errors.EmptyBufferError, mb.errors.NoValidSliceError):
            continue
        bad = violations(b, reader.lane_size, committed)
        generations.add(reader.generation)
        counts["batches"] += 1
        counts["bad_batches"] += bad > 0
        counts["bad_rows"] += bad
        if counts["batches"] % 50 == 0:  # verify judges what a reader may read, with the writer running
            counts["verified"] += 1
            counts["verify_failed"] += not verify(reader)["ok"]
        drawn[me], seen[me] = counts["batches"], len(generations)
    counts["fewest_generations"] = len(generations)
    out.put(("reader", counts))


def run_race(path, laps: int, batches: int, readers: int, generations: int = 10) -> dict[str, int]:
    """One writer and ``readers`` reader processes, until the writer has written
    ``laps`` times each lane's size to every lane and every reader has drawn
    ``batches`` batches from at least ``generations`` distinct commits (so it read
    while the writer wrote); summed counts (``fewest_generations``: the fewest
    distinct commits one reader drew from)."""
    ctx = mp.get_context("spawn")
    with mb.open(path, mode="r") as ro:
        lane_size, streams, start = ro.lane_size, ro.num_streams, np.array(ro.view().written)
    out, stop = ctx.Queue(), ctx.Event()
    state = ctx.Array("q", WRITTEN + streams, lock=False)
    drawn, seen = ctx.Array("q", readers, lock=False), ctx.Array("q", readers, lock=False)
    procs = [ctx.Process(target=_write_loop, args=(str(path), 7, stop, state, out))]
    procs += [ctx.Process(target=_read_loop, args=(str(path), 100 + i, stop, drawn, seen, i, out)) for i in range(readers)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + HANG_S
        while True:
            # the writer's cursors as of its last commit (readers draw from commits)
            lapped = int((np.array(state[WRITTEN:]) - start).min()) // lane_size if state[COMMITS] else 0
            if lapped >= laps and min(drawn) >= batches and min(seen) >= generations:
                break
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            assert not dead, f"a process of the race exited early: exit codes {dead}"
            assert time.monotonic() < deadline, (
                f"hang: after {HANG_S} s (a limit that only reports a hang, not a speed requirement) the writer "
                f"had lapped {lapped} of {laps} times and the readers drawn {list(drawn)} of {batches} batches "
                f"from {list(seen)} of {generations} commits")
            time.sleep(0.05)
    except BaseException:
        stop.set()
        for p in procs:  # a failed race leaves no process behind
            p.join(timeout=60)
            p.kill()
            p.join()
        raise
    stop.set()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (_, rows, commits), = [r for r in results if r[0] == "writer"]
    total = {"rows_written": rows, "commits": commits}
    for _, counts in (r for r in results if r[0] == "reader"):
        for k, v in counts.items():
            total[k] = min(total.get(k, v), v) if k == "fewest_generations" else total.get(k, 0) + v
    return total


def seed_store(path, lane_size, priorities):
    buf = make_store(path, lane_size=lane_size, priorities=priorities)
    writer = Writer(buf, seed=5)
    for _ in range(2 * lane_size // 20):
        for s in range(buf.num_streams):
            writer.extend(s, 20)
    for s in range(buf.num_streams):  # a new writer starts new episodes
        writer.extend(s, 1, end=True)
    buf.close()


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


def _write_forever(path: str, seed: int, state) -> None:
    """Commits about every 50 rounds (two laps of a 256-row lane): at a kill the dead
    writer has usually rewritten rows of its last commit."""
    _write_loop(path, seed, None, state, None, commit_p=0.02)


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
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    trials, after_commit, mid_write, in_commit = 6, 0, 0, 0
    for trial in range(trials):
        state = ctx.Array("q", WRITTEN + 2, lock=False)
        with mb.open(tmp_path / "s", mode="r") as ro:
            before = ro.generation
        proc = ctx.Process(target=_write_forever, args=(str(tmp_path / "s"), trial, state))
        proc.start()
        try:
            deadline = time.monotonic() + HANG_S
            while state[COMMITS] == 0:  # the writer is live: it has committed once
                assert proc.exitcode is None, f"the writer exited with {proc.exitcode} before its first commit"
                assert time.monotonic() < deadline, f"hang: no commit in {HANG_S} s (a limit that only reports a hang)"
                time.sleep(0.005)
            time.sleep(float(rng.random()))  # 0-1 s: about 0-4 commits later
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()  # also when an assert above failed: never leave it writing
            proc.join()
        assert proc.exitcode == -signal.SIGKILL  # it was still writing
        mid_write += state[UNCOMMITTED] > 0
        in_commit += state[IN_COMMIT]
        reader = mb.open(tmp_path / "s", mode="r")
        after_commit += reader.generation > before
        assert reader.generation >= state[GENERATION]  # extend's own commits may have come after it
        assert all(int(w) >= state[WRITTEN + s] for s, w in enumerate(reader.view().written))
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


def _extend_and_die(path: str, rows: int) -> None:
    buf = mb.open(path)
    Writer(buf, seed=3).extend(0, rows, p_end=0.0)
    os._exit(0)


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
    proc = mp.get_context("spawn").Process(target=_extend_and_die, args=(str(tmp_path / "s"), rows))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
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


def _write_laps_and_die(path: str) -> None:
    buf = mb.open(path)
    writer = Writer(buf, seed=6)
    for _ in range(40):  # five laps of a 128-row lane, never a commit of its own
        writer.extend(0, 16)
    os._exit(0)


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
    proc = mp.get_context("spawn").Process(target=_write_laps_and_die, args=(str(tmp_path / "s"),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    with mb.open(tmp_path / "s") as again:  # the open's bound holds after the kill
        assert verify(again)["ok"]
