"""The writer's private tree pages (``_ledger/touched.py``): its tree changes stay in its
own copy-on-write map until a commit writes them, so the file only ever holds committed
sums (issue 22 item 3, issue 26 item 5)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import warm
from sigkill import HANG_S, kill_when

import mmbuffer as mb
from mmbuffer import tree
from mmbuffer._ledger.verify import verify

CAP = 20_000

# Commits once, saves the committed leaves and reports "C"; then extends and updates
# priorities without committing, reports "U" after each of ``rounds`` rounds, and waits
# to be killed (more rounds would reach the extend that commits on its own: the 7th
# 3000-row extend takes the lane's uncommitted rows past the lane).
KILLED = textwrap.dedent(
    """
    import os, sys, time, numpy as np, mmbuffer as mb
    path, report, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    buf = mb.open(path)
    rng = np.random.default_rng(0)
    def extend(n):
        w = int(buf.view().written[0])
        rows = w + np.arange(n)
        buf.extend({"x": rows, "terminated": rows % 50 == 49})
    extend(15_000)
    buf.update_priorities(np.arange(0, 15_000, 3), rng.random(5000) + 0.1)
    buf.commit()  # a checkpoint: a record of 15,000 rows would outweigh their pages
    buf.update_priorities(np.arange(1, 15_000, 97), rng.random(155) + 2.0)
    buf.commit()  # a log-only commit
    np.save(report + ".leaves.npy", np.array(buf.store.priority_tree.leaves))
    np.save(report + ".nodes.npy", np.array(buf.store.priority_tree.nodes))
    with open(report, "a") as f:
        f.write("C\\n")
    for _ in range(rounds):  # past the lane: rows overwritten, episodes evicted, priorities changed
        extend(3000)
        buf.update_priorities(buf.sample(4096), rng.random(4096) + 5.0)
        with open(report, "a") as f:
            f.write("U\\n")
    while True:  # never committed
        time.sleep(1)
    """
)


def _store(path):
    mb.create(path, {"x": ((), "int64")}, capacity=CAP, next_keys=(), priorities=mb.PriorityConfig()).close()


def _run_until(path, report, rounds):
    """Start the writer, wait for its commit and ``rounds`` uncommitted rounds after it, kill it."""
    proc = warm.start(KILLED, [str(path), str(report), str(rounds)], stderr=subprocess.PIPE, text=True)
    kill_when(proc, lambda: report.exists() and report.read_text().count("U") == rounds,
              waiting_for=f"{rounds} uncommitted rounds", poll=0.01)
    lines = report.read_text().split()
    assert lines[0] == "C" and lines.count("U") == rounds  # killed after its commit, with changes since
    return np.load(str(report) + ".leaves.npy"), np.load(str(report) + ".nodes.npy")


def test_a_kill_between_commits_leaves_the_committed_tree_and_repairs_nothing(tmp_path, monkeypatch, caplog):
    """The dead writer changed leaves and sums after its commit (rows past the lane,
    thousands of priorities); the file still holds exactly the committed tree, no
    DIRTY marker and no mark, so the next writer recomputes no block and rebuilds
    nothing, and its tree is exactly a rebuild of the committed leaves."""
    path, report = tmp_path / "s", tmp_path / "report"
    _store(path)
    leaves, nodes = _run_until(path, report, rounds=3)
    assert not (path / "priority" / "DIRTY").exists()
    marks = np.fromfile(path / "priority" / "touched" / "c" / "0", dtype=np.uint8)[: -(-CAP // tree.BLOCK)]
    assert not marks.any()
    with mb.open(path, mode="r") as ro:  # what a reader sees (the file and the log): the committed tree, bit for bit
        assert ro.store.manifest.priority_log[1] > 0  # the commit was a log-only one
        assert np.array_equal(np.asarray(ro.view().tree.leaves), leaves)
        assert np.array_equal(np.asarray(ro.view().tree.nodes), nodes)
    rebuilt = tree.init(CAP)
    rebuilt.leaves[:] = leaves
    tree.rebuild(rebuilt)
    assert np.array_equal(rebuilt.nodes, nodes)  # committed sums are a rebuild's
    rebuilds = []
    real_rebuild = tree.rebuild
    monkeypatch.setattr(tree, "rebuild", lambda *a, **k: (rebuilds.append(1), real_rebuild(*a, **k))[1])
    with caplog.at_level("INFO", logger="mmbuffer"), mb.open(path) as buf:
        assert rebuilds == []
        assert [m for m in caplog.messages if "blocks repaired" in m] == [
            "priority tree: 0 blocks repaired after an interrupted writer"
        ]
        assert buf.view().written.tolist() == [15_000]
        # the committed leaves, less the committed episodes the dead writer's rows overwrote
        live = np.zeros(CAP, bool)
        lane = buf.view().lanes[0]
        for a, b in buf.layout.segments(0, lane.first_start, 15_000):
            live[a:b] = True
        assert 0 < live.sum() < 15_000  # it did give up some: its extends went past the lane
        rebuilt.leaves[:] = np.where(live, leaves, 0)
        real_rebuild(rebuilt)
        pt = buf.store.priority_tree
        assert np.array_equal(np.asarray(pt.leaves), rebuilt.leaves) and np.array_equal(np.asarray(pt.nodes), rebuilt.nodes)


def test_readers_see_committed_sums_only(tmp_path):
    """A reader's map of the tree (another map of the same file, as in another process)
    does not change while the writer updates priorities and extends, and ``verify``
    from it finds the tree whole (no "uncommitted changes" note); it shows the
    writer's tree, bit for bit, once the writer commits."""
    path = tmp_path / "s"
    _store(path)
    rng = np.random.default_rng(0)
    with mb.open(path) as buf, mb.open(path, mode="r") as ro:
        buf.extend({"x": np.arange(8000), "terminated": np.arange(8000) % 40 == 39})
        buf.commit()
        mine = buf.store.priority_tree
        for _ in range(3):
            ro.refresh()
            theirs = ro.view().tree  # the file's tree and the committed log, replayed
            before = np.array(theirs.nodes), np.array(theirs.leaves)
            assert np.array_equal(before[0], mine.nodes) and np.array_equal(before[1], mine.leaves)
            buf.update_priorities(np.arange(0, 8000, 7), rng.random(1143) * 10 + 0.1)
            buf.extend({"x": np.arange(500), "terminated": np.arange(500) % 40 == 39})
            assert tree.total(mine) != tree.total(theirs)  # the writer sees its changes
            assert np.array_equal(theirs.nodes, before[0]) and np.array_equal(theirs.leaves, before[1])
            assert (path / "priority" / "DIRTY").exists() is False  # nothing for a crash to repair
            report = verify(ro.store)  # a reader judges the live store: its tree is whole
            assert report["ok"] and report["tree_drift"] == 0.0 and not report["notes"], report
            buf.commit()
        ro.refresh()
        theirs = ro.view().tree
        assert np.array_equal(theirs.nodes, mine.nodes) and np.array_equal(theirs.leaves, mine.leaves)


