"""Behaviours of TorchRL's own replay buffers (``LazyTensorStorage`` /
``LazyMemmapStorage``, pure-Python parts), each run on TorchRL's buffer and on
``mmbuffer.torchrl.ReplayBuffer`` with the same data: they agree, or the drop-in
refuses with its documented, typed error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmbuffer as mb

pytest.importorskip("torchrl")
tensordict = pytest.importorskip("tensordict")
from mmbuffer.torchrl import ReplayBuffer

# torchrl 0.14 warns about its own deprecated internals on import and on use
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def _steps(T, ends=(), start=0, lead=()):
    """A synthetic ``[*lead, T]`` collector batch: observation ``start + t`` (3 floats),
    next observation ``start + t + 1``; ``("next", "done"/"terminated")`` at ``ends``."""
    shape = (*lead, T)
    obs = (start + torch.arange(T + 1, dtype=torch.float32)).expand(*lead, T + 1)[..., None].expand(*lead, T + 1, 3)
    end = torch.zeros(shape, dtype=torch.bool)
    end[..., list(ends)] = True
    nxt = {"observation": obs[..., 1:, :].contiguous(), "reward": torch.ones(*shape, 1),
           "done": end[..., None].clone(), "terminated": end[..., None].clone(),
           "truncated": torch.zeros(*shape, 1, dtype=torch.bool)}
    return tensordict.TensorDict({"observation": obs[..., :-1, :].contiguous(), "action": torch.zeros(*shape, 1),
                                  "next": nxt}, list(shape))


def _torchrl(capacity, batch_size, **kw):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=batch_size, **kw)


def test_empty_buffer_sample_raises_a_runtime_error_as_torchrl(tmp_path):
    ref = _torchrl(10, 4)
    rb = ReplayBuffer(tmp_path / "rb", capacity=10, batch_size=4)
    for buffer in (ref, rb):  # what a TorchRL user's code catches
        with pytest.raises(RuntimeError):
            buffer.sample()
    with pytest.raises(mb.errors.EmptyBufferError, match="created by the first extend"):
        rb.sample()
    # no trajectory long enough for a slice: RuntimeError on both
    from torchrl.data import SliceSampler

    ref = _torchrl(10, 10, sampler=SliceSampler(slice_len=5, end_key=("next", "done")))
    ref.extend(_steps(3, ends=[2]))
    rb.extend(_steps(3, ends=[2]))
    rb.set_sampler(mb.samplers.Slices(5))
    with pytest.raises(RuntimeError):
        ref.sample()
    with pytest.raises(RuntimeError):
        rb.sample(10)
    with pytest.raises(mb.errors.NoValidSliceError):
        rb.sample(10)


def test_every_row_is_sampleable_with_its_index_when_extend_returns(tmp_path):
    ref = _torchrl(10, 64)
    rb = ReplayBuffer(tmp_path / "rb", capacity=10, batch_size=64, generator=torch.Generator().manual_seed(0))
    for i in range(9):  # one open episode, a step at a time, as TorchRL users call add
        step = _steps(1, start=i)[0]
        j, k = ref.add(step), rb.add(step)
        assert k == j == i and len(rb) == len(ref) == i + 1
        for buffer in (ref, rb):  # the step just added is drawn, with its own next observation
            s = buffer.sample()
            assert set(s["index"].tolist()) == set(range(i + 1))
            torch.testing.assert_close(s["next", "observation"], s["observation"] + 1)
            assert not s["next", "done"].any()
    # slice counts follow the episode as its provisional end is undone and it grows
    rb.set_sampler(mb.samplers.Slices(4))
    for i in range(9, 11):  # windows start anywhere in the i rows (never past them)
        w = rb.sample(400).reshape(100, 4)
        assert w["index"][..., 0].diff(dim=1).eq(1).all()
        assert set(w["index"][:, 0, 0].tolist()) == set(range(i - 3))
        rb.add(_steps(1, start=i)[0])
    rb.set_sampler(mb.samplers.Uniform())
    # a batch whose episode stays open: every index returned, every row sampleable
    index = rb.extend(_steps(4, start=11))
    assert (index >= 0).all() and len(rb) <= 10  # never more than the capacity
    s = rb.sample()
    assert set(index[index >= 0].tolist()) <= set(s["index"].tolist())
    torch.testing.assert_close(s["next", "observation"], s["observation"] + 1)


def test_update_priority_of_what_extend_returned(tmp_path):
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, batch_size=8, sampler=mb.samplers.Prioritized(beta=0.4),
                      priorities=mb.PriorityConfig(alpha=1.0, eps=0.0))
    index = rb.extend(_steps(6))  # an open episode: its last row has an index too
    rb.update_priority(index, torch.arange(1.0, 7.0))
    np.testing.assert_allclose(rb.buffer.leaf_priorities(index), np.arange(1.0, 7.0))
    more = rb.extend(_steps(4, start=6, ends=[3]))  # the episode goes on: the priorities stay
    np.testing.assert_allclose(rb.buffer.leaf_priorities(index), np.arange(1.0, 7.0))
    assert rb.buffer.num_episodes == 1 and rb.buffer.episodes()[1].tolist() == [10]
    assert torch.equal(more, torch.arange(6, 10))


class _Tree:
    """A numpy stand-in for TorchRL's C++ segment trees (they need torch 2.14.1 here),
    so TorchRL's own ``PrioritizedSampler`` runs: the same calls, summed or min'ed in numpy."""

    def __init__(self, capacity, reduce):
        self.reduce, self.v = reduce, np.full(capacity, 0.0 if reduce is np.sum else np.inf)

    def __getitem__(self, index):
        return torch.as_tensor(self.v[np.asarray(index)])

    def __setitem__(self, index, value):
        self.v[np.asarray(index)] = np.asarray(value)

    def query(self, left, right):
        return float(self.reduce(self.v[left:right]))

    def scan_lower_bound(self, mass):
        return torch.as_tensor(np.searchsorted(np.cumsum(self.v), np.asarray(mass), side="right"))


@pytest.fixture
def torchrl_prioritized(monkeypatch):
    """TorchRL's ``PrioritizedSampler`` with :class:`_Tree` for its trees."""
    from torchrl.data.replay_buffers.samplers import prioritized

    for name, reduce in [("SumSegmentTreeFp32", np.sum), ("SumSegmentTreeFp64", np.sum),
                         ("MinSegmentTreeFp32", np.min), ("MinSegmentTreeFp64", np.min)]:
        monkeypatch.setattr(prioritized, name, lambda cap, reduce=reduce: _Tree(cap, reduce))
    return prioritized.PrioritizedSampler


