"""A store is untrusted input: hostile or corrupt files give typed errors, never a
crash, a write outside the store, or a silent repair (DESIGN.md)."""

from __future__ import annotations

import errno
import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import warm

import mmbuffer as mb

from conftest import tree_hash

CAP = 16


def make_store(path: Path, *, priorities: bool = False, compression: str | None = None) -> Path:
    buf = mb.create(
        path,
        {"x": ((3,), "float64"), "a": ((), "int64")},  # 8-byte items: "object" fits the files
        capacity=CAP,
        num_streams=2,
        next_keys=("x",),
        compression=compression,
        priorities=mb.PriorityConfig() if priorities else None,
    )
    for s in range(2):
        n = 6
        done = np.arange(n) % 3 == 2
        buf.extend(
            {"x": np.ones((n, 3), np.float32) * s, "a": np.arange(n, dtype=np.int32), "terminated": done},
            stream=s,
            final_obs={"x": np.zeros((int(done.sum()), 3), np.float32)},
        )
    buf.close()
    return path


def edit_json(file: Path, change) -> None:
    obj = json.loads(file.read_text())
    obj = change(obj) or obj
    file.write_text(json.dumps(obj))


def set_counter(path: Path, name: str, i: int, value: int) -> None:
    arr = np.memmap(path / "index" / name / "c" / "0", dtype="<i8", mode="r+", shape=(i + 1,))
    arr[i] = value
    arr.flush()
    del arr


def use(path: Path, mode: str = "r") -> None:
    """Open, then read and sample everything a reader may."""
    with mb.open(path, mode=mode) as buf:
        buf.get(torch.arange(CAP))
        if len(buf):
            buf.sample(8, generator=torch.Generator().manual_seed(0))
            buf.sample_slices(4, 2, generator=torch.Generator().manual_seed(0))


