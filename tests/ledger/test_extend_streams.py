"""``Buffer.extend(steps, stream=[...])``: K lanes in one call, the same store as K
single-lane extends in order (``_ledger/appending.py``), and a refused call changes
nothing."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

import mmbuffer as mb

COLUMNS = {"obs": ((3,), "float32"), "act": ((), "int64")}


def _files(path: Path) -> dict[str, bytes]:
    """Every file's bytes; the manifest's without its ``store_id`` (drawn per store)."""
    out = {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file() and f.name != "LOCK"}
    manifest = json.loads(out["manifest.json"])
    assert len(manifest.pop("store_id")) == 32
    out["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return out


def _batches(seed: int, count: int, k: int, t: int, streams: int):
    """``count`` batches of ``t`` steps for ``k`` random distinct streams; episodes end
    at random (terminated or truncated) and always within 12 rows of a stream."""
    rng = np.random.default_rng(seed)
    run = [0] * streams
    for _ in range(count):
        lanes = rng.permutation(streams)[:k]
        term = rng.random((k, t)) < 0.1
        trunc = (rng.random((k, t)) < 0.05) & ~term
        for j, lane in enumerate(lanes.tolist()):
            for s in range(t):
                run[lane] += 1
                if run[lane] >= 12 and not term[j, s]:
                    trunc[j, s] = True
                if term[j, s] or trunc[j, s]:
                    run[lane] = 0
        steps = {"obs": rng.normal(size=(k, t, 3)).astype(np.float32), "act": rng.integers(0, 9, size=(k, t)),
                 "terminated": term, "truncated": trunc}
        final = rng.normal(size=(int((term | trunc).sum()), 3)).astype(np.float32)
        yield lanes, steps, {"obs": final}


def _one_by_one(buf: mb.Buffer, lanes: np.ndarray, steps: dict, final: dict) -> None:
    done = steps["terminated"] | steps["truncated"]
    off = 0
    for k, lane in enumerate(lanes.tolist()):
        n = int(done[k].sum())
        buf.extend({c: v[k] for c, v in steps.items()}, stream=lane, final_obs={"obs": final["obs"][off : off + n]})
        off += n


@pytest.mark.parametrize(
    "priorities, compression, columns",
    [
        (None, None, COLUMNS),
        (mb.PriorityConfig(alpha=0.6), None, COLUMNS),
        (None, "zstd", COLUMNS),  # zarr chunks: written a lane at a time
        (None, None, {"obs": mb.Column((3,), "float32", codec="zstd"), "act": ((), "int64")}),  # shards, in lane order
    ],
)
def test_the_same_store_as_single_lane_extends_in_order(tmp_path, priorities, compression, columns):
    """Every file (columns, final observations, episode index, reservation, progress
    record, priority tree, manifest) byte for byte, through wraps, evictions, the
    commits an extend makes on its own and priorities set between calls."""
    kw = dict(capacity=64, num_streams=4, priorities=priorities, compression=compression)
    one, many = mb.create(tmp_path / "one", columns, **kw), mb.create(tmp_path / "many", columns, **kw)
    rng = np.random.default_rng(1)
    for i, (lanes, steps, final) in enumerate(_batches(0, 40, 3, 5, 4)):
        _one_by_one(one, lanes, steps, final)
        many.extend(steps, stream=lanes.tolist(), final_obs=final)
        if priorities is not None and i % 5 == 4:  # raw priorities above 1: the default is the live max
            rows = np.flatnonzero(one.store.priority_tree.leaves[: one.capacity] > 0)[:6]
            p = rng.uniform(0.5, 9.0, size=len(rows))
            one.update_priorities(rows, p)
            many.update_priorities(rows, p)
        if i % 9 == 8:
            assert one.commit() == many.commit()
    assert one.store.lanes == many.store.lanes
    lanes = one.store.lanes
    assert min(st.written for st in lanes) > one.capacity // 4  # every lane wrapped
    assert all(st.ep_head > 0 for st in lanes)  # and evicted episodes
    assert one.generation > 4  # extends committed on their own (only 4 commits were asked)
    if priorities is not None:
        assert float(one.store.priority_tree.leaves.max()) > 1.0  # new rows got a default above 1
    assert _files(tmp_path / "one") == _files(tmp_path / "many")
    rows = np.arange(one.capacity)
    assert np.array_equal(one.get(rows, ["next_obs"])["next_obs"], many.get(rows, ["next_obs"])["next_obs"])
    one.close()
    many.close()
    assert _files(tmp_path / "one") == _files(tmp_path / "many")


def test_streams_in_any_order_and_one_stream(tmp_path):
    """The streams need not be sorted; ``[K, T]`` rows go to ``stream[k]`` in that order."""
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=12, num_streams=3, next_keys=())
    buf.extend({"x": [[10, 11], [20, 21]]}, stream=[2, 0])
    buf.extend({"x": [[30]]}, stream=np.array([1]))
    assert buf.get(np.array([0, 1, 4, 8, 9]), ["x"])["x"].tolist() == [20, 21, 30, 10, 11]
    assert [st.written for st in buf.store.lanes] == [2, 1, 2]


@pytest.mark.parametrize(
    "stream, steps, final, error, match",
    [
        ([0, 0], None, None, mb.errors.InvalidArgumentError, "distinct"),
        ([0, 4], None, None, mb.errors.InvalidArgumentError, r"in \[0, 4\)"),
        ([0, True], None, None, mb.errors.InvalidArgumentError, "stream"),
        ([[0, 1]], None, None, mb.errors.InvalidArgumentError, "stream"),
        ([0, 1], {"obs": np.zeros((2, 3, 3), np.float32), "act": np.zeros((2, 3)), "bad": np.zeros((2, 3))},
         None, mb.errors.SchemaError, "unknown"),
        ([0, 1], {"obs": np.zeros((3, 3, 3), np.float32), "act": np.zeros((3, 3), np.int64)}, None,
         mb.errors.SchemaError, r"column 'obs': expected an array \[2, T, 3\]"),
        ([0, 1], {"obs": np.zeros((2, 3, 3), np.float32), "act": np.zeros((2, 4), np.int64)}, None,
         mb.errors.SchemaError, "same number of rows"),
        ([0, 1], None, {"obs": np.zeros((1, 3), np.float32)}, mb.errors.SchemaError, r"final_obs\['obs'\]: expected shape \(2, 3\)"),
        ([0, 1], {"obs": np.zeros((2, 17, 3), np.float32), "act": np.zeros((2, 17), np.int64)}, {"obs": np.zeros((0, 3))},
         mb.errors.CapacityError, "lane_size=16"),
        ([1, 2], {"obs": np.zeros((2, 15, 3), np.float32), "act": np.zeros((2, 15), np.int64)}, {"obs": np.zeros((0, 3))},
         mb.errors.CapacityError, "stream 2: an episode of 17 rows"),
    ],
)
def test_a_refused_call_changes_nothing(tmp_path, stream, steps, final, error, match):
    """Every check runs before anything changes: no file, no cursor, not even the
    streams listed before the one refused."""
    for name in ("s", "twin"):  # the twin never gets the refused call
        buf = mb.create(tmp_path / name, COLUMNS, capacity=64, num_streams=4)
        buf.extend({"obs": np.zeros((2, 3), np.float32), "act": [1, 2]}, stream=2)  # stream 2's open episode: 2 rows
        buf.close()
    mb.open(tmp_path / "twin").close()
    buf = mb.open(tmp_path / "s")
    before, lanes = _files(tmp_path / "s"), buf.store.lanes
    ends = np.zeros((2, 3), bool)
    ends[:, -1] = True
    default = {"obs": np.ones((2, 3, 3), np.float32), "act": np.ones((2, 3), np.int64), "terminated": ends}
    with pytest.raises(error, match=match):
        buf.extend(default if steps is None else steps, stream=stream,
                   final_obs={"obs": np.ones((2, 3), np.float32)} if final is None else final)
    assert buf.store.lanes == lanes and not buf.store.ledger.has_changes
    assert _files(tmp_path / "s") == before
    buf.close()
    assert _files(tmp_path / "s") == _files(tmp_path / "twin")


def test_a_full_disk_refuses_before_any_lane_changes(tmp_path, monkeypatch):
    """The second lane's disk room fails after the first lane's was allocated: a typed
    error, and no lane's rows, cursors or reservation changed; the call succeeds once
    there is room."""
    import mmbuffer._disk.files as files

    buf = mb.create(tmp_path / "s", COLUMNS, capacity=64, num_streams=4)
    before, lanes = _files(tmp_path / "s"), buf.store.lanes
    reserved = buf.reservation().tolist()
    real, calls = files.os.posix_fallocate, []

    def full_on_the_second_lane(fd, offset, length):
        calls.append(offset)
        if len(calls) > 3:  # three arrays of the first lane allocated, then no room
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    steps = {"obs": np.ones((2, 3, 3), np.float32), "act": np.ones((2, 3), np.int64)}
    monkeypatch.setattr(files.os, "posix_fallocate", full_on_the_second_lane)
    with pytest.raises(mb.errors.DiskFullError, match="extend"):
        buf.extend(steps, stream=[0, 1])
    assert len(calls) > 3  # the refusal came from the room of a lane after the first
    assert buf.store.lanes == lanes and buf.reservation().tolist() == reserved and not buf.store.ledger.has_changes
    assert {k: v for k, v in _files(tmp_path / "s").items()} == before
    monkeypatch.setattr(files.os, "posix_fallocate", real)
    buf.extend(steps, stream=[0, 1])
    assert [st.written for st in buf.store.lanes] == [3, 3, 0, 0]
    buf.close()


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's maps of ``path`` (``/proc/self/smaps``)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                mine = head[-1] == str(path)
            elif mine and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads this process's maps from /proc")
@pytest.mark.parametrize(("rows", "mapped"), [(8, True), (20_000, False)])
def test_the_reservation_maps_only_pages_stored_through_the_map(tmp_path, rows, mapped):
    """A block of a few rows is stored through the map, so the reservation window's pages
    are faulted in for it at once; a large one goes by pwrite, and its pages are not
    mapped into this process (a 20M-row conversion spent a fifth of its time faulting
    them in, and a mapped page is not dropped behind)."""
    with mb.create(tmp_path / "s", {"obs": ((16,), "float32")}, capacity=100_000, next_keys=()) as buf:
        buf.extend({"obs": np.ones((rows, 16), np.float32), "truncated": np.arange(rows) == rows - 1})
        obs = tmp_path / "s" / "columns" / "obs" / "c" / "0" / "0"  # the one shard of a raw column
        kib = _mapped_kib(obs.resolve())
        assert (kib > 0) == mapped, kib
        np.testing.assert_array_equal(buf.read("obs", np.arange(rows)), 1)
