"""The filesystem's edges: concurrent create, a full disk, a read-only mount.

The disk-full and read-only tests mount a small tmpfs of their own (root, or
CAP_SYS_ADMIN, is needed; they skip, saying so, where mounting is refused). A
writer that may die of SIGBUS runs in a subprocess, so that a SIGBUS fails the
test instead of killing pytest.
"""

import errno
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import warm
import zarr

import mmbuffer as mb
from conftest import tree_hash

COLUMNS = {"obs": ((16,), "float32"), "action": ((), "int64")}


def _run(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=warm.repo_env(), timeout=300
    )


def _result(proc: subprocess.CompletedProcess[str]) -> object:
    """The JSON a subprocess printed last; a signal (SIGBUS: -7) or an error fails here."""
    assert proc.returncode == 0, f"writer exited with {proc.returncode} (negative: killed by that signal)\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- two creators at once ---------------------------------------------------------------------
CREATE_RACE = r"""
import json, os, sys
import numpy as np
import mmbuffer as mb

root, trials, procs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
create, config = mb.create, mb.PriorityConfig  # imported here, so the children race from the same instant
out = []
for t in range(trials):
    path = os.path.join(root, f"s{t}")
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pids = []
    for _ in range(procs):
        pid = os.fork()  # zarr has not run in this parent yet: its event loop starts in each child
        if pid == 0:
            os.close(go_w)
            os.close(res_r)
            os.read(go_r, 1)  # every child starts at once
            try:
                create(path, {"x": ((4,), "float32")}, capacity=4096, num_streams=2, priorities=config(),
                       next_keys=("x",))
                r = "created"
            except mb.errors.StoreExistsError:
                r = "exists"
            except BaseException as exc:
                r = f"{type(exc).__name__}: {exc}"
            os.write(res_w, (json.dumps(r) + "\n").encode())
            os._exit(0)
        pids.append(pid)
    os.close(go_r)
    os.close(res_w)
    os.write(go_w, b"x" * procs)
    os.close(go_w)
    for pid in pids:
        os.waitpid(pid, 0)
    with os.fdopen(res_r) as f:
        out.append(sorted(json.loads(line) for line in f))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_concurrent_creates_make_one_whole_store_and_typed_losers(tmp_path):
    trials, procs = 6, 4
    outcomes = _result(_run(CREATE_RACE, tmp_path, trials, procs))
    assert outcomes == [["created"] + ["exists"] * (procs - 1)] * trials
    for t in range(trials):
        with mb.open(tmp_path / f"s{t}") as buf:  # whole: opens as a writer, takes rows
            buf.extend({"x": np.ones((3, 4))})
            assert buf.commit() == 1 and len(buf) == 2  # the last row waits for its next obs
    # the losers removed their own build directories, and only those
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"s{t}" for t in range(trials))


def test_create_leaves_other_directories_alone(tmp_path):
    """An older ``<path>.creating`` (someone else's) survives a create of ``<path>``."""
    theirs = tmp_path / "s.creating"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("not mmbuffer's")
    mb.create(tmp_path / "s", COLUMNS, capacity=64).close()
    assert (theirs / "keep.txt").read_text() == "not mmbuffer's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s", "s.creating"]


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "fallback"])
def test_create_refuses_an_empty_directory_made_meanwhile(tmp_path, monkeypatch, renameat2):
    """A rename onto an existing empty directory succeeds on Linux: create must not
    take that directory over when it appears while the store is being built (also
    where ``renameat2`` is missing: then the directory is checked just before)."""
    if not renameat2:
        from mmbuffer._disk import files as _files

        monkeypatch.setattr(_files, "_renameat2", lambda: None)
    target = tmp_path / "s"
    real = zarr.open_group

    def racing_open_group(*args, **kwargs):
        group = real(*args, **kwargs)
        target.mkdir()  # another process (or user) claims the path meanwhile
        return group

    monkeypatch.setattr(zarr, "open_group", racing_open_group)
    with pytest.raises(mb.errors.StoreExistsError, match=str(target)):
        mb.create(target, COLUMNS, capacity=64)
    assert target.is_dir() and list(target.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # the build directory is gone


# -- a small filesystem of our own -------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """A fresh 8 MiB tmpfs, unmounted after the test."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command: cannot mount a tmpfs to fill or make read-only")
    if r.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        gc.collect()  # drop this process's maps of the files
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(fs: Path) -> Path:
    """Take every free block of ``fs`` with one file; return it (delete it to free them)."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 4096, 1):
            block = b"\xff" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    assert os.statvfs(fs).f_bavail == 0
    return filler


def _remount_read_only(fs: Path) -> None:
    gc.collect()  # a writable map of a file (a closed Buffer's, until collected) keeps the mount writable
    r = subprocess.run(["mount", "-o", "remount,ro", str(fs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _small_store(path: Path, **kwargs: object) -> None:
    with mb.create(path, COLUMNS, capacity=64, **kwargs) as buf:
        _extend(buf, 0, 10, 5)


def _extend(buf: mb.Buffer, start: int, n: int, episode_len: int, stream: int = 0) -> None:
    """Extend rows whose values are their lane's row counters ``start .. start + n``;
    an episode ends every ``episode_len`` rows."""
    a = np.arange(start, start + n)
    done = a % episode_len == episode_len - 1
    steps = {"obs": np.repeat(a[:, None], 16, 1).astype(np.float32), "action": a, "terminated": done}
    final = {"obs": np.full((int(done.sum()), 16), -1, np.float32)} if buf.next_keys else None
    buf.extend(steps, stream=stream, final_obs=final)


# -- a full disk -------------------------------------------------------------------------------
FULL_DISK_WRITER = r"""
import hashlib, json, os, sys
from pathlib import Path
import numpy as np
import mmbuffer as mb
sys.path[:0] = [sys.argv[3], str(Path(sys.argv[3]).parent)]  # this file's folder, and tests/ (conftest)
from test_edges import _extend, _fill

fs, path = Path(sys.argv[1]), Path(sys.argv[2])
out = {}

def digest():
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != "LOCK":
            h.update(str(p.relative_to(path)).encode() + p.read_bytes())
    return h.hexdigest()

def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]

