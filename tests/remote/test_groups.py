"""Writer groups on a real S3 server on loopback (moto): writers in separate processes
publish their own stores under one URL (``mb.convert.publish(path, url, writer=...)``),
``mb.open(url)`` samples the union; one publisher per writer name, enforced by the
conditional PUT of ``group.json``; SIGKILLed publishers leave the group readable."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import warm
from s3server import moto_s3, new_bucket

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer.remote import _group

pytest.importorskip("s3fs")

EP = 10  # rows per episode; writer w's row i holds x = w * 1_000_000 + i
WRITER = r"""
import os, sys, time, numpy as np, mmbuffer as mb
store, url, name, w, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
gate = sys.argv[6] if len(sys.argv) > 6 else None  # a file to wait for before the second round
try:
    buf = mb.open(store, mode="a")
except mb.errors.StoreNotFoundError:
    buf = mb.create(store, {"x": ((), "int64")}, capacity=100_000, next_keys=(), priorities=mb.PriorityConfig())
print("ready", flush=True)
for r in range(rounds):
    while r == 1 and gate and not os.path.exists(gate):
        time.sleep(0.01)
    n = len(buf)
    x = w * 1_000_000 + np.arange(n, n + 3 * 10)
    buf.extend({"x": x, "terminated": np.arange(n, n + 30) % 10 == 9})
    buf.commit()
    mb.convert.publish(buf, url, writer=name, progress=False)
buf.close()
"""


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def url(s3):
    return f"s3://{new_bucket(s3)}/group"


def start_writer(store: Path, url: str, name: str, w: int, rounds: int, gate: Path | None = None) -> warm.Child:
    """Writer ``name`` publishing ``rounds`` times (after the first, once ``gate`` exists),
    forked warm (``tests/warm.py``), once it opened its store."""
    args = [str(store), url, name, str(w), str(rounds), *([str(gate)] if gate else [])]
    with open(f"{store}.{name}.err", "ab") as err:
        p = warm.start(WRITER, args, stdout=subprocess.PIPE, stderr=err)
    assert p.stdout is not None
    line = p.stdout.readline()
    p.stdout.close()
    assert line == b"ready\n", Path(f"{store}.{name}.err").read_text()
    return p


def check_whole(g) -> int:
    """Every writer of the open group snapshot holds exactly the rows its writer wrote,
    in whole episodes; the union counts are the sums. Returns the union's rows."""
    total = 0
    for w, (name, buf) in enumerate(g.buffers.items()):
        n = len(buf)
        k = int(name.split("-")[1])
        assert n % EP == 0 and buf.num_episodes == n // EP, (name, n, buf.num_episodes)
        assert np.array_equal(buf.get(np.arange(n))["x"].numpy(), k * 1_000_000 + np.arange(n)), name
        total += n
    assert len(g) == total and g.num_episodes == total // EP
    return total


def group_body(url: str) -> bytes:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True).cat_file(url + "/group.json")  # never a cached one of another server


def test_writers_publish_at_once_and_the_reader_sees_whole_unions(tmp_path, url):
    """Three writer processes publish 4 rounds each at the same time; the reader opens and
    refreshes meanwhile and every snapshot it sees is whole (rows = sum, episodes
    intact, each writer's rows exactly its own prefix). The writers publish their later
    rounds once the reader has opened the group."""
    gate = tmp_path / "reader-opened"
    procs = [start_writer(tmp_path / f"w{w}", url, f"host-{w}", w, 4, gate) for w in range(3)]
    g, seen = None, set()
    while any(p.poll() is None for p in procs) or g is None:
        try:
            if g is None:
                g = mb.open_group(url, cache_dir=tmp_path / "cache", pool=None)
                gate.touch()
            else:
                g.refresh()
        except errors.StoreNotFoundError:  # nothing published yet, or a snapshot pruned under us
            time.sleep(0.05)
            continue
        seen.add((tuple(g.writers), check_whole(g)))
        b = g.sample_slices(64, 5, generator=torch.Generator().manual_seed(len(seen)))
        x = b.data["x"]
        assert bool(((x[:, 1:] - x[:, :-1]) == 1).all()) and bool((x[:, 0] % EP <= EP - 5).all())
    for p in procs:
        assert p.wait() == 0, Path(f"{p.args[3]}.{p.args[5]}.err").read_text()
    g.refresh()
    assert g.writers == ("host-0", "host-1", "host-2") and check_whole(g) == 3 * 4 * 30
    assert json.loads(group_body(url))["sequence"] == 3 * 4 * 2  # a claim and a swap per publish, none lost
    seen.add((g.writers, 3 * 4 * 30))
    assert len(seen) >= 2  # the group the reader opened changed under it as the writers published
    w, rows = g.locate(g.sample(256, generator=torch.Generator().manual_seed(0)).indices.numpy())
    assert set(np.unique(w).tolist()) == {0, 1, 2} and (rows < 100_000).all()
    g.close()


