"""Final observations stored per episode (format 4, ``mmbuffer/_ledger/finals.py``).

Every value is a function of where it was written: row ``a`` of lane ``l`` holds
``obs_of(l, a)`` and the episode ending at absolute end ``e`` has the final
observation ``final_of(l, e)``. So ``next_obs`` of any live row is known from the
row's own flags, lane and absolute number alone (``expected``), whatever the
episodes, wraps, reopens or kills that came before: a final observation from the
wrong slot, episode or lane shows.
"""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
import torch
import warm

import mmbuffer as mb
from mmbuffer import errors

WIDTH = 16  # int64 values per row: 128 bytes, so 512 rows take the large-batch kernel
BIG = 1 << 40


def obs_of(lane, a):
    a = np.asarray(a, np.int64)
    return (lane * BIG + a)[..., None] * np.ones(WIDTH, np.int64) + np.arange(WIDTH, dtype=np.int64)


def final_of(lane, e):
    return -obs_of(lane, e) - 1


def write(buf, rng, lane, rows, *, p_end=0.05, max_len=None, chunk=(1, 40)):
    """Append ``rows`` rows to ``lane`` in extends of random sizes, episodes ending at
    random (never longer than ``max_len``, default half a lane), terminated or
    truncated at random, each with its final observation ``final_of``."""
    max_len = max_len or buf.lane_size // 2
    done_rows = 0
    while done_rows < rows:
        view = buf.view()
        w = int(view.written[lane])
        open_len = w - view.lanes[lane].open_start
        n = min(int(rng.integers(*chunk)), rows - done_rows)
        a = w + np.arange(n)
        ends = rng.random(n) < p_end
        length = open_len
        for i in range(n):  # cut episodes that would outgrow max_len
            length += 1
            if length >= max_len:
                ends[i] = True
            if ends[i]:
                length = 0
        term = ends & (rng.random(n) < 0.5)
        buf.extend({"obs": obs_of(lane, a), "terminated": term, "truncated": ends & ~term}, stream=lane,
                   final_obs={"obs": final_of(lane, a[ends] + 1)})
        done_rows += n


def live_rows(buf):
    """Every sampleable row (lane order) with its lane and absolute number."""
    view = buf.view()
    out = []
    for lane, lv in enumerate(view.lanes):
        a = np.arange(lv.first_start, lv.visible_end, dtype=np.int64)
        out.append((buf.layout.rows(lane, a), np.full(len(a), lane), a))
    return [np.concatenate(x) for x in zip(*out)]


def expected(buf, rows, lane, a):
    flags = buf.read("terminated", rows) | buf.read("truncated", rows)
    want = np.stack([obs_of(l, x + 1) for l, x in zip(lane, a)]) if len(a) else np.zeros((0, WIDTH), np.int64)
    if flags.any():
        want[flags] = np.stack([final_of(l, x + 1) for l, x in zip(lane[flags], a[flags])])
    return want, flags


def check(buf):
    """``next_obs`` of every live row, bit-exact, by the large-batch kernel (all rows at
    once), the small-batch one (16 at a time) and ``read("final/obs", rows)``; returns
    how many episode ends were checked."""
    rows, lane, a = live_rows(buf)
    want, flags = expected(buf, rows, lane, a)
    got = buf.get(rows, ["obs", "next_obs"])
    np.testing.assert_array_equal(got["obs"].numpy(), obs_of_rows(lane, a))
    np.testing.assert_array_equal(got["next_obs"].numpy(), want)
    for i in range(0, len(rows), 16):
        np.testing.assert_array_equal(buf.get(rows[i : i + 16], ["next_obs"])["next_obs"].numpy(), want[i : i + 16])
    if flags.any():
        np.testing.assert_array_equal(buf.read("final/obs", rows[flags]), want[flags])
    return int(flags.sum())


def obs_of_rows(lane, a):
    return np.stack([obs_of(l, x) for l, x in zip(lane, a)]) if len(a) else np.zeros((0, WIDTH), np.int64)


def make(path, streams=2, lane_size=600, **options):
    return mb.create(path, {"obs": ((WIDTH,), "int64")}, capacity=streams * lane_size, num_streams=streams, **options)


@pytest.mark.parametrize("options", [{}, {"compression": "zstd"}], ids=["raw", "zstd"])
def test_next_obs_is_exact_across_episode_ends_ring_wraps_and_streams(tmp_path, rng, options):
    """Short episodes in three lanes until each lane's final ring has come round many
    times (ep_tail > 3 * lane_size: episodes evicted, slots reused); checked after
    every round, after a commit, after close and reopen (writer and reader)."""
    buf = make(tmp_path / "s", streams=3, lane_size=200, **options)
    ends = 0
    for _ in range(8):
        for lane in range(3):
            write(buf, rng, lane, 300, p_end=0.4, max_len=30)
        ends += check(buf)
    assert all(st.ep_tail > 3 * buf.lane_size for st in buf.store.lanes)  # the final rings wrapped 3 times
    assert ends > 1000
    buf.close()
    with mb.open(tmp_path / "s") as again:
        check(again)
        write(again, rng, 1, 150, p_end=0.3)
        check(again)
    with mb.open(tmp_path / "s", mode="r") as ro:
        assert check(ro) > 0


