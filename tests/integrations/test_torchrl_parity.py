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