def intact(path: Path, mode: str = "r") -> None:
    """The store ``make_store`` wrote reads back whole: 2 lanes of 6 rows, lane ``s``'s
    ``x`` all ``s`` and ``a`` counting 0..5, episodes of 3 rows; and samples from it."""
    use(path, mode)
    lane_size = CAP // 2
    with mb.open(path, mode=mode) as buf:
        assert len(buf) == 12 and buf.num_episodes == 4
        starts, lengths = buf.episodes()
        assert starts.tolist() == [0, 3, lane_size, lane_size + 3] and lengths.tolist() == [3, 3, 3, 3]
        for s in range(2):
            got = buf.get(torch.arange(6) + s * lane_size, keys=["x", "a", "terminated", "next_x"])
            assert (got["x"] == s).all() and got["a"].tolist() == list(range(6))
            assert got["terminated"].tolist() == [False, False, True] * 2
            assert (got["next_x"][[2, 5]] == 0).all()  # the final observations
        b = buf.sample(8, generator=torch.Generator().manual_seed(0), keys=["x", "a"])
        assert (b.data["x"][:, 0] == (b.indices // lane_size)).all()
        assert (b.data["a"] == b.indices % lane_size).all()


def refused(path: Path, mode: str = "r", error: type[Exception] = mb.errors.CorruptStoreError) -> str:
    """The message of the typed error opening (and using) the store gives; the store is unchanged."""
    before = tree_hash(path)
    with pytest.raises(error) as info:
        use(path, mode)
    assert tree_hash(path) == before
    return str(info.value)


RUNNER = textwrap.dedent(
    """
    import sys, torch, mmbuffer as mb
    for path in sys.argv[1:]:
        try:
            with mb.open(path, mode="r") as buf:
                buf.get(torch.arange(16), keys=["x", "a", "next_x"])
                buf.sample(8)
            print("OPENED")
        except mb.errors.MMBufferError as exc:
            print(type(exc).__name__, exc)
    """
)


def run_isolated(*paths: Path) -> list[str]:
    """Open and read stores in a child process: a crash fails the test instead of pytest."""
    out = warm.run(RUNNER, [str(p) for p in paths], timeout=120)
    assert out.returncode == 0, f"child died with {out.returncode}: {out.stdout[-2000:]} {out.stderr[-2000:]}"
    return out.stdout.splitlines()


# -- dtypes and zarr.json ---------------------------------------------------------------
def test_object_dtype_in_zarr_json_or_manifest_is_refused_not_a_segfault(tmp_path):
    arrays = ["columns/a", "columns/x", "final/x"]
    paths = []
    for i, array in enumerate(arrays):
        paths.append(make_store(tmp_path / str(i)))
        edit_json(paths[-1] / array / "zarr.json", lambda m: m.update(data_type="object"))
    paths.append(make_store(tmp_path / "m"))
    edit_json(paths[-1] / "manifest.json", lambda m: m["columns"]["a"].update(dtype="object"))
    lines = run_isolated(*paths)
    assert len(lines) == 4
    for array, line in zip(arrays, lines):
        assert line.startswith("CorruptStoreError") and array in line and "data_type" in line
    assert lines[3].startswith("CorruptStoreError") and "columns['a'].dtype" in lines[3]


@pytest.mark.parametrize(
    "array, change, field",
    [
        ("columns/a", lambda m: m.update(data_type="float64"), "data_type"),  # same size, other dtype
        ("columns/a", lambda m: m.update(shape=[CAP * 1000], chunk_grid={**m["chunk_grid"]}), "shape"),
        ("columns/a", lambda m: m.update(shape=[CAP // 2]), "shape"),  # fewer rows than the capacity
        ("columns/x", lambda m: m.update(shape=[CAP, 6]), "shape"),
        ("index/ends", lambda m: m.update(shape=[4]), "shape"),
        ("columns/x", lambda m: m["codecs"][0]["configuration"].update(index_location="start"), "codecs"),
        ("columns/x", lambda m: m["codecs"][0]["configuration"]["codecs"].append({"name": "crc32c"}), "codecs"),
        ("columns/x", lambda m: m.update(chunk_grid={"name": "regular", "configuration": {"chunk_shape": [16, 1]}}), "chunk_grid"),
        ("columns/x", lambda m: m.update(chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}), "chunk_key_encoding"),
        ("columns/x", lambda m: m.update(data_type={"name": "fixed_length_utf32", "configuration": {"length_bytes": 4}}), "data_type"),
    ],
)
def test_zarr_json_must_match_the_manifest_and_the_raw_layout(tmp_path, array, change, field):
    path = make_store(tmp_path / "s")
    edit_json(path / array / "zarr.json", change)
    msg = refused(path)
    assert array in msg and field in msg and "expected" in msg
    refused(path, mode="a")


@pytest.mark.parametrize(
    "codec",
    [
        {"name": "numcodecs.pickle", "configuration": {"protocol": 5}},
        {"name": "gzip", "configuration": {"level": 1}},
        {"name": "zstd", "configuration": {"level": 3, "checksum": False, "exec": "x"}},
    ],
)
def test_compressed_column_codecs_are_those_mmbuffer_writes(tmp_path, codec):
    path = make_store(tmp_path / "s", compression="zstd")
    edit_json(path / "columns/x/zarr.json", lambda m: m["codecs"].__setitem__(1, codec))
    msg = refused(path)
    assert "columns/x" in msg and "codecs" in msg


def test_compressed_store_still_opens(tmp_path):
    for compression in ("zstd", "lz4"):
        intact(make_store(tmp_path / compression, compression=compression))


# -- links and names ----------------------------------------------------------------------
def test_lock_that_is_a_link_is_not_written_through(tmp_path):
    path = make_store(tmp_path / "s")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (path / "LOCK").unlink(missing_ok=True)
    (path / "LOCK").symlink_to("../victim")
    with pytest.raises(mb.errors.CorruptStoreError, match="LOCK"):
        mb.open(path)
    assert victim.read_text() == "precious"


def test_partial_manifest_link_is_replaced_not_written_through(tmp_path):
    path = make_store(tmp_path / "s")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (path / "manifest.json.partial").symlink_to(victim)
    with mb.open(path) as buf:
        buf.extend({"x": np.zeros((1, 3), np.float32), "a": np.zeros(1, np.int32)})
        gen = buf.commit()
    assert victim.read_text() == "precious"
    assert not os.path.lexists(path / "manifest.json.partial")
    assert mb.open(path, mode="r").generation == gen


def test_failed_manifest_write_leaves_no_partial(tmp_path, monkeypatch):
    path = make_store(tmp_path / "s")
    buf = mb.open(path)
    buf.extend({"x": np.zeros((1, 3), np.float32), "a": np.zeros(1, np.int32)})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        buf.commit()
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert not os.path.lexists(path / "manifest.json.partial")
    assert mb.open(path, mode="r").generation == 1  # the last commit stands


@pytest.mark.parametrize("target", ["columns/x/c/0/0", "columns/a/c/0", "index/ends/c/0", "final/x/c/0/0", "columns/a/zarr.json"])
def test_linked_file_inside_the_store_is_refused(tmp_path, target):
    path = make_store(tmp_path / "s")
    victim = tmp_path / "victim"
    os.replace(path / target, victim)
    (path / target).symlink_to(victim)
    before = victim.read_bytes()
    msg = refused(path, mode="a")
    assert target in msg and "link" in msg
    assert victim.read_bytes() == before


def test_linked_directory_inside_the_store_is_refused(tmp_path):
    path = make_store(tmp_path / "s")
    os.replace(path / "columns" / "a", tmp_path / "elsewhere")
    (path / "columns" / "a").symlink_to(tmp_path / "elsewhere")
    assert "link" in refused(path, mode="a")


def test_store_reached_through_a_link_opens(tmp_path):
    path = make_store(tmp_path / "s")
    (tmp_path / "alias").symlink_to(path)
    intact(tmp_path / "alias", mode="a")
    (tmp_path / "alias").unlink()
    intact(path)  # the writer through the link changed nothing it should not have


def test_linked_chunk_of_a_compressed_column_is_refused(tmp_path):
    path = make_store(tmp_path / "s", compression="zstd")
    chunks = sorted(p for p in (path / "columns" / "x" / "c").rglob("*") if p.is_file())
    os.replace(chunks[0], tmp_path / "victim")
    chunks[0].symlink_to(tmp_path / "victim")
    assert "link" in refused(path)


def test_a_compressed_column_wider_than_the_descriptor_limit_opens(tmp_path):
    """The link check walks a column's chunk folders holding one descriptor per level,
    not one per folder: a column with more chunk folders than the process may open
    files (a 1e9-row column has ~65,000) opens, and a link deep inside is still refused."""
    script = textwrap.dedent(f"""
        import dataclasses, resource, numpy as np, mmbuffer as mb
        from mmbuffer._disk import format as fmt
        fmt.config = dataclasses.replace(fmt.config, chunk_bytes=64)  # 4 rows of x a chunk folder (c/<i>/0)
        with mb.create({str(tmp_path / "s")!r}, {{"x": ((2,), "int64")}}, capacity=4096, next_keys=(),
                       compression="zstd") as buf:
            buf.extend({{"x": np.repeat(np.arange(4000)[:, None] + 1, 2, axis=1)}})
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        with mb.open({str(tmp_path / "s")!r}, mode="r") as ro:
            print(int(ro.get(np.arange(4000), keys=["x"])["x"].sum()))
    """)
    out = warm.run(script, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == 4000 * 4001
    folders = [p for p in (tmp_path / "s" / "columns" / "x" / "c").iterdir() if p.is_dir()]
    assert len(folders) > 128  # wider than the limit the reader ran under
    victim = sorted(p for p in folders[-1].rglob("*") if p.is_file())[0]
    os.replace(victim, tmp_path / "victim")
    victim.symlink_to(tmp_path / "victim")
    assert "link" in refused(tmp_path / "s")


@pytest.mark.parametrize("name", ["../../x", "../x", "next_x"])
def test_column_name_leading_outside_is_refused(tmp_path, name):
    path = make_store(tmp_path / "s")
    os.replace(path / "columns" / "a", os.path.normpath(path / "columns" / name))  # the files are there
    edit_json(path / "manifest.json", lambda m: m["columns"].update({name: m["columns"].pop("a")}))
    assert "columns" in refused(path, mode="a")


def test_linked_dirty_marker_and_sampler_directory_are_refused(tmp_path):
    path = make_store(tmp_path / "s", priorities=True)
    (tmp_path / "victim").write_text("precious")
    (path / "priority" / "DIRTY").symlink_to(tmp_path / "victim")
    assert "DIRTY" in refused(path, mode="a")
    (path / "priority" / "DIRTY").unlink()
    (path / "sampler").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (path / "sampler").symlink_to(tmp_path / "elsewhere")
    with mb.open(path, mode="r") as buf, pytest.raises(mb.errors.CorruptStoreError, match="sampler"):
        mb.EpochSampler(buf, batch_size=2)
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize(
    "state",
    [
        [1, 2],
        {"seed": 0},
        {"seed": "x", "epoch": 0, "position": 0, "num_items": -1, "slice_len": None, "shard": [0, 1]},
        {"seed": 0, "epoch": 0, "position": 99, "num_items": 10, "slice_len": None, "shard": [0, 1]},
        {"seed": 0, "epoch": 0, "position": 0, "num_items": 10, "slice_len": None, "shard": 5},
    ],
)
def test_corrupt_sampler_state_is_refused_naming_the_file(tmp_path, state):
    path = make_store(tmp_path / "s")
    (path / "sampler" / "default.json").write_text(json.dumps(state))
    with mb.open(path, mode="r") as buf, pytest.raises(mb.errors.CorruptStoreError, match="default.json"):
        mb.EpochSampler(buf, batch_size=2)


# -- counters -----------------------------------------------------------------------------
def test_absurd_reservation_is_refused_not_evicting_everything(tmp_path):
    path = make_store(tmp_path / "s", priorities=True)
    set_counter(path, "reserved", 0, 2**60)
    msg = refused(path, mode="a")
    assert "reservation" in msg and str(2**60) in msg
    set_counter(path, "reserved", 0, 3)  # below the committed cursor
    refused(path, mode="r")


@pytest.mark.parametrize(
    "lane, change",
    [
        (0, {"ep_tail": 10**6}),
        (0, {"ep_head": 5}),
        (0, {"first_start": 7}),
        (0, {"written": 2**62 + 1}),
        (0, {"written": 40}),  # the episodes it ends at 3, 6 start more than a lane before it
        (1, {"ep_tail": -1}),
        (1, {"written": True}),
    ],
)
def test_contradicting_lane_counters_are_refused(tmp_path, lane, change):
    path = make_store(tmp_path / "s")
    edit_json(path / "manifest.json", lambda m: m["lanes"][lane].update(change))
    refused(path)
    refused(path, mode="a")


@pytest.mark.parametrize("slot, value", [(0, 0), (0, 99), (1, 2), (1, -5)])
def test_corrupt_episode_ends_are_refused_at_open(tmp_path, slot, value):
    path = make_store(tmp_path / "s")
    set_counter(path, "ends", slot, value)
    assert "episode" in refused(path)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: [m],
        lambda m: m.pop("capacity") and None,
        lambda m: m.pop("lanes") and None,
        lambda m: m.update(generation="x"),
        lambda m: m.update(generation=-1),
        lambda m: m.update(capacity=17),
        lambda m: m.update(lane_size=4),
        lambda m: m.update(num_streams=0),
        lambda m: m.update(compression="gzip"),
        lambda m: m.update(priorities={"alpha": 0.6, "eps": 0.0, "max_priority": 1.0, "beta": 1}),
        lambda m: m.update(priorities={"alpha": float("nan"), "eps": 0.0, "max_priority": 1.0}),
        lambda m: m.update(next_keys=["a", "a"]),
        lambda m: m.update(next_keys="x"),
        lambda m: m.update(attrs=[]),
        lambda m: m["columns"].pop("terminated") and None,
        lambda m: m["columns"]["x"].update(shape=[0]),
        lambda m: m["columns"]["x"].update(shape=[2**40, 2**40]),
    ],
)
def test_malformed_manifest_gives_a_typed_error(tmp_path, change):
    path = make_store(tmp_path / "s")
    edit_json(path / "manifest.json", change)
    assert "manifest.json" in refused(path, mode="a")


def test_unknown_format_version_is_a_format_error(tmp_path):
    path = make_store(tmp_path / "s")
    edit_json(path / "manifest.json", lambda m: m.update(format_version=True))
    refused(path, error=mb.errors.FormatVersionError)


def test_refresh_refuses_a_corrupt_new_commit_and_keeps_the_old(tmp_path):
    path = make_store(tmp_path / "s")
    ro = mb.open(path, mode="r")
    before = ro.episodes()[1].tolist()
    edit_json(path / "manifest.json", lambda m: m.update(generation=m["generation"] + 1) or m["lanes"][0].update(ep_tail=10**6))
    with pytest.raises(mb.errors.CorruptStoreError):
        ro.refresh()
    edit_json(path / "manifest.json", lambda m: m["lanes"][0].update(ep_tail=2) or m.update(capacity=32, lane_size=16))
    with pytest.raises(mb.errors.CorruptStoreError, match="schema"):
        ro.refresh()
    assert ro.episodes()[1].tolist() == before and ro.generation == 1


def test_refresh_checks_the_episodes_a_writer_adds(tmp_path):
    path = make_store(tmp_path / "s")
    ro = mb.open(path, mode="r")
    with mb.open(path) as buf:
        for _ in range(3):
            buf.extend({"x": np.zeros((5, 3), np.float32), "a": np.zeros(5, np.int32), "terminated": np.arange(5) == 4},
                       final_obs={"x": np.zeros((1, 3), np.float32)})
            buf.commit()
            assert ro.refresh()
            fresh = mb.open(path, mode="r")
            assert ro.episodes()[1].tolist() == fresh.episodes()[1].tolist()
            assert sum(ro.episodes()[1].tolist()) > 0


# -- inputs silently accepted before --------------------------------------------------------
def test_update_priorities_refuses_float_ids(tmp_path):
    buf = mb.open(make_store(tmp_path / "s", priorities=True))
    before = buf.leaf_priorities(np.arange(CAP)).tolist()
    with pytest.raises(mb.errors.InvalidArgumentError, match="integer row ids, got dtype float"):
        buf.update_priorities([0.5, 1.7], [3.0, 4.0])
    with pytest.raises(mb.errors.InvalidArgumentError):
        buf.update_priorities(np.array([2**63], dtype=np.uint64), [3.0])
    assert buf.leaf_priorities(np.arange(CAP)).tolist() == before
    buf.update_priorities(np.array([1], dtype=np.uint8), [4.0])
    buf.update_priorities([], [])


@pytest.mark.parametrize(
    "column, dtype, values",
    [
        ("i", "int64", np.array([1, 2**63], dtype=np.uint64)),
        ("i", "int8", np.array([3, 300], dtype=np.int64)),
        ("i", "int8", np.array([-3, -129], dtype=np.int16)),
        ("u", "uint8", np.array([3, 256], dtype=np.uint16)),
        ("f", "float32", np.array([1.0, 1e300])),
    ],
)
def test_extend_refuses_values_that_do_not_fit_the_column(tmp_path, column, dtype, values):
    buf = mb.create(tmp_path / "s", {column: ((), dtype)}, capacity=8, next_keys=())
    with pytest.raises(mb.errors.SchemaError, match=f"column '{column}'.*{dtype}") as info:
        buf.extend({column: values})
    assert str(values.dtype) in str(info.value)
    assert len(buf) == 0
    buf.extend({column: values[:1]})  # the value that fits goes in
    assert buf.get(torch.tensor([0]))[column].item() == values[0]


def test_final_obs_that_does_not_fit_is_refused(tmp_path):
    buf = mb.create(tmp_path / "s", {"o": ((), "int8")}, capacity=8, next_keys=("o",))
    with pytest.raises(mb.errors.SchemaError, match=r"final_obs\['o'\]"):
        buf.extend({"o": np.zeros(1, np.int8), "terminated": np.ones(1, bool)}, final_obs={"o": np.array([1000])})


# -- fuzz ---------------------------------------------------------------------------------
FUZZ = textwrap.dedent(
    """
    import json, os, shutil, sys, hashlib, numpy as np, torch, mmbuffer as mb
    sys.path.insert(0, sys.argv[2])
    from conftest import tree_hash
    base, work = sys.argv[1], sys.argv[1] + "-w"
    rng = np.random.default_rng(0)
    odd = [None, -1, 0, 1, 2**62, 2**70, "x", [], {}, 1.5, True, "float64", "object", [1, 2]]

    def paths(obj, at=()):
        yield at
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for k, v in items:
            yield from paths(v, at + (k,))

    def mutate(file):
        obj = json.load(open(file))
        where = list(paths(obj))[1:]
        at = where[rng.integers(len(where))]
        parent = obj
        for k in at[:-1]:
            parent = parent[k]
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[at[-1]]
        else:
            parent[at[-1]] = odd[rng.integers(len(odd))]
        json.dump(obj, open(file, "w"))
        return at

    files = ["manifest.json", "columns/x/zarr.json", "columns/a/zarr.json", "final/x/zarr.json",
             "index/ends/zarr.json", "index/reserved/zarr.json", "priority/leaves/zarr.json"]
    shutil.copytree(base, work, symlinks=True)
    snapshot = {}
    for root, _, names in os.walk(work):
        for n in names:
            snapshot[os.path.join(root, n)] = open(os.path.join(root, n), "rb").read()

    def restore():  # cheaper than a fresh copy per trial
        for root, _, names in os.walk(work):
            for n in names:
                f = os.path.join(root, n)
                if f not in snapshot:
                    os.unlink(f)
                elif open(f, "rb").read() != snapshot[f]:
                    open(f, "wb").write(snapshot[f])

    outcomes = {}
    for trial in range(int(sys.argv[3])):
        restore()
        file = files[trial % len(files)]
        if trial % 9 == 8:  # a counter in the index
            name = ["ends", "reserved"][trial % 2]
            arr = np.memmap(os.path.join(work, "index", name, "c", "0"), dtype="<i8", mode="r+", shape=({"ends": 32, "reserved": 2}[name],))
            arr[rng.integers(len(arr))] = [2**60, -3, 0, 7, 31][rng.integers(5)]
            arr.flush(); del arr
            at = ("index", name)
        else:
            at = mutate(os.path.join(work, file))
        before = tree_hash(__import__("pathlib").Path(work))
        mode = "r" if trial % 2 else "a"
        try:
            with mb.open(work, mode=mode) as buf:
                buf.get(torch.arange(16), keys=["x", "a", "next_x"])
                if len(buf):
                    buf.sample(8); buf.sample_slices(4, 2); buf.sample(4, prioritized=True)
            result = "ok"
        except mb.errors.MMBufferError as exc:
            result = type(exc).__name__
            assert tree_hash(__import__("pathlib").Path(work)) == before, (file, at, "changed on disk")
        except Exception as exc:
            print("UNTYPED", file, at, mode, type(exc).__name__, exc)
            raise SystemExit(1)
        outcomes[result] = outcomes.get(result, 0) + 1
    print(json.dumps(outcomes))
    """
)


def test_fuzzed_metadata_gives_typed_errors_only(tmp_path):
    base = make_store(tmp_path / "s", priorities=True)
    out = warm.run(FUZZ, [str(base), str(Path(__file__).resolve().parents[1]), "150"], timeout=600)  # tests/: conftest
    assert out.returncode == 0, f"exit {out.returncode}: {out.stdout[-3000:]} {out.stderr[-3000:]}"
    outcomes = json.loads(out.stdout.splitlines()[-1])
    print(outcomes)
    assert outcomes.get("CorruptStoreError", 0) > 60 and outcomes.get("ok", 0) > 0


CRASHING_WRITER = textwrap.dedent(
    """
    import os, sys, numpy as np, mmbuffer as mb
    buf = mb.open(sys.argv[1])
    for _ in range(int(sys.argv[2])):  # many lanes' worth of rows, never committed
        buf.extend({"x": np.zeros((4, 3)), "a": np.zeros(4, np.int64), "terminated": np.arange(4) == 3},
                   stream=0, final_obs={"x": np.zeros((1, 3))})
    os._exit(0)  # a crash: no commit, no close
    """
)


@pytest.mark.parametrize("blocks, kept", [(1, [3]), (5, [4]), (40, [])])
def test_writer_crashed_far_past_its_commit_reopens(tmp_path, blocks, kept):
    """The reservation a crashed writer leaves passes the open-time check however far
    it wrote past its last commit; what it may have overwritten is dropped, and only
    that: with 5 blocks it committed twice (a lane of uncommitted rows forces it), and
    the episode of rows [18, 22) it committed last, which its last extend (rows
    [22, 26), over ring rows of [14, 18)) did not reach, stays."""
    path = make_store(tmp_path / "s")
    before = mb.open(path, mode="r").episodes()[1].tolist()
    warm.run(CRASHING_WRITER, [str(path), str(blocks)], check=True, timeout=120)
    lane_size = CAP // 2
    with mb.open(path) as buf:  # the writer recovers
        starts, lengths = buf.episodes()
        # lane 0 held episodes [0, 3) and [3, 6); the crashed writer wrote up to row
        # 6 + 4 * blocks (index/progress): what starts a lane below that is dropped
        lane0 = starts < lane_size
        assert lengths[lane0].tolist() == kept  # the lengths of lane 0's episodes kept
        assert lengths[~lane0].tolist() == before[2:]  # lane 1 untouched
    use(path)


def test_refresh_refuses_corrupt_ends_of_new_episodes(tmp_path):
    path = make_store(tmp_path / "s")
    ro = mb.open(path, mode="r")
    gen = ro.generation
    with mb.open(path) as buf:
        buf.extend({"x": np.zeros((2, 3)), "a": np.zeros(2, np.int64), "terminated": np.ones(2, bool)},
                   final_obs={"x": np.zeros((2, 3))})
    set_counter(path, "ends", 3, 2)  # lane 0's new episodes 2 and 3 end at 7 and 8: 8 -> 2
    with pytest.raises(mb.errors.CorruptStoreError, match="episode 3 ending at 2"):
        ro.refresh()
    assert ro.generation == gen


def test_leaf_priorities_refuses_float_ids(tmp_path):
    """A float id would be truncated to another row: refused like update_priorities."""
    buf = mb.create(tmp_path / "p", {"x": ((), "int32")}, capacity=8, next_keys=(),
                    priorities=mb.PriorityConfig(alpha=1.0, eps=0.0))
    buf.extend({"x": np.arange(3)})
    buf.update_priorities([0, 1, 2], [1.0, 2.0, 3.0])
    with pytest.raises(mb.errors.InvalidArgumentError, match="integer row ids"):
        buf.leaf_priorities([0.5, 1.7])
    assert buf.leaf_priorities(np.array([1, 2], np.uint8)).tolist() == [2.0, 3.0]
