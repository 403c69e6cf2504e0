"""The drop-in's ``extend`` reads a batch's leaves in one walk (``keys.leaves``) and
takes numpy views of CPU tensors: what it accepts and refuses, compared with what
TorchRL's own buffer stores from the same batch."""

from __future__ import annotations

import pytest
import torch

import mmbuffer as mb

pytest.importorskip("torchrl")
tensordict = pytest.importorskip("tensordict")
from mmbuffer.torchrl import ReplayBuffer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def _batch(E, T, start=0):
    """A ``[E, T]`` batch whose observations are strided views of a ``[E, T + 1]`` tensor."""
    obs = (start + torch.arange(E * (T + 1), dtype=torch.float32)).reshape(E, T + 1)[..., None].expand(E, T + 1, 3)
    end = torch.zeros(E, T, 1, dtype=torch.bool)
    end[:, 3] = True
    return tensordict.TensorDict({
        "observation": obs[:, :-1], "action": torch.randn(E, T, 2, requires_grad=True),  # a policy's output
        "next": {"observation": obs[:, 1:], "reward": torch.randn(E, T, 1), "done": end, "terminated": end.clone()},
    }, [E, T])


def test_strided_and_grad_tensors_are_stored_as_torchrl_stores_them(tmp_path):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, batch_size=4)
    td = _batch(2, 8)
    assert not td["observation"].is_contiguous() and td["action"].requires_grad
    index = rb.extend(td)
    ref.extend(td.reshape(-1))
    ours, theirs = rb[index.reshape(-1)], ref[:]
    for key in ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done")):
        assert torch.equal(ours[key], theirs[key].detach()), key
    assert not ours["action"].requires_grad
    rb.close()


def test_a_non_tensor_leaf_is_refused_by_name_and_nothing_is_written(tmp_path):
    from tensordict import NonTensorData

    rb = ReplayBuffer(tmp_path / "rb", capacity=100)
    td = _batch(1, 8)
    td.set(("info", "name"), NonTensorData("cartpole", batch_size=[1, 8]))
    with pytest.raises(mb.errors.SchemaError, match=r"\('info', 'name'\).*expected a tensor, got NonTensorData"):
        rb.extend(td)  # the first batch: no store is created
    assert not (tmp_path / "rb").exists()
    rb.extend(_batch(1, 8))
    with pytest.raises(mb.errors.SchemaError, match=r"unknown \[\('info', 'name'\)\]"):
        rb.extend(td)  # on a store: refused before anything is written
    assert len(rb) == 8
    rb.close()
