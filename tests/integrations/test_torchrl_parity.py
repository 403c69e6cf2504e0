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
    """A ``[*lead, T]`` collector batch: observation ``start + t`` (3 floats), next one ``start + t + 1``."""
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
    for draw in (ref.sample, lambda: rb.sample(10)):
        with pytest.raises(RuntimeError):
            draw()
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
        return self.v[np.asarray(index)]

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


def _both(tmp_path, capacity=10, batch_size=4, **kw):
    """TorchRL's buffer and the drop-in, the same options, the same steps extended."""
    ref = _torchrl(capacity, batch_size, **kw)
    rb = ReplayBuffer(tmp_path / "rb", capacity=capacity, batch_size=batch_size, **kw)
    return ref, rb


def _same(a, b):
    assert set(a.keys(include_nested=True, leaves_only=True)) == set(b.keys(include_nested=True, leaves_only=True))
    assert a.batch_size == b.batch_size
    for k, v in a.items(include_nested=True, leaves_only=True):
        assert torch.equal(v, b[k]), k


def test_rows_by_index_slice_and_key_as_torchrl(tmp_path):
    ref, rb = _both(tmp_path)
    for buffer in (ref, rb):
        buffer.extend(_steps(4, ends=[1]))
        buffer.extend(_steps(3, start=4))  # its last episode open
    for index in [3, 6, -1, -7, slice(None), slice(2, 5), slice(1, None, 2), [0, 6, 2], torch.tensor([5, 1])]:
        _same(ref[index], rb[index])
    torch.testing.assert_close(rb["observation"], ref["observation"])
    torch.testing.assert_close(rb["next", "observation"], ref["next", "observation"])
    for index in [7, -8, [1, 9]]:  # past the rows written: an IndexError in both
        for buffer in (ref, rb):
            with pytest.raises(IndexError):
                buffer[index]
    with pytest.raises(mb.errors.RowNotLiveError, match="expected live rows"):
        rb[[1, 9]]
    for buffer in (ref, rb):  # once the ring wraps, positions are the ring's
        buffer.extend(_steps(6, start=7, ends=[5]))
    assert len(rb) <= len(ref) == 10
    for index in [slice(None), 2, [0, 9]]:
        if len(rb) == 10:
            _same(ref[index], rb[index])


def test_empty_iterate_and_transform_as_torchrl(tmp_path):
    from torchrl.envs.transforms import RewardScaling

    ref, rb = _both(tmp_path, capacity=20)
    for buffer in (ref, rb):
        buffer.extend(_steps(6, ends=[5]))
        batch = next(iter(buffer))
        assert batch.batch_size == (4,) and len(buffer.sample()) == 4
        buffer.append_transform(RewardScaling(loc=1.0, scale=2.0, in_keys=[("next", "reward")]))
        buffer.append_transform(lambda td: td.set("double", td["observation"] * 2))
        s = buffer.sample()
        assert (s["next", "reward"] == 3.0).all() and torch.equal(s["double"], s["observation"] * 2)
        assert (buffer[0]["next", "reward"] == 3.0).all()
        buffer.empty()
        assert len(buffer) == 0
        with pytest.raises(RuntimeError):
            buffer.sample()
        buffer.extend(_steps(5, ends=[4], start=100))
        assert len(buffer) == 5 and (buffer.sample()["observation"] >= 100).all()
    with pytest.raises(mb.errors.InvalidArgumentError, match="invert"):
        rb.append_transform(lambda td: td, invert=True)
    from torchrl.envs.transforms import MultiStepTransform

    with pytest.raises(mb.errors.InvalidArgumentError, match="derives"):  # this store derives next obs (test_torchrl_nstep)
        rb.append_transform(MultiStepTransform(n_steps=3, gamma=0.99))
    rb.close()