BOUNDED = textwrap.dedent(
    """
    import json, sys, numpy as np, mmbuffer as mb
    def anon():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) * 1024
    buf = mb.open(sys.argv[1])
    marks = buf._writer._marks
    rng = np.random.default_rng(0)
    buf.update_priorities(np.arange(200_000), rng.random(200_000))  # every leaf page changes
    buf.commit()
    base = anon()
    kept = []
    for _ in range(30):
        buf.update_priorities(rng.integers(0, 200_000, 2000), rng.random(2000))
        buf._writer.commit(checkpoint=True)  # the pages written: kept or dropped (a log-only commit keeps them)
        kept.append(marks.private_pages * 4096)
    print(json.dumps({"bound": marks.bound, "kept": kept, "drops": marks.drops, "anon_growth": anon() - base,
                      "tree": int(sum(a.nbytes for a in buf.store.priority_tree.arrays))}))
    buf.close()
    """
)


@pytest.mark.parametrize("bound", [256 << 10, 1 << 30])
def test_private_pages_stay_under_the_bound(tmp_path, bound):
    """``MMBUFFER_PRIVATE_TREE_BYTES``: after each commit the writer keeps at most that
    many bytes of private tree pages (counted, and seen in its RssAnon); a bound above
    the tree's size never drops them."""
    import json

    path = tmp_path / "s"
    mb.create(path, {"x": ((), "uint8")}, capacity=200_000, next_keys=(), priorities=mb.PriorityConfig()).close()
    with mb.open(path) as buf:
        buf.extend({"x": np.zeros(200_000, np.uint8), "truncated": np.arange(200_000) % 100 == 99})
    env = {**os.environ, "MMBUFFER_PRIVATE_TREE_BYTES": str(bound)}
    out = subprocess.run([sys.executable, "-c", BOUNDED, str(path)], capture_output=True, text=True, env=env,
                         check=True, timeout=HANG_S)
    res = json.loads(out.stdout)
    assert res["bound"] == bound
    tree_bytes = res["tree"]  # 200,000 rows: 800 KB of leaves, a few KB of nodes
    if bound < tree_bytes:
        assert res["drops"] >= 10  # 2,000 random rows touch most leaf pages: dropped again and again
        assert max(res["kept"]) <= bound
        assert res["anon_growth"] <= bound + (1 << 20)  # RssAnon: what was kept, and allocator noise
    else:
        assert res["drops"] == 0
        assert min(res["kept"]) >= 0.9 * tree_bytes  # every page stays private, none faults again


