"""Without replacement: every item once per epoch, in a keyed order, resumable.

``Epoch(...)`` is ``mb.EpochSampler`` as a spec: each ``buf.sample(n,
sampler=Epoch(...))`` returns the next ``n`` items of the epoch's permutation
(sampleable transitions, or valid strict windows of ``slice_len`` rows; see
``mmbuffer/epoch.py``) and saves the position to ``sampler/<name>.json`` in the
store, so a restarted run goes on where it stopped, and ``mb.EpochSampler`` with
the same name resumes the same position. A batch that reaches the end of an
epoch is filled from the next one (a new permutation, its item count taken
then): batches always hold ``n`` items, and every epoch delivers each item once.
``shard=(i, k)`` takes every ``k``-th item from ``i`` (workers, ranks).
``mb.data.BufferDataset(path, n, sampler=Epoch(...))`` runs in epoch mode with the
shards of its workers and ranks.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/e", {"x": ((), "int64")}, capacity=64, next_keys=())
>>> buf.extend({"x": np.arange(10)})
>>> spec = mb.samplers.Epoch(seed=1)
>>> seen = np.concatenate([buf.sample(5, sampler=spec)["x"].numpy() for _ in range(2)])
>>> sorted(seen.tolist()) == list(range(10)), mb.EpochSampler(buf, 5, seed=1).epoch
(True, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._disk import format as fmt
from .. import errors
from .._disk.checks import check_int
from .._ledger.store import View
from .base import Draw, Sampler


@dataclass(frozen=True, slots=True)
class Epoch(Sampler):
    """Items without replacement, epoch after epoch (see the module docstring).

    ``slice_len``: None for transitions, else strict windows. ``seed``: the
    permutation key. ``name``: the state file ``sampler/<name>.json`` (a state
    saved there with another seed, ``slice_len`` or shard is refused). ``shard``:
    ``(index, count)``, this process's part of every epoch. The generator passed
    to ``sample`` is not used: the order is the seed's.
    """

    slice_len: int | None = None
    seed: int = 0
    name: str = "default"
    shard: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        if self.slice_len is not None:
            object.__setattr__(self, "slice_len", check_int("slice_len", self.slice_len, 1))
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 1 << 63:
            raise errors.InvalidArgumentError(f"seed: expected an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        fmt.check_column_name(self.name)
        try:
            index, count = (int(self.shard[0]), int(self.shard[1]))
        except (TypeError, ValueError, IndexError):
            index, count = -1, 0
        if count < 1 or not 0 <= index < count or len(self.shard) != 2:
            raise errors.InvalidArgumentError(f"shard: expected (index, count) with 0 <= index < count, got {self.shard!r}")
        object.__setattr__(self, "shard", (index, count))

    @property
    def slices(self) -> bool:  # type: ignore[override]
        return self.slice_len is not None

    def _cursor(self, root: Path | None, cache: dict[Any, Any]) -> Any:
        """The buffer's cursor for this spec's state file (loaded from it once, when
        ``root`` is given); a spec that disagrees with it is refused."""
        from .._feed.epochs import EpochCursor  # epoch.py reads buffers: imported when used

        key = ("epoch", self.name)
        cur = cache.get(key)
        if cur is None:  # without a root: a fresh cursor that saves nothing
            cur = cache[key] = EpochCursor(root, self.name, seed=self.seed, slice_len=self.slice_len, shard=self.shard)
        st = cur.state
        if (st.seed, st.slice_len, st.shard) != (self.seed, self.slice_len, self.shard):
            raise errors.InvalidArgumentError(
                f"sampler: expected the seed, slice_len and shard this buffer's epoch {self.name!r} runs with "
                f"({st.seed}, {st.slice_len}, {st.shard}), got {self!r}; use another name"
            )
        return cur

    def plan(self, buf: Any, n: int, generator: torch.Generator | None, cache: dict[Any, Any]) -> Callable[[np.ndarray], Draw]:
        cur = self._cursor(Path(buf.path), cache)
        ranks = cur.take(n, buf.view())
        cur.save()  # a failed save restores the position and raises: no item is skipped

        def draw(positions: np.ndarray) -> Draw:
            # ranks resolve against the view of now: a reader re-reads overwritten items this way
            resolved: Draw = cur.resolve(buf.view(), ranks[positions])
            return resolved

        return draw

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, cache: dict[Any, Any]) -> Draw:
        """The next ``n`` items of ``snapshot`` by the position kept in ``cache``
        (nothing is loaded or saved: ``buf.sample`` does that)."""
        cur = self._cursor(None, cache)
        resolved: Draw = cur.resolve(snapshot, cur.take(n, snapshot))
        return resolved
