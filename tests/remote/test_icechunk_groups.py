"""Writer groups in one Icechunk repository, against the real loopback S3 server (moto):
writers publish side by side (a commit that lost the race is rebased over the other
writer's), a reader samples every writer at one commit, and one publisher per writer
name is enforced by Icechunk's compare-and-swap (a second one's rebase fails: a
LockedError that changes nothing) and by the lease."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from s3server import new_bucket
from s3server import s3  # noqa: F401 - fixture

import mmbuffer as mb
from mmbuffer import errors

pytest.importorskip("s3fs")
icechunk = pytest.importorskip("icechunk")
from mmbuffer.remote import _icechunk, _icegroup  # noqa: E402

EP = 10


def make_local(path: Path, w: int, rows: int) -> mb.Buffer:
    buf = mb.create(path, {"x": ((), "int64")}, capacity=1000, next_keys=(), priorities=mb.PriorityConfig())
    add(buf, w, rows)
    return buf


def add(buf: mb.Buffer, w: int, rows: int) -> None:
    n = len(buf)
    buf.extend({"x": w * 1_000_000 + np.arange(n, n + rows), "terminated": np.arange(n, n + rows) % EP == EP - 1})
    buf.commit()


def xs(g: mb.GroupBuffer) -> dict[str, list[int]]:
    """Every writer's live rows, read through the group."""
    return {name: sorted(buf.get(np.arange(len(buf)), keys=["x"])["x"].tolist()) for name, buf in g.buffers.items()}


def publish(buf: mb.Buffer, url: str, name: str, **kw) -> dict:
    return mb.convert.publish(buf, url, writer=name, engine="icechunk", progress=False, **kw)


def meanwhile(monkeypatch, action) -> dict:
    """Run ``action`` once, inside the next publish, after its session began and before
    it commits (the publish stages its objects then); returns what ``action`` returned."""
    real, done = _icechunk.stage, {}

    def staged(*args, **kwargs):
        monkeypatch.setattr(_icechunk, "stage", real)
        done.update(action())
        return real(*args, **kwargs)

    monkeypatch.setattr(_icechunk, "stage", staged)
    return done


def history(url: str) -> list[str]:
    repo = icechunk.Repository.open(_icechunk.storage(url, None))
    return [s.message.split(" (")[0] for s in repo.ancestry(branch="main")]