def test_a_private_page_is_never_left_unwritten(tmp_path):
    """Whatever the writer changed since its checkpoint (pagemap: pages this process holds
    a private copy of), the checkpoint writes: after it, the file equals the writer's map;
    after a log-only commit, a reader's (the file plus the log) does."""
    path = tmp_path / "s"
    _store(path)
    rng = np.random.default_rng(3)
    with mb.open(path) as buf, mb.open(path, mode="r") as ro:
        for k in range(12):
            n = int(rng.integers(100, 4000))
            buf.extend({"x": np.arange(n), "terminated": rng.random(n) < 0.05})
            if k % 3:
                live = int(len(buf))
                buf.update_priorities(rng.integers(0, max(live, 1), 300), rng.random(300) * 3)
            if k % 4 == 1:
                buf.set_leaf_priorities(np.arange(0, min(len(buf), CAP), 11), 0.5)
            buf._writer.commit(checkpoint=k % 3 == 2)
            ro.refresh()
            mine, theirs = buf.store.priority_tree, ro.view().tree
            assert np.array_equal(theirs.leaves, mine.leaves) and np.array_equal(theirs.nodes, mine.nodes)
            assert tree.check(theirs) == 0.0
            if k % 3 == 2:  # a checkpoint: the file itself
                assert ro.store.manifest.priority_log == (0, 0) or buf.store.manifest.priority_log[1] == 0
                assert np.array_equal(np.fromfile(path / "priority" / "leaves" / "c" / "0", "<f4", CAP), mine.leaves)


def test_what_a_writer_records_between_commits_stays_bounded_by_the_tree(tmp_path):
    """Hours of priority updates (and one-row extends) without a commit: the blocks the
    writer records for its next commit are one flag per block of the tree and the ranges
    are merged as they pile up, so they hold at most the tree's blocks, not one array per
    update; the commit after them still writes every change (the file equals the
    writer's map) and clears every flag."""
    from mmbuffer._ledger import touched

    path = tmp_path / "s"
    _store(path)
    rng = np.random.default_rng(4)
    blocks = -(-CAP // tree.BLOCK)
    with mb.open(path) as buf, mb.open(path, mode="r") as ro:
        buf.extend({"x": np.arange(15_000), "terminated": np.arange(15_000) % 50 == 49})
        buf.commit()
        marks = buf._writer._marks
        recorded = 0
        for _ in range(1000):
            rows = rng.integers(0, 15_000, 2048)
            recorded += len(np.unique(rows // tree.BLOCK))
            buf.update_priorities(rows, rng.random(2048) * 3)
        for i in range(touched._COMPACT + 10):  # one-row extends: a range each
            marks.range(i % CAP, i % CAP + 1)
        assert recorded > 2 * touched._COMPACT  # without the merges, more than this was held
        assert marks._pending.shape == (blocks,) and marks._pending.any()
        assert len(marks._ranges) <= blocks
        assert marks._count * 12 <= marks.log_bound  # the rows logged at the commit: bounded by the log's bound
        buf._writer.commit(checkpoint=True)
        assert not marks._pending.any()
        ro.refresh()
        mine, theirs = buf.store.priority_tree, ro.view().tree
        assert np.array_equal(theirs.leaves, mine.leaves) and np.array_equal(theirs.nodes, mine.nodes)
        assert not np.fromfile(path / "priority" / "touched" / "c" / "0", dtype=np.uint8)[:blocks].any()
