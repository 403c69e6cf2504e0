"""``Buffer``: the user-facing store (docs/api.md): write, inspect, sample, reprioritize.

``Buffer`` is a ``Store`` (files, cursors, commit protocol) plus the read side:
it asks a sampler spec (``mmbuffer.samplers``) for indices, gathers them
(``gather.py``) and, in a reader, re-checks them against the writer (``read_batch``).

>>> import tempfile, numpy as np, mmbuffer as mb
>>> path = tempfile.mkdtemp() + "/replay"
>>> buf = mb.create(path, {"obs": ((3,), "float32"), "action": ((), "int64"),
...                        "reward": ((), "float32")}, capacity=1000)
>>> T = 50
>>> steps = {"obs": np.random.rand(T, 3), "action": np.arange(T), "reward": np.ones(T),
...          "terminated": np.arange(T) % 10 == 9}
>>> buf.extend(steps, final_obs={"obs": np.zeros((5, 3))})
>>> buf.commit()
1
>>> len(buf), buf.num_episodes
(50, 5)
>>> b = buf.sample_slices(4, 8, generator=torch.Generator().manual_seed(0))
>>> tuple(b.data["obs"].shape), tuple(b.indices.shape)
((4, 8, 3), (4, 8))
>>> buf.close()
>>> mb.open(path, mode="r").num_episodes
5
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from . import errors, samplers
from ._checks import check_int
from .gather import Batch, gather, resolve_keys
from .layout import Layout
from .samplers import Draw, Sampler
from .store import PriorityConfig, Store, create_store, locked

_REMEMBERED_BATCHES = 256
_MAX_REREADS = 64


def _spec(sampler: object, slice_len: int | None, *, prioritized: bool = False, beta: float = 0.4) -> Sampler:
    """``sampler``, or the spec the flags stand for; both at once is refused."""
    if sampler is None:
        return samplers.from_flags(slice_len, prioritized=prioritized, beta=beta)
    if not isinstance(sampler, Sampler):
        raise errors.InvalidArgumentError(f"sampler: expected an mb.samplers spec (Uniform(), Slices(16), ...), got {sampler!r}")
    if prioritized or beta != 0.4:
        raise errors.InvalidArgumentError(
            f"sampler: expected either sampler= or prioritized=/beta=, got both (sampler={sampler!r}, prioritized={prioritized})"
        )
    return sampler


class Buffer(Store):
    """An on-disk, memory-mapped trajectory store (use ``mb.create`` / ``mb.open``)."""

    def __init__(self, path: str | os.PathLike[str], mode: str = "a") -> None:
        super().__init__(path, mode)
        self._sampled: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray]] = {}

    def __repr__(self) -> str:
        return (
            f"Buffer({str(self.path)!r}, mode={self.mode!r}, rows={len(self)}, "
            f"episodes={self.num_episodes}, capacity={self.capacity}, streams={self.num_streams})"
        )

    # -- reading -----------------------------------------------------------------------
    @locked
    def episodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts, lengths)`` of live complete episodes as int64 tensors.

        An episode's rows are ``start + arange(length)``, wrapping inside its lane
        (``lane_size = capacity // num_streams``) when the ring wraps.
        """
        starts, lengths = self.episode_bounds()
        return torch.from_numpy(starts), torch.from_numpy(lengths)

    def episode(self, i: int, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The ``i``-th live episode (``episodes()`` order: lane by lane, oldest first)
        as ``{key: tensor [length, ...]}``, steps in order, wrap undone (``episodes.py``)."""
        from .episodes import episode

        return episode(self, i, keys)

    def iter_episodes(self, keys: Iterable[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Every live episode as of the call, in ``episode(i)`` order (``episodes.py``)."""
        from .episodes import iter_episodes

        return iter_episodes(self, keys)

    @locked
    def get(self, index: Any, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows at global ids ``index`` (any integer shape) as ``{key: tensor}``.

        ``keys`` may name stored columns and ``next_<col>`` for next-derived ones.
        The ``next_<col>`` of an open episode's last row is not known until the
        next ``extend`` (it reads whatever the following ring row holds); the
        samplers never return that row.
        """
        idx = torch.as_tensor(index).numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if idx.dtype.kind not in "iu":
            raise errors.InvalidArgumentError(f"index: expected integer row ids, got dtype {idx.dtype}")
        return gather(self, idx, keys)

    # -- sampling ----------------------------------------------------------------------
    @locked
    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        prioritized: bool = False,
        beta: float = 0.4,
        keys: Iterable[str] | None = None,
        sampler: Sampler | None = None,
    ) -> Batch:
        """``batch_size`` items drawn by ``sampler`` (default: uniform transitions).

        ``sampler`` is any spec of :mod:`mmbuffer.samplers` (``Slices(16)`` gives
        ``[B, 16]`` windows); ``prioritized=True, beta=...`` is the shorthand for
        ``sampler=samplers.Prioritized(beta)``. Uniform: every sampleable row
        (complete episodes, and the open episodes up to their last row with a
        known next observation) equally likely. Prioritized: probability
        ``p_i / sum p`` with importance weights ``(N P(i))^-beta`` normalized by
        their maximum over live rows.
        """
        spec = _spec(sampler, None, prioritized=prioritized, beta=beta)
        return self._draw(spec, check_int("batch_size", batch_size, 1), generator, keys)

    @locked
    def sample_slices(
        self,
        num_slices: int,
        slice_len: int,
        strict: bool = True,
        generator: torch.Generator | None = None,
        *,
        prioritized: bool = False,
        beta: float = 0.4,
        weighting: str = "windows",
        keys: Iterable[str] | None = None,
    ) -> Batch:
        """``[num_slices, slice_len]`` windows of consecutive rows of one episode:
        ``sample(num_slices, sampler=samplers.Slices(slice_len, strict, weighting))``,
        or ``samplers.PrioritizedSlices(slice_len, beta, strict)`` when prioritized.

        ``strict=True``: every valid window (inside one live episode) is equally
        likely: an episode of ``n >= L`` rows offers ``n - L + 1`` starts, shorter
        ones none. ``strict=False``: every row may start a window; the window is
        cut at its episode's end and padded to ``L`` (padding repeats the index
        of the last real row, its data is zero and ``mask`` is False there).
        ``weighting="episodes"`` draws the episode uniformly first, then a start
        inside it (TorchRL's SliceSampler convention). ``prioritized=True``: a
        window's probability is proportional to the priority of its start row
        among valid starts (invalid starts have probability exactly 0).
        """
        spec = samplers.from_flags(slice_len, prioritized=prioritized, beta=beta, strict=strict, weighting=weighting)
        return self._draw(spec, check_int("num_slices", num_slices, 1), generator, keys)

    @locked
    def indices(self, sampler: Sampler, n: int, generator: torch.Generator | None = None) -> samplers.Draw:
        """The index half of sampling with any spec: ``(rows, weights, mask or None,
        lane cursors)`` as numpy arrays, with no column read."""
        n = check_int("n", n, 1)
        _spec(sampler, None).check(self)
        return sampler.indices(self.view(), n, generator, self._sampler_cache)

    def sample_indices(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        prioritized: bool = False,
        beta: float = 0.4,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The index half of ``sample``: ``(rows [B], weights [B], lane cursors)``."""
        spec = samplers.from_flags(None, prioritized=prioritized, beta=beta)
        rows, weights, _, written = self.indices(spec, check_int("batch_size", batch_size, 1), generator)
        return rows, weights, written

    def slice_indices(
        self,
        num_slices: int,
        slice_len: int,
        strict: bool = True,
        generator: torch.Generator | None = None,
        *,
        prioritized: bool = False,
        beta: float = 0.4,
        weighting: str = "windows",
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The index half of ``sample_slices``: ``(rows [B, L], weights [B], mask [B, L],
        lane cursors)``."""
        spec = samplers.from_flags(slice_len, prioritized=prioritized, beta=beta, strict=strict, weighting=weighting)
        rows, weights, mask, written = self.indices(spec, check_int("num_slices", num_slices, 1), generator)
        assert mask is not None  # slices always have a mask
        return rows, weights, mask, written

    def _draw(self, spec: Sampler, n: int, generator: torch.Generator | None, keys: Iterable[str] | None) -> Batch:
        names = resolve_keys(self, keys)
        spec.check(self)

        def draw(positions: np.ndarray) -> Draw:
            return spec.indices(self.view(), len(positions), generator, self._sampler_cache)

        return self.read_batch(draw, n, names)

    @locked
    def update_priorities(self, indices: Any, priorities: Any) -> None:  # type: ignore[override]
        """Set the priorities of sampled rows (before ``eps`` and ``alpha``).

        ``indices`` is a batch's ``indices`` (or the ``Batch``); ``priorities``
        has its shape or a leading part of it (one value per slice, say). Rows
        overwritten or evicted since the batch was sampled are ignored;
        duplicates resolve to the last value. NaN, inf or negative values raise
        ``InvalidPriorityError`` and change nothing.
        """
        written_at = None
        if isinstance(indices, Batch):
            written_at, indices = indices.written_at, indices.indices
        elif isinstance(indices, torch.Tensor):
            entry = self._sampled.get(id(indices))
            if entry is not None and entry[0]() is indices:
                written_at = entry[1]
        idx = torch.as_tensor(indices).cpu().numpy()
        pri = torch.as_tensor(priorities).detach().cpu().numpy() if not isinstance(priorities, np.ndarray) else priorities
        pri = np.asarray(pri)
        if pri.ndim < idx.ndim and idx.shape[: pri.ndim] == pri.shape:
            pri = pri.reshape(pri.shape + (1,) * (idx.ndim - pri.ndim))
        try:
            pri = np.broadcast_to(pri, idx.shape)
        except ValueError:
            raise errors.InvalidPriorityError(
                f"priorities: expected shape {tuple(idx.shape)} (or a leading part of it), got {tuple(pri.shape)}"
            ) from None
        super().update_priorities(idx, pri, written_at)

    # -- helpers -----------------------------------------------------------------------
    @locked
    def read_batch(self, draw: Callable[[np.ndarray], Draw], size: int, names: list[str]) -> Batch:
        """Gather the rows that ``draw`` picks for batch positions ``arange(size)``.

        ``draw(positions)`` returns ``(rows, weights, mask or None, lane cursors)``
        for those positions, from the store's current ``view()`` (a sampler, or a
        rank lookup). In a reader (``mode="r"``) a writer in another process may
        overwrite rows while they are copied, so after the copy every item is
        checked against the writer's reservation as it stands *then*
        (:func:`overwritten`); the items that fail are drawn again from a fresh
        view and copied again, until none fails. What a reader returns was
        therefore never being rewritten while it was read. The writer needs no
        check: its writes take the same lock.
        """
        rows, weights, mask, written = draw(np.arange(size))
        data = gather(self, rows, names)
        if self.mode == "r":
            cursors = written[self.layout.lane(_first_rows(rows, size))]
            for _ in range(_MAX_REREADS):
                bad = np.flatnonzero(overwritten(self.layout, rows, cursors, self.reservation()))
                if bad.size == 0:
                    break
                r, w, m, wr = draw(bad)
                fresh = gather(self, r, names)
                rows[bad], weights[bad], cursors[bad] = r, w, wr[self.layout.lane(_first_rows(r, bad.size))]
                if mask is not None and m is not None:
                    mask[bad] = m
                for name, value in data.items():
                    value[torch.from_numpy(bad)] = fresh[name]
            else:
                raise errors.EmptyBufferError(
                    f"sample: expected rows that stay put while they are read, got rows overwritten by the writer "
                    f"in {_MAX_REREADS} draws in a row (the writer laps this lane faster than a batch is read)"
                )
        mask_t = None
        if mask is not None:
            mask_t = torch.from_numpy(mask)
            if not mask.all():
                for value in data.values():
                    value[~mask_t] = 0
        indices = torch.from_numpy(rows)
        batch = Batch(data, indices, torch.from_numpy(weights), mask_t, written.copy())
        if self._tree is not None:
            self._remember(indices, batch.written_at)
        return batch

    def _remember(self, indices: torch.Tensor, written: np.ndarray | None) -> None:
        if len(self._sampled) >= _REMEMBERED_BATCHES:
            self._sampled = {k: v for k, v in self._sampled.items() if v[0]() is not None}
            while len(self._sampled) >= _REMEMBERED_BATCHES:
                self._sampled.pop(next(iter(self._sampled)))
        assert written is not None
        self._sampled[id(indices)] = (weakref.ref(indices), written)


def _first_rows(rows: np.ndarray, items: int) -> np.ndarray:
    """The first row of each of ``items`` items (``rows`` is ``[B]`` or ``[B, L]``)."""
    first: np.ndarray = rows.reshape(items, -1)[:, 0]
    return first


def overwritten(layout: Layout, rows: np.ndarray, cursors: np.ndarray, reserved: np.ndarray) -> np.ndarray:
    """Which items (first axis of ``rows``) the writer may have begun rewriting.

    ``cursors[i]`` is the ``written`` counter of item ``i``'s lane in the view it
    was drawn from, which fixes the absolute row its first row held. Absolute row
    ``a`` is rewritten when the writer writes ``a + lane_size``, and the writer
    raises ``reserved`` past a row before it writes it: ``a >= reserved -
    lane_size`` holds exactly while ``a`` is intact. An item's later rows (the
    window, the next row read for ``next_*``) are younger than its first.

    >>> overwritten(Layout(8), np.array([[2, 3], [6, 7]]), np.array([8, 8]), np.array([11]))
    array([ True, False])
    """
    first = _first_rows(rows, len(cursors))
    bad: np.ndarray = layout.absolute_at(first, cursors) < reserved[layout.lane(first)] - layout.lane_size
    return bad


def create(
    path: str | os.PathLike[str],
    columns: Mapping[str, tuple[Any, Any]],
    capacity: int,
    num_streams: int = 1,
    compression: str | None = None,
    priorities: PriorityConfig | None = None,
    next_keys: Iterable[str] = ("obs",),
    attrs: Mapping[str, Any] | None = None,
) -> Buffer:
    """Create an empty store at ``path`` (which must not exist) and open it for writing.

    Parameters
    ----------
    columns:
        name -> ``(shape, dtype)``; ``()`` for scalars. ``terminated`` and
        ``truncated`` (bool) always exist and must not be listed.
    capacity:
        Rows over all streams; each of the ``num_streams`` lanes is a ring of
        ``capacity // num_streams`` rows.
    compression:
        None (raw, memory-mapped: for training) or ``"zstd"`` / ``"lz4"`` (archives).
    priorities:
        ``mb.PriorityConfig(...)`` to keep a persisted priority tree.
    next_keys:
        Columns whose next value is derived (``next_obs``), never stored twice.
        Missing names are ignored only when ``next_keys`` is left at its default.
    attrs:
        JSON-serializable metadata kept in the manifest (``buf.attrs``).
    """
    if tuple(next_keys) == ("obs",) and isinstance(columns, Mapping) and "obs" not in columns:
        next_keys = ()
    create_store(
        path,
        columns,
        capacity,
        num_streams=num_streams,
        compression=compression,
        priorities=priorities,
        next_keys=next_keys,
        attrs=attrs,
    )
    return Buffer(path, "a")


def open(path: str | os.PathLike[str], mode: str = "a") -> Buffer:  # noqa: A001 - API name
    """Open an existing store: ``mode="a"`` the single writer, ``mode="r"`` a reader."""
    return Buffer(path, mode)
