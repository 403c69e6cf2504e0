"""mb.data.BufferDataset under DataLoader: workers, seeds, live writers, epochs."""

import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import mmbuffer as mb

BufferDataset = mb.data.BufferDataset
REPO = Path(mb.__file__).resolve().parents[1]


def _store(path, rows, episode=50, capacity=100_000):
    """Rows whose ``x`` equals their global row id (no wrap)."""
    with mb.create(path, {"x": ((), "int64"), "obs": ((2,), "float32")}, capacity=capacity) as buf:
        _append(buf, 0, rows, episode)
    return path


def _append(buf, first, rows, episode):
    x = np.arange(first, first + rows)
    done = x % episode == episode - 1
    buf.extend(
        {"x": x, "obs": np.stack([x, -x], 1).astype("float32"), "truncated": done},
        final_obs={"obs": np.zeros((int(done.sum()), 2))},
    )


def _loader(ds, workers=2, **kw):
    return DataLoader(ds, batch_size=None, num_workers=workers, **kw)


def test_yields_batches_in_main_process(tmp_path):
    path = _store(tmp_path / "s", 500)
    out = list(_loader(BufferDataset(path, 16, 4, num_batches=3), workers=0))
    assert len(out) == 3 and all(isinstance(b, mb.Batch) for b in out)
    assert out[0]["obs"].shape == (16, 4, 2) and out[0].indices.shape == (16, 4)
    assert torch.equal(out[0]["x"], out[0].indices)


def test_two_workers_distinct_and_reproducible(tmp_path):
    path = _store(tmp_path / "s", 2000)
    ds = BufferDataset(path, 32, num_batches=6, seed=5)

    def run(dataset, torch_seed=0):
        torch.manual_seed(torch_seed)  # DataLoader draws its per-pass base seed from it
        return [b.indices for b in _loader(dataset)]

    first = run(ds)
    assert len(first) == 6
    # DataLoader takes batches from the workers in turn: 0, 1, 0, 1, ...
    assert not torch.equal(first[0], first[1])
    again = run(BufferDataset(path, 32, num_batches=6, seed=5))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for other in (
        run(ds, torch_seed=1),  # the next pass of a run
        run(BufferDataset(path, 32, num_batches=6, seed=6)),
        run(BufferDataset(path, 32, num_batches=6, seed=5, rank=1, world_size=2)),
    ):
        assert not any(torch.equal(a, b) for a in first for b in other)
    ds.set_epoch(1)
    assert not torch.equal(first[0], run(ds)[0])


def test_passes_differ_in_process_and_with_persistent_workers(tmp_path):
    path = _store(tmp_path / "s", 2000)
    ds = BufferDataset(path, 32, num_batches=2)
    a, b = list(ds), list(ds)
    assert not torch.equal(a[0].indices, b[0].indices)
    loader = _loader(BufferDataset(path, 32, num_batches=4), persistent_workers=True)
    first, second = [x.indices for x in loader], [x.indices for x in loader]
    assert not any(torch.equal(x, y) for x in first for y in second)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_num_batches_split_over_workers(tmp_path):
    path = _store(tmp_path / "s", 300)
    assert len(list(_loader(BufferDataset(path, 8, num_batches=7), workers=3))) == 7


def test_workers_see_commits_of_a_live_writer(tmp_path):
    path = _store(tmp_path / "s", 1000)
    writer = textwrap.dedent(
        f"""
        import sys, time, numpy as np
        sys.path.insert(0, {str(REPO)!r})
        import mmbuffer as mb
        with mb.open({str(path)!r}) as buf:
            for k in range(20):
                first = 1000 + 500 * k
                x = np.arange(first, first + 500)
                done = x % 50 == 49
                buf.extend({{"x": x, "obs": np.stack([x, -x], 1).astype("float32"), "truncated": done}},
                           final_obs={{"obs": np.zeros((int(done.sum()), 2))}})
                buf.commit()
                time.sleep(0.02)
        print("writer done", flush=True)
        """
    )
    # A finite dataset, read to its end: the workers then stop inside the loop, where
    # an error in them surfaces as one. (Breaking out of an endless one left their
    # shutdown to the iterator's __del__, which on a loaded CI machine once reported an
    # exception no test could see.) While the writer runs, batches are taken slowly,
    # so that the batches run out only long after it is done.
    ds = BufferDataset(path, 64, refresh_every=1, num_batches=2000)
    seen_new = [False, False]
    proc = None
    try:
        for i, b in enumerate(_loader(ds)):
            if proc is None:  # the workers are running: start writing
                proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
            assert torch.equal(b["x"], b.indices)  # readers never see a row half written
            assert torch.equal(b["obs"][:, 0].long(), b.indices)
            if (b.indices >= 1000).any():
                seen_new[i % 2] = True
            if proc.poll() is None:
                time.sleep(0.02)
    finally:
        if proc is not None:
            out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "writer done" in out
    assert all(seen_new), f"workers saw new rows: {seen_new}"


