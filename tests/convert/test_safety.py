"""Converters never change data silently, and ``overwrite`` never deletes what mmbuffer did not write.

Issue 10, items 3.1 and 4. Every source is built here, in D4RL's own layout.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer._cli.main import main
from mmbuffer.convert import ConversionWarning, convert_d4rl, convert_npz, convert_torchrl, copy, export_d4rl, export_minari
from mmbuffer.errors import ConversionError, StoreExistsError

N = 1050


def d4rl_arrays(n: int = N, *, seed: int = 0, open_tail: bool = True) -> dict[str, np.ndarray]:
    """D4RL's keys: episodes end at rows n//10 (terminal), 3n//10 (timeout), n//2 (terminal),
    3n//4 (timeout); the last episode has no end flag when ``open_tail``, as in real D4RL files."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n + 1, 3)).astype(np.float32)
    term = np.zeros(n, bool)
    term[[n // 10, n // 2]] = True
    tout = np.zeros(n, bool)
    tout[[3 * n // 10, 3 * n // 4]] = True
    if not open_tail:
        tout[-1] = True
    return {
        "observations": obs[:-1],
        "next_observations": obs[1:],
        "actions": rng.standard_normal((n, 2)).astype(np.float32),
        "rewards": rng.standard_normal(n).astype(np.float32),
        "terminals": term,
        "timeouts": tout,
    }


def write_h5(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f[k] = v
    return path


def read_h5(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f if isinstance(f[k], h5py.Dataset)}


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        return fn(*args, progress=False, **kwargs)


@pytest.fixture()
def store(tmp_path) -> Path:
    src = write_h5(tmp_path / "src.hdf5", d4rl_arrays(200, open_tail=False))
    quiet(convert_d4rl, src, tmp_path / "store")
    return tmp_path / "store"


# -- overwrite replaces only what mmbuffer wrote -----------------------------------------------
def _foreign_dir(path: Path) -> Path:
    path.mkdir()
    (path / "results.csv").write_text("epoch,return\n1,200\n")
    return path


def _foreign_file(path: Path) -> Path:
    path.write_text("my notes\n")
    return path


@pytest.mark.parametrize("make", [_foreign_dir, _foreign_file], ids=["dir-with-results.csv", "plain-file"])
def test_convert_overwrite_refuses_what_mmbuffer_did_not_write(tmp_path, make):
    src = write_h5(tmp_path / "src.hdf5", d4rl_arrays(200, open_tail=False))
    dst = make(tmp_path / "dst")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(StoreExistsError, match=r"dst.*overwrite refused.*got (a directory holding 'results.csv'|a text file)"):
        convert_d4rl(src, dst, overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert main(["convert", "d4rl", str(src), str(dst), "--overwrite", "--no-progress"]) == 2
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_store_with_an_extra_file_is_not_ours(tmp_path, store):
    (store / "results.csv").write_text("keep me")
    src = write_h5(tmp_path / "src2.hdf5", d4rl_arrays(100, open_tail=False))
    with pytest.raises(StoreExistsError, match="results.csv"):
        convert_d4rl(src, store, overwrite=True, progress=False)
    assert (store / "results.csv").read_text() == "keep me"
    assert mb.open(str(store), mode="r").capacity == 200


def test_copy_and_export_overwrite_refuse_foreign_outputs(tmp_path, store):
    d = _foreign_dir(tmp_path / "d")
    f = _foreign_file(tmp_path / "f.hdf5")
    with pytest.raises(StoreExistsError, match="overwrite refused"):
        copy(store, d, overwrite=True, progress=False)
    with pytest.raises(StoreExistsError, match="overwrite refused.*text file"):
        export_d4rl(store, f, overwrite=True, progress=False)
    with pytest.raises(StoreExistsError, match="overwrite refused"):
        export_minari(store, d, overwrite=True, progress=False)
    # an mmbuffer store is not a D4RL file nor a Minari dataset
    with pytest.raises(StoreExistsError, match="overwrite refused"):
        export_minari(store, store, overwrite=True, progress=False)
    # an HDF5 file that is not a D4RL dataset
    with h5py.File(tmp_path / "model.h5", "w") as h:
        h["weights"] = np.ones(3)
    with pytest.raises(StoreExistsError, match="without D4RL"):
        export_d4rl(store, tmp_path / "model.h5", overwrite=True, progress=False)
    for argv in (["copy", str(store), str(d)], ["export", "d4rl", str(store), str(f)],
                 ["export", "minari", str(store), str(d)]):
        assert main([*argv, "--overwrite", "--no-progress"]) == 2
    assert (d / "results.csv").exists() and f.read_text() == "my notes\n"
    assert read_h5(tmp_path / "model.h5")["weights"].tolist() == [1, 1, 1]


def test_symlink_at_destination_is_never_followed(tmp_path, store):
    target = _foreign_dir(tmp_path / "precious")
    link = tmp_path / "link"
    link.symlink_to(target)
    src = write_h5(tmp_path / "src2.hdf5", d4rl_arrays(100, open_tail=False))
    with pytest.raises(StoreExistsError, match="symbolic link"):
        convert_d4rl(src, link, overwrite=True, progress=False)
    # a link to a real store is refused too: the link is the user's, not ours
    store_link = tmp_path / "store_link"
    store_link.symlink_to(store)
    with pytest.raises(StoreExistsError, match="symbolic link"):
        copy(store, store_link, overwrite=True, progress=False)
    assert link.is_symlink() and (target / "results.csv").exists()
    assert store_link.is_symlink() and (store / "manifest.json").is_file()


def test_stale_partial_that_is_not_ours_is_refused(tmp_path, store):
    src = write_h5(tmp_path / "src2.hdf5", d4rl_arrays(100, open_tail=False))
    _foreign_file(tmp_path / "new.partial")
    with pytest.raises(StoreExistsError, match=r"new\.partial.*interrupted"):
        convert_d4rl(src, tmp_path / "new", progress=False)
    assert (tmp_path / "new.partial").read_text() == "my notes\n"
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_overwrite_replaces_our_own_outputs(tmp_path, store, monkeypatch, exchange):
    from mmbuffer.convert._pipeline import dest as _dest

    if not exchange:  # a filesystem or kernel without RENAME_EXCHANGE
        monkeypatch.setattr(_dest, "_exchange", lambda a, b: False)
    src = write_h5(tmp_path / "src2.hdf5", d4rl_arrays(100, seed=1, open_tail=False))
    out = quiet(convert_d4rl, src, store, overwrite=True)
    assert out["verified"] and mb.open(str(store), mode="r").capacity == 100
    quiet(copy, store, tmp_path / "copy")
    quiet(copy, store, tmp_path / "copy", compression="zstd", overwrite=True)
    assert mb.open(str(tmp_path / "copy"), mode="r").compression == "zstd"
    quiet(export_d4rl, store, tmp_path / "o.hdf5")
    quiet(export_d4rl, store, tmp_path / "o.hdf5", overwrite=True)
    quiet(export_minari, store, tmp_path / "m")
    quiet(export_minari, store, tmp_path / "m", overwrite=True)
    leftovers = [p.name for p in tmp_path.iterdir() if ".partial" in p.name or ".old" in p.name]
    assert leftovers == []


def test_store_with_a_live_writer_is_not_overwritten(tmp_path, store):
    src = write_h5(tmp_path / "src2.hdf5", d4rl_arrays(100, open_tail=False))
    with mb.open(str(store), mode="a"):
        with pytest.raises(StoreExistsError, match="writer lock"):
            convert_d4rl(src, store, overwrite=True, progress=False)
    assert mb.open(str(store), mode="r").capacity == 200


def test_swap_failure_leaves_the_old_output(tmp_path, store, monkeypatch):
    """A crash while swapping leaves the old store or the new one at DST, never neither."""
    from mmbuffer.convert._pipeline import dest as _dest

    src = write_h5(tmp_path / "src2.hdf5", d4rl_arrays(100, open_tail=False))

    def boom(a, b):
        raise OSError("disk on fire")

    monkeypatch.setattr(_dest, "_exchange", boom)
    with pytest.raises(OSError, match="disk on fire"):
        convert_d4rl(src, store, overwrite=True, progress=False)
    assert mb.open(str(store), mode="r").capacity == 200  # the old one, intact
    monkeypatch.undo()
    quiet(convert_d4rl, src, store, overwrite=True)  # the stale partial is ours: replaced
    assert mb.open(str(store), mode="r").capacity == 100


# -- a D4RL file that stops inside an episode: round trip exact --------------------------------
def assert_same_file(got: Path, want: Path) -> None:
    a, b = read_h5(want), read_h5(got)
    assert sorted(b) == sorted(a)
    for key in a:
        assert b[key].dtype == a[key].dtype, key
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)


def test_d4rl_unflagged_tail_keeps_every_row_and_exports_exactly(tmp_path):
    src = write_h5(tmp_path / "src.hdf5", d4rl_arrays())
    s = quiet(convert_d4rl, src, tmp_path / "s")
    assert s["rows"] == N and s["episodes"] == 5 and s["open_episode_rows"] == 0
    with mb.open(str(tmp_path / "s"), mode="r") as buf:
        assert len(buf) == N  # every row is sampleable, the last one included
        last = buf.get(torch.tensor([N - 1]), keys=["next_obs", "truncated"])
        np.testing.assert_array_equal(last["next_obs"][0].numpy(), d4rl_arrays()["next_observations"][-1])
        assert bool(last["truncated"][0])
    out = quiet(export_d4rl, tmp_path / "s", tmp_path / "out.hdf5")
    assert out["verified"] and out["rows"] == N and out["skipped_open_rows"] == 0
    assert_same_file(tmp_path / "out.hdf5", src)  # next_observations[-1] is not observations[0]
    again = quiet(convert_d4rl, tmp_path / "out.hdf5", tmp_path / "s2")
    assert again["checksums"] == s["checksums"] and again["final_obs_checksums"] == s["final_obs_checksums"]


def test_d4rl_without_next_observations_is_refused_or_drops_last_transitions(tmp_path):
    """Unknown final observations: refused by name (nothing written), or, when asked, each
    complete episode's last transition is dropped and the export writes back exactly the
    rows kept, with the dropped rows' observations as their next observations."""
    arrays = d4rl_arrays(open_tail=False)
    del arrays["next_observations"]
    src = write_h5(tmp_path / "src.hdf5", arrays)
    with pytest.raises(ConversionError, match="no next observations"):
        quiet(convert_d4rl, src, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    s = quiet(convert_d4rl, src, tmp_path / "s", drop_last_transition=True)
    done = arrays["terminals"].astype(bool) | arrays["timeouts"].astype(bool)
    assert s["rows"] == N - int(done.sum()) and s["dropped_last_transitions"] == int(done.sum())
    out = quiet(export_d4rl, tmp_path / "s", tmp_path / "out.hdf5")
    assert out["verified"]
    with h5py.File(tmp_path / "out.hdf5") as f:
        np.testing.assert_array_equal(f["observations"][()], arrays["observations"][~done])
        last = np.flatnonzero(f["timeouts"][()])
        np.testing.assert_array_equal(f["next_observations"][()][last], arrays["observations"][done][: len(last)])


def test_export_never_wraps_an_open_episode_into_next_observations(tmp_path):
    """An open episode's last row has no next observation: it is not made up from row 0."""
    cap = 10
    with mb.create(str(tmp_path / "s"), {"obs": ((2,), "float32"), "action": ((), "float32"),
                                         "reward": ((), "float32")}, capacity=cap) as buf:
        obs = np.arange(2 * cap, dtype=np.float32).reshape(cap, 2)
        term = np.zeros(cap, bool)
        term[3] = True
        buf.extend({"obs": obs, "action": np.zeros(cap, np.float32), "reward": np.ones(cap, np.float32),
                    "terminated": term}, final_obs={"obs": np.full((1, 2), -1, np.float32)})
    with pytest.raises(ConversionError, match="6 rows of open .* no next observation.*drop_open_episodes=True"):
        export_d4rl(tmp_path / "s", tmp_path / "o.hdf5", progress=False)
    assert not (tmp_path / "o.hdf5").exists() and not (tmp_path / "o.hdf5.partial").exists()
    with pytest.warns(ConversionWarning, match="6 rows of open .* no next observation"):
        out = export_d4rl(tmp_path / "s", tmp_path / "o.hdf5", drop_open_episodes=True, progress=False)
    assert out["rows"] == 4 and out["skipped_open_rows"] == 6 and out["verified"]
    got = read_h5(tmp_path / "o.hdf5")
    np.testing.assert_array_equal(got["next_observations"], np.r_[obs[1:4], [[-1, -1]]])
    # without next observations the open episode can be written whole, unflagged at the end
    out = export_d4rl(tmp_path / "s", tmp_path / "o.hdf5", overwrite=True, next_observations=False,
                      progress=False)
    got = read_h5(tmp_path / "o.hdf5")
    assert out["rows"] == cap and "next_observations" not in got
    np.testing.assert_array_equal(got["observations"], obs)


@pytest.mark.parametrize("cli", [False, True], ids=["python", "cli"])
def test_keep_next_obs_store_exports_exactly(tmp_path, cli):
    arrays = d4rl_arrays()
    arrays["next_observations"][10] += 1  # a next observation that differs from the next row
    src = write_h5(tmp_path / "src.hdf5", arrays)
    if cli:
        assert main(["convert", "d4rl", str(src), str(tmp_path / "s"), "--keep-next-obs", "--no-progress"]) == 0
        assert main(["export", "d4rl", str(tmp_path / "s"), str(tmp_path / "o.hdf5"), "--no-progress"]) == 0
    else:
        quiet(convert_d4rl, src, tmp_path / "s", keep_next_obs=True)
        assert quiet(export_d4rl, tmp_path / "s", tmp_path / "o.hdf5")["verified"]
    assert_same_file(tmp_path / "o.hdf5", src)
    assert not (tmp_path / "o.hdf5.partial").exists()


# -- a required key that cannot be converted is an error ---------------------------------------
@pytest.mark.parametrize("key", ["rewards", "terminals", "actions"])
def test_npz_required_key_of_strings_is_an_error(tmp_path, key):
    arrays = d4rl_arrays(20, open_tail=False)
    arrays[key] = arrays[key].astype(str)
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(ConversionError, match=rf"d\.npz \[{key}\]: expected a numeric array.*got dtype <U"):
        convert_npz(tmp_path / "d.npz", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()


# -- wrong-format input: one typed line, what was expected and what was found ------------------
def _sources(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "notes.txt").write_text("some notes\nnot a dataset\n")
    (tmp_path / "x.json").write_text(json.dumps({"observations": [1, 2]}))
    (tmp_path / "x.csv").write_text("obs,action\n1,2\n")
    np.savez(tmp_path / "x.npz", **d4rl_arrays(20, open_tail=False))
    (tmp_path / "empty_dir").mkdir()
    bad = tmp_path / "bad_dump" / "storage"
    bad.mkdir(parents=True)
    (bad / "storage_metadata.json").write_text("{not json")
    return {
        "txt": tmp_path / "notes.txt", "json": tmp_path / "x.json", "csv": tmp_path / "x.csv",
        "hdf5": write_h5(tmp_path / "x.hdf5", d4rl_arrays(20, open_tail=False)),
        "npz": tmp_path / "x.npz", "dir": tmp_path / "empty_dir", "bad_dump": tmp_path / "bad_dump",
    }


CASES = [
    ("torchrl", "txt", "expected a TD-MPC2 .pt file .* found a text file"),
    ("tdmpc2", "hdf5", "expected a TD-MPC2 .pt file .* found an HDF5 file"),
    ("tdmpc2", "json", "expected a TD-MPC2 .pt file .* found a JSON file"),
    ("tdmpc2", "csv", "expected a TD-MPC2 .pt file .* found a text file"),
    ("tdmpc2", "npz", "found a zip archive that torch.save did not write"),
    ("torchrl", "bad_dump", r"storage_metadata\.json\]: expected a JSON object, found unreadable JSON"),
    ("d4rl", "dir", "expected a D4RL HDF5 file, found a directory"),
    ("d4rl", "txt", "expected a D4RL HDF5 file, found a text file"),
    ("d4rl", "npz", "expected a D4RL HDF5 file, found a zip archive"),
    ("minari", "hdf5", "expected a Minari dataset directory .* found an HDF5 file"),
    ("npz", "hdf5", "expected an .npz archive or a directory of .npy files, found an HDF5 file"),
    ("npz", "json", "expected an .npz archive or a directory of .npy files, found a JSON file"),
]


@pytest.mark.parametrize("fmt, what, message", CASES, ids=[f"{f}-{w}" for f, w, _ in CASES])
def test_wrong_format_input_is_one_typed_line(tmp_path, capsys, fmt, what, message):
    from mmbuffer.convert import convert

    src = _sources(tmp_path)[what]
    with pytest.raises(ConversionError, match=message):
        convert(fmt, src, tmp_path / "out", progress=False)
    capsys.readouterr()
    assert main(["convert", fmt, str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmbuffer: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_sniff_names_what_a_file_holds(tmp_path):
    from mmbuffer.convert._pipeline.sniff import sniff

    src = _sources(tmp_path)
    torch.save({"obs": torch.zeros(2)}, tmp_path / "t.pt")
    assert sniff(src["hdf5"]) == "an HDF5 file"
    assert sniff(src["npz"]).startswith("a zip archive") and sniff(tmp_path / "t.pt").startswith("a zip archive")
    assert sniff(src["json"]) == "a JSON file" and sniff(src["txt"]) == "a text file"
    assert sniff(src["dir"]) == "a directory" and sniff(tmp_path / "nope").startswith("nothing")
    (tmp_path / "e").write_bytes(b"")
    assert sniff(tmp_path / "e") == "an empty file"


@pytest.mark.parametrize("argv", [["export", "d4rl"], ["export", "minari"], ["copy"]], ids=" ".join)
def test_export_and_copy_of_something_that_is_not_a_store(tmp_path, capsys, argv):
    src = _sources(tmp_path)["hdf5"]
    assert main([*argv, str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"mmbuffer: error: {src}: expected an mmbuffer store directory, found an HDF5 file\n"
    with pytest.raises(mb.errors.StoreNotFoundError, match="found an HDF5 file"):
        copy(src, tmp_path / "out", progress=False)


def test_a_source_array_that_shrinks_while_it_is_read_is_refused_by_name(tmp_path):
    """A flat source's arrays (npz members, TorchRL memmaps) are read with pread; the
    size checked when the reader opened them can shrink before a chunk is read, and that
    is a ConversionError naming the file, the bytes expected and those read, not an
    EOFError."""
    from mmbuffer.convert._pipeline.flat import FileArray

    path = tmp_path / "a.bin"
    np.arange(100, dtype=np.int64).tofile(path)
    arr = FileArray(path, 0, (100,), np.int64)
    np.testing.assert_array_equal(arr[10:20], np.arange(10, 20))
    os.truncate(path, 50 * 8)
    with pytest.raises(mb.errors.ConversionError, match=r"a\.bin: expected 400 bytes at byte 320, got 80 \(the file ends at byte 400"):
        arr[40:90]
    np.testing.assert_array_equal(arr[0:50], np.arange(50))  # what is still there reads as before
