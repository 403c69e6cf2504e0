"""The copy a publish keeps between publishes (``convert/_pipeline/staged.py``).

A publish appends to the last publish's copy only the rows written since, and what a
reader of the snapshot gets is still the local store's, row for row, priorities and
``attrs`` included; wherever that copy is not an earlier state of the source (another
store at the path, a lane lapped, other options, a damaged copy, a store without an id)
the publish copies whole, and reads are still the local store's.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch
import warm

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer.convert._pipeline import staged
from mmbuffer.remote._snapshot import cache_base

LANE = 2048


def make(path, priorities: bool = True) -> None:
    cols = {"obs": ((3,), "float32"), "x": ((), "int64"), "px": mb.Column((4, 4), "uint8", codec="zstd")}
    mb.create(path, cols, capacity=2 * LANE, num_streams=2,
              priorities=mb.PriorityConfig() if priorities else None).close()


def extend(path, n: int, seed: int, episode: int = 37) -> None:
    """``n`` rows into each of the two lanes (episodes of ``episode`` rows, cut anywhere)."""
    rng = np.random.default_rng(seed)
    with mb.open(path) as buf:
        for lane in (0, 1):
            done = rng.random(n) < 1 / episode
            buf.extend({"obs": rng.standard_normal((n, 3), dtype=np.float32), "x": rng.integers(0, 1 << 40, n),
                        "px": rng.integers(0, 255, (n, 4, 4), np.uint8), "terminated": done}, stream=lane,
                       final_obs={"obs": rng.standard_normal((int(done.sum()), 3), dtype=np.float32)})


def reprioritize(path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with mb.open(path) as buf:
        buf.update_priorities(buf.sample(200).indices, rng.uniform(0.1, 5.0, 200))
        buf.attrs = {"step": seed}


def same(url: str, path, cache) -> None:
    """A new reader of ``url`` gets the local store's episodes, rows, priorities and attrs."""
    with mb.open(path, mode="r") as local, mb.open(url, mode="r", cache_dir=cache, pool=None) as ro:
        for a, b in zip(local.episodes(), ro.episodes()):
            assert torch.equal(a, b)
        rows = np.concatenate([lane * LANE + np.arange(lv.first_start, lv.visible_end) % LANE
                               for lane, lv in enumerate(local.view().lanes)])
        assert len(rows) == len(local) == len(ro)
        want, got = local.get(rows), ro.get(rows)
        for k in want:
            assert torch.equal(want[k], got[k]), k
        if local.priorities is not None:
            np.testing.assert_array_equal(ro.leaf_priorities(rows), local.leaf_priorities(rows))
        assert ro.attrs == local.attrs


def publish(path, url: str, **kw) -> dict:
    return mb.convert.publish(path, url, progress=False, **kw)


def test_a_publish_appends_to_the_copy_it_kept_and_reads_the_same(tmp_path):
    make(tmp_path / "s")
    extend(tmp_path / "s", 1500, 0)
    url = f"file://{tmp_path}/pub"
    first = publish(tmp_path / "s", url)
    assert not first["incremental"] and first["rows_copied"] == first["rows"] == 3000
    same(url, tmp_path / "s", tmp_path / "c0")
    for step, n in enumerate((20, 700, 1100), start=1):  # the last two pass the end of both rings
        extend(tmp_path / "s", n, step)
        reprioritize(tmp_path / "s", step)
        summary = publish(tmp_path / "s", url)
        assert summary["incremental"] and summary["rows_copied"] == 2 * n
        with mb.open(tmp_path / "s", mode="r") as local:  # every live row, the open episodes' too
            view = local.view()
            assert summary["rows"] == sum(int(w) - lv.first_start for w, lv in zip(view.written, view.lanes))
        same(url, tmp_path / "s", tmp_path / f"c{step}")
    with mb.open(tmp_path / "s", mode="r") as local:
        assert local.view().first_starts.min() > 0  # both lanes evicted episodes


def _replace_store(path, seed):
    shutil.rmtree(path)
    make(path)
    extend(path, 1500, seed)