def test_prefetch_as_torchrl(tmp_path):
    ref, rb = _both(tmp_path, capacity=20, prefetch=2)
    for buffer in (ref, rb):
        buffer.extend(_steps(6, ends=[5]))
        for _ in range(3):  # batches drawn ahead, of the preset size, of the rows there
            s = buffer.sample()
            assert s.batch_size == (4,) and set(s["index"].tolist()) <= set(range(6))
    # batches drawn ahead before empty() are dropped (TorchRL's queue still returns them)
    rb.empty()
    rb.extend(_steps(5, ends=[4], start=100))
    assert all((rb.sample()["observation"] >= 100).all() for _ in range(3))
    with pytest.raises(mb.errors.InvalidArgumentError, match="batch_size.*prefetch"):
        ReplayBuffer(tmp_path / "x", capacity=10, prefetch=2)
    rb.close()


def _learner(rb):  # a learner process: what it sees of the pickled buffer it was handed
    s = rb.sample()
    return type(rb).__name__, rb.mode, len(rb), s.batch_size, s["observation"][:, 0].tolist()


def test_a_reader_of_the_same_class_follows_commits_and_pickles_to_other_processes(tmp_path):
    import multiprocessing
    import pickle

    ref, rb = _both(tmp_path, capacity=100, batch_size=8, sampler=None)
    for buffer in (ref, rb):
        buffer.extend(_steps(10, ends=[9]))
    rb.commit()
    reader = ReplayBuffer(tmp_path / "rb", mode="r", batch_size=8)  # while the writer lives: no LockedError
    assert len(reader) == len(ref) == 10
    s, r = reader.sample(), ref.sample()
    assert set(s.keys(True, True)) == set(r.keys(True, True)) and s.batch_size == r.batch_size
    rb.extend(_steps(5, ends=[4], start=10))
    assert len(reader) == 10  # the writer's rows are seen at its commits
    rb.commit()
    assert len(reader) == 15 and reader[14]["observation"][0] == 14.0
    with pytest.raises(mb.errors.ReadOnlyError):
        reader.extend(_steps(2, ends=[1]))
    with pytest.raises(mb.errors.ReadOnlyError):
        reader.empty()
    # pickling: TorchRL's buffer carries its data; the drop-in its path, and opens it read-only
    ref2, rb2 = pickle.loads(pickle.dumps(ref)), pickle.loads(pickle.dumps(rb.share()))
    assert len(ref2) == len(ref) and len(rb2) == len(rb) == 15 and rb2.mode == "r"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        name, mode, n, shape, obs = pool.apply(_learner, (rb,))
    assert (name, mode, n, shape) == ("ReplayBuffer", "r", 15, (8,)) and set(obs) <= set(range(15))
    reader.close()
    rb2.close()
    with pytest.raises(mb.errors.StoreNotFoundError):
        ReplayBuffer(tmp_path / "nothing", mode="r")


def test_state_dict_restores_its_state_or_refuses_as_documented(tmp_path):
    ref, rb = _both(tmp_path, capacity=100, batch_size=8)
    rb.generator = torch.Generator().manual_seed(0)
    for buffer in (ref, rb):
        buffer.extend(_steps(10, ends=[9]))
    ref_state, state = ref.state_dict(), rb.state_dict()
    for buffer in (ref, rb):
        buffer.extend(_steps(10, ends=[9], start=10))
    ref.load_state_dict(ref_state)
    assert len(ref) == 10  # TorchRL's state holds its data: the state at 10 rows
    with pytest.raises(mb.errors.InvalidArgumentError, match="data the state describes is gone"):
        rb.load_state_dict(state)  # the store moved on: refused, never the 20 rows as the state
    assert len(rb) == 20
    # unchanged since: the state comes back exactly (the same draws)
    state = rb.state_dict()
    expected = rb.sample()
    rb.close()
    again = ReplayBuffer(tmp_path / "rb")
    again.load_state_dict(state)
    assert len(again) == 20 and (again.sample() == expected).all()


def _trajectories(T=40, length=10):
    """A [T] batch of episodes of ``length`` steps with ("collector", "traj_ids")."""
    td = _steps(T, ends=list(range(length - 1, T, length)))
    td["collector", "traj_ids"] = torch.arange(T) // length
    return td


