"""A kill loses only what was uncommitted, and counters are checked on write (issue 22, item 4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import warm
from sigkill import kill_when

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer._ledger import index
from mmbuffer._ledger.manifest import MAX_COUNTER

# The writer reports to a file: "E lane written rows" just before each extend,
# "C generation written_0 ..." just after each commit returns. It commits after every
# round of one extend per lane, so the rows past a commit are at most one extend per lane.
WRITER = textwrap.dedent(
    """
    import os, sys, numpy as np, mmbuffer as mb
    path, report = sys.argv[1], sys.argv[2]
    fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    buf = mb.open(path)
    rng = np.random.default_rng(int(sys.argv[3]))
    while True:
        for s in range(buf.num_streams):
            w, n = int(buf.view().written[s]), 37
            rows = w + np.arange(n)
            ends = (rows * 7 + s) % 23 == 0
            os.write(fd, f"E {s} {w} {n}\\n".encode())
            buf.extend({"x": (rows * 10 + s).astype(np.int64), "terminated": ends},
                       stream=s, final_obs={"x": (rows[ends] * 10 + s + 1).astype(np.int64)})
        if buf.priorities is not None:
            b = buf.sample(32)
            buf.update_priorities(b, rng.random(32) + 0.1)
        gen = buf.commit()
        os.write(fd, ("C %d %s\\n" % (gen, " ".join(str(int(w)) for w in buf.view().written))).encode())
    """
)
STORES = {  # name: (num_streams, lane_size, create options)
    "raw": (1, 2000, {}),
    "prioritized": (2, 2000, {"priorities": mb.PriorityConfig()}),
    "multi-stream": (3, 1500, {}),
    "compressed": (2, 2000, {"compression": "zstd"}),
    "codec": (2, 2000, {"codec": "zstd"}),  # shards of 400 rows: kills land mid-encode and mid-staging
}
KILL_TRIALS = int(os.environ.get("MMBUFFER_KILL_TRIALS", "5"))  # the harness runs more: benchmarks/RESULTS.md


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


def _committed_episodes(path):
    """Per lane, the absolute starts of the complete episodes the manifest on disk
    names (read before any writer recovers), and the reservation and generation."""
    with mb.open(path, mode="r") as ro:
        store = ro.store
        out = []
        for lane, st in enumerate(store.ledger.lanes):  # the manifest's, before any eviction
            starts, _ = index.starts_lengths(store.ends, lane, store.lane_size, st)
            out.append((st.written, set(starts.tolist())))
        return out, ro.reservation().tolist(), ro.generation


def _recovered_episodes(buf):
    """Per lane, the absolute starts of the live episodes, each checked whole: its
    values are ``10 * absolute + lane`` in order, its last row is an end, and its
    final observation is the next value."""
    starts, lengths = buf.episodes()
    out = [set() for _ in range(buf.num_streams)]
    if not len(starts):
        return out
    lanes = starts.numpy() // buf.lane_size
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths.numpy()) - lengths.numpy(), lengths.numpy())
    rows = np.repeat(lanes * buf.lane_size, lengths.numpy()) + (np.repeat(starts.numpy() % buf.lane_size,
                                                                          lengths.numpy()) + offsets) % buf.lane_size
    got = buf.get(rows, keys=["x", "terminated", "next_x"])  # every episode in one read, split below
    bounds = np.cumsum(lengths.numpy())[:-1]
    for lane, v, ends, nxt in zip(lanes.tolist(), *(np.split(got[k].numpy(), bounds) for k in ("x", "terminated", "next_x"))):
        assert (v % 10 == lane).all() and (np.diff(v // 10) == 1).all(), f"torn episode in lane {lane}"
        a = v // 10
        assert ((a[-1] * 7 + lane) % 23 == 0) and bool(ends[-1]) and nxt[-1] == v[-1] + 1
        out[lane].add(int(a[0]))
    return out


def _check_tree(buf):
    """The tree is exactly what a rebuild from the leaves makes, and its leaves are
    positive on the live rows (complete and open episodes) and 0 elsewhere."""
    from mmbuffer import tree

    pt = buf.store.priority_tree
    assert tree.check(pt) == 0.0
    live = np.zeros(buf.capacity, bool)
    for lane, lv in enumerate(buf.view().lanes):
        for a, b in buf.layout.segments(lane, lv.first_start, int(buf.view().written[lane])):
            live[a:b] = True
    leaves = np.asarray(pt.leaves)
    assert (leaves[live] > 0).all() and (leaves[~live] == 0).all()


@pytest.mark.parametrize("kind", list(STORES))
def test_sigkill_loses_only_what_the_last_extends_reached(tmp_path, kind, monkeypatch, caplog):
    """A live writer that has wrapped its ring (committing after every extend of each
    lane) is SIGKILLed at a random instant; the next writer keeps every committed
    episode whose rows the dead writer's last extends could not reach (it starts at or
    above ``reach - lane_size``, ``reach`` the end of the last extend reported), with
    its data, and drops nothing else that was committed. Counted against what was
    committed, and against what the reservation window alone would have kept.

    Proves where its kills landed: all after the child wrapped every lane and
    committed, most mid-write (an extend or commit begun since the last commit).
    A prioritized store's tree is never rebuilt whole and is then exactly a rebuild's:
    after a kill between commits no block is repaired (the writer's changes were in
    its private pages), after one inside a commit's tree write the marked blocks are
    (``_ledger/touched.py``). This writer commits after every round, so either kind
    of kill may land in a run of 5; ``test_private_tree.py`` and the test below make
    each on purpose."""
    from mmbuffer import tree
    from mmbuffer._ledger.verify import verify

    rebuilds = []
    real_rebuild = tree.rebuild
    monkeypatch.setattr(tree, "rebuild", lambda *a, **k: (rebuilds.append(1), real_rebuild(*a, **k))[1])

    streams, lane_size, options = STORES[kind]
    options = dict(options)
    path = tmp_path / "s"
    mb.create(path, {"x": mb.Column((), "int64", codec=options.pop("codec", None))}, capacity=streams * lane_size,
              num_streams=streams, next_keys=("x",), **options).close()
    rng = np.random.default_rng(1)
    mid_write = committed_total = kept_total = expected_total = window_total = 0
    for trial in range(KILL_TRIALS):
        report = tmp_path / f"report{trial}"
        proc = warm.start(WRITER, [str(path), str(report), str(trial)], stderr=subprocess.PIPE, text=True)
        def lapped() -> bool:  # a commit of this child shows every lane a lap further than its first
            commits = [line.split() for line in _lines(report) if line.startswith("C ")]
            return bool(commits) and all(int(w) >= int(s) + 1.2 * lane_size for w, s in zip(commits[-1][2:], commits[0][2:]))

        pause = float(rng.random()) * 0.1
        kill_when(proc, lapped, lambda: time.sleep(pause), waiting_for="lap")
        lines = _lines(report)
        mid_write += lines[-1].startswith("E ")
        last_c = max(i for i, line in enumerate(lines) if line.startswith("C "))
        gen = int(lines[last_c].split()[1])
        episodes, reserved, generation = _committed_episodes(path)
        assert generation in (gen, gen + 1)  # the last reported, or the one the kill cut short after its rename
        reach = [written for written, _ in episodes]
        for line in lines[last_c + 1 :]:
            if line.startswith("E "):
                _, s, w, n = line.split()
                reach[int(s)] = max(reach[int(s)], int(w) + int(n))
        assert all(r - w <= 37 for r, (w, _) in zip(reach, episodes))  # one extend per lane past the commit
        in_tree_write = (path / "priority" / "DIRTY").exists()  # killed inside a commit's tree write
        caplog.clear()
        with caplog.at_level("INFO", logger="mmbuffer"), mb.open(path) as buf:  # the next writer recovers
            assert rebuilds == [], "recovery rebuilt the whole tree"
            repaired = [m for m in caplog.messages if "blocks repaired" in m]
            if not in_tree_write:  # between commits the file holds the committed tree: nothing to repair
                assert repaired in ([], ["priority tree: 0 blocks repaired after an interrupted writer"])
            else:  # the blocks that commit marked (none if the kill came before its marks)
                assert len(repaired) == 1, repaired
            if buf.priorities is not None:
                _check_tree(buf)
            kept = _recovered_episodes(buf)
            assert buf.view().written.tolist() == [w for w, _ in episodes]  # the committed cursors
            assert verify(buf)["ok"]
        for lane, (written, starts) in enumerate(episodes):
            expected = {a for a in starts if a >= reach[lane] - lane_size}
            assert expected <= kept[lane], f"lane {lane}: committed episodes lost: {sorted(expected - kept[lane])[:5]}"
            assert kept[lane] <= starts, f"lane {lane}: episodes that were never committed"
            committed_total += len(starts)
            kept_total += len(kept[lane])
            expected_total += len(expected)
            window_total += len({a for a in starts if a >= reserved[lane] - lane_size})
        with mb.open(path, mode="r") as ro:  # a reader after recovery sees what the writer kept
            assert [len(k) for k in _recovered_episodes(ro)] == [len(k) for k in kept]
    assert mid_write >= 0.6 * KILL_TRIALS, f"only {mid_write} of {KILL_TRIALS} kills landed mid-write"
    # the reservation window alone would have given up more committed episodes than recovery did
    assert kept_total > window_total, (kept_total, window_total)
    assert committed_total - kept_total <= committed_total - expected_total


def _store_near_the_limit(path, written, generation=1):
    """A store whose lane has ``written`` rows ever written (none live), as a long
    run would leave it: manifest and reservation set to that count."""
    mb.create(path, {"x": ((), "int64")}, capacity=100, next_keys=()).close()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["lanes"] = [{"written": written, "ep_head": 0, "ep_tail": 0, "first_start": written}]
    manifest["generation"] = generation
    (path / "manifest.json").write_text(json.dumps(manifest))
    shard = path / "index" / "reserved" / "c" / "0"
    reserved = np.memmap(shard, dtype="<i8", mode="r+", shape=(1,))
    reserved[0] = written
    reserved.flush()
    del reserved


def test_counters_are_checked_on_write_as_on_open(tmp_path):
    """An extend that would take a lane past 2**62 rows (what every open refuses) is
    refused, typed, and changes nothing; extends up to the limit work, commit, and the
    store opens; a commit whose generation would pass the limit is refused too."""
    path = tmp_path / "s"
    _store_near_the_limit(path, MAX_COUNTER - 150)
    ends = np.arange(100) % 10 == 9
    with mb.open(path) as buf:
        buf.extend({"x": np.arange(100), "terminated": ends})
        assert int(buf.reservation()[0]) <= MAX_COUNTER
        files = {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != "LOCK"}
        with pytest.raises(errors.CapacityError, match="2\\*\\*62"):
            buf.extend({"x": np.arange(100), "terminated": ends})
        assert buf.view().written.tolist() == [MAX_COUNTER - 50]
        assert {p: p.read_bytes() for p in files} == files  # nothing changed on disk
        buf.extend({"x": np.arange(50), "terminated": ends[:50]})  # exactly to the limit
        assert buf.commit() > 1
    with mb.open(path, mode="r") as ro:  # an open accepts what the writer wrote
        assert ro.view().written.tolist() == [MAX_COUNTER] and len(ro) == 100
    other = tmp_path / "g"
    _store_near_the_limit(other, 0, generation=MAX_COUNTER)
    buf = mb.open(other)
    buf.extend({"x": np.arange(3)})
    with pytest.raises(errors.CapacityError, match="generation"):
        buf.commit()
    assert buf.generation == MAX_COUNTER
    with pytest.raises(errors.CapacityError, match="generation"):
        buf.close()  # its commit is refused as well; the lock is released all the same
    with mb.open(other, mode="r") as ro:
        assert ro.generation == MAX_COUNTER and ro.view().written.tolist() == [0]


CRASH = textwrap.dedent(
    """
    import os, sys, numpy as np, mmbuffer as mb
    buf = mb.open(sys.argv[1])
    for k in range(9):  # past the lane of 5000: a commit before the last, then rows and priorities after it
        rows = k * 600 + np.arange(600)
        buf.extend({"x": rows * 10, "terminated": rows % 9 == 8}, final_obs={"x": rows[rows % 9 == 8] * 10 + 1})
        buf.update_priorities(buf.sample(20), np.random.default_rng(k).random(20) + 0.5)
        if k == 5:  # a checkpoint: the tree's pages in the file (later commits append to the log)
            buf._writer.commit(checkpoint=True)
        if k == 7:
            buf.commit()
    assert buf._writer._marks.log_commits >= 1 and buf.store.manifest.priority_log[1] > 0  # a log-only commit
    from mmbuffer._disk import rawio
    real = rawio.write_private
    def dying(fd, mm, pages):  # half of the leaves' changed pages reach the file, then the kill
        real(fd, mm, pages[: len(pages) // 2])
        os.kill(os.getpid(), 9)
    rawio.write_private = dying
    buf._writer.commit(checkpoint=True)  # killed inside its tree write
    """
)


@pytest.mark.parametrize("reboot", [False, True])
def test_a_killed_writers_tree_is_repaired_where_it_changed_or_rebuilt_after_a_reboot(tmp_path, monkeypatch, caplog, reboot):
    """Killed inside a commit's tree write (half the changed leaf pages written, none
    of the nodes), the window where the file's tree may disagree with itself: the next
    writer repairs the tree in the blocks that commit marked (no whole rebuild); when the
    marks are of another boot (simulated: the record's boot id changed, as a reboot
    changes the kernel's), it rebuilds the whole tree. Either way the tree is then
    exactly a rebuild's, with leaves on the live rows only."""
    from mmbuffer import tree
    from mmbuffer._ledger import progress

    path = tmp_path / "s"
    mb.create(path, {"x": ((), "int64")}, capacity=5000, next_keys=("x",), priorities=mb.PriorityConfig()).close()
    child = subprocess.run([sys.executable, "-c", CRASH, str(path)], timeout=300)
    assert child.returncode == -signal.SIGKILL  # killed where it was meant to be
    assert (path / "priority" / "DIRTY").exists()  # inside a commit's tree write
    marks = np.fromfile(path / "priority" / "touched" / "c" / "0", dtype=np.uint8)[: -(-5000 // 64)]
    assert 0 < marks.sum() < len(marks) or reboot  # some blocks marked, not all
    if reboot:
        record = np.memmap(path / "index" / "progress" / "c" / "0", dtype="<i8", mode="r+", shape=(3,))
        record[:2] = np.array(progress.boot_id()) ^ 1
        record.flush()
        del record
    rebuilds = []
    real_rebuild = tree.rebuild
    monkeypatch.setattr(tree, "rebuild", lambda *a, **k: (rebuilds.append(1), real_rebuild(*a, **k))[1])
    with caplog.at_level("INFO", logger="mmbuffer"), mb.open(path) as buf:
        assert rebuilds == ([1] if reboot else [])
        repaired = [r for r in caplog.messages if "blocks repaired" in r]
        assert repaired == ([] if reboot else [f"priority tree: {int(marks.sum())} blocks repaired after an interrupted writer"])
        _check_tree(buf)
        assert buf.view().written.tolist() == [4800]  # the rows after the last commit are gone
        assert not np.asarray(np.fromfile(path / "priority" / "touched" / "c" / "0", dtype=np.uint8)[: len(marks)]).any()
