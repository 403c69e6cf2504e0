"""The harness of the reader/writer races (``test_readers.py``, ``benchmarks/bench_readers.py``).

Every row encodes where it belongs: ``id = (stream, episode, step, absolute row)``,
``obs`` repeats the id (so ``next_obs`` is checkable) and ``wide`` is a function of
the id over 64 values (a row torn across columns or inside a row disagrees). A
reader's batch is checked against the encoding and against its own commit: every
row it returns must have been written at or before the commit it reads, at the
ring position it was read from, in one episode per slice, with consecutive steps.

The writers and readers of a race are processes of their own, forked warm
(``tests/warm.py``: :func:`start`). They show the parent their progress on a
:class:`Board`, a small int64 file every one of them maps, which the parent reads
while they run and after a SIGKILL, and each writes its final counts as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import warm

import mmbuffer as mb
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


def seed_store(path, lane_size, priorities):
    buf = make_store(path, lane_size=lane_size, priorities=priorities)
    writer = Writer(buf, seed=5)
    for _ in range(2 * lane_size // 20):
        for s in range(buf.num_streams):
            writer.extend(s, 20)
    for s in range(buf.num_streams):  # a new writer starts new episodes
        writer.extend(s, 1, end=True)
    buf.close()


# The board's slots: its shape, then the writer's state (as of its last commit), then one
# slot per lane (WRITTEN) and two per reader (batches drawn, distinct commits seen).
STREAMS, READERS, STOP, COMMITS, GENERATION, UNCOMMITTED, IN_COMMIT, HEAD = range(8)


class Board:
    """Counters the processes of a race share through a mapped int64 file: the writer's
    ``state`` (commits, generation of its last commit, rows extended since, whether it
    is inside ``commit``), its lanes' cursors as of its last commit (``written``), each
    reader's batches (``drawn``) and distinct commits seen (``seen``), and ``STOP``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.state = np.memmap(self.path, np.int64, mode="r+")
        streams, readers = int(self.state[STREAMS]), int(self.state[READERS])
        self.written = self.state[HEAD : HEAD + streams]
        self.drawn = self.state[HEAD + streams : HEAD + streams + readers]
        self.seen = self.state[HEAD + streams + readers :]

    @classmethod
    def create(cls, path: str | os.PathLike[str], streams: int, readers: int = 0) -> Board:
        slots = np.zeros(HEAD + streams + 2 * readers, np.int64)
        slots[STREAMS], slots[READERS] = streams, readers
        slots.tofile(path)
        return cls(path)


def write_loop(path: str, seed: int, board: Board, commit_p: float = 0.3) -> dict[str, int]:
    """Extend every lane, commit with probability ``commit_p`` per round, update
    priorities; until the board says stop. Shows its progress on ``board``."""
    buf = mb.open(path)
    writer = Writer(buf, seed)
    rng = np.random.default_rng(seed)
    state = board.state
    commits = rows = 0
    g = torch.Generator().manual_seed(seed)
    while not state[STOP]:
        for s in range(buf.num_streams):
            n = int(rng.integers(1, 24))
            state[UNCOMMITTED] += n  # before the extend: set while any of its rows may be on disk
            writer.extend(s, n)
            rows += n
        if rng.random() < commit_p:
            state[IN_COMMIT] = 1
            generation = buf.commit()
            state[GENERATION] = generation
            board.written[:] = writer.written
            state[UNCOMMITTED] = state[IN_COMMIT] = 0
            state[COMMITS] += 1
            commits += 1
        if buf.priorities is not None and rng.random() < 0.3:
            b = buf.sample(32, prioritized=True, generator=g, keys=["reward"])
            buf.update_priorities(b.indices, torch.rand(32, generator=g) * 10)
    buf.close()
    return {"rows_written": rows, "commits": commits}


def read_loop(path: str, seed: int, board: Board, me: int) -> dict[str, int]:
    """Refresh and draw every way in turn until the board says stop, checking every
    row; ``verify`` every 50 batches. Shows its batches and commits seen on ``board``."""
    reader = mb.open(path, mode="r")
    g = torch.Generator().manual_seed(seed)
    counts = {"batches": 0, "bad_batches": 0, "bad_rows": 0, "verified": 0, "verify_failed": 0}
    generations = set()
    kinds = ["uniform", "slices", "padded"] + (["prioritized"] if reader.priorities else [])
    while not board.state[STOP]:
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
        board.drawn[me], board.seen[me] = counts["batches"], len(generations)
    counts["fewest_generations"] = len(generations)
    return counts


