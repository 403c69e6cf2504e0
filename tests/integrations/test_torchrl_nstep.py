"""n-step returns through ``MultiStepTransform``: a real TorchRL ``Collector`` on
CartPole feeds TorchRL's own ``TensorDictReplayBuffer`` and ``mmbuffer.torchrl.
ReplayBuffer``, each with its own ``MultiStepTransform``; the rows stored are the
same, bit for bit, and so are the indices ``extend`` returns."""

from __future__ import annotations

import warnings

import pytest
import torch

import mmbuffer as mb

pytest.importorskip("torchrl")
pytest.importorskip("gymnasium")
tensordict = pytest.importorskip("tensordict")
from mmbuffer.torchrl import ReplayBuffer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def _collect(num_envs, frames_per_batch, batches, seed=0):
    """The batches a real Collector returns on ``num_envs`` CartPole envs (random actions)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchrl.collectors import Collector
        from torchrl.envs import GymEnv, SerialEnv

    torch.manual_seed(seed)
    env = SerialEnv(num_envs, lambda: GymEnv("CartPole-v1"))
    env.set_seed(seed)
    collector = Collector(env, policy=None, frames_per_batch=frames_per_batch, total_frames=frames_per_batch * batches)
    out = [td.clone() for td in collector]
    collector.shutdown()
    return out


def _nstep(n=3, gamma=0.9):
    from torchrl.envs.transforms import MultiStepTransform

    return MultiStepTransform(n_steps=n, gamma=gamma)


def _assert_same_rows(ours, theirs):
    """Every key of TorchRL's rows is in ours with the same shape, dtype and bits."""
    keys = {k for k in theirs.keys(include_nested=True, leaves_only=True) if k != "index"}
    assert keys <= set(ours.keys(include_nested=True, leaves_only=True))
    for key in keys:
        a, b = ours.get(key), theirs.get(key)
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key


def test_nstep_rows_are_torchrls_bit_for_bit(tmp_path):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    batches = [td[0] for td in _collect(1, 40, 6)]  # [40] batches of one env, episodes of ~10-40 steps
    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=8, transform=_nstep())
    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=8, transform=_nstep(),
                      generator=torch.Generator().manual_seed(0))
    ours = []
    for td in batches:
        j, k = ref.extend(td.clone()), rb.extend(td.clone())
        assert k.shape == j.shape and torch.equal(k, j)  # the first batch: 40 - 3 rows, then 40
        ours.append(k)
    index = torch.cat(ours)
    assert len(index) == len(rb) == len(ref) == 6 * 40 - 3
    stored = rb[index]
    assert stored["next", "done"].any() and (stored["steps_to_next_obs"] < 3).any()  # episode ends inside the windows
    _assert_same_rows(stored, ref[:])
    # ("next", "observation") is n steps ahead: not the following row's observation
    assert not torch.equal(stored["next", "observation"][:-1], stored["observation"][1:])
    # sampled rows carry the same values as the stored ones
    s = rb.sample(64)
    _assert_same_rows(s, ref[:][s["index"]])
    rb.close()


def test_nstep_on_env_streams_matches_the_transform(tmp_path):
    """[E, T] batches: each environment's rows are what TorchRL's transform returns."""
    batches = _collect(2, 80, 4)  # [2, 40]
    check = _nstep(n=4, gamma=0.95)  # TorchRL's transform, fed the same batches
    rb = ReplayBuffer(tmp_path / "rb", capacity=400, transform=_nstep(n=4, gamma=0.95))
    for td in batches:
        want = check.inv(td.clone())
        index = rb.extend(td.clone())
        assert index.shape == want.batch_size == (2, 36 if td is batches[0] else 40)
        assert len(set(index[0].tolist()) & set(index[1].tolist())) == 0  # one stream per env
        _assert_same_rows(rb[index.reshape(-1)], want.reshape(-1))
    assert rb.buffer.num_streams == 2 and "next/observation" in rb.buffer.columns  # stored, not derived
    rb.close()


def test_held_back_rows_add_and_refusals(tmp_path):
    batch = _collect(1, 10, 1)[0][0]
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, transform=_nstep(n=3))
    for i in range(3):  # the transform holds the first n steps back: nothing stored, as TorchRL's add
        out = rb.add(batch[i].clone())
        assert isinstance(out, torch.Tensor) and out.shape == (0, 1)
    assert len(rb) == 0
    assert rb.add(batch[3].clone()) == 0 and len(rb) == 1  # then one row per step, 3 steps behind
    rb.close()
    # a store that derives ("next", "observation") from the following row: an n-step
    # transform is refused, on construction, by append_transform, and nothing changes
    plain = ReplayBuffer(tmp_path / "plain", capacity=100)
    plain.extend(batch.clone())
    with pytest.raises(mb.errors.InvalidArgumentError, match="derives"):
        plain.append_transform(_nstep())
    assert plain.transforms == [] and len(plain) == 10
    plain.close()
    with pytest.raises(mb.errors.InvalidArgumentError, match="derives"):
        ReplayBuffer(tmp_path / "plain", transform=_nstep())
    with ReplayBuffer(tmp_path / "plain") as again:
        assert len(again) == 10
    # inverse transforms other than n-step stay refused
    from torchrl.envs.transforms import DoubleToFloat

    with pytest.raises(mb.errors.InvalidArgumentError, match="changes data on its way in"):
        ReplayBuffer(tmp_path / "other", capacity=10, transform=DoubleToFloat(in_keys_inv=["action"]))