def test_writers_on_a_local_filesystem_swap_the_group_under_a_lock(tmp_path):
    """file:// groups: the compare-and-swap is a compare under flock and a rename; two
    writer processes publishing 3 rounds each at once lose no update."""
    url = f"file://{tmp_path}/group"
    procs = [start_writer(tmp_path / f"w{w}", url, f"host-{w}", w, 3) for w in range(2)]
    for p in procs:
        assert p.wait() == 0, Path(f"{p.args[3]}.{p.args[5]}.err").read_text()
    body = json.loads((tmp_path / "group" / "group.json").read_bytes())
    assert {n: e["pointer"]["sequence"] for n, e in body["writers"].items()} == {"host-0": 3, "host-1": 3}
    assert body["sequence"] == 2 * 3 * 2  # a claim and a swap per publish, none lost
    with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
        assert check_whole(g) == 2 * 3 * 30
    with pytest.raises(errors.InvalidArgumentError, match="writer group.*mb.open_group"):
        mb.open(url, mode="r", cache_dir=tmp_path / "cache2")  # mb.open is typed Buffer: one store


def make_local(path: Path, w: int, rows: int, priorities: np.ndarray | None = None) -> mb.Buffer:
    buf = mb.create(path, {"x": ((), "int64")}, capacity=1000, next_keys=(), priorities=mb.PriorityConfig())
    buf.extend({"x": w * 1_000_000 + np.arange(rows), "terminated": np.arange(rows) % EP == EP - 1})
    if priorities is not None:
        buf.update_priorities(np.arange(rows), priorities)
    buf.commit()
    return buf


def test_a_first_publish_that_read_no_group_before_another_writer_made_it_joins_that_group(tmp_path, url, monkeypatch):
    """Two writers' first publishes to an empty prefix at once: one read no ``group.json``,
    then found the one the other had just put there. That is a lost swap to retry, not
    "other objects" (it was refused as those while the writers raced)."""
    a, b = make_local(tmp_path / "a", 0, 20), make_local(tmp_path / "b", 1, 30)
    mb.convert.publish(a, url, writer="host-0", progress=False)
    real, reads = _group._read_raw, []

    def read_before_host_0_made_it(*args):
        reads.append(1)
        return (None, None) if len(reads) == 1 else real(*args)

    monkeypatch.setattr(_group, "_read_raw", read_before_host_0_made_it)
    summary = mb.convert.publish(b, url, writer="host-1", progress=False)
    assert len(reads) >= 3  # the stale read, its retry, the pointer's swap
    assert summary["group_sequence"] == 4  # host-0's claim and swap, then host-1's: nothing lost
    with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
        assert g.writers == ("host-0", "host-1") and check_whole(g) == 50
    a.close()
    b.close()


def test_a_second_publisher_of_a_writer_name_gets_locked_error(tmp_path, url):
    a, b = make_local(tmp_path / "a", 0, 20), make_local(tmp_path / "b", 1, 30)
    first = mb.convert.publish(a, url, writer="host-0", progress=False)
    assert (first["writer"], first["epoch"], first["sequence"]) == ("host-0", 1, 1)
    before = group_body(url)
    with pytest.raises(errors.LockedError, match="host-0.*lease"):
        mb.convert.publish(b, url, writer="host-0", progress=False)  # another store: another holder
    assert group_body(url) == before  # the refusal changed nothing
    assert mb.convert.copy(b, url, writer="host-1", progress=False)["writer"] == "host-1"  # another name: no conflict
    again = mb.convert.publish(a, url, writer="host-0", progress=False)  # the holder itself resumes
    assert (again["epoch"], again["sequence"]) == (1, 2)
    with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
        assert g.writers == ("host-0", "host-1") and check_whole(g) == 50
    a.close()
    b.close()