buf = mb.open(path)
g0 = buf.generation
_extend(buf, 500, 2, 1)                                 # lane 0 at row 502: its window is allocated
ring = mb.open(fs / "ring")                             # a lane that has wrapped ...
_extend(ring, 600, 1, 7)
filler = _fill(fs)
attempt("wrapped", lambda: [_extend(ring, s, 10, 7) for s in range(601, 1111, 10)])  # ... needs no new space
attempt("wrapped_past_a_lane", lambda: _extend(ring, 1111, 10, 7))  # a lane uncommitted: extend commits first
for start in range(502, 700, 9):                        # inside the window: rows through the maps, one
    _extend(buf, start, 9, 1)                           # episode each (index slots past the first page),
before = digest()                                       # final observations, priorities
attempt("small_past_window", lambda: _extend(buf, 700, 300, 7))
attempt("large", lambda: _extend(buf, 700, 1100, 7))      # >= 64 KiB: written with pwrite
attempt("other_lane", lambda: _extend(buf, 0, 1, 7, stream=1))
attempt("commit", buf.commit)
out["unchanged"] = digest() == before
out["partial"] = sorted(p.name for p in path.iterdir() if p.name.endswith(".partial"))
out["generation_after_refusals"] = buf.generation - g0
filler.unlink()                                         # space again: the same calls succeed
attempt("small_again", lambda: _extend(buf, 700, 300, 7))
attempt("large_again", lambda: _extend(buf, 1000, 1100, 7))
attempt("other_lane_again", lambda: _extend(buf, 0, 1, 7, stream=1))
attempt("commit_again", buf.commit)
attempt("wrapped_again", lambda: [_extend(ring, s, 10, 7) for s in range(1111, 2601, 10)])
out["generation"] = buf.generation - g0
buf.close()
ring.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_full_disk_extends_are_typed_errors_never_sigbus(small_fs):
    path = small_fs / "s"
    buf = mb.create(path, COLUMNS, capacity=2 * 4096, num_streams=2, priorities=mb.PriorityConfig())
    _extend(buf, 0, 500, 1)  # 500 one-row episodes: the writer's go past the index's first page
    buf.commit()
    buf.close()
    with mb.create(small_fs / "ring", COLUMNS, capacity=512, priorities=mb.PriorityConfig()) as ring:
        _extend(ring, 0, 300, 7)
        _extend(ring, 300, 300, 7)
    out = _result(_run(FULL_DISK_WRITER, small_fs, path, Path(__file__).resolve().parent))
    assert out["wrapped"] == "ok", out["wrapped"]  # a lane of rows into the allocated ring
    kind, message = out["wrapped_past_a_lane"]  # then extend commits first, and the manifest needs room
    assert kind == "DiskFullError" and "commit" in message and str(small_fs / "ring") in message
    assert out["wrapped_again"] == "ok", out["wrapped_again"]
    for name in ("small_past_window", "large", "other_lane", "commit"):
        kind, message = out[name]
        assert kind == "DiskFullError", out[name]
        assert str(path) in message and ("extend" in message or name == "commit")
    assert "commit" in out["commit"][1]
    assert out["unchanged"] is True  # no file of the store changed: nothing a reader or a reopen sees
    assert out["partial"] == [] and out["generation_after_refusals"] == 0
    for name in ("small_again", "large_again", "other_lane_again", "commit_again"):
        assert out[name] == "ok", out[name]
    assert out["generation"] == 1
    ro = mb.open(path, mode="r")  # everything written since the last commit arrived
    # lane 0 holds rows 0..2099 in whole episodes; lane 1 one row, whose next obs is not known yet
    assert ro.generation == 2 and len(ro) == 2100
    rows = np.arange(2100)
    got = ro.get(rows)
    np.testing.assert_array_equal(got["action"].numpy(), rows)
    np.testing.assert_array_equal(got["obs"].numpy()[:, 3], rows)
    starts, lengths = ro.episodes()
    assert starts.tolist() == list(range(700)) + list(range(700, 2100, 7))
    assert lengths.tolist() == [1] * 700 + [7] * 200
    assert (ro.get(rows[:700], keys=["next_obs"])["next_obs"].numpy() == -1).all()  # the final observations
    assert (ro.leaf_priorities(rows) > 0).all() and ro.get([4096])["action"].tolist() == [0]
    ring = mb.open(small_fs / "ring", mode="r")  # round the ring four more times, then space again
    np.testing.assert_array_equal(ring.get(np.arange(512))["action"].numpy() % 512, np.arange(512))
    assert ring.get([0])["action"].tolist() == [2560]