def run_ahead_and_die(path: str) -> None:
    """Extend past the reservation of the last commit, then end without a commit, a
    close or a release of the reservation: a crash."""
    writer = Writer(mb.open(path), seed=2)
    for _ in range(3):
        writer.extend(0, 30)
    os._exit(0)


def extend_and_die(path: str, rows: str) -> None:
    Writer(mb.open(path), seed=3).extend(0, int(rows), p_end=0.0)
    os._exit(0)


def write_laps_and_die(path: str) -> None:
    writer = Writer(mb.open(path), seed=6)
    for _ in range(40):  # five laps of a 128-row lane, never a commit of its own
        writer.extend(0, 16)
    os._exit(0)


def _write(path: str, seed: str, board: str, commit_p: str, report: str) -> None:
    counts = write_loop(path, int(seed), Board(board), float(commit_p))
    Path(report).write_text(json.dumps(counts))


def _read(path: str, seed: str, board: str, me: str, report: str) -> None:
    counts = read_loop(path, int(seed), Board(board), int(me))
    Path(report).write_text(json.dumps(counts))


ROLES = {"write": _write, "read": _read, "run_ahead_and_die": run_ahead_and_die,
         "extend_and_die": extend_and_die, "write_laps_and_die": write_laps_and_die}
_CHILD = "import sys\nsys.path.insert(0, sys.argv[1])\nimport racing\nracing.ROLES[sys.argv[2]](*sys.argv[3:])"


def start(role: str, *args: object) -> warm.Child:
    """A process of its own, forked warm, that runs ``ROLES[role](*args)`` (as strings)."""
    return warm.start(_CHILD, [str(Path(__file__).parent), role, *map(str, args)])


HANG_S = 900


def run_race(path, laps: int, batches: int, readers: int, generations: int = 10) -> dict[str, int]:
    """One writer and ``readers`` reader processes, until the writer has written
    ``laps`` times each lane's size to every lane and every reader has drawn
    ``batches`` batches from at least ``generations`` distinct commits (so it read
    while the writer wrote); summed counts (``fewest_generations``: the fewest
    distinct commits one reader drew from).

    No speed is asked of the machine: a race runs until its goals are reached, however
    long that takes; ``HANG_S`` only turns a hang into a failure that says so."""
    path = Path(path)
    with mb.open(path, mode="r") as ro:
        lane_size, streams, first = ro.lane_size, ro.num_streams, np.array(ro.view().written)
    board = Board.create(path.parent / "board", streams, readers)
    reports = [path.parent / f"report-{i}.json" for i in range(readers + 1)]
    procs = [start("write", path, 7, board.path, 0.3, reports[0])]
    procs += [start("read", path, 100 + i, board.path, i, reports[i + 1]) for i in range(readers)]
    try:
        deadline = time.monotonic() + HANG_S
        while True:
            # the writer's cursors as of its last commit (readers draw from commits)
            lapped = int((board.written - first).min()) // lane_size if board.state[COMMITS] else 0
            if lapped >= laps and board.drawn.min() >= batches and board.seen.min() >= generations:
                break
            dead = [p.returncode for p in procs if p.poll() is not None]
            assert not dead, f"a process of the race exited early: exit codes {dead}"
            assert time.monotonic() < deadline, (
                f"hang: after {HANG_S} s (a limit that only reports a hang, not a speed requirement) the writer "
                f"had lapped {lapped} of {laps} times and the readers drawn {board.drawn.tolist()} of {batches} "
                f"batches from {board.seen.tolist()} of {generations} commits")
            time.sleep(0.05)
    except BaseException:
        board.state[STOP] = 1
        for p in procs:  # a failed race leaves no process behind
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise
    board.state[STOP] = 1
    ended = [p.wait(timeout=HANG_S) for p in procs]
    assert ended == [0] * len(procs), f"exit codes {ended}"
    (writer, *counts) = (json.loads(r.read_text()) for r in reports)
    total = dict(writer)
    for c in counts:
        for k, v in c.items():
            total[k] = min(total.get(k, v), v) if k == "fewest_generations" else total.get(k, 0) + v
    return total

