"""The Zarr world reads a store without mmbuffer (docs/format.md, README "Zarr").

xarray and tensorstore open the columns; the reading recipe of docs/format.md
(run from the document itself) finds the live rows and the episodes of a
wrapped, multi-stream ring from the Zarr attributes alone, and what it reads
equals ``buf.get``.
"""

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr

import mmbuffer as mb

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def _recipe():
    """The ```python block of docs/format.md that defines the recipe, executed."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    code = next(b for b in blocks if "def read_episodes" in b)
    ns = {}
    exec(compile(code, str(DOC), "exec"), ns)
    return ns["read_episodes"], ns["live_rows"]


def _fill(path, *, compression=None, streams=2, lane=40, rounds=7, close=True):
    """A store whose rows encode (stream, absolute row): x = 1000 * stream + absolute.

    Episode lengths vary (3..9 rows) and the rings wrap several times; reward is
    0 on every other row (xarray must not take the fill value 0 for missing)."""
    buf = mb.create(path, {"x": ((), "int64"), "obs": ((2,), "float32"), "reward": ((), "float32")},
                    capacity=streams * lane, num_streams=streams, compression=compression)
    rng = np.random.default_rng(0)
    written = [0] * streams
    for _ in range(rounds):
        for s in range(streams):
            n = int(rng.integers(10, 25))
            absolute = written[s] + np.arange(n)
            done = rng.random(n) < 0.25
            buf.extend({"x": 1000 * s + absolute, "obs": np.stack([absolute, -absolute], 1),
                        "reward": (absolute % 2) * 1.5, "terminated": done},
                       stream=s, final_obs={"obs": np.full((int(done.sum()), 2), 7.0)})
            written[s] += n
    buf.commit()
    if close:
        buf.close()
        return mb.open(path, mode="r")
    return buf


def test_xarray_reads_the_columns_as_one_dataset(tmp_path):
    xr = pytest.importorskip("xarray")
    ro = _fill(tmp_path / "s")
    ds = xr.open_zarr(tmp_path / "s", group="columns", consolidated=False)
    assert ds["obs"].dims == ("row", "obs_1") and ds.sizes["row"] == ro.capacity
    rows = ro.episodes()[0].numpy()
    want = ro.get(np.arange(ro.capacity))
    for name in ("x", "obs", "reward", "terminated", "truncated"):
        np.testing.assert_array_equal(ds[name].values, want[name].numpy(), err_msg=name)
    assert (ds["reward"].values[rows] == 0).any()  # zeros stay zeros (not a fill value)


def test_xarray_reads_a_compressed_store(tmp_path):
    xr = pytest.importorskip("xarray")
    ro = _fill(tmp_path / "s", compression="zstd")
    ds = xr.open_zarr(tmp_path / "s", group="columns", consolidated=False)
    np.testing.assert_array_equal(ds["obs"].values, ro.get(np.arange(ro.capacity))["obs"].numpy())


def test_tensorstore_reads_live_rows_in_ring_order(tmp_path):
    ts = pytest.importorskip("tensorstore")
    ro = _fill(tmp_path / "s")
    _, live_rows = _recipe()
    rows = live_rows(tmp_path / "s")
    for name in ("x", "obs"):
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "s" / "columns" / name)}},
                      read=True).result()
        got = arr.oindex[rows].read().result()
        np.testing.assert_array_equal(got, ro.get(rows)[name].numpy(), err_msg=name)
    # ring order: per lane, the absolute rows count up from the oldest live row
    x = ro.get(rows)["x"].numpy()
    lanes = rows // ro.lane_size
    for lane in range(ro.num_streams):
        ax = x[lanes == lane] - 1000 * lane
        assert (np.diff(ax) == 1).all() and ax[-1] == int(ro.view().written[lane]) - 1
        assert ro.lane_size - 10 < ax.size <= ro.lane_size  # an evicted head episode at most


def test_the_recipe_finds_every_episode_of_a_wrapped_multistream_ring(tmp_path):
    ro = _fill(tmp_path / "s", streams=3)
    read_episodes, live_rows = _recipe()
    starts, lengths = (t.numpy() for t in ro.episodes())
    found = list(read_episodes(tmp_path / "s"))
    assert len(found) == ro.num_episodes
    assert [int(rows[0]) for _, _, rows in found] == starts.tolist()  # same order as episodes()
    assert [len(rows) for _, _, rows in found] == lengths.tolist()
    assert any(len(rows) > 1 and np.diff(rows).min() < 0 for _, _, rows in found)  # one episode wraps its ring
    root = zarr.open_group(tmp_path / "s", mode="r")
    for lane, _, rows in found:
        got = root["columns/x"].oindex[rows]
        np.testing.assert_array_equal(got, ro.get(rows)["x"].numpy())
        assert (np.diff(got) == 1).all() and (got // 1000 == lane).all()
        assert bool(root["columns/terminated"].oindex[rows][-1] or root["columns/truncated"].oindex[rows][-1])
    assert len(live_rows(tmp_path / "s")) >= len(ro)  # + the open episodes' last rows


def test_attributes_follow_each_commit_and_stay_safe_while_a_writer_runs(tmp_path):
    """A commit refreshes the attributes; rows the writer rewrites after it are
    dropped by the recipe's reservation check, and what it keeps is intact."""
    buf = _fill(tmp_path / "s", close=False)
    read_episodes, live_rows = _recipe()
    meta = zarr.open_group(tmp_path / "s", mode="r").attrs["mmbuffer"]
    assert meta["generation"] == buf.generation
    assert [ln["written"] for ln in meta["lanes"]] == [int(w) for w in buf.view().written]
    before = {start: rows for _, start, rows in read_episodes(tmp_path / "s")}
    # the writer goes on without committing: lane 0 rewrites most of its ring
    w0 = int(buf.view().written[0])
    absolute = w0 + np.arange(30)
    buf.extend({"x": 55555 + absolute, "obs": np.zeros((30, 2)), "reward": np.zeros(30),
                "terminated": absolute % 10 == 9}, stream=0, final_obs={"obs": np.zeros((3, 2))})
    assert zarr.open_group(tmp_path / "s", mode="r").attrs["mmbuffer"]["generation"] == meta["generation"]
    after = list(read_episodes(tmp_path / "s"))
    assert 0 < len(after) < len(before)
    x = zarr.open_group(tmp_path / "s", mode="r")["columns/x"]
    for lane, start, rows in after:
        assert (x.oindex[rows] == 1000 * lane + start + np.arange(len(rows))).all()  # never the new rows
    assert not (x.oindex[live_rows(tmp_path / "s")] >= 55555).any()
    buf.commit()
    fresh = list(read_episodes(tmp_path / "s"))
    reader = mb.open(tmp_path / "s", mode="r")  # keeps away from the reservation the same way
    assert [int(r[0]) for _, _, r in fresh] == reader.episodes()[0].tolist()
    buf.close()