def test_failed_commit_keeps_the_last_commit_and_its_generation(small_fs):
    path = small_fs / "s"
    buf = mb.create(path, COLUMNS, capacity=4096, priorities=mb.PriorityConfig())
    _extend(buf, 0, 10, 5)
    assert buf.commit() == 1
    _extend(buf, 10, 5, 5)  # allocated while there is room
    filler = _fill(small_fs)
    with pytest.raises(mb.errors.DiskFullError, match="commit") as info:
        buf.commit()
    assert str(path) in str(info.value) and info.value.errno == errno.ENOSPC
    assert isinstance(info.value, OSError)
    assert buf.generation == 1 and not (path / "manifest.json.partial").exists()
    assert mb.open(path, mode="r").num_episodes == 2  # a reader sees the last commit
    filler.unlink()
    assert buf.commit() == 2
    assert mb.open(path, mode="r").num_episodes == 3
    # close() commits: when that fails, the lock is released and the last commit stays
    _extend(buf, 15, 5, 5)
    filler = _fill(small_fs)
    with pytest.raises(mb.errors.DiskFullError, match="commit"):
        buf.close()
    assert not (path / "manifest.json.partial").exists()
    filler.unlink()
    with mb.open(path) as again:
        assert again.generation >= 2 and again.num_episodes == 3


FULL_DISK_CREATE = r"""
import json, sys
import mmbuffer as mb
out = {}
try:
    mb.create(sys.argv[1] + "/big", {"x": ((), "float32")}, capacity=4_000_000, priorities=mb.PriorityConfig())
    out["priorities"] = "ok"
except Exception as exc:
    out["priorities"] = [type(exc).__name__, str(exc)]
mb.create(sys.argv[1] + "/sparse", {"x": ((), "float32")}, capacity=4_000_000).close()
out["sparse"] = "ok"
print(json.dumps(out))
"""


