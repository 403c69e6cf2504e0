"""A full ring: TorchRL overwrites row by row and keeps ``len == capacity``; the
drop-in evicts whole episodes (the core keeps only whole episodes sampleable), so
its ``len`` stays below the capacity by less than one episode per stream. The
bound README states, ``len >= capacity - streams * (longest episode - 1)``, is
pinned here against TorchRL's own buffer fed the same batches, and shown tight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrl")
tensordict = pytest.importorskip("tensordict")
from mmbuffer.torchrl import ReplayBuffer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def _episodes(num_envs, T, ep_len, step):
    """A ``[E, T]`` collector batch from step ``step`` on: episodes of ``ep_len`` steps."""
    t = step + torch.arange(T)
    obs = (t[None, :] + 1000 * torch.arange(num_envs)[:, None]).float()
    end = ((t % ep_len) == ep_len - 1).expand(num_envs, T)[..., None]
    return tensordict.TensorDict({
        "observation": obs[..., None], "action": torch.zeros(num_envs, T, 1),
        "collector": {"traj_ids": (t // ep_len)[None, :] * num_envs + torch.arange(num_envs)[:, None]},
        "next": {"observation": obs[..., None] + 1, "reward": torch.ones(num_envs, T, 1),
                 "done": end.clone(), "terminated": end.clone()},
    }, [num_envs, T])


@pytest.mark.parametrize(("num_envs", "capacity", "ep_len"), [(1, 200, 7), (1, 200, 100), (2, 400, 50)])
def test_len_when_full_stays_within_the_documented_bound(tmp_path, num_envs, capacity, ep_len):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=8)
    rb = ReplayBuffer(tmp_path / "rb", capacity=capacity, batch_size=8)
    bound = capacity - num_envs * (ep_len - 1)
    lows, T = [], 1  # a step at a time: the bound is reached exactly
    for i in range(3 * capacity // (num_envs * T)):  # three passes through the ring
        td = _episodes(num_envs, T, ep_len, i * T)
        ref.extend(td.reshape(-1))
        rb.extend(td)
        if len(ref) == capacity:  # full: TorchRL keeps exactly the capacity
            assert bound <= len(rb) <= capacity
            lows.append(len(rb))
            s = rb.sample(256)  # what stays is sampled with its own next observation
            assert torch.equal(s["next", "observation"], s["observation"] + 1)
    assert min(lows) == bound  # the bound is reached: whole episodes go, their first rows overwritten
    assert max(lows) <= capacity
    rb.close()