def test_long_episodes_take_the_disk_of_their_frames_plus_one_final_each(tmp_path, rng):
    """84x84 uint8 frames, episodes of 30-300 rows, the ring filled 4 times over: the
    final array holds one frame per live episode (plus a few blocks not yet given back),
    not a frame per row; the frames take their rows."""
    frame = (84, 84)
    row = 84 * 84
    lane_size = 3000
    buf = mb.create(tmp_path / "px", {"pixels": (frame, "uint8")}, capacity=lane_size, next_keys=("pixels",))
    written = 0
    while written < 4 * lane_size:
        n = int(rng.integers(30, 301))
        px = rng.integers(0, 256, (n, *frame), dtype=np.uint8)
        done = np.zeros(n, bool)
        done[-1] = True
        for a in range(0, n, 64):  # extends of up to 64 rows, as a collector adds them
            b = min(n, a + 64)
            buf.extend({"pixels": px[a:b], "truncated": done[a:b]},
                       final_obs={"pixels": px[-1:] ^ 0x5A if b == n else np.zeros((0, *frame), np.uint8)})
        written += n
    buf.commit()
    live = buf.num_episodes + 1  # and the slot of the one evicted last
    assert buf.store.lanes[0].ep_tail > 3 * live  # many more episodes were written than are live

    def blocks(name):
        shard = tmp_path / "px" / name / "c" / "0" / "0" / "0"
        return os.stat(shard).st_blocks * 512

    finals, frames = blocks("final/pixels"), blocks("columns/pixels")
    assert frames >= lane_size * row  # every row of the ring holds a frame
    # the last evicted slots before they are given back together, and the slots allocated ahead
    slack = (1 << 16) + (1 << 18) + 4 * 4096 + 16 * row
    assert finals <= live * row + slack, (finals, live, live * row + slack)
    assert finals + frames <= 1.05 * lane_size * row + slack
    # and what is there is right: each live episode's final frame
    starts, lengths = buf.episodes()
    last = (starts + lengths - 1).numpy() % lane_size
    got = buf.get(last, ["pixels", "next_pixels"])
    np.testing.assert_array_equal(got["next_pixels"].numpy(), got["pixels"].numpy() ^ 0x5A)
    buf.close()


PROVISIONAL = textwrap.dedent(
    """
    import os, sys, numpy as np, mmbuffer as mb
    from mmbuffer._ledger.appending import end_open_episode, reopen_last_episode
    sys.path.insert(0, sys.argv[2])
    from test_finals import final_of, obs_of
    buf = mb.open(sys.argv[1])
    buf.extend({"obs": obs_of(0, np.arange(3)), "truncated": [False, False, True]}, final_obs={"obs": final_of(0, [3])})
    buf.extend({"obs": obs_of(0, np.arange(3, 6)), "truncated": [False, False, True]}, final_obs={"obs": obs_of(0, [6])})
    assert reopen_last_episode(buf.store, 0)  # the episode goes on: its end undone
    buf.commit()
    assert end_open_episode(buf.store, 0)  # ended again with the observation stored before
    print(buf.get(np.array([5]), ["next_obs"])["next_obs"].numpy()[0, 0], flush=True)
    os._exit(0)  # dies without closing: the commit is what survives
    """
)