def test_a_new_row_gets_the_running_max_priority_as_torchrl(tmp_path, torchrl_prioritized):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    alpha, n = 0.6, 40_000
    errors = torch.arange(2.0, 12.0)  # TD errors above 1: the max, 11, is row 9's
    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=n,
                                 sampler=torchrl_prioritized(100, alpha=alpha, beta=0.4, eps=1e-8))
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, batch_size=n, sampler=mb.samplers.Prioritized(beta=0.4),
                      priorities=mb.PriorityConfig(alpha=alpha, eps=1e-8), generator=torch.Generator().manual_seed(0))
    np.random.seed(0)  # TorchRL's sampler draws with np.random
    for buffer in (ref, rb):
        index = buffer.extend(_steps(10, ends=[9]))
        buffer.update_priority(index, errors)
        new = int(buffer.extend(_steps(1, ends=[0], start=10))[0])
        assert new == 10
    # the new row's stored priority is the max row's, (11 + eps) ** alpha, in both
    want = (11.0 + 1e-8) ** alpha
    assert float(ref.sampler._sum_tree[10]) == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(rb.buffer.leaf_priorities([9, 10]), [want, want], rtol=1e-6)
    for buffer in (ref, rb):  # and it is drawn about as often as the max row
        counts = torch.bincount(buffer.sample()["index"].reshape(-1), minlength=11)
        assert 0.85 < counts[10] / counts[9] < 1.15, counts
