"""Uniform slices: ``[B, L]`` windows of consecutive rows inside one episode.

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/s", {"x": ((), "int64")}, capacity=64, next_keys=())
>>> buf.extend({"x": np.arange(30), "truncated": np.arange(30) % 10 == 9})
>>> b = buf.sample(8, sampler=mb.samplers.Slices(4), generator=torch.Generator().manual_seed(0))
>>> tuple(b.data["x"].shape), bool((b.data["x"].diff(dim=1) == 1).all())
((8, 4), True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import errors
import mmbuffer.samplers._draw as sampling  # the algorithms (not "from .": that names the package)
from .._disk.checks import check_int
from .._ledger.snapshot import Draw, View
from ._counts import SliceCounts
from .base import Sampler, SamplerState, ones

WEIGHTINGS = ("windows", "episodes")


@dataclass(frozen=True, slots=True)
class Slices(Sampler):
    """Windows of ``slice_len`` rows, uniformly.

    ``strict=True``: every valid window (inside one live episode) is equally likely;
    an episode of ``n >= L`` rows offers ``n - L + 1`` starts, shorter ones none.
    ``strict=False``: every row may start a window; the window is cut at its
    episode's end and padded (``mask`` False there). ``weighting="episodes"`` draws
    the episode uniformly first, then a start inside it (TorchRL's SliceSampler).
    """

    slice_len: int
    strict: bool = True
    weighting: str = "windows"
    slices = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "slice_len", check_int("slice_len", self.slice_len, 1))
        object.__setattr__(self, "strict", bool(self.strict))
        if self.weighting not in WEIGHTINGS:
            raise errors.InvalidArgumentError(f"weighting: expected 'windows' or 'episodes', got {self.weighting!r}")

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState) -> Draw:
        return self._windows(snapshot, n, generator, state)[0]

    def draw_with_ends(
        self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState
    ) -> tuple[Draw, np.ndarray | None]:
        if type(self).indices is not Slices.indices:  # a subclass that draws its own way
            return Sampler.draw_with_ends(self, snapshot, n, generator, state)  # (slots: no bare super())
        return self._windows(snapshot, n, generator, state)

    def _windows(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState,
                 ) -> tuple[Draw, np.ndarray]:
        counts = slice_counts(state, self.slice_len, self.strict, self.weighting)
        rows, mask, last = sampling.slices(snapshot, counts, n, generator)
        return Draw(rows, ones(n), mask, snapshot.written), last

    def mass(self, snapshot: View, state: SamplerState) -> float:
        closed, opened = slice_counts(state, self.slice_len, self.strict, self.weighting).totals(snapshot)
        return float((closed + opened).sum())


def slice_counts(state: SamplerState, slice_len: int, strict: bool, weighting: str) -> SliceCounts:
    """The buffer's counts of eligible starts for these settings (non-strict counts do
    not depend on the length: one entry serves every length)."""
    per_episode = weighting == "episodes"
    key = (slice_len if strict else 1, strict, per_episode)
    counts = state.slice_counts.get(key)
    if counts is None:
        counts = state.slice_counts[key] = SliceCounts(slice_len, strict, per_episode)
    counts.slice_len = slice_len
    return counts