def test_torchrl_sampler_objects_are_translated(tmp_path, torchrl_prioritized):
    from torchrl.data import (PrioritizedSliceSampler, RandomSampler, SamplerWithoutReplacement, SliceSampler,
                              SliceSamplerWithoutReplacement)

    cases = [
        (lambda: RandomSampler(), mb.samplers.Uniform(), 8),
        (lambda: SliceSampler(num_slices=4, traj_key=("collector", "traj_ids")), None, 32),
        (lambda: SliceSampler(slice_len=4, end_key=("next", "done"), strict_length=False, pad_output=True), None, 32),
        (lambda: SamplerWithoutReplacement(), mb.samplers.Epoch(name="torchrl"), 8),
        (lambda: SliceSamplerWithoutReplacement(slice_len=5), mb.samplers.Epoch(5, name="torchrl"), 10),
        (lambda: torchrl_prioritized(100, alpha=0.7, beta=0.5, eps=1e-6), mb.samplers.Prioritized(beta=0.5), 8),
        (lambda: PrioritizedSliceSampler(100, alpha=0.7, beta=0.5, slice_len=5), None, 10),
    ]
    for i, (make, spec, size) in enumerate(cases):
        ref = _torchrl(100, size, sampler=make())
        rb = ReplayBuffer(tmp_path / str(i), capacity=100, batch_size=size, sampler=make(),
                          generator=torch.Generator().manual_seed(0))
        if spec is not None:
            assert rb.sampler == spec
        for buffer in (ref, rb):
            buffer.extend(_trajectories())
        s, r = rb.sample(), ref.sample()
        mask = {("collector", "mask")}  # TorchRL adds it only to batches that were padded; the drop-in always
        assert s.batch_size == r.batch_size and set(s.keys(True, True)) - mask == set(r.keys(True, True)) - mask
        if rb.sampler.slices:  # windows of consecutive steps of one trajectory, as TorchRL's
            n = 4 if i == 1 else size // rb.sampler.slice_len
            for w in (s.reshape(n, -1), r.reshape(n, -1)):
                real = w.get(("collector", "mask"), torch.ones(w.shape, dtype=torch.bool))
                ids = w["collector", "traj_ids"]
                assert (ids[real] == ids[:, :1].expand_as(ids)[real]).all()
    assert rb.buffer.priorities.alpha == 0.7  # the PrioritizedSampler's alpha made the store
    # without replacement: an epoch gives every transition once, in both
    ref = _torchrl(100, 10, sampler=SamplerWithoutReplacement())
    rb = ReplayBuffer(tmp_path / "epoch", capacity=100, batch_size=10, sampler=SamplerWithoutReplacement())
    for buffer in (ref, rb):
        buffer.extend(_trajectories())
        seen = torch.cat([buffer.sample()["index"] for _ in range(4)])
        assert sorted(seen.tolist()) == list(range(40))


def test_torchrl_sampler_arguments_that_are_not_translated_are_refused(tmp_path, torchrl_prioritized):
    from torchrl.data import SamplerWithoutReplacement, SliceSampler
    from torchrl.data.replay_buffers.samplers import StalenessAwareSampler

    refused = [
        (SliceSampler(slice_len=4, span=True), "span"),
        (SliceSampler(slice_len=4, end_key=("next", "terminated")), "end_key"),
        (SliceSampler(slice_len=4, truncated_key=None), "truncated_key"),
        (SamplerWithoutReplacement(shuffle=False), "shuffle"),
        (SamplerWithoutReplacement(drop_last=True), "drop_last"),
        (torchrl_prioritized(100, alpha=0.7, beta=0.5, reduction="mean"), "reduction"),
        (StalenessAwareSampler(), "StalenessAwareSampler"),
    ]
    for sampler, name in refused:
        with pytest.raises(mb.errors.InvalidArgumentError, match=name):
            ReplayBuffer(tmp_path / "rb", capacity=10, sampler=sampler)
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, sampler=torchrl_prioritized(100, alpha=0.7, beta=0.5))
    rb.extend(_steps(3, ends=[2]))
    rb.close()
    with pytest.raises(mb.errors.InvalidArgumentError, match="alpha=0.5.*expected the store's alpha=0.7"):
        ReplayBuffer(tmp_path / "rb", sampler=torchrl_prioritized(100, alpha=0.5, beta=0.5))
    rb = ReplayBuffer(tmp_path / "rb", batch_size=30, sampler=SliceSampler(num_slices=4))
    with pytest.raises(mb.errors.InvalidArgumentError, match="multiple of num_slices=4"):
        rb.sample()


