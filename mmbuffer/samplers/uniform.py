"""Uniform transitions: every sampleable row equally likely.

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/u", {"x": ((), "int64")}, capacity=16, next_keys=())
>>> buf.extend({"x": np.arange(10)})
>>> buf.sample(4, sampler=mb.samplers.Uniform(), generator=torch.Generator().manual_seed(0)).data["x"].shape
torch.Size([4])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import mmbuffer.samplers._draw as sampling  # the algorithms (not "from .": that names the package)
from .._ledger.snapshot import Draw, View
from .base import Sampler, SamplerState, ones


@dataclass(frozen=True, slots=True)
class Uniform(Sampler):
    """Transitions drawn uniformly over the sampleable rows of every lane (complete
    episodes, and open episodes up to their last row with a known next value)."""

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState) -> Draw:
        return Draw(sampling.uniform(snapshot, n, generator), ones(n), None, snapshot.written)

    def mass(self, snapshot: View, state: SamplerState) -> float:
        return float(snapshot.total_transitions)
