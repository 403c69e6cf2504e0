"""A TorchRL replay buffer kept in an mmbuffer store (optional extra ``torchrl``).

``ReplayBuffer`` takes the TensorDicts TorchRL collectors produce and returns
TensorDicts with TorchRL's layout, so a TorchRL training loop swaps it in for
``TensorDictReplayBuffer`` / ``TensorDictPrioritizedReplayBuffer`` with one line::

    rb = TensorDictPrioritizedReplayBuffer(storage=LazyMemmapStorage(N), alpha=0.6, beta=0.4, batch_size=256)
    rb = ReplayBuffer("runs/replay", capacity=N, batch_size=256, sampler=samplers.Prioritized(beta=0.4))

Keys and columns. The store is created at the first ``extend``, its schema taken
from that TensorDict (a store that exists is reopened; every batch must then
have its keys, shapes and dtypes). Root keys become columns named by their path
(``("collector", "traj_ids")`` -> ``collector/traj_ids``; ``observation`` ->
``obs``, as ``mmbuffer convert torchrl`` names it); a root key that also exists
under ``"next"`` is next-derived: ``("next", key)`` is never stored twice, it is
the following row's value inside an episode and the stored final observation at
an episode's end. ``("next", "reward")`` -> ``reward``, other next-only keys ->
``next/<path>``. ``("next", "terminated" | "truncated" | "done")`` are the episode
ends (``done`` without ``terminated`` counts as ``terminated``; ``done`` set with
neither as ``truncated``); the root flags, always False in what a collector
returns, are not stored (an extend where one is True is refused) and come back as
False. ``"index"``, ``"priority_weight"`` and the priority key (``"td_error"``)
are never stored; a priority key in an extended TensorDict sets its rows' priorities.
The mapping is kept in the store's ``attrs["torchrl_layout"]``; a store converted
from a TorchRL dump (``mb.convert.convert("torchrl", ...)``) opens with the same rules.

Streams. A ``[E, T]`` batch (``E`` environments, time last, as collectors return
it; more leading dims are flattened into ``E``) gives environment ``e`` to stream
``e`` of an ``E``-stream store. A ``[T]`` batch goes to one stream; with
``("collector", "traj_ids")`` it is cut where the id changes with no episode end
(a ``[E, T]`` batch flattened with ``reshape(-1)``), and each piece continues the
stream whose trajectory has its first id, or takes a free stream (with
``num_streams=E`` every environment keeps its own stream). A trajectory cut
before its end, with no stream to continue it, ends as truncated there.
Every row is stored, and sampleable, when ``extend`` returns, with its index. A
stream's open episode ends provisionally at its last row: truncated, with that
row's ``("next", obs)`` as final observation; when the next batch continues the
episode, that end is undone (``mmbuffer._ledger.appending``) and the episode goes on
(unless it would outgrow a lane: then it stays ended there, truncated).
``commit`` keeps open episodes open (readers see them up to their last row but
one); ``close``, ``state_dict`` and ``dumps`` make the provisional ends
truncations, so a reopened store never glues a new episode onto an old one (after
a crash, the next writer ends the episodes a commit kept open, with their stored
final observations); ``len(rb) <= capacity`` always.

Sampling. ``sample(batch_size)`` (default: the preset ``batch_size``) returns a
TensorDict of ``batch_size`` transitions with ``"index"`` (global row ids for
``update_priority``) and, with a prioritized sampler, the importance weights under
``"priority_weight"``, the key TorchRL's prioritized samplers and losses use. With
``samplers.Slices(L)`` or ``PrioritizedSlices(L)`` ``batch_size`` counts rows, as in
TorchRL's ``SliceSampler``: ``batch_size // L`` windows returned flat ``[B * L]``
(``"index"`` then ``[B * L, 1]`` as there; ``flatten_slices=False``: ``[B, L]``), with ``("next", "truncated")`` and
``("next", "done")`` set at each window's last step as ``SliceSampler`` sets them,
and ``("collector", "mask")`` when ``strict=False`` (padded windows).

TorchRL's other ways in: its sampler objects are translated to specs
(``translate.py``); ``transform=``, ``append_transform``, ``prefetch=``,
``rb[i]``, ``rb[a:b]``, iteration and ``empty()`` as TorchRL's (``access.py``);
``MultiStepTransform`` acts at ``extend``, as TorchRL's (``nstep.py``: its store
keeps ``("next", obs)`` in its own column). A full ring evicts whole episodes:
``len(rb) >= capacity - streams * (longest episode - 1)`` (TorchRL: ``capacity``).

Checkpoints and processes (``checkpoint.py``). The store is the checkpoint:
``state_dict()`` commits what changed and names the store at that commit (path,
generation, cursors) with the batch size and generator state (no data);
``load_state_dict`` restores exactly that, or refuses with a typed error once the
store has moved on; ``dumps(path)`` copies the store, ``loads(path)`` opens a copy.
``ReplayBuffer(path, mode="r")`` is a reader of the same class (a learner
process), following the writer's commits; a pickled buffer unpickles as one.

>>> import pytest; td_mod = pytest.importorskip("tensordict")
>>> import tempfile, torch
>>> T = 10
>>> obs = torch.arange(T + 1, dtype=torch.float32)[:, None].expand(T + 1, 3)
>>> td = td_mod.TensorDict({"observation": obs[:-1], "action": torch.zeros(T, 1),
...     "next": {"observation": obs[1:], "reward": torch.ones(T, 1),
...              "done": (torch.arange(T) == 4)[:, None], "terminated": (torch.arange(T) == 4)[:, None]}}, [T])
>>> rb = ReplayBuffer(tempfile.mkdtemp() + "/rb", capacity=100, batch_size=4)
>>> index = rb.extend(td)
>>> len(rb), index[-1].item()   # every row stored, the open episode's last one too
(10, 9)
>>> s = rb.sample()
>>> bool((s["next", "observation"] == s["observation"] + 1).all()), tuple(s["next", "done"].shape)
(True, (4, 1))
>>> rb.close()
"""

from .keys import WEIGHT_KEY
from .replay import ReplayBuffer

__all__ = ["WEIGHT_KEY", "ReplayBuffer"]