def test_a_takeover_fences_the_old_holder_out(tmp_path, url, monkeypatch):
    """After its lease ends another holder claims the name (epoch 2); the old one is then
    refused at its claim, and a publisher whose name was taken over while it uploaded
    is refused at its pointer swap (the CAS it cannot win), naming nothing new."""
    a, b = make_local(tmp_path / "a", 0, 20), make_local(tmp_path / "b", 0, 40)
    mb.convert.publish(a, url, writer="host-0", progress=False, lease=0.2)
    time.sleep(0.3)
    took = mb.convert.publish(b, url, writer="host-0", progress=False)
    assert took["epoch"] == 2
    with pytest.raises(errors.LockedError, match="lease"):
        mb.convert.publish(a, url, writer="host-0", progress=False)
    b.extend({"x": 40 + np.arange(10), "terminated": np.arange(10) == 9})
    b.commit()
    upload = _group._snapshot.upload_snapshot

    def taken_over_meanwhile(*args, **kwargs):
        out = upload(*args, **kwargs)
        fs, root = mb._disk.urls.filesystem(url, None)  # another holder claims the name now
        _group._transact(fs, root, url, lambda body: {**body, "writers": {**body["writers"], "host-0": {
            **body["writers"]["host-0"], "holder": "elsewhere", "epoch": 9}}})
        return out

    monkeypatch.setattr(_group._snapshot, "upload_snapshot", taken_over_meanwhile)
    with pytest.raises(errors.LockedError, match="epoch 9"):
        mb.convert.publish(b, url, writer="host-0", progress=False)
    body = json.loads(group_body(url))
    assert body["writers"]["host-0"]["pointer"]["snapshot"] == took["snapshot"]  # b's rows stay published
    a.close()
    b.close()


def test_a_group_refuses_what_it_cannot_hold(tmp_path, url, s3):
    a = make_local(tmp_path / "a", 0, 20)
    with pytest.raises(errors.InvalidArgumentError, match="writer"):
        mb.convert.publish(a, url, writer="../x", progress=False)
    mb.convert.publish(a, url, writer="host-0", progress=False)
    with pytest.raises(errors.StoreExistsError):
        mb.convert.publish(a, url, progress=False)  # a plain publish onto a group
    single = f"s3://{new_bucket(s3)}/store"
    mb.convert.publish(a, single, progress=False)
    with pytest.raises(errors.StoreExistsError, match="writer group"):
        mb.convert.publish(a, single, writer="host-0", progress=False)  # a group onto a plain store
    other = mb.create(tmp_path / "o", {"y": ((), "float32")}, capacity=100, next_keys=())
    other.extend({"y": np.arange(10), "terminated": np.arange(10) == 9})
    mb.convert.publish(other, url, writer="host-1", progress=False)
    with pytest.raises(errors.SchemaError, match="host-1"):
        mb.open_group(url, cache_dir=tmp_path / "cache")
    with pytest.raises(errors.InvalidArgumentError, match="writer group"):
        mb.convert.copy(url, tmp_path / "copy", progress=False)  # one store expected
    a.close()
    other.close()


def test_prioritized_draws_across_writers_follow_the_priorities(tmp_path, url):
    """Two writers with different priorities and sizes: each union row is drawn with
    probability leaf / (sum of both writers' leaves). Chi-square over the 50 rows at
    20,000 draws, refused above the 1 - 1e-6 quantile (a correct sampler fails with
    probability 1e-6; seeded, so the run is fixed). Weights are (min_union / leaf)^beta
    exactly; uniform draws split by rows (binomial, 6 sigma)."""
    from scipy import stats

    rng = np.random.default_rng(0)
    pa, pb = rng.uniform(0.1, 1.0, 20), rng.uniform(1.0, 5.0, 30)
    a, b = make_local(tmp_path / "a", 0, 20, pa), make_local(tmp_path / "b", 1, 30, pb)
    leaves = np.concatenate([a.leaf_priorities(np.arange(20)), b.leaf_priorities(np.arange(30))])
    for buf, name in ((a, "host-0"), (b, "host-1")):
        mb.convert.publish(buf, url, writer=name, progress=False)
    # only the open episode's last row is not sampleable (no next observation): none here, every episode ends
    with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
        n = 20_000
        batch = g.sample(n, prioritized=True, beta=0.5, generator=torch.Generator().manual_seed(1))
        w, rows = g.locate(batch.indices.numpy())
        union = np.where(w == 0, rows, 20 + rows)
        counts = np.bincount(union, minlength=50)
        expected = n * leaves / leaves.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < stats.chi2.ppf(1 - 1e-6, df=49), chi2
        np.testing.assert_allclose(batch.weights.numpy(), (leaves.min() / leaves[union]) ** 0.5, rtol=1e-5)
        sl = g.sample_slices(2_000, 4, prioritized=True, beta=0.5, generator=torch.Generator().manual_seed(3))
        w, rows = g.locate(sl.indices[:, 0].numpy())
        start = np.where(w == 0, rows, 20 + rows)
        assert (rows % EP <= EP - 4).all()  # valid starts only: windows inside one episode of one writer
        np.testing.assert_allclose(sl.weights.numpy(), (leaves.min() / leaves[start]) ** 0.5, rtol=1e-5)
        share = float((g.locate(g.sample(n, generator=torch.Generator().manual_seed(2)).indices.numpy())[0] == 0).mean())
        assert abs(share - 0.4) < 6 * np.sqrt(0.4 * 0.6 / n), share
    a.close()
    b.close()


