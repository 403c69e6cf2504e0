"""The priority log (``_disk/prilog.py``, format 5): a commit that is not a checkpoint
appends the changed leaf values instead of writing the tree's pages; every reader of the
tree (the writer's open, a reader, ``verify``) applies the committed log (issue 26 item 5)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import warm
from sigkill import HANG_S, kill_when, wait_for

import mmbuffer as mb
from mmbuffer import errors, tree
from mmbuffer._ledger.verify import verify

CAP = 4096


def _store(path, capacity=CAP):
    buf = mb.create(path, {"x": ((), "int32")}, capacity=capacity, next_keys=(), priorities=mb.PriorityConfig(alpha=0.7))
    buf.extend({"x": np.arange(capacity), "truncated": np.arange(capacity) % 64 == 63})
    buf.close()  # a checkpoint: the log is empty
    return path


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _rebuilt(leaves):
    """The tree ``tree.rebuild`` makes of these leaves (the exactness reference)."""
    pt = tree.init(len(leaves))
    pt.leaves[:] = leaves
    tree.rebuild(pt)
    return pt


def _same_tree(pt, leaves):
    ref = _rebuilt(leaves)
    return np.array_equal(np.asarray(pt.leaves), ref.leaves) and np.array_equal(np.asarray(pt.nodes), ref.nodes)


def test_log_only_commits_are_what_readers_and_a_reopen_see(tmp_path):
    """Commits append to the log and leave the tree's file at the checkpoint; a reader
    (at open and after each refresh, and across a checkpoint) and a reopened writer see
    the committed tree, bit for bit a rebuild of the committed leaves; a reader that
    never samples by priority replays nothing."""
    path = _store(tmp_path / "s")
    file_leaves = path / "priority" / "leaves" / "c" / "0"
    at_checkpoint = np.fromfile(file_leaves, "<f4", CAP)
    rng = np.random.default_rng(0)
    with mb.open(path) as buf, mb.open(path, mode="r") as ro:
        for k in range(6):
            buf.update_priorities(rng.integers(0, CAP, 300), rng.random(300) * 4)
            buf.commit()
            log = _manifest(path)["priority_log"]
            assert log["bytes"] > 0 and (path / "priority" / f"log-{log['checkpoint']}").exists()
            assert np.array_equal(np.fromfile(file_leaves, "<f4", CAP), at_checkpoint)  # no page written
            committed = np.array(buf.store.priority_tree.leaves)
            assert _same_tree(buf.store.priority_tree, committed)
            assert ro.refresh()
            assert ro.store._log_have != ro.store._log_want  # nothing replayed until prioritized use
            assert _same_tree(ro.view().tree, committed)
            assert np.array_equal(ro.leaf_priorities(np.arange(CAP)), committed)
        marks = buf._writer._marks
        assert marks.log_commits == 6 and marks.checkpoints == 0
        buf._writer.commit(checkpoint=True)  # the pages, and a new (empty) log; the old one removed
        assert marks.checkpoints == 1 and _manifest(path)["priority_log"] == {"checkpoint": log["checkpoint"] + 1, "bytes": 0}
        assert not list((path / "priority").glob("log-*"))
        assert np.array_equal(np.fromfile(file_leaves, "<f4", CAP), committed)
        buf.update_priorities(rng.integers(0, CAP, 300), rng.random(300) * 4)
        buf.commit()
        committed = np.array(buf.store.priority_tree.leaves)
        assert ro.refresh() and _same_tree(ro.view().tree, committed)  # its replayed pages dropped, the new log applied
        report = verify(ro.store)
        assert report["ok"] and report["tree_drift"] == 0.0, report
        buf._writer.release()  # no close: the log stays as committed
    with mb.open(path) as again:
        assert _manifest(path)["priority_log"]["bytes"] > 0
        assert _same_tree(again.store.priority_tree, committed)
        assert verify(again)["ok"]
    assert _manifest(path)["priority_log"]["bytes"] == 0  # close() checkpoints


def test_the_log_bound_makes_a_checkpoint(tmp_path, monkeypatch):
    """Past ``priority_log_bytes`` (here a few records) a commit writes the pages and
    starts the next log; the tree stays exact throughout."""
    path = _store(tmp_path / "s")
    rng = np.random.default_rng(1)
    with mb.open(path) as buf:
        marks = buf._writer._marks
        marks.log_bound = 3 * (32 + 12 * 200)
        seen = set()
        for _ in range(10):
            buf.update_priorities(rng.choice(CAP, 200, replace=False), rng.random(200))
            buf.commit()
            seen.add(_manifest(path)["priority_log"]["checkpoint"])
            with mb.open(path, mode="r") as ro:
                assert _same_tree(ro.view().tree, np.array(buf.store.priority_tree.leaves))
        assert (marks.checkpoints, marks.log_commits, len(seen)) == (2, 8, 3)  # 3 records per log, then a checkpoint
        assert len(list((path / "priority").glob("log-*"))) <= 1


def test_bytes_past_the_committed_length_are_ignored_and_overwritten(tmp_path):
    """A commit killed after its log append, before its rename, leaves bytes past the
    committed length: readers and the next writer ignore them, its next commit writes over them."""
    path = _store(tmp_path / "s")
    with mb.open(path) as buf:
        buf.update_priorities([1, 2, 3], [5.0, 6.0, 7.0])
        buf.commit()
        committed = np.array(buf.store.priority_tree.leaves)
        buf._writer.release()
    log = _manifest(path)["priority_log"]
    name = path / "priority" / f"log-{log['checkpoint']}"
    with open(name, "ab") as f:
        f.write(b"MBPL" + os.urandom(100))  # a torn record
    with mb.open(path, mode="r") as ro:
        assert _same_tree(ro.view().tree, committed)
    with mb.open(path) as buf:
        assert _same_tree(buf.store.priority_tree, committed)
        buf.update_priorities([4], [9.0])
        buf.commit()
        assert _manifest(path)["priority_log"]["bytes"] == (32 + 12 * 3) + (32 + 12) < name.stat().st_size  # over the torn bytes
        committed = np.array(buf.store.priority_tree.leaves)
        buf._writer.release()
    with mb.open(path, mode="r") as ro:
        assert _same_tree(ro.view().tree, committed)


@pytest.mark.parametrize("damage, words", [
    ("truncate", "expected at least"),
    ("flip", "crc32"),
    ("missing", "got no file"),
    ("checkpoint", "expected checkpoint"),
])
def test_a_damaged_log_is_a_typed_error_naming_the_file(tmp_path, damage, words):
    """Inside the committed range: cut short, a flipped byte, no file, another checkpoint's
    record: ``CorruptStoreError`` naming the file from a reader's first prioritized use,
    from the writer's open (which then changes nothing on disk) and as a problem from
    ``verify``; never wrong priorities."""
    path = _store(tmp_path / "s")
    with mb.open(path) as buf:
        for _ in range(2):
            buf.update_priorities(np.arange(0, CAP, 7), 3.0)
            buf.commit()
        buf._writer.release()
    log = _manifest(path)["priority_log"]
    name = path / "priority" / f"log-{log['checkpoint']}"
    data = bytearray(name.read_bytes())
    if damage == "truncate":
        name.write_bytes(data[: log["bytes"] - 5])
    elif damage == "flip":
        data[-3] ^= 0xFF
        name.write_bytes(data)
    elif damage == "missing":
        name.unlink()
    else:
        m = _manifest(path)
        m["priority_log"]["checkpoint"] += 5
        (path / "manifest.json").write_text(json.dumps(m))
        name.rename(path / "priority" / f"log-{log['checkpoint'] + 5}")
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != "LOCK"}
    ro = mb.open(path, mode="r") if damage != "missing" else None
    if ro is not None:
        assert len(ro) == CAP  # a uniform reader is unaffected
        with pytest.raises(errors.CorruptStoreError, match=words) as exc:
            ro.view().tree
        assert "log-" in str(exc.value)
        with pytest.raises(errors.CorruptStoreError, match=words):
            ro.leaf_priorities([0])
        report = verify(ro.store)
        assert not report["ok"] and any("priority log" in p for p in report["problems"])
        ro.close()
    else:
        with pytest.raises(errors.CorruptStoreError, match=words):
            mb.open(path, mode="r")
    with pytest.raises(errors.CorruptStoreError, match=words):
        mb.open(path)
    after = {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != "LOCK"}
    assert after.keys() == before.keys() and all(after[p] == before[p] for p in before if "progress" not in str(p))


def test_a_version_4_store_opens_and_becomes_version_5_at_its_first_commit(tmp_path):
    """A store as version 4 wrote it (no ``priority_log`` field): readers and the writer
    open it; its first commit writes version 5 with the log (which code of version 4
    refuses by its version: ``FormatVersionError``)."""
    path = _store(tmp_path / "s")
    m = _manifest(path)
    del m["priority_log"]
    m["format_version"] = 4
    (path / "manifest.json").write_text(json.dumps(m))
    with mb.open(path, mode="r") as ro:
        assert ro.store.manifest.format_version == 4 and _same_tree(ro.view().tree, np.array(ro.view().tree.leaves))
        before = np.array(ro.view().tree.leaves)
    with mb.open(path) as buf:
        assert np.array_equal(buf.store.priority_tree.leaves, before)
        buf.update_priorities([5, 6], [2.0, 3.0])
        buf.commit()
        m = _manifest(path)
        assert m["format_version"] == 5 and m["priority_log"]["bytes"] > 0
        committed = np.array(buf.store.priority_tree.leaves)
        buf._writer.release()
    with mb.open(path, mode="r") as ro:
        assert _same_tree(ro.view().tree, committed)


READER = textwrap.dedent(
    """
    import hashlib, sys, numpy as np, mmbuffer as mb
    from mmbuffer import tree
    ro = mb.open(sys.argv[1], mode="r")
    for line in sys.stdin:
        ro.refresh()
        pt = ro.view().tree
        print(ro.generation, hashlib.sha1(np.asarray(pt.leaves).tobytes() + np.asarray(pt.nodes).tobytes()).hexdigest(),
              flush=True)
    """
)


def test_a_reader_in_another_process_follows_log_commits_and_checkpoints(tmp_path):
    """A reader process that keeps the store open sees the writer's committed tree after
    each log-only commit and across checkpoints (whose logs the writer removes while the
    reader holds them), bit for bit."""
    import hashlib

    path = _store(tmp_path / "s")
    proc = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rng = np.random.default_rng(2)
    try:
        with mb.open(path) as buf:
            for k in range(7):
                buf.update_priorities(rng.integers(0, CAP, 500), rng.random(500) * 2)
                gen = buf._writer.commit(checkpoint=k in (2, 5))
                pt = buf.store.priority_tree
                want = hashlib.sha1(np.asarray(pt.leaves).tobytes() + np.asarray(pt.nodes).tobytes()).hexdigest()
                proc.stdin.write("\n")
                proc.stdin.flush()
                assert proc.stdout.readline().split() == [str(gen), want], k
            assert buf._writer._marks.checkpoints == 2 and buf._writer._marks.log_commits == 5
    finally:
        proc.stdin.close()
        proc.wait(timeout=HANG_S)
        proc.stdout.close()


# The writer: updates priorities and commits, forever; checkpoints come from a small log
# bound, and sleep inside their page write and log appends widen both windows (so kills
# land there). Before each commit it saves the leaves that commit makes durable.
KILLED = textwrap.dedent(
    """
    import os, sys, time, numpy as np, mmbuffer as mb
    from mmbuffer._disk import prilog, rawio
    path, report = sys.argv[1], sys.argv[2]
    real_write, real_append = rawio.write_private, prilog.append
    def slow_write(*a):
        time.sleep(0.01)
        return real_write(*a)
    def slow_append(*a):
        time.sleep(0.005)
        return real_append(*a)
    rawio.write_private, prilog.append = slow_write, slow_append
    buf = mb.open(path)
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while True:
        buf.update_priorities(rng.integers(0, buf.capacity, 200), rng.random(200) * 3)
        np.save(f"{path}.leaves-{buf.generation + 1}.npy", np.array(buf.store.priority_tree.leaves))
        gen = buf.commit()
        os.write(fd, f"C {gen}\\n".encode())
    """
)
KILL_TRIALS = max(4, int(os.environ.get("MMBUFFER_KILL_TRIALS", "4")))


def test_sigkill_in_a_loop_of_updates_and_commits_loses_no_committed_priority(tmp_path):
    """SIGKILL at random instants of a writer that updates priorities and commits (log
    appends, and a checkpoint every few commits): the store opens at the last commit, or
    the one cut short after its rename, with exactly the leaves that commit made durable
    and a tree bit for bit their rebuild, for a reader and for the writer that recovers
    (``verify`` passes); after a kill inside a checkpoint's page write, a row that
    uncommitted commit changed may keep either value, as before the log. The test proves where kills landed: some after a log-only commit
    (the manifest names a non-empty log), some inside a checkpoint (``priority/DIRTY``)."""
    path = _store(tmp_path / "s")
    env = {**os.environ, "MMBUFFER_PRIORITY_LOG_BYTES": str(5 * (32 + 12 * 200))}
    rng = np.random.default_rng(3)
    in_log = in_checkpoint = 0
    for trial in range(KILL_TRIALS):
        report = tmp_path / f"report{trial}"
        proc = warm.start(KILLED, [str(path), str(report)], stderr=subprocess.PIPE, text=True, env=env)
        if trial % 2:  # a random instant
            then = functools.partial(time.sleep, float(rng.random()) * 0.2)
        else:  # inside a checkpoint's page write (20 ms long here), as soon as it begins
            then = functools.partial(wait_for, proc, (path / "priority" / "DIRTY").exists, "a checkpoint", 0.001)
        kill_when(proc, lambda: report.exists() and report.read_text().count("C") >= 2, then,
                  waiting_for="two commits")
        gen = int(report.read_text().split()[-1])
        in_checkpoint += (path / "priority" / "DIRTY").exists()
        in_log += _manifest(path)["priority_log"]["bytes"] > 0
        with mb.open(path, mode="r") as ro:
            assert ro.generation in (gen, gen + 1)
            committed = np.load(f"{path}.leaves-{ro.generation}.npy")
            if not (path / "priority" / "DIRTY").exists():  # else the file's tree is mid-checkpoint until the writer repairs it
                assert _same_tree(ro.view().tree, committed)
        dirty = (path / "priority" / "DIRTY").exists()
        with mb.open(path) as buf:
            pt = buf.store.priority_tree
            if dirty:  # a row the cut checkpoint changed may keep its new value (its page reached the file)
                nxt = path.parent / f"s.leaves-{gen + 1}.npy"
                new = np.load(nxt) if nxt.exists() else committed
                got = np.asarray(pt.leaves)
                assert ((got == committed) | (got == new)).all()
                committed = got.copy()
            assert _same_tree(pt, committed)
            assert verify(buf)["ok"]
            buf._writer.release()  # leave the log as it is for the next trial
        with mb.open(path, mode="r") as ro:
            assert _same_tree(ro.view().tree, committed)
    assert in_log >= 1 and in_checkpoint >= 1, (in_log, in_checkpoint)


def test_a_published_copy_carries_the_logged_priorities_and_zarr_sees_the_checkpoint(tmp_path):
    """``copy(store, url)`` reads the source's priorities with the log applied and publishes
    a checkpointed copy (its writer closes: empty log), so a remote reader samples by the
    committed priorities; zarr, which knows no log, reads the last checkpoint's leaves
    until the writer's next checkpoint (``close()`` makes one)."""
    import zarr

    path = _store(tmp_path / "s")
    buf = mb.open(path)
    buf.update_priorities(np.arange(0, CAP, 3), 7.0)
    buf.commit()
    committed = np.array(buf.store.priority_tree.leaves)
    assert _manifest(path)["priority_log"]["bytes"] > 0
    checkpoint_leaves = zarr.open_array(str(path / "priority" / "leaves"), mode="r")[:]
    assert not np.array_equal(checkpoint_leaves, committed)  # zarr: the checkpoint's
    url = "file://" + str(tmp_path / "pub")
    mb.convert.copy(path, url, progress=False)
    with mb.open(url, mode="r", cache_dir=tmp_path / "cache") as remote:
        assert np.array_equal(remote.leaf_priorities(np.arange(CAP)), committed)
    buf.close()
    assert np.array_equal(zarr.open_array(str(path / "priority" / "leaves"), mode="r")[:], committed)
