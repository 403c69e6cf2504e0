"""Recency: draw only from each lane's most recent episodes.

For on-policy-ish updates, recency-biased replay (e.g. "emphasize recent
experience", Wang & Ross 2019) and debugging: ``Recent(episodes=N)`` restricts any
uniform sampler to the ``N`` newest complete episodes of every lane plus the
episode still being written. The restriction is a view of the snapshot (the
oldest live episode moves forward), so the cost is the wrapped sampler's.

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/r", {"x": ((), "int64")}, capacity=100, next_keys=())
>>> buf.extend({"x": np.arange(40), "truncated": np.arange(40) % 10 == 9})  # 4 episodes
>>> b = buf.sample(64, sampler=mb.samplers.Recent(episodes=1), generator=torch.Generator().manual_seed(0))
>>> int(b.data["x"].min()) >= 30
True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .. import errors
from .._ledger import index
from .._disk.checks import check_int
from .._ledger.snapshot import Draw, ReadableStore, View
from .base import Sampler, SamplerState
from .uniform import Uniform


@dataclass(frozen=True, slots=True)
class Recent(Sampler):
    """The wrapped sampler (``Uniform()`` or ``Slices(...)``) over each lane's
    ``episodes`` newest complete episodes and its open one."""

    episodes: int
    sampler: Sampler = field(default_factory=Uniform)

    def __post_init__(self) -> None:
        object.__setattr__(self, "episodes", check_int("episodes", self.episodes, 1))
        if not isinstance(self.sampler, Sampler) or isinstance(self.sampler, Recent) or self.sampler.prioritized or self.sampler.stateful:
            raise errors.InvalidArgumentError(
                f"sampler: expected a uniform sampler (mb.samplers.Uniform() or Slices(...)), got {self.sampler!r}"
            )

    @property
    def slices(self) -> bool:  # type: ignore[override]
        return self.sampler.slices

    def check(self, store: ReadableStore) -> None:
        self.sampler.check(store)

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState) -> Draw:
        lanes = []
        for lane, lv in enumerate(snapshot.lanes):
            head = max(lv.ep_head, lv.ep_tail - self.episodes)
            if head == lv.ep_head:
                lanes.append(lv)
                continue
            start = int(index.ends_at(snapshot.ends, lane, snapshot.lane_size, np.array([head - 1]))[0])
            lanes.append(replace(lv, ep_head=head, first_start=start))
        recent = replace(snapshot, lanes=tuple(lanes))
        # state of its own: shared counts would be trimmed to the recent episodes
        return self.sampler.indices(recent, n, generator, state.recent.setdefault(self.episodes, SamplerState()))
