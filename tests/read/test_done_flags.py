"""The done flags of windows: a slice draw knows where each window holds its complete
episode's last row, and ``read_spec`` has the gather read ``terminated``/``truncated``
only there (False elsewhere: a flag is set only where an episode ends). Every batch's flags
must equal the stored flags at its rows, in every setting of the sampler, in a writer and
in a reader, on rings that wrapped; a flag set on every row reads True only where the
windows say; a subclass that draws its own windows keeps its own rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer._ledger.snapshot import Draw
from mmbuffer._read import batch
from mmbuffer._read.gather import gather

FLAGS = ("terminated", "truncated")


def episodes_store(path, lanes: int, seed: int) -> mb.Buffer:
    """Lanes that wrapped, with short episodes ending in either flag, and an open one."""
    rng = np.random.default_rng(seed)
    buf = mb.create(path, {"x": ((), "int64")}, capacity=lanes * 300, num_streams=lanes, next_keys=())
    for i in range(12 * lanes):
        lane = i % lanes
        n = int(rng.integers(20, 120))
        ends = rng.random(n) < 0.15
        term = ends & (rng.random(n) < 0.5)
        buf.extend({"x": np.arange(n) + 1000 * lane, "terminated": term, "truncated": ends & ~term}, stream=lane)
    for lane in range(lanes):  # every lane ends with an open episode of a few rows
        buf.extend({"x": np.arange(5)}, stream=lane)
    return buf


def stored_flags(buf: mb.Buffer, b) -> dict[str, torch.Tensor]:
    """The flags the columns hold at the batch's rows (padding zeroed, as a batch's is)."""
    ref = gather(buf.store, b.indices.numpy(), list(FLAGS))
    for value in ref.values():
        value[~b.mask] = False
    return ref


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("strict, weighting", [(True, "windows"), (False, "windows"), (True, "episodes"),
                                               (False, "episodes")])
def test_window_flags_are_the_stored_flags(tmp_path, monkeypatch, lanes, strict, weighting):
    asked: list[object] = []
    real = batch.gather
    monkeypatch.setattr(batch, "gather", lambda store, rows, names, done_at=None: (asked.append(done_at),
                                                                                   real(store, rows, names, done_at=done_at))[1])
    buf = episodes_store(tmp_path / "s", lanes, seed=lanes)
    buf.commit()
    reader = mb.open(tmp_path / "s", mode="r")
    assert all(st.written > 300 for st in buf.store.lanes)  # every lane's ring wrapped
    g = torch.Generator().manual_seed(0)
    seen = {name: 0 for name in FLAGS}
    for source in (buf, reader):
        for _ in range(30):
            b = source.sample_slices(64, 6, strict=strict, weighting=weighting, generator=g)
            ref = stored_flags(source, b)
            for name in FLAGS:
                assert torch.equal(b.data[name], ref[name]), name
                seen[name] += int(b.data[name].sum())
            assert list(b.data) == ["x", *FLAGS] or list(b.data) == [*FLAGS, "x"]
            assert b.data["x"].shape == (64, 6)
    assert min(seen.values()) > 50  # windows reach their episodes' ends in both flags
    assert asked and all(isinstance(at, np.ndarray) for at in asked)  # every window's episode end was known
    reader.close()
    buf.close()


def test_only_the_flags_asked_for_and_the_order_of_the_keys(tmp_path):
    buf = episodes_store(tmp_path / "s", 1, seed=5)
    g = torch.Generator().manual_seed(1)
    b = buf.sample_slices(32, 8, strict=False, generator=g, keys=["truncated", "x"])
    assert list(b.data) == ["truncated", "x"]
    assert torch.equal(b.data["truncated"], stored_flags(buf, b)["truncated"])
    only = buf.sample_slices(32, 8, strict=False, generator=g, keys=["terminated"])
    assert list(only.data) == ["terminated"] and torch.equal(only.data["terminated"], stored_flags(buf, only)["terminated"])
    buf.close()


def test_a_subclass_that_draws_its_own_windows_keeps_them(tmp_path):
    """``draw_with_ends`` of ``Slices`` is only its own draw: a subclass that overrides
    ``indices`` gets its rows back, flags read from the columns."""

    class FirstWindow(mb.samplers.Slices):
        def indices(self, snapshot, n, generator, state):
            d = super().indices(snapshot, n, generator, state)
            return Draw(np.repeat(d.rows[:1], n, axis=0), d.weights, np.repeat(d.mask[:1], n, axis=0), d.written)

    buf = episodes_store(tmp_path / "s", 1, seed=7)
    b = buf.sample(16, sampler=FirstWindow(4), generator=torch.Generator().manual_seed(2))
    assert (b.indices == b.indices[:1]).all()
    assert torch.equal(b.data["terminated"], stored_flags(buf, b)["terminated"])
    buf.close()


def test_a_windowed_gather_reads_the_flags_only_at_the_windows_ends(tmp_path):
    """Every row ends an episode here, so both flags are set on every row: a gather told
    where the windows' episodes end returns True there and only there (the other rows'
    flags are not read), and the other columns whole."""
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=64, next_keys=())
    buf.extend({"x": np.arange(40), "terminated": np.ones(40, bool), "truncated": np.zeros(40, bool)})
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 37, 24)[:, None] + np.arange(3)  # [24, 3] windows
    last = rng.integers(-1, 3, 24)
    out = gather(buf.store, rows, ["x", "terminated", "truncated"], done_at=last)
    want = np.arange(3)[None, :] == last[:, None]
    assert np.array_equal(out["terminated"].numpy(), want) and not out["truncated"].any()
    assert np.array_equal(out["x"].numpy(), rows)
    assert gather(buf.store, rows, ["terminated"])["terminated"].all()  # without: every row read
    buf.close()
