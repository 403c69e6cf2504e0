"""Prioritized replay (Schaul et al. 2016): transitions, or windows by their start.

Probabilities come from the store's persisted priority tree; importance weights
are ``(N P(i))^-beta`` normalized by their maximum over live rows.

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/p", {"x": ((), "int64")}, capacity=64, next_keys=(),
...                 priorities=mb.PriorityConfig())
>>> buf.extend({"x": np.arange(30), "truncated": np.arange(30) % 10 == 9})
>>> b = buf.sample(8, sampler=mb.samplers.PrioritizedSlices(4), generator=torch.Generator().manual_seed(0))
>>> tuple(b.indices.shape), b.weights.dtype
((8, 4), torch.float32)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import mmbuffer.samplers._draw as sampling  # the algorithms (not "from .": that names the package)
from .._disk.checks import check_int
from .._ledger.snapshot import Draw, ReadableStore, View
from .base import Sampler, SamplerState, check_beta, require_priorities, tree_of


@dataclass(frozen=True, slots=True)
class Prioritized(Sampler):
    """Transitions with probability ``p_i / sum p`` over sampleable rows."""

    beta: float = 0.4
    prioritized = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_beta(self.beta))

    def check(self, store: ReadableStore) -> None:
        require_priorities(store)

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState) -> Draw:
        rows, weights = sampling.prioritized(snapshot, tree_of(snapshot), n, self.beta, generator)
        return Draw(rows, weights, None, snapshot.written)

    def mass(self, snapshot: View, state: SamplerState) -> float:
        return sampling.valid_mass(snapshot, tree_of(snapshot), None, True)


@dataclass(frozen=True, slots=True)
class PrioritizedSlices(Sampler):
    """Windows of ``slice_len`` rows; a window's probability is its start row's
    priority over the priorities of all valid starts (invalid starts: exactly 0).
    ``strict=False`` lets every row start a window, cut and padded at its
    episode's end."""

    slice_len: int
    beta: float = 0.4
    strict: bool = True
    slices = True
    prioritized = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "slice_len", check_int("slice_len", self.slice_len, 1))
        object.__setattr__(self, "beta", check_beta(self.beta))
        object.__setattr__(self, "strict", bool(self.strict))

    def check(self, store: ReadableStore) -> None:
        require_priorities(store)

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState) -> Draw:
        starts, weights = sampling.prioritized(
            snapshot, tree_of(snapshot), n, self.beta, generator, slice_len=self.slice_len, strict=self.strict
        )
        lane, absolute = sampling.absolute_rows(snapshot, starts)
        avail = sampling.rows_left(snapshot, lane, absolute)
        rows, mask = sampling.window(snapshot, lane, absolute, avail, self.slice_len)
        return Draw(rows, weights, mask, snapshot.written)

    def mass(self, snapshot: View, state: SamplerState) -> float:
        return sampling.valid_mass(snapshot, tree_of(snapshot), self.slice_len, self.strict)
