"""A writer left open closes at interpreter exit as ``close()`` does (issue 22, item 4)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer._ledger import closing

# Two stores, one prioritized; rows extended (and priorities set) after the last
# commit, or with no commit at all; then the script ends without close().
SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, mmbuffer as mb
    how, paths = sys.argv[1], sys.argv[2:]
    bufs = [mb.open(p) for p in paths]
    for k, buf in enumerate(bufs):
        for block in range(5):
            rows = block * 30 + np.arange(30)
            buf.extend({"x": rows * 10 + k, "terminated": rows % 7 == 6}, final_obs={"x": rows[rows % 7 == 6] * 10 + k + 1})
            if k == 1 and block == 1:
                buf.commit()  # the second store has a commit behind the rows left open
        if buf.priorities is not None:
            buf.update_priorities(buf.sample(16).indices, np.full(16, 3.0))
    print("extended", flush=True)
    if how == "raise":
        raise RuntimeError("boom")
    if how == "exit":
        sys.exit(3)
    """
)


def _stores(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    mb.create(paths[0], {"x": ((), "int64")}, capacity=1000, next_keys=("x",)).close()
    mb.create(paths[1], {"x": ((), "int64")}, capacity=1000, next_keys=("x",), priorities=mb.PriorityConfig()).close()
    return paths


@pytest.mark.parametrize("how,code", [("end", 0), ("raise", 1), ("exit", 3)])
def test_a_writer_left_open_commits_at_interpreter_exit(tmp_path, how, code):
    """The script extends without close() and ends (falls off its end, raises, or calls
    sys.exit): every extended row is committed, the close was clean (the reservation is
    back at the cursor, no tree marked dirty), so the next open recovers nothing; stderr
    names each store."""
    paths = _stores(tmp_path)
    out = subprocess.run([sys.executable, "-c", SCRIPT, how, *map(str, paths)], capture_output=True, text=True, timeout=600)
    assert out.returncode == code, out.stderr
    assert out.stdout.split() == ["extended"]  # the script reached its end with rows open
    if how == "raise":
        assert "RuntimeError: boom" in out.stderr
    for k, path in enumerate(paths):
        assert f"mmbuffer: {path}: the writer was not closed" in out.stderr
        assert "committed 150 extended rows" in out.stderr if k == 0 else "committed 90 extended rows" in out.stderr
        with mb.open(path, mode="r") as ro:
            generation = ro.generation
            assert generation == (1 if k == 0 else 2)  # one commit at exit (after the script's own)
            assert ro.view().written.tolist() == [150]
            assert ro.reservation().tolist() == [150]  # released as close() releases it
            x = ro.get(np.arange(150), keys=["x"])["x"].numpy()
            assert np.array_equal(x, np.arange(150) * 10 + k)
            assert ro.num_episodes == 150 // 7
            if k == 1:
                assert not (path / "priority" / "DIRTY").exists()
                assert (ro.leaf_priorities(np.arange(150)) > 0).all()
        with mb.open(path) as buf:  # the writer's open recovered nothing: it committed nothing
            assert buf.generation == generation and not buf.store.ledger.has_changes
        with mb.open(path, mode="r") as ro:
            assert ro.generation == generation


def test_a_closed_writer_is_not_closed_again_and_says_nothing(tmp_path):
    path = _stores(tmp_path)[0]
    script = f"import mmbuffer as mb, numpy as np\nb = mb.open({str(path)!r})\nb.extend({{'x': np.arange(5)}})\nb.close()\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "mmbuffer:" not in out.stderr, out.stderr
    with mb.open(path, mode="r") as ro:
        assert ro.generation == 1 and ro.view().written.tolist() == [5]


def test_the_exit_registry_keeps_no_buffer_alive(tmp_path):
    """Registration is weak: a buffer dropped by its program is collected (and its
    writer released its lock), it is not kept for the exit."""
    path = _stores(tmp_path)[0]
    buf = mb.open(path)
    buf.extend({"x": np.arange(5)})
    ref, writer_ref = weakref.ref(buf), weakref.ref(buf._writer)
    assert writer_ref() in closing._open
    del buf
    gc.collect()
    assert ref() is None and writer_ref() is None
    assert all(w.path != path for w in closing._open)
    with mb.open(path) as again:  # the lock was released; the uncommitted rows were not committed
        assert len(again) == 0


HOLDER = textwrap.dedent(
    """
    import sys, weakref, numpy as np, mmbuffer as mb
    from mmbuffer._ledger.closing import close_first

    class Holder:  # an integration that keeps steps in memory until it writes them (mmbuffer.sb3)
        pass

    buf = mb.open(sys.argv[1])
    buf.extend({"x": np.arange(10), "terminated": np.arange(10) == 9}, final_obs={"x": np.array([100])})
    held = {"x": np.arange(10, 15), "truncated": np.arange(5) == 4}
    owner = Holder()
    close_first(owner, lambda: buf.extend(held, final_obs={"x": np.array([200])}))
    print("held", flush=True)
    """
)


def test_close_first_callbacks_run_before_the_writers_close(tmp_path):
    """At exit, what an integration registered with ``close_first`` runs while the writer
    is still open: its held rows are extended, then committed by the writer's close (before
    this existed, the writer was closed first and the late extend failed, ReadOnlyError)."""
    path = tmp_path / "s"
    mb.create(path, {"x": ((), "int64")}, capacity=100, next_keys=("x",)).close()
    out = subprocess.run([sys.executable, "-c", HOLDER, str(path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split() == ["held"], out.stderr
    assert "failed" not in out.stderr and "committed 15 extended rows" in out.stderr, out.stderr
    with mb.open(path, mode="r") as ro:
        assert len(ro) == 15 and ro.num_episodes == 2
        assert ro.get(np.arange(15))["x"].tolist() == list(range(15))


def _mapped(path) -> list[str]:
    """This process's maps of files inside the store ``path``."""
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if f"{path}/" in line]


@pytest.mark.parametrize("mode", ["a", "r"])
@pytest.mark.parametrize("k", [0, 1], ids=["plain", "prioritized"])
def test_close_releases_the_maps_at_once_and_later_calls_are_typed_errors(tmp_path, mode, k):
    """While the closed object is still referenced (``with ... as buf`` leaves it in
    scope), none of the store's files stays mapped; a read then names the store (its
    size is still answered), a write is a ReadOnlyError as before, closing again does
    nothing."""
    path = _stores(tmp_path)[k]
    with mb.open(path) as w:
        w.extend({"x": np.arange(100), "terminated": np.arange(100) % 10 == 9}, final_obs={"x": np.arange(10)})
    buf = mb.open(path, mode=mode)
    buf.sample(8)
    buf.sample_slices(2, 4)
    if buf.priorities is not None:
        buf.warm()
    assert _mapped(path)  # the state this is about: the store's files were mapped
    buf.close()
    assert _mapped(path) == [], _mapped(path)
    with pytest.raises(mb.errors.InvalidArgumentError, match=f"store {path} is closed"):
        buf.sample(8)
    with pytest.raises(mb.errors.InvalidArgumentError, match="is closed"):
        buf.episodes()
    assert (len(buf), buf.num_episodes) == (100, 10)  # what it held at close: still answered
    with pytest.raises(mb.errors.ReadOnlyError, match=f"attrs: store {path} is closed"):
        buf.attrs = {"a": 1}
    with pytest.raises(mb.errors.ReadOnlyError, match=f"extend: store {path} is (closed|opened with mode='r')"):
        buf.extend({"x": np.arange(3)})
    buf.close()
    assert "closed" in repr(buf)
    with mb.open(path, mode="r") as ro:  # what was written stays
        assert len(ro) == 100
