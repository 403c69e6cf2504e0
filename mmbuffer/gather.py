"""Read rows for given indices: one vectorized read per column, out as torch tensors.

``next_<col>`` of a row is ``<col>`` of the following row of its lane, except at
an episode's last row, where it is the stored final observation (``final/<col>``).

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/s", {"obs": ((2,), "float32")}, capacity=8)
>>> buf.extend({"obs": np.arange(6, dtype="float32").reshape(3, 2),
...             "terminated": [False, False, True]}, final_obs={"obs": [[9.0, 9.0]]})
>>> out = gather(buf, np.array([1, 2]), keys=["obs", "next_obs"])
>>> out["next_obs"].tolist()
[[4.0, 5.0], [9.0, 9.0]]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import errors
from .store import Store


@dataclass(slots=True)
class Batch:
    """One sampled batch (docs/api.md).

    data:    column -> tensor ``[B, ...]`` (transitions) or ``[B, L, ...]`` (slices)
    indices: int64 global row ids, ``[B]`` or ``[B, L]``
    weights: float32 importance weights ``[B]`` (ones when not prioritized)
    mask:    bool ``[B, L]``, False on padded positions (all True otherwise; None for transitions)
    """

    data: dict[str, torch.Tensor]
    indices: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor | None = None
    written_at: np.ndarray | None = field(default=None, repr=False)  # lane cursors when sampled

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.data[key]

    def to(self, device: Any, non_blocking: bool = False) -> Batch:
        """The same batch with every tensor moved to ``device``."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return Batch(
            {k: move(v) for k, v in self.data.items()},
            move(self.indices),
            move(self.weights),
            None if self.mask is None else move(self.mask),
            self.written_at,
        )

    def pin_memory(self) -> Batch:
        """The same batch in page-locked memory (for asynchronous copies to a GPU)."""
        return Batch(
            {k: v.pin_memory() for k, v in self.data.items()},
            self.indices.pin_memory(),
            self.weights.pin_memory(),
            None if self.mask is None else self.mask.pin_memory(),
            self.written_at,
        )


def resolve_keys(store: Store, keys: Iterable[str] | None) -> list[str]:
    """Validate ``keys`` (default: every column and every ``next_<col>``)."""
    allowed = [*store.columns, *(f"next_{k}" for k in store.next_keys)]
    if keys is None:
        return allowed
    if isinstance(keys, str):
        keys = [keys]
    keys = list(keys)
    unknown = [k for k in keys if k not in allowed]
    if unknown:
        raise errors.InvalidArgumentError(f"keys: expected names among {allowed}, got unknown {unknown}")
    return keys


def gather(
    store: Store,
    rows: np.ndarray,
    keys: Iterable[str] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Rows of ``store`` at global ids ``rows`` (any shape) as a dict of tensors.

    ``out`` may hold caller-owned CPU tensors (pinned, say) of the result shapes;
    they are filled in place and returned.
    """
    names = resolve_keys(store, keys)
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= store.capacity):
        raise errors.InvalidArgumentError(
            f"index: expected row ids in [0, {store.capacity}), got values from {rows.min()} to {rows.max()}"
        )
    # reading a memory map in row order turns random page faults into near-sequential
    # ones; slices are sorted within, so ordering by their first row is enough
    lead = rows.reshape(rows.shape[0], -1)[:, 0] if rows.ndim > 1 else rows.reshape(-1)
    order = np.argsort(lead)
    sorted_rows = (rows[order] if rows.ndim else rows).reshape(-1)
    result: dict[str, torch.Tensor] = {}
    cache: dict[str, np.ndarray] = {}

    def read(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = store.read(name, sorted_rows)
        return cache[name]

    for name in names:
        if name.startswith("next_"):
            base = name[5:]
            values = store.read(base, store.layout.following(sorted_rows))
            last = read("terminated") | read("truncated")
            if last.any():
                values[last] = store.read(f"final/{base}", sorted_rows[last])
        else:
            values = read(name)
        shaped = values.reshape(rows.shape + values.shape[1:])
        if rows.ndim:
            unsorted = np.empty_like(shaped)
            unsorted[order] = shaped
            shaped = unsorted
        if out is not None and name in out:
            target = out[name]
            target.copy_(torch.from_numpy(shaped))
            result[name] = target
        else:
            result[name] = torch.from_numpy(np.ascontiguousarray(shaped))
    return result