def test_opening_the_group_columns_and_arrays_does_not_warn(tmp_path):
    _fill(tmp_path / "s")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = zarr.open_group(tmp_path / "s", mode="r")
        assert root.attrs["mmbuffer"]["lane_size"] == 40
        assert root["columns/obs"].shape == (80, 2)
        assert sorted(zarr.open_group(tmp_path / "s" / "columns", mode="r").array_keys()) == [
            "obs", "reward", "terminated", "truncated", "x"]
    with pytest.warns(UserWarning, match="LOCK|manifest.json|sampler"):  # docs/format.md says so
        list(root.members(max_depth=None))


def test_stores_without_dimension_names_still_open_and_bad_ones_are_refused(tmp_path):
    _fill(tmp_path / "s").close()
    meta_file = tmp_path / "s" / "columns" / "obs" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    assert meta["dimension_names"] == ["row", "obs_1"]
    del meta["dimension_names"]  # a store written before 2026-11-23
    meta_file.write_text(json.dumps(meta))
    assert len(mb.open(tmp_path / "s", mode="r").get([0])["obs"]) == 1
    meta["dimension_names"] = ["row"]  # one name for two dimensions
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(mb.errors.CorruptStoreError, match=r"dimension_names: expected absent or a list of 2 names"):
        mb.open(tmp_path / "s", mode="r")


def test_a_failed_attributes_write_leaves_the_last_ones_and_the_commit_stands(tmp_path):
    buf = _fill(tmp_path / "s", close=False)
    before = zarr.open_group(tmp_path / "s", mode="r").attrs["mmbuffer"]
    (tmp_path / "s" / "zarr.json.partial").mkdir()  # the write cannot happen
    buf.extend({"x": np.arange(5), "obs": np.zeros((5, 2)), "reward": np.zeros(5)}, stream=0)
    generation = buf.commit()
    assert mb.open(tmp_path / "s", mode="r").generation == generation == before["generation"] + 1
    assert zarr.open_group(tmp_path / "s", mode="r").attrs["mmbuffer"] == before  # stale, and whole
    (tmp_path / "s" / "zarr.json.partial").rmdir()
    buf.extend({"x": np.arange(5), "obs": np.zeros((5, 2)), "reward": np.zeros(5)}, stream=0)
    generation = buf.commit()
    assert zarr.open_group(tmp_path / "s", mode="r").attrs["mmbuffer"]["generation"] == generation
    buf.close()