@pytest.mark.slow
def test_create_on_a_small_disk_is_sparse_with_priorities_too(small_fs):
    """The priority tree's files are sparse like the columns (issue 12): 16 MB of
    leaves fit 8 MiB until rows are written (extend allocates, see above)."""
    out = _result(_run(FULL_DISK_CREATE, small_fs))
    assert out["priorities"] == "ok" and out["sparse"] == "ok"
    assert sorted(p.name for p in small_fs.iterdir()) == ["big", "sparse"]  # no build directory left


# -- a read-only filesystem ---------------------------------------------------------------------
def test_read_only_filesystem_refuses_a_writer_with_a_typed_error(small_fs):
    path = small_fs / "s"
    _small_store(path)
    _remount_read_only(small_fs)
    before = tree_hash(path)
    with pytest.raises(mb.errors.ReadOnlyError, match="mode='r'") as info:
        mb.open(path)
    assert str(path) in str(info.value)
    with pytest.raises(mb.errors.ReadOnlyError, match=str(small_fs / "t")):
        mb.create(small_fs / "t", COLUMNS, capacity=64)
    ro = mb.open(path, mode="r")  # reading works
    assert ro.num_episodes == 2 and ro.get([7])["action"].tolist() == [7]
    from mmbuffer._cli.main import main

    assert main(["verify", str(path)]) == 0  # a reader's verify needs no write
    assert main(["verify", str(path), "--repair"]) == 2  # one typed line, no traceback
    assert tree_hash(path) == before


def test_epoch_sampler_on_a_read_only_filesystem_says_its_state_cannot_be_saved(small_fs):
    path = small_fs / "s"
    _small_store(path, next_keys=())
    _remount_read_only(small_fs)
    ro = mb.open(path, mode="r")
    sampler = mb.EpochSampler(ro, batch_size=4, seed=3)
    with pytest.raises(mb.errors.ReadOnlyError, match="state") as info:
        next(iter(sampler))
    assert str(path) in str(info.value) and "default.json" in str(info.value)
    assert sampler.position == 0 and sampler.epoch == 0  # no batch was taken


def test_a_failed_lock_owner_write_releases_the_lock(tmp_path, monkeypatch):
    """If writing the owner's name into LOCK fails (a full disk), the open is refused
    and the lock is not kept: the next writer gets it."""
    _small_store(tmp_path / "s")
    import mmbuffer._disk.guards as guards

    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(guards.os, "pwrite", full)
    with pytest.raises(mb.errors.DiskFullError):
        mb.open(tmp_path / "s")
    monkeypatch.setattr(guards.os, "pwrite", real)
    mb.open(tmp_path / "s").close()


def test_the_reservation_runs_at_most_16_mib_of_rows_ahead(tmp_path):
    """README: a lane/16 ahead of the cursor, but no more than 16 MiB of rows, so a big
    sparse store does not become dense at its first extend."""
    capacity = 1 << 26  # a lane/16 would be 4M rows, 56 MiB at 14 bytes a row
    buf = mb.create(tmp_path / "s", {"x": ((), "float32")}, capacity=capacity, next_keys=())
    buf.extend({"x": np.zeros(1, np.float32)})
    ahead = int(buf.reservation()[0]) - 1
    row_bytes = 4 + 1 + 1 + 8  # x, the two flags, an episode-end slot
    assert 0 < ahead <= (1 << 24) // row_bytes < capacity // 16
    used = os.stat(tmp_path / "s" / "columns" / "x" / "c" / "0").st_blocks * 512
    assert used <= 2 * ahead * 4 + (1 << 20)  # allocated for the window, not for the lane/16
    small = mb.create(tmp_path / "t", {"x": ((), "float32")}, capacity=1 << 12, next_keys=())
    small.extend({"x": np.zeros(1, np.float32)})
    assert int(small.reservation()[0]) - 1 == (1 << 12) // 16  # a small lane: the lane/16 rule