def test_plain_tensordicts_without_episode_keys(tmp_path):
    from torchrl.data import SliceSampler

    T = 12
    plain = tensordict.TensorDict({"obs": torch.arange(T * 3.0).reshape(T, 3), "action": torch.arange(T)}, [T])
    ref, rb = _both(tmp_path, capacity=20, batch_size=6)
    for buffer in (ref, rb):
        buffer.extend(plain)
    assert len(rb) == len(ref) == T and rb.buffer.num_episodes == T  # every row its own episode
    _same(ref[:], rb[:])
    s, r = rb.sample(), ref.sample()
    assert set(s.keys(True, True)) == set(r.keys(True, True)) and s.batch_size == r.batch_size
    for buffer in (ref, rb):  # the ring wraps row by row: len stays at the capacity, as TorchRL's
        buffer.extend(plain)
    assert len(rb) == len(ref) == 20
    # told otherwise: a trajectory key makes episodes of the rows that share it
    episodic = plain.clone()
    episodic["episode"] = torch.arange(T) // 4
    ref = _torchrl(20, 8, sampler=SliceSampler(slice_len=4, traj_key="episode"))
    rb = ReplayBuffer(tmp_path / "ep", capacity=20, batch_size=8, sampler=SliceSampler(slice_len=4, traj_key="episode"))
    for buffer in (ref, rb):
        buffer.extend(episodic)
        w = buffer.sample().reshape(2, 4)
        assert (w["episode"] == w["episode"][:, :1]).all() and (w["action"].diff(dim=1) == 1).all()
    assert rb.buffer.episodes()[1].tolist() == [4, 4, 4]  # the last one ended provisionally


def test_iterating_without_replacement_ends_with_the_epoch_as_torchrl(tmp_path):
    from torchrl.data import SamplerWithoutReplacement

    ref = _torchrl(20, 4, sampler=SamplerWithoutReplacement())
    rb = ReplayBuffer(tmp_path / "rb", capacity=20, batch_size=4, sampler=SamplerWithoutReplacement())
    for buffer in (ref, rb):
        buffer.extend(_steps(10))
        for _ in range(2):  # each pass: every row once, the last batch short
            batches = [b["index"].tolist() for b in buffer]
            assert [len(b) for b in batches] == [4, 4, 2]
            assert sorted(sum(batches, [])) == list(range(10))
    rb.set_sampler(mb.samplers.Uniform())  # with replacement: endless, as TorchRL's RandomSampler
    it = iter(rb)
    assert all(next(it).batch_size == (4,) for _ in range(20))