def _epoch_items(path, batch, slice_len=None, workers=2, **kw):
    ds = BufferDataset(path, batch, slice_len, epoch=True, **kw)
    got = [b["x"] if slice_len is None else b["x"][:, 0] for b in _loader(ds, workers)]
    return torch.cat(got).sort().values.tolist() if got else []


def test_epoch_covers_each_transition_once_across_workers(tmp_path):
    path = _store(tmp_path / "s", 997, episode=37)
    with mb.open(path, "r") as ro:
        n = len(ro)
    first = _epoch_items(path, 32)
    assert first == list(range(n))
    assert _epoch_items(path, 32) == list(range(n))  # the next epoch, too


def test_epoch_covers_each_window_once_across_workers_and_ranks(tmp_path):
    path = tmp_path / "s"
    lengths = [7, 20, 3, 12, 9, 30]
    with mb.create(path, {"x": ((), "int64")}, capacity=1000, next_keys=()) as buf:
        for n in lengths:
            start = len(buf)
            buf.extend({"x": np.arange(start, start + n), "terminated": np.arange(n) == n - 1})
    L = 5
    starts, s0 = [], 0
    for n in lengths:
        starts += list(range(s0, s0 + max(0, n - L + 1)))
        s0 += n
    per_rank = [_epoch_items(path, 4, L, rank=r, world_size=2) for r in range(2)]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == starts


def test_epoch_reset(tmp_path):
    path = _store(tmp_path / "s", 100)
    ds = BufferDataset(path, 8, epoch=True)
    it = iter(_loader(ds, workers=0))
    next(it)
    del it
    ds.reset()
    assert _epoch_items(path, 8, workers=0) == list(range(100))


def test_pickles_without_the_open_store(tmp_path):
    path = _store(tmp_path / "s", 100)
    ds = BufferDataset(path, 4, num_batches=1)
    list(ds)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._buf is None and len(list(clone)) == 1
    b = pickle.loads(pickle.dumps(next(iter(ds))))  # a Batch crosses processes too
    assert isinstance(b, mb.Batch) and b["x"].shape == (4,)


def test_loader_pin_memory_uses_batch_pin(tmp_path, monkeypatch):
    from torch.utils.data._utils.pin_memory import pin_memory

    path = _store(tmp_path / "s", 100)
    batch = next(iter(BufferDataset(path, 4)))
    assert isinstance(batch, mb.Batch)
    monkeypatch.setattr(type(batch), "pin_memory", lambda self: ("pinned", self))
    assert pin_memory(batch) == ("pinned", batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loader_pin_memory_cuda(tmp_path):
    path = _store(tmp_path / "s", 100)
    for b in _loader(BufferDataset(path, 4, num_batches=2), pin_memory=True):
        assert b["x"].is_pinned() and b.indices.is_pinned()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": 4, "refresh_every": -1},
        {"batch_size": 4, "epoch": True, "prioritized": True},
        {"batch_size": 4, "rank": 1},
        {"batch_size": 4, "rank": 2, "world_size": 2},
    ],
)
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(mb.errors.InvalidArgumentError):
        BufferDataset(tmp_path, **kwargs)



@pytest.mark.parametrize("kwargs", [{"slice_len": 6, "strict": False}, {}])
def test_worker_batches_cross_as_one_block(tmp_path, kwargs):
    """A worker's batch arrives as one shared-memory block whose views are the
    columns, indices, weights and mask, with the same contents per-column
    sampling gives (x is the row id, obs is [x, -x], next_obs the next row's)."""
    path = _store(tmp_path / "s", 400, episode=20)
    out = list(_loader(BufferDataset(path, 16, num_batches=6, **kwargs)))
    assert len(out) == 6
    for b in out:
        assert type(b).__name__ == "PackedBatch" and b.block.is_shared()
        tensors = [*b.data.values(), b.indices, b.weights] + ([] if b.mask is None else [b.mask])
        assert {t.untyped_storage().data_ptr() for t in tensors} == {b.block.data_ptr()}
        live = torch.ones_like(b.indices, dtype=torch.bool) if b.mask is None else b.mask
        x = b["x"]
        assert torch.equal(x[live], b.indices[live]) and (x[~live] == 0).all()
        assert torch.equal(b["obs"][live], torch.stack([x, -x], -1).float()[live])
        last = (x % 20) == 19
        nxt = b["next_obs"][..., 0]
        assert torch.equal(nxt[live & ~last], (x + 1).float()[live & ~last]) and (nxt[live & last] == 0).all()