def _lap(path, seed):
    extend(path, LANE // 2 + 5, seed)
    extend(path, LANE // 2 + 5, seed + 1)


def _damage_copy(path, seed):
    work = staged.work_dir(path, f"file://{path.parent}/pub", cache_base(None))
    (work / "store" / "manifest.json").write_text("{")
    extend(path, 10, seed)


def _forget_the_source(path, seed):
    work = staged.work_dir(path, f"file://{path.parent}/pub", cache_base(None))
    (work / "source.json").unlink()
    extend(path, 10, seed)


def _store_without_an_id(path, seed):
    """A store made before store ids: never appended to (nothing says it is the same store)."""
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["store_id"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    extend(path, 10, seed)


@pytest.mark.parametrize("change", [_replace_store, _lap, _damage_copy, _forget_the_source, _store_without_an_id])
def test_a_publish_copies_whole_where_its_copy_is_not_an_earlier_state_of_the_source(tmp_path, change):
    make(tmp_path / "s")
    extend(tmp_path / "s", 1500, 0)
    url = f"file://{tmp_path}/pub"
    publish(tmp_path / "s", url)
    change(tmp_path / "s", 1)
    summary = publish(tmp_path / "s", url)
    assert not summary["incremental"] and summary["rows_copied"] == summary["rows"]
    same(url, tmp_path / "s", tmp_path / "c")
    if change is not _store_without_an_id:  # and the copy made whole is appended to next time
        extend(tmp_path / "s", 10, 2)
        assert publish(tmp_path / "s", url)["incremental"]
        same(url, tmp_path / "s", tmp_path / "c2")


def test_other_options_copy_whole(tmp_path):
    make(tmp_path / "s", priorities=False)
    extend(tmp_path / "s", 500, 0)
    url = f"file://{tmp_path}/pub"
    publish(tmp_path / "s", url)
    extend(tmp_path / "s", 10, 1)
    assert not publish(tmp_path / "s", url, compression="lz4")["incremental"]
    same(url, tmp_path / "s", tmp_path / "c")
    extend(tmp_path / "s", 10, 2)
    assert publish(tmp_path / "s", url, compression="lz4")["incremental"]


def test_episodes_a_live_writer_reserved_over_are_left_out_as_the_sources_readers_leave_them(tmp_path):
    """Beside a writer whose reservation passed the oldest episodes, the source's readers
    leave those out; the copy kept them from the publish before, and its readers leave
    them out too (its reservation raised), so the snapshot holds what a reader saw."""
    make(tmp_path / "s")
    extend(tmp_path / "s", 1500, 0, episode=5)
    url = f"file://{tmp_path}/pub"
    publish(tmp_path / "s", url)
    rng = np.random.default_rng(1)
    with mb.open(tmp_path / "s") as w:  # a writer that stays open: its reservation runs ahead
        n = 600
        w.extend({"obs": rng.standard_normal((n, 3), dtype=np.float32), "x": np.arange(n),
                  "px": np.zeros((n, 4, 4), np.uint8), "terminated": np.arange(n) % 5 == 4},
                 final_obs={"obs": np.zeros((n // 5, 3), np.float32)})
        w.commit()
        with mb.open(tmp_path / "s", mode="r") as reader:
            seen = reader.view().first_starts[0]
            assert seen > w.store.committed[0].first_start  # the reader leaves out episodes the manifest keeps
        summary = publish(tmp_path / "s", url)
        assert summary["incremental"]
        same(url, tmp_path / "s", tmp_path / "c")
        with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
            assert ro.view().first_starts[0] == seen


def test_a_second_publish_at_the_same_time_copies_into_a_temporary_directory(tmp_path):
    make(tmp_path / "s")
    extend(tmp_path / "s", 500, 0)
    url = f"file://{tmp_path}/pub"
    publish(tmp_path / "s", url)
    work = staged.work_dir(tmp_path / "s", url, cache_base(None))
    before = sorted(os.listdir(work / "store" / "columns" / "obs" / "c"))
    extend(tmp_path / "s", 2000, 1)
    fd = os.open(work / "LOCK", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another publish of this store to this URL holds it
    try:
        summary = publish(tmp_path / "s", url)
    finally:
        os.close(fd)
    assert not summary["incremental"]
    assert sorted(os.listdir(work / "store" / "columns" / "obs" / "c")) == before  # the kept copy untouched
    same(url, tmp_path / "s", tmp_path / "c")


def test_work_dir_false_keeps_no_copy(tmp_path):
    make(tmp_path / "s")
    extend(tmp_path / "s", 100, 0)
    url = f"file://{tmp_path}/pub"
    assert not publish(tmp_path / "s", url, work_dir=False)["incremental"]
    assert not staged.work_dir(tmp_path / "s", url, cache_base(None)).exists()
    same(url, tmp_path / "s", tmp_path / "c")


def test_a_cache_directory_that_cannot_be_written_copies_into_a_temporary_directory(tmp_path, monkeypatch):
    make(tmp_path / "s")
    extend(tmp_path / "s", 100, 0)
    (tmp_path / "ro").write_text("a file where the cache directory would be")
    monkeypatch.setenv("MMBUFFER_CACHE_DIR", str(tmp_path / "ro"))
    url = f"file://{tmp_path}/pub"
    for seed in (1, 2):
        extend(tmp_path / "s", 10, seed)
        assert not publish(tmp_path / "s", url)["incremental"]
        same(url, tmp_path / "s", tmp_path / f"c{seed}")


def test_the_writers_own_buffer_publishes_incrementally(tmp_path):
    """A training process publishes from the buffer it writes (committed first)."""
    make(tmp_path / "s")
    url = f"file://{tmp_path}/pub"
    rng = np.random.default_rng(0)
    with mb.open(tmp_path / "s") as w:
        for step, n in enumerate((1500, 30, 900, 900)):  # the last two wrap the lane
            w.extend({"obs": rng.standard_normal((n, 3), dtype=np.float32), "x": np.arange(n),
                      "px": rng.integers(0, 255, (n, 4, 4), np.uint8), "terminated": np.arange(n) % 7 == 6},
                     final_obs={"obs": np.zeros((n // 7, 3), np.float32)})
            w.commit()
            summary = publish(w, url)
            assert summary["incremental"] == (step > 0) and summary["rows_copied"] == (n if step else 1500)
            with mb.open(url, mode="r", cache_dir=tmp_path / f"c{step}", pool=None) as ro:
                for a, b in zip(w.episodes(), ro.episodes()):
                    assert torch.equal(a, b)
                rows = np.arange(w.view().first_starts[0], w.view().written[0]) % LANE
                assert torch.equal(w.get(rows)["x"], ro.get(rows)["x"])


_PUBLISHER = """
import sys, time
import mmbuffer as mb
from mmbuffer.convert._pipeline import staged
settle = staged.TailWriter.settle
def slow_settle(self, out):  # the appended rows written, not committed: a window to be killed in
    settle(self, out)
    print("appended", flush=True)
    time.sleep(1.5)
staged.TailWriter.settle = slow_settle
print("ready", flush=True)
mb.convert.publish(sys.argv[1], sys.argv[2], progress=False)
"""


@pytest.mark.slow
def test_a_publisher_killed_while_it_appends_leaves_what_the_next_publish_completes(tmp_path):
    """Publishers SIGKILLed at random instants of an incremental publish (each one pauses
    1.5 s after its rows were appended, before their commit): every other one at a random
    instant of that pause (its copy's writer then holds a reservation past its commit: the
    kill came mid-append), the others anywhere in the publish; after each, the next publish
    completes and its snapshot is the local store's."""
    make(tmp_path / "s")
    extend(tmp_path / "s", 1500, 0)
    url = f"file://{tmp_path}/pub"

    def start():  # forked warm (tests/warm.py): the random instants land in the publish
        p = warm.start(_PUBLISHER, [str(tmp_path / "s"), url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        return p

    def finish(p):
        assert p.stdout is not None
        p.stdout.read()
        p.stdout.close()
        return p.wait()

    assert finish(start()) == 0
    work = staged.work_dir(tmp_path / "s", url, cache_base(None))
    rng = np.random.default_rng(7)
    trials = int(os.environ.get("MMBUFFER_KILL_TRIALS", "6"))
    mid_append = aimed = 0
    for round_ in range(trials):
        extend(tmp_path / "s", 300, 2 + round_)
        p = start()
        if round_ % 2 == 0:  # in the pause after the append
            assert p.stdout is not None and p.stdout.readline() == b"appended\n"
            time.sleep(float(rng.uniform(0.0, 0.8)))  # 0.7 s short of the commit at least
            aimed += 1
        else:  # anywhere: before, in or after the append
            time.sleep(float(rng.uniform(0.0, 2.5)))
        p.kill()
        if finish(p) != 0:  # killed before it ended
            with mb.open(work / "store", mode="r") as copy:  # a dead writer's reservation past its commit
                mid_append += any(r > st.written for r, st in zip(copy.reservation(), copy.store.committed))
        assert finish(start()) == 0
        same(url, tmp_path / "s", tmp_path / f"c{round_}")
    print(f"{mid_append} publishers killed while appending, {aimed} aimed there")
    assert mid_append >= aimed >= 1


_WRITER = """
import sys, time
import numpy as np
import mmbuffer as mb
with mb.open(sys.argv[1]) as w:
    print("ready", flush=True)
    end = time.monotonic() + float(sys.argv[2])
    written = [int(st.written) for st in w.store.committed]
    while time.monotonic() < end:
        for lane in (0, 1):
            n = 97
            x = np.arange(written[lane], written[lane] + n)  # each row holds its own absolute row
            w.extend({"obs": np.zeros((n, 3), np.float32), "x": x, "px": np.zeros((n, 4, 4), np.uint8),
                      "terminated": x % 11 == 10}, stream=lane, final_obs={"obs": np.zeros((int((x % 11 == 10).sum()), 3), np.float32)})
            written[lane] += n
        w.commit()
        time.sleep(0.15)  # ~600 rows a second a lane: a lap of a lane in ~3 s
"""


@pytest.mark.slow
def test_publishes_beside_a_live_writer_process_hold_the_rows_written_there(tmp_path):
    """A writer process extends both lanes (each row's ``x`` its absolute row) and commits
    while this process publishes the store's path again and again: every snapshot holds,
    at every live row, the row written there, and later publishes append to the copy."""
    import sys

    make(tmp_path / "s")
    url = f"file://{tmp_path}/pub"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in sys.path if p]))
    w = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "s"), "25"], env=env, stdout=subprocess.PIPE)
    assert w.stdout is not None and w.stdout.readline() == b"ready\n"
    w.stdout.close()
    incremental, lapped, refused = 0, False, 0
    try:
        for i in range(12):
            time.sleep(0.3)
            try:
                incremental += publish(tmp_path / "s", url)["incremental"]
            except errors.RowNotLiveError:  # the writer lapped rows while they were copied: refused, typed
                refused += 1
                continue
            with mb.open(url, mode="r", cache_dir=tmp_path / f"c{i}", pool=None) as ro:
                view = ro.view()
                lapped |= bool(view.first_starts.min() > 0)
                for lane, lv in enumerate(view.lanes):
                    absolute = np.arange(lv.first_start, lv.visible_end)
                    got = ro.get(lane * LANE + absolute % LANE, ["x"])["x"].numpy()
                    np.testing.assert_array_equal(got, absolute)
    finally:
        w.kill()
        w.wait()
    print(f"{incremental} of 12 publishes appended, {refused} refused")
    assert lapped and incremental >= 6  # the rings wrapped, and most publishes appended


def test_work_directories_no_publish_used_for_two_weeks_are_removed_and_nothing_else(tmp_path):
    make(tmp_path / "s")
    extend(tmp_path / "s", 100, 0)
    folder = cache_base(None) / "publish"
    old = time.time() - 15 * 86400
    made = {}
    for name, files in {"a" * 20: ["LOCK", "digests.json"], "b" * 20: ["LOCK"], "c" * 20: ["LOCK", "notes.txt"],
                        "not-a-work-dir": ["LOCK"]}.items():
        (folder / name).mkdir(parents=True)
        for f in files:
            (folder / name / f).write_text("x")
        made[name] = folder / name
    os.utime(made["a" * 20] / "LOCK", (old, old))  # unused for 15 days: removed
    os.utime(made["c" * 20] / "LOCK", (old, old))  # unused, but holds a file mmbuffer never writes: kept
    os.utime(made["not-a-work-dir"] / "LOCK", (old, old))  # not a name mmbuffer gives: kept
    held = made["d" * 20] = folder / ("d" * 20)  # unused, but a publish holds it now: kept
    held.mkdir()
    (held / "LOCK").write_text("x")
    os.utime(held / "LOCK", (old, old))
    fd = os.open(held / "LOCK", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        publish(tmp_path / "s", f"file://{tmp_path}/pub")
    finally:
        os.close(fd)
    assert {name for name, path in made.items() if path.exists()} == {"b" * 20, "c" * 20, "not-a-work-dir", "d" * 20}
    assert staged.work_dir(tmp_path / "s", f"file://{tmp_path}/pub", cache_base(None)).is_dir()  # this publish's own
    for path in made.values():
        shutil.rmtree(path, ignore_errors=True)


def test_a_failed_check_of_an_append_removes_the_copy_and_says_so(tmp_path, monkeypatch):
    """An append whose read-back differs is a ``ConversionError`` that says the copy is gone
    (not kept for inspection, as a whole copy's output is); the next publish copies whole."""
    from mmbuffer.convert._pipeline.frame import mismatch

    make(tmp_path / "s")
    extend(tmp_path / "s", 300, 0)
    url = f"file://{tmp_path}/pub"
    publish(tmp_path / "s", url)
    extend(tmp_path / "s", 50, 1)
    kept = staged.work_dir(tmp_path / "s", url, cache_base(None)) / "store"
    assert kept.is_dir()

    def differs(self, store):
        raise mismatch(store, "rows", 1, 2)

    monkeypatch.setattr(staged.TailWriter, "verify", differs)
    with pytest.raises(errors.ConversionError, match=r"rows: expected 1, got 2 \(the publish's copy was removed: "
                                                     r"the next publish copies the store whole\)") as info:
        publish(tmp_path / "s", url)
    assert type(info.value) is errors.ConversionError and not kept.exists()
    monkeypatch.undo()
    assert not publish(tmp_path / "s", url)["incremental"]
    same(url, tmp_path / "s", tmp_path / "c")