def test_an_extend_that_fails_after_reopening_an_episode_leaves_it_continuable(tmp_path, monkeypatch):
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, batch_size=16)
    rb.extend(_steps(4))  # open: its last row ends provisionally
    buf = rb.buffer
    real = buf.extend

    def full(*args, **kwargs):
        raise mb.errors.DiskFullError(28, "no space left (simulated)")

    monkeypatch.setattr(buf, "extend", full)
    with pytest.raises(mb.errors.DiskFullError):
        rb.extend(_steps(3, start=4))  # the end was undone, then the write failed
    monkeypatch.setattr(buf, "extend", real)
    index = rb.extend(_steps(3, start=4, ends=[2]))  # space again: the same batch goes on
    assert index.tolist() == [4, 5, 6] and buf.episodes()[1].tolist() == [7]
    assert buf.get(np.arange(7))["next_obs"][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def _commit_and_die(path):  # a writer process that commits with an episode open, then dies
    import os

    rb = ReplayBuffer(path, capacity=100, batch_size=4)
    rb.extend(_steps(5))
    rb.commit()
    os._exit(0)


def test_commits_keep_episodes_open_and_readers_refuse_writes(tmp_path):
    import multiprocessing

    rb = ReplayBuffer(tmp_path / "rb", capacity=100, batch_size=4, sampler=mb.samplers.Prioritized())
    index = rb.extend(_steps(5))  # an open episode
    rb.commit()  # a reader sees the rows; the episode stays open
    reader = ReplayBuffer(tmp_path / "rb", mode="r", batch_size=4, sampler=mb.samplers.Prioritized())
    assert len(reader) == 4 and reader.buffer.num_episodes == 0  # its last row: when the episode goes on
    assert not rb[int(index[-1])]["next", "truncated"].any()  # the writer: sampleable, not truncated
    with pytest.raises(mb.errors.RowNotLiveError):  # a reader: its next observation is not known yet
        reader[int(index[-1])]
    assert reader[:].batch_size == (4,) and set(reader.sample(64)["index"].tolist()) == {0, 1, 2, 3}
    s = reader.sample()
    with pytest.raises(mb.errors.ReadOnlyError):
        reader.update_priority(s["index"], torch.ones(4))
    with pytest.raises(mb.errors.ReadOnlyError):
        reader.commit()
    more = rb.extend(_steps(3, start=5, ends=[2]))  # the episode goes on across the commit
    rb.commit()
    assert more.tolist() == [5, 6, 7] and reader.buffer.episodes()[1].tolist() == [8]
    assert not reader[:]["next", "truncated"].any() and reader[:]["next", "terminated"][-1].all()
    torch.testing.assert_close(reader[:]["next", "observation"], reader[:]["observation"] + 1)
    rb.extend(_steps(2, start=8))
    rb.state_dict()  # a checkpoint ends open episodes, truncated: the state has none
    assert rb.buffer.episodes()[1].tolist() == [8, 2] and rb[9]["next", "truncated"].all()
    reader.close()
    rb.close()
    # a writer that dies after such a commit: the next one ends the open episode, with its
    # stored final observation, and goes on in a new one
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_commit_and_die, args=(tmp_path / "crash",))
    p.start()
    p.join()
    again = ReplayBuffer(tmp_path / "crash", batch_size=4)
    assert again.buffer.episodes()[1].tolist() == [5] and again[4]["next", "observation"][0] == 5.0
    assert again.extend(_steps(2, start=100, ends=[1])).tolist() == [5, 6]
    assert again.buffer.episodes()[1].tolist() == [5, 2]
    again.close()


def test_storage_argument_as_torchrl_users_write_it(tmp_path):
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ListStorage, TensorDictReplayBuffer

    ref = TensorDictReplayBuffer(storage=LazyMemmapStorage(50, scratch_dir=tmp_path / "theirs"), batch_size=4)
    rb = ReplayBuffer(storage=LazyMemmapStorage(50, scratch_dir=tmp_path / "ours"), batch_size=4)  # the class alone changes
    for buffer in (ref, rb):
        buffer.extend(_steps(8, ends=[7]))
        assert len(buffer) == 8 and buffer.sample().batch_size == (4,)
    assert rb.path == tmp_path / "ours" and rb.buffer.capacity == 50
    rb.close()
    assert len(ReplayBuffer(tmp_path / "ours")) == 8  # kept on disk: reopened by its path
    with pytest.raises(mb.errors.InvalidArgumentError, match="storage: .*got ListStorage"):
        ReplayBuffer(storage=ListStorage(10))
    with pytest.raises(mb.errors.InvalidArgumentError, match="path: expected the store's directory"):
        ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(mb.errors.InvalidArgumentError, match="capacity: expected storage's max_size 10"):
        ReplayBuffer(tmp_path / "x", storage=LazyTensorStorage(10), capacity=20)
    assert ReplayBuffer(tmp_path / "y", storage=LazyTensorStorage(10)).path == tmp_path / "y"
