"""One batch: draw indices, gather their rows (re-checked in a reader), wrap them in a Batch.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/b", {"x": ((), "int64")}, capacity=8, next_keys=())
>>> buf.extend({"x": np.arange(4)})
>>> draw = lambda p: mb.samplers.Draw(p.astype(np.int64), np.ones(len(p), np.float32), None, np.array([4]))
>>> read_batch(buf.store, draw, 3, ["x"]).data["x"].tolist()
[0, 1, 2]
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .._ledger.snapshot import Draw
from .._ledger.store import Store
from ..samplers import Sampler, SamplerState
from .gather import Batch, gather
from .frames import Stacks
from .recheck import read_checked, rechecked

__all__ = ["SampledBatches", "read_batch", "read_spec"]


def read_batch(
    store: Store,
    draw: Callable[[np.ndarray], Draw],
    size: int,
    names: list[str],
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    recheck: bool = False,
    stack: Stacks | None = None,
) -> Batch:
    """Gather the rows that ``draw`` picks for batch positions ``arange(size)`` from ``store``.

    Under the store's lock unless ``recheck``: then the gather runs beside the writer
    and every item is re-checked against its reservation afterwards, as a reader's
    always are (``recheck.py``). Padded window positions read as zeros. ``stack``: frame
    stacks (``frames.py``).
    """
    if recheck:
        data, drawn = read_checked(store, draw, size, names, out=out, recheck=True, stack=stack)
    else:
        with store.lock:
            data, drawn = read_checked(store, draw, size, names, out=out, stack=stack)
    return _batch(data, drawn)


def read_spec(buf: Any, spec: Sampler, n: int, generator: torch.Generator | None, state: SamplerState,
              names: list[str], stack: Stacks | None) -> Batch:
    """``read_batch(buf.store, spec.plan(buf, n, generator, state), n, names, stack=stack)``:
    ``n`` items of ``spec`` from ``buf`` (a ``Buffer``). The same, in fewer steps, where
    a spec without state is read and nothing is stacked (``sample``'s default: its fixed
    cost is most of a small batch's): one ``indices`` call under the lock (what the
    default ``plan`` draws), one gather, and in a reader the re-check (``rechecked``,
    which draws again through ``plan``; the writer's reads take the lock). A spec that
    knows where its windows hold their episodes' last rows (``Sampler.draw_with_ends``:
    ``Slices``) has the done flags read only there (``gather(done_at=)``)."""
    store = buf.store
    if stack is not None or spec.stateful:
        return read_batch(store, spec.plan(buf, n, generator, state), n, names, stack=stack)
    with store.lock:
        view = store.view()
        drawn, last = spec.draw_with_ends(view, n, generator, state)
        data = gather(store, drawn[0], names, done_at=last)
        if store.mode == "r":
            data, drawn = rechecked(store, spec.plan(buf, n, generator, state), drawn, data, names, view=view)
        return _batch(data, drawn)


def _batch(data: dict[str, torch.Tensor], drawn: Draw) -> Batch:
    rows, weights, mask, written = drawn
    mask_t = None
    if mask is not None:
        mask_t = torch.from_numpy(mask)
        if not mask.all():
            for value in data.values():
                value[~mask_t] = 0
    return Batch(data, torch.from_numpy(rows), torch.from_numpy(weights), mask_t, written.copy())


class SampledBatches:
    """The lane cursors of the last ``keep`` batches, by their ``indices`` tensor: what
    ``update_priorities(batch.indices, p)`` needs to skip rows overwritten since."""

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._by_id: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray]] = {}

    def remember(self, indices: torch.Tensor, written: np.ndarray | None) -> None:
        if written is None:  # not a sampled batch: nothing to check against later
            return
        if len(self._by_id) >= self.keep:
            self._by_id = {k: v for k, v in self._by_id.items() if v[0]() is not None}
            while len(self._by_id) >= self.keep:
                self._by_id.pop(next(iter(self._by_id)))
        self._by_id[id(indices)] = (weakref.ref(indices), written)

    def written_at(self, indices: torch.Tensor) -> np.ndarray | None:
        """The cursors ``indices`` was drawn against, if it is a remembered batch's tensor."""
        entry = self._by_id.get(id(indices))
        return entry[1] if entry is not None and entry[0]() is indices else None
