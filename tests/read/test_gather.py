"""The gather and its compiled kernels against a naive reference written row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer._read.gather import gather, resolve_keys
from mmbuffer.kernels import gather as kernels, split
from layouts import write_layout

COLUMNS = {
    "obs": ((3,), "float32"),
    "img": ((2, 4, 4), "uint8"),
    "flag": ((), "bool"),
    "half": ((5,), "float16"),
    "count": ((), "int64"),
}


def fill(path, rng, *, streams=2, lane=24, compression=None, steps=12):
    """A store whose lanes wrap, with episodes ending at random rows of every lane
    (also at a lane's last ring row), and every column's data kept in RAM."""
    buf = mb.create(path, COLUMNS, capacity=streams * lane, num_streams=streams,
                    compression=compression, next_keys=("obs", "img"))
    for _ in range(steps):
        s = int(rng.integers(streams))
        n = int(rng.integers(1, lane // 2))
        done = rng.random(n) < 0.25
        steps_ = {
            "obs": rng.standard_normal((n, 3)).astype(np.float32),
            "img": rng.integers(0, 256, (n, 2, 4, 4), dtype=np.uint8),
            "flag": rng.random(n) < 0.5,
            "half": rng.standard_normal((n, 5)).astype(np.float16),
            "count": rng.integers(-(2**40), 2**40, n),
            "terminated": done & (rng.random(n) < 0.5),
        }
        steps_["truncated"] = done & ~steps_["terminated"]
        e = int(done.sum())
        final = {"obs": rng.standard_normal((e, 3)).astype(np.float32),
                 "img": rng.integers(0, 256, (e, 2, 4, 4), dtype=np.uint8)}
        buf.extend(steps_, stream=s, final_obs=final)
    return buf


def reference(buf, rows, keys):
    """Row by row: ``next_<col>`` of row ``r`` is ``<col>`` at the next ring position
    of its lane, or the final observation of the episode ending at ``r`` when ``r`` ends one
    (``buf.read("final/<col>", r)``, one row at a time)."""
    lane = buf.capacity // buf.num_streams
    every = np.arange(buf.capacity)
    full = {name: np.asarray(buf.read(name, every)) for name in buf.columns}
    last = every[full["terminated"] | full["truncated"]]
    finals = {k: {r: np.asarray(buf.read(f"final/{k}", np.array([r])))[0] for r in last.tolist()} for k in buf.next_keys}
    out = {}
    flat = np.asarray(rows).reshape(-1)
    for key in keys:
        values = []
        for r in flat.tolist():
            if key.startswith("next_"):
                base = key[5:]
                if full["terminated"][r] or full["truncated"][r]:
                    values.append(finals[base][r])
                else:
                    values.append(full[base][r // lane * lane + (r % lane + 1) % lane])
            else:
                values.append(full[key][r])
        col = buf.columns[key[5:] if key.startswith("next_") else key]
        out[key] = np.array(values, dtype=col.dtype).reshape(np.shape(rows) + tuple(col.shape))
    return out


KEYS = ["obs", "img", "flag", "half", "count", "terminated", "truncated", "next_obs", "next_img"]


def assert_same(got, want):
    assert list(got) == list(want)
    for key, value in want.items():
        assert isinstance(got[key], torch.Tensor)
        np.testing.assert_array_equal(got[key].numpy(), value, err_msg=key)
        assert got[key].numpy().dtype == value.dtype, key


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_random_rows_of_every_dtype_match_the_reference(tmp_path, rng, compression):
    buf = fill(tmp_path / "s", rng, compression=compression)
    for shape in [(40,), (5, 7), (), (700,)]:  # 700 rows: 76 KB, past the small batch's one kernel call
        rows = rng.integers(0, buf.capacity, shape)
        assert_same(gather(buf, rows, KEYS), reference(buf, rows, KEYS))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_runs_across_the_ring_episode_ends_and_lane_boundaries(tmp_path, rng, compression):
    """Runs of consecutive rows that wrap a lane (11 -> 0), cross from one lane into
    the next (23, 24), end episodes, repeat a row, or go backwards."""
    buf = fill(tmp_path / "s", rng, compression=compression)
    rows = np.array([
        [20, 21, 22, 23, 0, 1, 2, 3],      # lane 0 wraps at 24
        [22, 23, 24, 25, 26, 27, 28, 29],  # lane 0's last rows, then lane 1's first
        [44, 45, 46, 47, 24, 25, 26, 27],  # lane 1 wraps
        [5, 5, 5, 6, 6, 7, 7, 7],          # padding repeats a row
        [9, 8, 7, 6, 5, 4, 3, 2],          # backwards
    ])
    # every keys order: with and without the base column of a next-derived one
    for keys in (KEYS, ["next_obs"], ["next_img", "img"], ["img", "terminated"]):
        assert_same(gather(buf, rows, keys), reference(buf, rows, keys))


def test_sampled_slices_of_a_wrapped_multi_lane_store_match_the_reference(tmp_path, rng):
    buf = fill(tmp_path / "s", rng, streams=3, lane=40, steps=40)
    for strict in (True, False):
        b = buf.sample_slices(32, 6, strict=strict, generator=torch.Generator().manual_seed(3))
        want = reference(buf, b.indices.numpy(), list(b.data))
        mask = b.mask.numpy()
        for key, value in want.items():
            np.testing.assert_array_equal(b.data[key].numpy()[mask], value[mask], err_msg=key)
    b = buf.sample(50, generator=torch.Generator().manual_seed(4))
    assert_same(b.data, reference(buf, b.indices.numpy(), list(b.data)))


def test_out_buffers_are_filled_in_place(tmp_path, rng):
    buf = fill(tmp_path / "s", rng)
    rows = rng.integers(0, buf.capacity, (4, 6))
    want = reference(buf, rows, KEYS)
    out = {k: torch.full(v.shape, 7, dtype=torch.from_numpy(v).dtype) for k, v in want.items()}
    # a buffer of another dtype and a non-contiguous one are filled by copy_
    out["obs"] = torch.zeros((4, 6, 3), dtype=torch.float64)
    out["half"] = torch.zeros((4, 5, 6), dtype=torch.float16).transpose(1, 2)
    got = gather(buf, rows, KEYS, out=out)
    for key in KEYS:
        assert got[key] is out[key]
        np.testing.assert_array_equal(got[key].numpy(), want[key].astype(got[key].numpy().dtype), err_msg=key)


def test_rows_out_of_range_are_refused_and_change_no_out_buffer(tmp_path, rng):
    buf = fill(tmp_path / "s", rng)
    out = {"obs": torch.full((3, 3), 5.0)}
    for bad in ([0, 1, buf.capacity], [-1, 0, 1]):
        with pytest.raises(mb.errors.InvalidArgumentError, match=r"index: expected row ids in \[0, 48\)"):
            gather(buf, np.array(bad), ["obs"], out=out)
        assert (out["obs"] == 5.0).all()


def test_rows_out_of_range_are_refused_in_small_and_large_batches(tmp_path, rng):
    buf = fill(tmp_path / "s", rng)
    for n in (3, 700):  # one kernel call for every key, and a call per key
        rows = rng.integers(0, buf.capacity, n)
        for bad in (buf.capacity, -1):
            rows[n // 2] = bad
            with pytest.raises(mb.errors.InvalidArgumentError, match=r"index: expected row ids in \[0, 48\)"):
                gather(buf, rows, KEYS)


def test_plans_are_kept_per_store_and_keys(tmp_path, rng):
    """What a gather keeps between calls (the keys' dtypes, shapes and maps) belongs to
    one store and one keys argument: another store, a store reopened on new files,
    keys in another order or given as a list each get their own, and bad names are
    still refused with a typed error."""
    a = fill(tmp_path / "a", rng)
    b = fill(tmp_path / "b", rng, streams=3, lane=16)
    rows = rng.integers(0, 48, (3, 5))
    for buf in (a, b, a):
        for keys in (KEYS, KEYS[::-1], tuple(KEYS), ["next_img"], "obs", ["obs"], None):
            want_keys = resolve_keys(buf, keys)
            want = reference(buf, rows, want_keys)
            assert_same(gather(buf, rows, keys), {k: want[k] for k in dict.fromkeys(want_keys)})
    a.close()
    c = fill(tmp_path / "a2", np.random.default_rng(7))  # other rows, other files
    assert_same(gather(c, rows, KEYS), reference(c, rows, KEYS))
    for bad in (["obs", "nope"], [["obs"]]):
        with pytest.raises(mb.errors.InvalidArgumentError, match="keys: expected names among"):
            gather(c, rows, bad)


def test_empty_rows(tmp_path, rng):
    buf = fill(tmp_path / "s", rng)
    got = gather(buf, np.zeros((0, 4), np.int64), KEYS)
    assert got["img"].shape == (0, 4, 2, 4, 4) and got["next_obs"].shape == (0, 4, 3)


# -- the kernels alone ---------------------------------------------------------------------
def naive_rows(src, rows):
    return np.stack([src[r] for r in rows]) if len(rows) else src[:0]


def naive_next(src, final, done, rows, lane):
    return np.stack([final[r] if done[r] else src[r // lane * lane + (r % lane + 1) % lane] for r in rows])


@pytest.mark.parametrize("row_shape,dtype", [((), "bool"), ((3,), "float16"), ((7,), "uint8"), ((2, 3), "float64")])
def test_kernels_match_the_naive_copy(rng, row_shape, dtype):
    lane, lanes = 13, 3
    n = lane * lanes
    src = rng.integers(0, 100, (n, *row_shape)).astype(dtype)
    final = rng.integers(100, 200, (n, *row_shape)).astype(dtype)
    term, trunc = rng.random(n) < 0.2, rng.random(n) < 0.1
    row_bytes = src[0].nbytes
    b = kernels.bytes_of
    for size in (1, 6, 60):  # a few runs (prefetched from the start) to many
        # runs of consecutive rows from random starts, some crossing lane ends
        starts = rng.integers(0, n, size)
        rows = np.concatenate([np.arange(s, min(n, s + int(rng.integers(1, 20)))) for s in starts]).astype(np.int64)
        runs, bad = kernels.runs(rows, n)
        assert bad == -1 and runs[0] == 0 and runs[-1] == len(rows)
        assert all((np.diff(rows[a:z]) == 1).all() and (a == 0 or rows[a] != rows[a - 1] + 1)
                   for a, z in zip(runs[:-1], runs[1:]))
        out = np.zeros((len(rows), *row_shape), dtype)
        nxt = np.zeros_like(out)
        kernels.copy_rows(b(src), rows, runs, row_bytes, b(out))
        np.testing.assert_array_equal(out, naive_rows(src, rows))
        out[...] = 0
        kernels.copy_rows_next(b(src), b(final), b(term), b(trunc), rows, runs, lane, row_bytes, b(nxt), b(out))
        np.testing.assert_array_equal(out, naive_rows(src, rows))
        np.testing.assert_array_equal(nxt, naive_next(src, final, term | trunc, rows, lane))
        nxt[...] = 0
        kernels.copy_rows_next(b(src), b(final), b(term), b(trunc), rows, runs, lane, row_bytes, b(nxt))
        np.testing.assert_array_equal(nxt, naive_next(src, final, term | trunc, rows, lane))


def small_args(passes, lane, n_rows, rows, index=None, cursors=None):
    """``gather_small``'s arguments for ``passes`` of ``(src, final or None, own?, next?)``
    over flags ``passes[0]``'s, and the ``out`` block (``args[OUT]``) and where each pass's
    outputs lie; final rows at the episode-end rows (version 3) unless ``index`` and
    ``cursors`` say where episodes' slots are."""
    arrays, row_bytes, own_at, next_at, at = [], [], [], [], 0
    for src, final, own, nxt, _ in passes:
        rb = src[0].nbytes
        arrays += [src, final if final is not None else np.zeros(0, np.uint8)]
        row_bytes.append(rb)
        own_at.append(at if own else -1)
        at += len(rows) * rb if own else 0
        next_at.append(at if nxt else -1)
        at += len(rows) * rb if nxt else 0
    arrays += [*passes[0][4], index if index is not None else np.zeros(0, np.int64)]
    where = [kernels.address(a) for a in arrays]
    return ([np.array([w[i] for w in where], np.int64) for i in (0, 1)]
            + [np.array(v, np.int64) for v in (row_bytes, own_at, next_at)] + [lane, rows, n_rows, np.zeros(at, np.uint8)]
            + [cursors if cursors is not None else np.zeros(0, np.int64), index is not None, arrays])


OUT = 8  # where ``small_args`` puts the out block


def test_the_small_batch_kernel_matches_the_naive_copy(rng):
    """Every key of a small batch in one call: rows, next rows (the lane's following row,
    or the final row at an episode's end), rows that repeat, cross lanes or wrap, runs of
    consecutive rows as windows draw them (copied a run at once), one crossing into the
    next lane; every pass alone or with its next rows."""
    lane, lanes = 13, 3
    n = lane * lanes
    term, trunc = rng.random(n) < 0.2, rng.random(n) < 0.1
    flags = (term.view(np.uint8), trunc.view(np.uint8))
    cols = [rng.integers(0, 100, (n, *shape)).astype(dtype) for shape, dtype in
            [((), "bool"), ((3,), "float16"), ((7,), "uint8"), ((2, 3), "float64")]]
    finals = [rng.integers(100, 200, c.shape).astype(c.dtype) for c in cols]
    for size, windows in ((1, False), (6, False), (60, False), (60, True), (200, True)):
        rows = rng.integers(0, n, size)
        rows[: min(size, 3)] = [lane - 1, lane, n - 1][: min(size, 3)]
        if windows:  # runs of 1-5 rows, the first crossing from lane 0 into lane 1
            starts = np.concatenate([[lane - 2], rng.integers(0, n, size)])
            rows = np.concatenate([np.arange(a, min(a + k, n)) for a, k in zip(starts, [4, *rng.integers(1, 6, size)])])
            rows = rows[:size]
            assert (np.diff(rows) == 1).sum() > size // 3 and rows[:4].tolist() == [lane - 2, lane - 1, lane, lane + 1]
        passes = [(c, f, bool(rng.random() < 0.7), True, flags) for c, f in zip(cols, finals)]
        passes.append((cols[2], None, True, False, flags))  # a pass without next rows
        args = small_args(passes, lane, n, rows)[:-1]
        assert kernels.gather_small(*args) == -1
        out, at = args[OUT], 0
        for src, final, own, nxt, _ in passes:
            size_ = len(rows) * src[0].nbytes
            if own:
                np.testing.assert_array_equal(out[at : at + size_].view(src.dtype).reshape(-1, *src.shape[1:]), src[rows])
                at += size_
            if nxt:
                got = out[at : at + size_].view(src.dtype).reshape(-1, *src.shape[1:])
                np.testing.assert_array_equal(got, naive_next(src, final, term | trunc, rows, lane))
                at += size_


def test_the_small_batch_kernel_refuses_bad_rows_and_wrong_sizes(rng):
    src = np.arange(40, dtype=np.int32).reshape(10, 4)
    flags = (np.zeros(10, np.uint8), np.zeros(10, np.uint8))
    args = small_args([(src, src, True, True, flags)], 5, 10, np.array([1, 10, 3]))[:-1]
    assert kernels.gather_small(*args) == 1 and not args[OUT].any()  # nothing copied
    args[6][1] = -1
    assert kernels.gather_small(*args) == 1
    args[6][1] = 2
    assert kernels.gather_small(*args) == -1
    for i, value, match in [(OUT, np.zeros(95, np.uint8), "out has the wrong size"),
                            (7, 20, "wrong size"),  # rows of another source
                            (5, 3, "inconsistent"),  # a lane size that does not divide the rows
                            (2, np.array([8], np.int64), "a source of the wrong size")]:
        bad = list(args)
        bad[i] = value
        with pytest.raises(ValueError, match=match):
            kernels.gather_small(*bad)
    wrong = small_args([(src, src, True, True, (flags[0][:9], flags[1]))], 5, 10, np.array([1, 2, 3]))[:-1]
    with pytest.raises(ValueError, match="flags of the wrong size"):
        kernels.gather_small(*wrong)


def test_prefetching_rows_reads_nothing_and_takes_any_rows(rng):
    """``prefetch_rows`` (called before a small gather's checks) is a hint: rows outside
    the sources, windows that are not runs, a width that does not divide the rows, none
    or zero width return without a fault, and no array changes; the gather after it
    still refuses the bad rows."""
    src = rng.integers(0, 255, (10, 300), dtype=np.uint8)  # rows of 5 lines: 4 asked for
    flags = (np.zeros(10, np.uint8), np.zeros(10, np.uint8))
    kept = src.copy()
    args = small_args([(src, None, True, False, flags), (flags[0][:, None], None, True, False, flags)], 10, 10,
                      np.zeros(0, np.int64))
    addresses, sizes, row_bytes = args[0], args[1], args[2]
    huge = np.iinfo(np.int64).max // 2
    for rows in ([3, 4, 5, 6], [9, 0, 1, 2], [-1, 10, huge, -huge], [7, 7, 7, 7, 2], []):
        for width in (1, 2, 3, 4, 0):
            for skip in (None, np.array([False, True]), np.array([True, True])):
                kernels.prefetch_rows(addresses, sizes, row_bytes, np.array(rows, np.int64), width, skip)
    assert (src == kept).all() and not flags[0].any() and not flags[1].any()
    small = small_args([(src, None, True, False, flags)], 10, 10, np.array([1, huge, 3]))[:-1]
    assert kernels.gather_small(*small) == 1 and not small[OUT].any()


def test_kernels_refuse_bad_rows_wrong_sizes_and_bad_runs(rng):
    src = np.arange(40, dtype=np.int32).reshape(10, 4)
    out = np.zeros((3, 4), np.int32)
    b = kernels.bytes_of
    assert kernels.runs(np.array([1, 2, 10]), 10)[1] == 2
    assert kernels.runs(np.array([1, -1, 3]), 10)[1] == 1
    assert kernels.runs(np.array([7, 8, 9]), 10)[0].tolist() == [0, 3]
    with pytest.raises(ValueError, match="wrong size"):
        kernels.copy_rows(b(src), np.array([1, 2]), np.array([0, 2]), 16, b(out))
    # runs that do not describe the rows never make a copy leave the source
    with pytest.raises(ValueError, match="outside the source"):
        kernels.copy_rows(b(src), np.array([8, 9, 10]), np.array([0, 3]), 16, b(out))
    with pytest.raises(ValueError, match="outside the source"):
        kernels.copy_rows(b(src), np.array([8, 2, 3]), np.array([0, 3]), 16, b(out))
    with pytest.raises(ValueError, match="out of order"):
        kernels.copy_rows(b(src), np.array([1, 2, 3]), np.array([0, 5]), 16, b(out))
    flags = np.zeros(10, bool)
    rows = np.array([1, 2, 3])
    runs = kernels.runs(rows, 10)[0]
    with pytest.raises(ValueError, match="inconsistent sizes"):  # a lane size that does not divide the rows
        kernels.copy_rows_next(b(src), b(src), b(flags), b(flags), rows, runs, 3, 16, b(out))
    with pytest.raises(ValueError, match="inconsistent sizes"):  # flags of another length
        kernels.copy_rows_next(b(src), b(src), b(flags[:9]), b(flags), rows, runs, 5, 16, b(out))
    with pytest.raises(ValueError, match="outside the source"):
        kernels.copy_rows_next(b(src), b(src), b(flags), b(flags), np.array([8, 9, 10]), runs, 5, 16, b(out))
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.bytes_of(src[:, ::2])


def test_the_overwritten_kernel_matches_the_numpy_check(rng):
    """``kernels.gather.overwritten`` (a reader's re-check, compiled) finds exactly the
    items ``recheck.overwritten`` finds: lanes, cursors before and after a lap, rings
    wrapped, reservations at, behind and ahead of the cursors; cursors per item or,
    ``by_lane``, per lane."""
    from mmbuffer._ledger.layout import Layout
    from mmbuffer._read import recheck

    for lanes, lane in ((1, 7), (3, 10), (4, 1000)):
        layout = Layout(lanes * lane, lanes)
        for _ in range(50):
            first = rng.integers(0, lanes * lane, int(rng.integers(1, 40)))
            cursors = rng.integers(0, 5 * lane, first.shape[0])
            reserved = rng.integers(0, 6 * lane, lanes)
            want = np.flatnonzero(recheck.overwritten(layout, first, cursors, reserved))
            np.testing.assert_array_equal(kernels.overwritten(first, cursors, reserved, lane), want)
            written = rng.integers(0, 5 * lane, lanes)  # items drawn from one view: its lanes' cursors
            want = np.flatnonzero(recheck.overwritten(layout, first, written[first // lane], reserved))
            np.testing.assert_array_equal(kernels.overwritten(first, written, reserved, lane, by_lane=True), want)
    with pytest.raises(ValueError, match="outside the lanes"):
        kernels.overwritten(np.array([30]), np.array([5]), np.array([9, 9]), 10)


def test_no_item_needs_a_check_until_the_reservation_passes_what_the_view_keeps_intact(tmp_path, rng):
    """A reader skips the per-item re-check while ``Store.reserved_past`` says no: every
    live row of a view (at or after its lane's ``first_start``) is intact while the
    reservation is at most ``View.intact_up_to`` (the bound, on random lanes; past it
    some row is not, so the shortcut declines). On a store: an idle writer's reader
    skips it; a writer that laps the ring past the reader's view makes it say yes."""
    from mmbuffer._ledger.layout import Layout
    from mmbuffer._read import recheck

    for lanes, lane in ((1, 7), (3, 10), (4, 1000)):
        layout = Layout(lanes * lane, lanes)
        for _ in range(50):
            first_start = rng.integers(0, 4 * lane, lanes)
            written = first_start + rng.integers(1, lane + 1, lanes)  # a lane holds at most lane_size rows
            which = rng.integers(0, lanes, 64)
            absolute = first_start[which] + (rng.random(64) * (written - first_start)[which]).astype(np.int64)
            rows = layout.rows(which, absolute)
            bound = first_start + lane  # View.intact_up_to
            at_most = bound - rng.integers(0, 2 * lane, lanes)
            assert not recheck.overwritten(layout, rows, written[which], at_most).any()
            past = bound.copy()
            past[which[0]] += absolute[0] - first_start[which[0]] + 1  # just past that item's row
            assert recheck.overwritten(layout, rows[:1], written[which[:1]], past).all()
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=32, next_keys=())
    buf.extend({"x": np.arange(20), "terminated": np.arange(20) % 5 == 4})
    buf.commit()
    reader = mb.open(tmp_path / "s", mode="r")
    view = reader.view()
    np.testing.assert_array_equal(view.intact_up_to, [view.lanes[0].first_start + 32])
    buf.extend({"x": np.arange(4), "terminated": np.arange(4) == 3})  # the writer reserves ahead of its rows
    assert buf.reservation()[0] > view.written[0]
    assert not reader.store.reserved_past(view.intact_up_to)
    for _ in range(3):  # past the view's oldest episode: its rows may be being rewritten
        buf.extend({"x": np.arange(5), "terminated": np.arange(5) == 4})
    assert buf.reservation()[0] > view.intact_up_to[0]
    assert reader.store.reserved_past(view.intact_up_to)
    buf.commit()
    assert not reader.store.reserved_past(reader.view().intact_up_to)  # the next view drops those episodes


def test_kernels_release_the_gil():
    """Compiled with nogil (and cached), so a gather runs beside the training step."""
    for kernel in (kernels._runs, kernels._copy_rows, kernels._copy_rows_next, kernels._gather_small, split._gather_runs,
                   kernels._overwritten):
        assert kernel.targetoptions["nogil"]
        assert type(kernel._cache).__name__ == "FunctionCache"  # cache=True (NullCache otherwise)


# -- the index sampling kernels (mmbuffer.kernels.sampling) ---------------------------------
def reference_slices(layout, lane_size, n, L, strict, per_episode, seed):
    """Every eligible item listed one by one, in lane order, then the same random bits
    as the sampler draws (ranks, then offsets inside the drawn episodes)."""
    items = []  # (lane, episode start, episode rows, index of the item inside the episode)
    for lane, episodes in enumerate(layout):
        for st, rows, _ in episodes:
            if per_episode:
                count = int(rows >= (L if strict else 1))
            else:
                count = max(rows - L + 1, 0) if strict else rows
            items += [(lane, st, rows, k) for k in range(count)]
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, 2**62, (n,), generator=g).numpy() % len(items)
    bits = torch.randint(0, 2**62, (n,), generator=g).numpy() if per_episode else None
    out, mask = np.empty((n, L), np.int64), np.empty((n, L), bool)
    for i, r in enumerate(ranks.tolist()):
        lane, st, rows, k = items[r]
        if per_episode:
            room = max(rows - L + 1, 1) if strict else rows
            k = int(bits[i]) % room
        avail = rows - k
        for j in range(L):
            out[i, j] = lane * lane_size + (st + k + min(j, avail - 1)) % lane_size
            mask[i, j] = j < avail
    return out, mask


def reference_uniform(layout, lane_size, n, seed):
    rows = []
    for lane, episodes in enumerate(layout):
        lo = episodes[0][0]
        hi = episodes[-1][0] + episodes[-1][1]  # the open episode's visible end
        rows += [lane * lane_size + a % lane_size for a in range(lo, hi)]
    g = torch.Generator().manual_seed(seed)
    return np.array(rows)[torch.randint(0, 2**62, (n,), generator=g).numpy() % len(rows)]


@pytest.mark.parametrize("streams", [1, 5])
def test_index_kernels_match_an_item_by_item_reference(tmp_path, rng, streams):
    """Same generator state, same batch as the listing of every eligible item: slices
    (strict or not, weighted by window or by episode) and uniform transitions, over
    lanes whose rings wrapped, episodes of 1 to ~2500 rows, open episodes."""
    buf, layout = write_layout(tmp_path / "s", rng, streams=streams, lane=3000, steps=30)
    lane_size = buf.capacity // buf.num_streams
    for L in (1, 4, 300):
        for strict in (True, False):
            for weighting in ("windows", "episodes"):
                for seed in range(3):
                    try:
                        got = buf.slice_indices(64, L, strict, torch.Generator().manual_seed(seed), weighting=weighting)
                    except mb.errors.NoValidSliceError:
                        continue
                    rows, mask = reference_slices(layout, lane_size, 64, L, strict, weighting == "episodes", seed)
                    np.testing.assert_array_equal(got[2], mask)
                    np.testing.assert_array_equal(got[0], rows)
    for seed in range(3):
        got = buf.sample_indices(200, torch.Generator().manual_seed(seed))[0]
        np.testing.assert_array_equal(got, reference_uniform(layout, lane_size, 200, seed))


def test_a_kept_batch_is_never_overwritten_and_a_dropped_one_is_recycled(tmp_path, rng):
    """New batches take the memory of batches whose every tensor is gone (no page
    faults on fresh memory), never of one still referenced, even through a view."""
    import gc

    buf = fill(tmp_path / "s", rng)
    rows = rng.integers(0, buf.capacity, (6, 5))
    kept = gather(buf, rows, KEYS)
    view = gather(buf, rows, KEYS)["next_img"][2:4]  # only a view of one key survives
    want = reference(buf, rows, KEYS)
    for _ in range(20):
        gather(buf, rng.integers(0, buf.capacity, (6, 5)), KEYS)
    gc.collect()
    assert_same(kept, want)
    np.testing.assert_array_equal(view.numpy(), want["next_img"][2:4])
    address = kept["obs"].data_ptr()
    del kept
    gc.collect()
    again = gather(buf, rows, KEYS)
    assert again["obs"].data_ptr() == address
    assert_same(again, want)