def _kill_and_resume(tmp_path: Path, url: str, kills: int) -> None:
    """Writer host-0 publishes in a loop and is SIGKILLed at random instants; host-1
    published once. After each kill the group opens whole, and the restarted writer (same
    store, same host: the same holder) publishes again at once."""
    b = make_local(tmp_path / "b", 1, 30)
    mb.convert.publish(b, url, writer="host-1", progress=False)
    store, rng, killed, last = tmp_path / "a", np.random.default_rng(0), 0, -1
    span = None
    while killed < kills:
        p = start_writer(store, url, "host-0", 0, 1000)
        t0 = time.perf_counter()
        if span is None:  # one publish's length, measured once: kills land across it
            while True:
                try:
                    s = json.loads(group_body(url))["writers"].get("host-0", {}).get("pointer")
                except FileNotFoundError:
                    s = None
                if s is not None or time.perf_counter() - t0 > 120:
                    break
                time.sleep(0.02)
            span = max(time.perf_counter() - t0, 0.2)
        time.sleep(float(rng.uniform(0.0, 2.0)) * span)
        p.kill()
        p.wait()
        killed += 1
        with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
            check_whole(g)
            seq = json.loads(group_body(url))["writers"].get("host-0", {}).get("pointer", {}) or {}
            assert int(seq.get("sequence", 0)) >= last
            last = int(seq.get("sequence", 0))
    assert last >= 1  # the first kill came after host-0's first publish: inside its publishing loop
    p = start_writer(store, url, "host-0", 0, 1)  # the restarted writer resumes
    assert p.wait() == 0, p.args
    with mb.open_group(url, cache_dir=tmp_path / "cache", pool=None) as g:
        with mb.open(store, mode="r") as local:
            assert check_whole(g) == 30 + len(local)
        assert json.loads(group_body(url))["writers"]["host-0"]["pointer"]["sequence"] > last
    b.close()


@pytest.mark.slow
def test_killed_publishers_leave_the_group_readable_and_resume(tmp_path, url):
    """4 kills (``MMBUFFER_KILL_TRIALS`` runs more; 12 in benchmarks/HISTORY.md)."""
    _kill_and_resume(tmp_path, url, int(os.environ.get("MMBUFFER_KILL_TRIALS", 4)))


def test_a_refresh_moves_every_writer_or_none(tmp_path, url, monkeypatch):
    """A refresh whose second writer cannot be opened leaves the group where it was
    (every writer at the snapshots it had, the same sequence); the next one succeeds."""
    a, b = make_local(tmp_path / "a", 0, 20), make_local(tmp_path / "b", 1, 30)
    for buf, name in ((a, "host-0"), (b, "host-1")):
        mb.convert.publish(buf, url, writer=name, progress=False)
    g = mb.open_group(url, cache_dir=tmp_path / "cache", pool=None)
    before, seq = dict(g.buffers), g.sequence
    for buf, name in ((a, "host-0"), (b, "host-1")):
        buf.extend({"x": 2_000_000 + np.arange(10), "terminated": np.arange(10) == 9})
        buf.commit()
        mb.convert.publish(buf, url, writer=name, progress=False)
    real = type(g)._open_writer

    def fails_for_host_1(self, name, pointer):
        if name == "host-1":
            raise errors.RemoteAccessError("host-1: unreachable (injected)")
        return real(self, name, pointer)

    monkeypatch.setattr(type(g), "_open_writer", fails_for_host_1)
    with pytest.raises(errors.RemoteAccessError, match="injected"):
        g.refresh()
    assert g.buffers == before and g.sequence == seq and len(g) == 50
    monkeypatch.setattr(type(g), "_open_writer", real)
    assert g.refresh() and len(g) == 70 and g.sequence > seq
    assert not g.refresh()  # nothing newer
    g.close()
    a.close()
    b.close()