def test_writers_commit_side_by_side_and_a_reader_sees_one_commit(tmp_path, s3, monkeypatch):
    url = f"s3://{new_bucket(s3)}/group"
    a, b = make_local(tmp_path / "a", 0, 20), make_local(tmp_path / "b", 1, 30)
    publish(a, url, "host-0")
    add(a, 0, 10)
    other = meanwhile(monkeypatch, lambda: publish(b, url, "host-1"))
    mine = publish(a, url, "host-0")  # began before host-1's commit, committed after it: rebased
    assert other["writer"] == "host-1" and mine["sequence"] == 2 and mine["epoch"] == 1
    assert history(url)[:3] == ["mmbuffer publish host-0 2", "mmbuffer publish host-1 1", "mmbuffer publish host-0 1"]
    with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
        assert g.writers == ("host-0", "host-1") and len(g) == 60 and g.num_episodes == 6
        assert xs(g) == {"host-0": list(range(30)), "host-1": [1_000_000 + i for i in range(30)]}
        batch = g.sample_slices(16, 5, prioritized=True)
        x = batch.data["x"]
        assert bool(((x[:, 1:] - x[:, :-1]) == 1).all())  # windows inside one writer's episode
    import zarr  # the group without mmbuffer: zarr through Icechunk's store

    repo = icechunk.Repository.open(_icechunk.storage(url, None))
    pointers = _icegroup.GroupRepo(url, None).read()["writers"]  # what open_group reads: every writer at the tip
    assert {p["commit"] for p in pointers.values()} == {repo.lookup_branch("main")} == {mine["snapshot"]}
    group = zarr.open_group(repo.readonly_session("main").store, mode="r")
    np.testing.assert_array_equal(group["writers/host-1/columns/x"][:30], 1_000_000 + np.arange(30))
    assert group["writers/host-0"].attrs["mmbuffer"]["sequence"] == 2
    with pytest.raises(errors.InvalidArgumentError, match="open_group"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c2")
    a.close()
    b.close()


def test_a_second_publisher_of_one_writer_name_is_refused_and_changes_nothing(tmp_path, s3, monkeypatch):
    url = f"s3://{new_bucket(s3)}/group"
    a, b = make_local(tmp_path / "a", 0, 20), make_local(tmp_path / "b", 1, 30)
    won = meanwhile(monkeypatch, lambda: publish(b, url, "host-0"))
    with pytest.raises(errors.LockedError, match="'host-0': expected to be its only publisher"):
        publish(a, url, "host-0")  # both began on the empty repository; b committed first
    assert won["epoch"] == 1 and history(url)[0] == "mmbuffer publish host-0 1"
    with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
        assert xs(g) == {"host-0": [1_000_000 + i for i in range(30)]}  # b's rows, nothing of a's
    with pytest.raises(errors.LockedError, match="holding it for"):  # then the lease refuses a
        publish(a, url, "host-0")
    a.close()
    b.close()


def test_a_lease_that_ran_out_is_taken_over_and_refresh_reopens_only_what_changed(tmp_path, s3):
    url = f"s3://{new_bucket(s3)}/group"
    a, b, c = (make_local(tmp_path / n, w, 20) for n, w in (("a", 0), ("b", 1), ("c", 2)))
    publish(a, url, "host-0", lease=0.5)
    publish(b, url, "host-1")
    g = mb.open_group(url, cache_dir=tmp_path / "cache", pool=None)
    before = g.buffers
    time.sleep(0.6)
    taken = publish(c, url, "host-0")  # another holder, after a's lease
    assert taken["epoch"] == 2 and taken["sequence"] == 2
    assert g.refresh()
    assert g.buffers["host-1"] is before["host-1"]  # unchanged writer: its buffer kept
    assert g.buffers["host-0"] is not before["host-0"]
    assert xs(g)["host-0"] == [2_000_000 + i for i in range(20)]
    assert not g.refresh()
    g.close()
    for buf in (a, b, c):
        buf.close()


def test_a_group_and_a_single_store_do_not_mix_in_one_repository(tmp_path, s3):
    single, group = f"s3://{new_bucket(s3)}/one", f"s3://{new_bucket(s3)}/group"
    a = make_local(tmp_path / "a", 0, 20)
    mb.convert.publish(a, single, engine="icechunk", progress=False)
    publish(a, group, "host-0")
    with pytest.raises(errors.StoreExistsError, match="published without writer="):
        publish(a, single, "host-0")
    with pytest.raises(errors.StoreExistsError, match="expected an empty repository or one mmbuffer published"):
        mb.convert.publish(a, group, engine="icechunk", progress=False)
    assert publish(a, group, "host-0")["sequence"] == 2  # engine=None keeps the repository's
    assert mb.convert.publish(a, group, writer="host-0", progress=False)["sequence"] == 3
    a.close()


_PUBLISHER = r"""
import sys, mmbuffer as mb
print("ready", flush=True)
mb.convert.publish(sys.argv[1], sys.argv[2], writer="host-0", engine="icechunk", lease=0.01, progress=False)
"""


@pytest.mark.slow
def test_publishers_killed_at_random_instants_leave_every_writer_whole(tmp_path, s3):
    """4 publishers of writer host-0 (``MMBUFFER_KILL_TRIALS`` runs more) SIGKILLed at random
    instants, alternating two stores, beside a writer host-1 published once: after each, a
    reader finds host-0 as one of the two stores whole and host-1 untouched; a restarted
    publisher commits."""
    import os

    from killing import kill_at_random_instants, publisher, timed

    url = f"s3://{new_bucket(s3)}/group"
    stores = [tmp_path / "a", tmp_path / "b"]
    for path, rows in zip(stores, (200, 300)):
        make_local(path, 0 if rows == 200 else 5, rows).close()
    with make_local(tmp_path / "other", 1, 40) as other:
        publish(other, url, "host-1")
    states = [np.arange(200), 5_000_000 + np.arange(300)]
    start = publisher(_PUBLISHER, url)
    span = timed(start, stores[0])

    def read() -> np.ndarray:
        with mb.open_group(url, cache_dir=tmp_path / "c", pool=None) as g:
            got = xs(g)
        assert got["host-1"] == [1_000_000 + i for i in range(40)]
        return np.array(got["host-0"])

    kill_at_random_instants(start, stores, read, states, kills=int(os.environ.get("MMBUFFER_KILL_TRIALS", 4)),
                            span=span, fraction=(0.2, 1.0))
    assert start(stores[1]).wait() == 0
    np.testing.assert_array_equal(read(), states[1])


def test_expired_commits_leave_the_group_readable_and_kept_writers_follow_the_tip(tmp_path, s3):
    """``keep=2`` in a group: after host-1's publishes expire the commit a reader opened,
    its refresh reopens host-1 and reads the unchanged host-0 at the newest commit."""
    url = f"s3://{new_bucket(s3)}/group"
    a, b = make_local(tmp_path / "a", 0, 20), make_local(tmp_path / "b", 1, 30)
    publish(a, url, "host-0", keep=2)
    publish(b, url, "host-1", keep=2)
    g = mb.open_group(url, cache_dir=tmp_path / "cache", pool=None)
    kept = g.buffers["host-0"]
    pruned = []
    for _ in range(3):
        add(b, 1, 10)
        pruned += publish(b, url, "host-1", keep=2)["pruned"]
    assert len(pruned) == 2 and len(history(url)) == 4  # 3 commits and the repository's first
    assert g.refresh() and g.buffers["host-0"] is kept
    kept.remote.repo.check_alive(kept.remote.snapshot)  # host-0 is read at a commit the branch keeps
    assert xs(g) == {"host-0": list(range(20)), "host-1": [1_000_000 + i for i in range(60)]}
    g.close()
    a.close()
    b.close()