def test_the_open_episodes_provisional_end_keeps_its_slot(tmp_path):
    """The TorchRL drop-in's open tail: an episode ended provisionally (its last row's
    next observation as final), reopened, committed, ended again: the final observation
    written before the commit is found again, by the next writer after a crash too."""
    from mmbuffer._ledger.appending import end_open_episode

    make(tmp_path / "s", streams=1, lane_size=50).close()
    out = warm.run(PROVISIONAL, [str(tmp_path / "s"), os.path.dirname(__file__)], timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == obs_of(0, [6])[0, 0]
    with mb.open(tmp_path / "s") as again:
        assert again.num_episodes == 1  # the commit kept the second episode open
        assert end_open_episode(again.store, 0)
        assert again.get(np.array([2, 5]), ["next_obs"])["next_obs"].numpy().tolist() == [
            final_of(0, 3).tolist(), obs_of(0, 6).tolist()]


READER = textwrap.dedent(
    """
    import sys, numpy as np, mmbuffer as mb
    sys.path.insert(0, sys.argv[2])
    import test_finals as t
    with mb.open(sys.argv[1], mode="r") as ro:
        print(t.check(ro))
    """
)


def test_a_reader_in_another_process_reads_the_same_finals(tmp_path, rng):
    buf = make(tmp_path / "s", streams=2, lane_size=300)
    for _ in range(4):
        for lane in range(2):
            write(buf, rng, lane, 250, p_end=0.2)
    ends = check(buf)
    buf.close()  # the reservation comes down to the cursors: a reader sees every episode
    here = os.path.dirname(__file__)
    out = warm.run(READER, [str(tmp_path / "s"), here], timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == ends > 20


def test_stacks_end_with_the_final_observation_after_wraps(tmp_path, rng):
    """``stack=``: the next stack of an episode's last row ends with its final
    observation, also after the final ring has wrapped; padding never crosses episodes."""
    buf = make(tmp_path / "s", streams=1, lane_size=120)
    write(buf, rng, 0, 1200, p_end=0.3, max_len=10)
    assert buf.store.lanes[0].ep_tail > 2 * buf.lane_size
    rows, lane, a = live_rows(buf)
    want, flags = expected(buf, rows, lane, a)
    b = buf.sample(256, torch.Generator().manual_seed(0), stack={"obs": 3}, stack_pad="zero")
    pos = {int(r): i for i, r in enumerate(rows)}
    idx = np.array([pos[int(r)] for r in b.indices.numpy()])
    np.testing.assert_array_equal(b["next_obs"].numpy()[:, -1], want[idx])
    assert flags[idx].any()
    buf.close()


def to_version_3(path):
    """Rewrite a closed version 4 store as version 3 wrote it: each live episode's final
    observation at its last row id, the manifest saying ``format_version`` 3."""
    with mb.open(path, mode="r") as ro:
        starts, lengths = ro.episodes()
        last = ((starts + lengths - 1) % ro.lane_size + starts // ro.lane_size * ro.lane_size).numpy()
        finals = ro.read("final/obs", last)
        shape = (ro.capacity, WIDTH)
    shard = path / "final" / "obs" / "c" / "0" / "0"
    mm = np.memmap(shard, dtype="<i8", mode="r+", shape=shape)
    mm[:] = 0
    mm[last] = finals
    mm.flush()
    del mm
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 3
    (path / "manifest.json").write_text(json.dumps(manifest))
    return len(last)


def test_a_version_3_store_opens_reads_and_writes_its_own_layout(tmp_path, rng):
    buf = make(tmp_path / "s", streams=2, lane_size=300)
    for lane in range(2):
        write(buf, rng, lane, 700, p_end=0.1)
    buf.close()
    assert to_version_3(tmp_path / "s") > 20
    with mb.open(tmp_path / "s", mode="r") as ro:
        assert not ro.store.finals_by_episode and check(ro) > 20
    with mb.open(tmp_path / "s") as old:  # the writer keeps the row layout
        check(old)
        for lane in range(2):
            write(old, rng, lane, 400, p_end=0.1)
        check(old)
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["format_version"] == 3
    with mb.open(tmp_path / "s", mode="r") as ro:
        check(ro)
        mb.convert.copy(ro, tmp_path / "new", progress=False)  # a copy is a version 4 store
        old_episodes = list(ro.iter_episodes(["obs", "next_obs"]))
    with mb.open(tmp_path / "new", mode="r") as new:  # the same episodes (rows renumbered from 0)
        assert new.store.finals_by_episode
        new_episodes = list(new.iter_episodes(["obs", "next_obs"]))
    assert len(new_episodes) == len(old_episodes) > 20
    for x, y in zip(old_episodes, new_episodes):
        np.testing.assert_array_equal(x["next_obs"].numpy(), y["next_obs"].numpy())
        np.testing.assert_array_equal(x["obs"].numpy(), y["obs"].numpy())


def test_other_versions_are_refused_by_name(tmp_path):
    make(tmp_path / "s").close()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["format_version"] == 5
    for version in (2, 6):
        (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "format_version": version}))
        with pytest.raises(errors.FormatVersionError, match=f"expected format_version 3 or 4 or 5, got {version}"):
            mb.open(tmp_path / "s", mode="r")


def test_reading_a_final_observation_of_a_row_that_ends_no_episode_is_refused(tmp_path):
    buf = make(tmp_path / "s", streams=1, lane_size=20)
    buf.extend({"obs": obs_of(0, np.arange(4)), "terminated": [False, True, False, False]},
               final_obs={"obs": final_of(0, [2])})
    assert buf.read("final/obs", np.array([1])).tolist() == final_of(0, [2]).tolist()
    with pytest.raises(errors.InvalidArgumentError, match=r"expected rows that end an episode .*got \[0, 2\]"):
        buf.read("final/obs", np.array([0, 1, 2]))
    buf.close()
