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
Each stream's last row is held back until the next batch tells whether its
episode goes on (its ``("next", obs)`` is then the final observation of a
truncation); ``commit`` writes held rows as truncated, so every commit ends with
no open episode and a reopened store never glues a new episode onto an old one.

Sampling. ``sample(batch_size)`` (default: the preset ``batch_size``) returns a
TensorDict of ``batch_size`` transitions with ``"index"`` (global row ids for
``update_priority``) and, with a prioritized sampler, the importance weights under
``"priority_weight"``, the key TorchRL's prioritized samplers and losses use. With
``samplers.Slices(L)`` or ``PrioritizedSlices(L)`` ``batch_size`` counts rows, as in
TorchRL's ``SliceSampler``: ``batch_size // L`` windows returned flat ``[B * L]``
(``"index"`` then ``[B * L, 1]`` as there; ``flatten_slices=False``: ``[B, L]``), with ``("next", "truncated")`` and
``("next", "done")`` set at each window's last step as ``SliceSampler`` sets them,
and ``("collector", "mask")`` when ``strict=False`` (padded windows).

Checkpoints. The store is the checkpoint: ``state_dict()`` commits and returns
the store path, generation, batch size and generator state (no data);
``load_state_dict`` reopens that store (refused if it is older than the state);
``dumps(path)`` commits and copies the store to ``path`` (nothing more when
``path`` is the store); ``loads(path)`` makes the store at ``path`` this buffer's.

>>> import pytest; td_mod = pytest.importorskip("tensordict")
>>> import tempfile, torch
>>> T = 10
>>> obs = torch.arange(T + 1, dtype=torch.float32)[:, None].expand(T + 1, 3)
>>> td = td_mod.TensorDict({"observation": obs[:-1], "action": torch.zeros(T, 1),
...     "next": {"observation": obs[1:], "reward": torch.ones(T, 1),
...              "done": (torch.arange(T) == 4)[:, None], "terminated": (torch.arange(T) == 4)[:, None]}}, [T])
>>> rb = ReplayBuffer(tempfile.mkdtemp() + "/rb", capacity=100, batch_size=4)
>>> index = rb.extend(td)
>>> len(rb), index[-1].item()   # the last row is held until the next batch
(10, -1)
>>> s = rb.sample()
>>> bool((s["next", "observation"] == s["observation"] + 1).all()), tuple(s["next", "done"].shape)
(True, (4, 1))
>>> rb.close()
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import errors, samplers
from .buffer import Buffer
from .buffer import create as create_buffer
from .buffer import open as open_buffer
from .gather import Batch
from .schema import PriorityConfig

__all__ = ["ReplayBuffer", "WEIGHT_KEY"]

WEIGHT_KEY = "priority_weight"  # TorchRL's PrioritizedSampler info key, read by its losses
_FLAGS = ("done", "terminated", "truncated")
_ATTR = "torchrl_layout"
_REMEMBERED = 256

Key = tuple[str, ...]


@dataclass(slots=True)
class _Layout:
    """Which TensorDict key each column holds (``derived``: next-derived columns,
    whose ``("next", *key)`` is rebuilt), and the flags to give back."""

    columns: dict[str, Key]
    derived: tuple[str, ...]
    next_flags: tuple[str, ...] = ("done", "terminated", "truncated")
    root_flags: tuple[str, ...] = ("done", "terminated", "truncated")
    flag_shape: tuple[int, ...] = (1,)
    squeezed: tuple[str, ...] = ()  # columns stored without TorchRL's trailing [..., 1]

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": {k: list(v) for k, v in self.columns.items()},
            "derived": list(self.derived),
            "next_flags": list(self.next_flags),
            "root_flags": list(self.root_flags),
            "flag_shape": list(self.flag_shape),
            "squeezed": list(self.squeezed),
        }

    @classmethod
    def from_attrs(cls, buf: Buffer) -> _Layout:
        """The layout saved by this module, or the converter's naming rules for a
        store converted from a TorchRL dump (or any store: columns by path)."""
        saved = buf.attrs.get(_ATTR)
        if isinstance(saved, dict):
            try:
                return cls(
                    {str(k): tuple(map(str, v)) for k, v in saved["columns"].items()},
                    tuple(saved["derived"]),
                    tuple(saved["next_flags"]),
                    tuple(saved["root_flags"]),
                    tuple(int(x) for x in saved["flag_shape"]),
                    tuple(saved.get("squeezed", ())),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise errors.CorruptStoreError(
                    f"attrs[{_ATTR!r}]: expected the layout this module writes, got {saved!r} ({exc})"
                ) from None
        source = buf.attrs.get("torchrl", {})
        paths = set(source.get("keys", [])) if isinstance(source, dict) else set()
        columns: dict[str, Key] = {}
        for name in buf.columns:
            if name in ("terminated", "truncated"):
                continue
            if name == "obs" and ("observation" in paths or "obs" not in paths):
                columns[name] = ("observation",)
            elif name == "reward":
                columns[name] = ("next", "reward")
            else:
                columns[name] = tuple(name.split("/"))
        # the converter stores reward as a scalar; TorchRL's layout has [..., 1]
        squeezed = ("reward",) if "reward" in buf.columns and buf.columns["reward"].shape == () else ()
        return cls(columns, tuple(buf.next_keys), squeezed=squeezed)


@dataclass(slots=True)
class _Held:
    """A stream's last row, held until the next batch says whether its episode goes on."""

    values: dict[str, np.ndarray]  # column (and next-derived "next_<col>", priority) -> [1, ...]
    traj: int | None


@dataclass(slots=True)
class _Piece:
    """Rows ``[start, stop)`` of environment row ``env`` of a batch, for one stream."""

    env: int
    start: int
    stop: int
    stream: int = -1
    continues: bool = False


@dataclass(slots=True)
class _Segment:
    """What one piece writes: ``rows`` (a held row first when ``lead_in`` is 1) with
    their episode ends, and the row held back after them."""

    piece: _Piece
    rows: dict[str, np.ndarray]
    end: np.ndarray
    trunc: np.ndarray
    after: _Held | None
    lead_in: int


class ReplayBuffer:
    """A replay buffer with TorchRL's interface over an on-disk mmbuffer store.

    Parameters
    ----------
    path
        The store directory: reopened when it exists, else created at the first ``extend``.
    capacity
        Rows over all streams (rounded down to a multiple of the stream count);
        needed to create the store.
    batch_size
        The default of ``sample`` (rows, for slice samplers).
    sampler
        An ``mb.samplers`` spec: ``Uniform()`` (default), ``Prioritized(beta)``,
        ``Slices(L)``, ``PrioritizedSlices(L, beta)``.
    num_streams
        Streams of a store created from ``[T]`` batches (default 1; ``[E, T]`` batches give ``E``).
    priorities
        ``mb.PriorityConfig`` of a created store (default ``PriorityConfig()`` with a
        prioritized sampler, none otherwise).
    priority_key
        The key ``update_tensordict_priority`` reads (TorchRL's ``"td_error"``).
    flatten_slices
        Return slices flat ``[B * L]`` like TorchRL (True) or as ``[B, L]``.
    generator
        A ``torch.Generator`` for sampling (the same state gives the same batch).
    compression
        ``None`` (raw, memory-mapped) or ``"zstd"`` / ``"lz4"`` for a created store.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int | None = None,
        batch_size: int | None = None,
        sampler: samplers.Sampler | None = None,
        num_streams: int | None = None,
        priorities: PriorityConfig | None = None,
        priority_key: str | Key = "td_error",
        flatten_slices: bool = True,
        generator: torch.Generator | None = None,
        compression: str | None = None,
    ) -> None:
        _tensordict()  # the extra must be installed
        self.path = Path(path)
        self._sampler = sampler if sampler is not None else samplers.Uniform()
        if not isinstance(self._sampler, samplers.Sampler):
            raise errors.InvalidArgumentError(f"sampler: expected an mb.samplers spec, got {sampler!r}")
        self._batch_size = _positive("batch_size", batch_size)
        self._capacity = _positive("capacity", capacity)
        self._num_streams = _positive("num_streams", num_streams)
        prioritized = isinstance(self._sampler, (samplers.Prioritized, samplers.PrioritizedSlices))
        self._priorities = priorities if priorities is not None else (PriorityConfig() if prioritized else None)
        self.priority_key: Key = (priority_key,) if isinstance(priority_key, str) else tuple(priority_key)
        self.flatten_slices = bool(flatten_slices)
        self.generator = generator
        self._compression = compression
        self._buf: Buffer | None = None
        self._layout: _Layout | None = None
        self._held: dict[int, _Held] = {}
        self._uncommitted: np.ndarray = np.zeros(0, dtype=np.int64)
        self._dangling: set[int] = set()
        self._sampled: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray | None]] = {}
        if self.path.exists():
            self._attach(open_buffer(self.path))

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer({str(self.path)!r}, rows={len(self)}, batch_size={self._batch_size}, "
            f"sampler={self._sampler!r})"
        )

    # -- the store -----------------------------------------------------------------------
    @property
    def buffer(self) -> Buffer:
        """The underlying ``mb.Buffer`` (it exists from the first ``extend``, or at once
        for a store that existed)."""
        if self._buf is None:
            raise errors.EmptyBufferError(f"buffer: expected a store at {self.path}, got none yet (it is created by the first extend)")
        return self._buf

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def sampler(self) -> samplers.Sampler:
        return self._sampler

    def set_sampler(self, sampler: samplers.Sampler) -> None:
        """Sample with ``sampler`` from now on (TorchRL's name for it)."""
        if not isinstance(sampler, samplers.Sampler):
            raise errors.InvalidArgumentError(f"sampler: expected an mb.samplers spec, got {sampler!r}")
        prioritized = isinstance(sampler, (samplers.Prioritized, samplers.PrioritizedSlices))
        if prioritized and self._buf is not None and self._buf.priorities is None:
            raise errors.InvalidArgumentError(f"sampler: {sampler!r} needs priorities; the store at {self.path} has none")
        self._sampler = sampler

    def __len__(self) -> int:
        """Rows extended that the store still holds (live episodes, open ones whole)
        plus the rows held back (one per stream at most)."""
        if self._buf is None:
            return 0
        view = self._buf.view()
        return int(sum(int(view.written[s]) - lv.first_start for s, lv in enumerate(view.lanes))) + len(self._held)

    def _attach(self, buf: Buffer) -> None:
        try:
            if self._capacity is not None and buf.capacity != self._capacity // buf.num_streams * buf.num_streams:
                raise errors.SchemaError(
                    f"capacity: expected the store's {buf.capacity} at {buf.path}, got {self._capacity}"
                )
            if isinstance(self._sampler, (samplers.Prioritized, samplers.PrioritizedSlices)) and buf.priorities is None:
                raise errors.InvalidArgumentError(
                    f"sampler: {self._sampler!r} needs priorities; the store at {buf.path} has none"
                )
            layout = _Layout.from_attrs(buf)
        except BaseException:
            buf.close()
            raise
        self._buf, self._layout = buf, layout
        self._uncommitted = np.zeros(buf.num_streams, dtype=np.int64)
        view = buf.view()
        # streams whose last episode is open (written by other code): nothing can close it
        self._dangling = {s for s, lv in enumerate(view.lanes) if int(view.written[s]) > lv.open_start}

    # -- writing -------------------------------------------------------------------------
    def add(self, data: Any) -> int:
        """One step (a TensorDict with no batch dims): ``extend(data.unsqueeze(0))``."""
        return int(self.extend(data.unsqueeze(0))[0])

    def extend(self, data: Any) -> torch.Tensor:
        """Append a collector's TensorDict (``[T]`` or ``[E, T]``) and return the global
        row of each of its rows (shape ``data.batch_size``; -1 for rows held back).

        Raises ``SchemaError`` (keys, shapes, dtypes differ from the store's),
        ``InvalidArgumentError`` or ``CapacityError`` (a stream given more rows than
        its lane holds) before anything is written.
        """
        td = _as_tensordict(data)
        if td.batch_dims == 0:
            raise errors.InvalidArgumentError("data: expected a TensorDict with batch dims [T] or [E, T], got [] (use add)")
        if td.numel() == 0:
            return torch.full(tuple(td.batch_size), -1, dtype=torch.int64)
        if ("collector", "mask") in td.keys(include_nested=True):
            raise errors.InvalidArgumentError(
                "data: expected a collector batch with split_trajs=False, got padded trajectories (('collector', 'mask'))"
            )
        if self._buf is None:
            layout, columns = _infer(td, self.priority_key)
            rows_per_env = td.batch_size[-1] if td.batch_dims > 1 else 0
            streams = self._num_streams or (int(np.prod(td.batch_size[:-1])) if rows_per_env else 1)
            self._create(layout, columns, streams)
        assert self._buf is not None and self._layout is not None
        values, ends, truncated, traj = self._arrays(td)
        segments = self._segments(self._plan(ends, traj), values, ends, truncated, traj)
        lane = self._buf.capacity // self._buf.num_streams
        added = np.zeros_like(self._uncommitted)
        np.add.at(added, [s.piece.stream for s in segments], [len(s.end) for s in segments])
        if (self._uncommitted + added > lane).any():
            # commit first (held rows end as truncated), before the store would commit on
            # its own with an episode open; then plan again without held rows
            self.commit()
            segments = self._segments(self._plan(ends, traj), values, ends, truncated, traj)
        return self._write(segments, tuple(td.batch_size), ends.shape)

    def _create(self, layout: _Layout, columns: dict[str, tuple[tuple[int, ...], str]], streams: int) -> None:
        if self._capacity is None:
            raise errors.InvalidArgumentError(f"capacity: expected the row capacity of the new store at {self.path}, got None")
        capacity = self._capacity // streams * streams
        if capacity == 0:
            raise errors.InvalidArgumentError(f"capacity: expected at least num_streams={streams} rows, got {self._capacity}")
        buf = create_buffer(
            self.path,
            columns,
            capacity,
            num_streams=streams,
            compression=self._compression,
            priorities=self._priorities,
            next_keys=layout.derived,
            attrs={_ATTR: layout.to_json()},
        )
        self._attach(buf)

    def _arrays(self, td: Any) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray | None]:
        """Columns (and ``next_<col>``, priorities) as ``[E, T, ...]`` arrays, episode
        ends and truncations ``[E, T]``, trajectory ids ``[E, T]`` or None."""
        assert self._buf is not None and self._layout is not None
        layout, lead = self._layout, tuple(td.batch_size)
        shape = (int(np.prod(lead[:-1])), lead[-1])
        found = {_key(k) for k in td.keys(include_nested=True, leaves_only=True)}
        wanted = {*layout.columns.values(), *(("next", *layout.columns[c]) for c in layout.derived)}
        flags = {("next", f) for f in layout.next_flags} | {(f,) for f in layout.root_flags}
        ignored = {("index",), (WEIGHT_KEY,), self.priority_key}
        if found - ignored != wanted | flags:
            raise errors.SchemaError(
                f"data: expected the keys of the store at {self.path}, {sorted(wanted | flags)}, got {sorted(found - ignored)} "
                f"(missing {sorted((wanted | flags) - found)}, unknown {sorted(found - ignored - wanted - flags)})"
            )

        def get(key: Key) -> np.ndarray:
            value = td.get(key)
            if not isinstance(value, torch.Tensor):
                raise errors.SchemaError(f"data[{key}]: expected a tensor, got {type(value).__name__}")
            out: np.ndarray = value.detach().cpu().reshape(shape + tuple(value.shape[len(lead):])).numpy()
            return out

        values = {name: get(key) for name, key in layout.columns.items()}
        for name in layout.squeezed:
            if values[name].shape[2:] == (1,):
                values[name] = values[name][..., 0]
        for name in layout.derived:
            values[f"next_{name}"] = get(("next", *layout.columns[name]))
        for name, value in values.items():
            col = self._buf.columns[name.removeprefix("next_") if name.startswith("next_") and name not in self._buf.columns else name]
            if value.shape[2:] != col.shape or value.dtype != np.dtype(col.dtype):
                key = layout.columns[name] if name in layout.columns else ("next", *layout.columns[name[5:]])
                raise errors.SchemaError(
                    f"data[{key}] (column {name!r}): expected rows of shape {col.shape} and dtype {col.dtype}, "
                    f"got shape {value.shape[2:]} and dtype {value.dtype}"
                )
        for f in layout.root_flags:
            if get((f,)).any():
                raise errors.InvalidArgumentError(f"data[{f!r}]: expected False (a step never starts from an ended state), got True")
        flag = {f: get(("next", f)).reshape(shape) for f in layout.next_flags}
        term = flag.get("terminated", flag.get("done"))
        trunc = flag.get("truncated")
        term = np.zeros(shape, bool) if term is None else term.astype(bool)
        trunc = np.zeros(shape, bool) if trunc is None else trunc.astype(bool)
        if "done" in flag:
            trunc = trunc | (flag["done"].astype(bool) & ~term)
        if self.priority_key in found and self._buf.priorities is not None:
            values["__priority__"] = get(self.priority_key).reshape(shape + (-1,)).max(-1)
        traj = values.get(_name_of(layout, ("collector", "traj_ids")) or "")
        return values, term | trunc, trunc, None if traj is None else traj.reshape(shape)

    def _plan(self, ends: np.ndarray, traj: np.ndarray | None) -> list[_Piece]:
        """Cut the batch into pieces, one stream each (see the module docstring)."""
        assert self._buf is not None
        n_env, t = ends.shape
        streams = self._buf.num_streams
        if traj is None:
            if n_env not in (1, streams):
                raise errors.SchemaError(
                    f"data: expected [{streams}, T] batches (the store's streams) or ('collector', 'traj_ids'), got [{n_env}, {t}]"
                )
            return [_Piece(e, 0, t, e) for e in range(n_env)]
        pieces: list[_Piece] = []
        for e in range(n_env):
            cuts = np.flatnonzero((traj[e, 1:] != traj[e, :-1]) & ~ends[e, :-1]) + 1
            bounds = [0, *cuts.tolist(), t]
            pieces += [_Piece(e, a, b, e if n_env == streams > 1 else -1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        if n_env == streams > 1:  # environment e is stream e; a cut ends an episode as truncated
            return pieces
        # a piece continues the stream whose held row has its first trajectory id, else
        # takes a stream with nothing held, else the one whose held row waited longest
        order = {s: i for i, s in enumerate(self._held)}
        free = [s for s in range(streams) if s not in self._held]
        owner = {h.traj: s for s, h in self._held.items() if h.traj is not None}
        taken: set[int] = set()
        for p in pieces:
            first = int(traj[p.env, p.start])
            s = owner.get(first)
            if s is not None and s not in taken:
                p.stream, p.continues = s, True
            elif free:
                p.stream = free.pop(0)
            else:
                p.stream = min((s for s in range(streams)), key=lambda s: (s in taken, order.get(s, -1)))
            taken.add(p.stream)
            owner = {k: v for k, v in owner.items() if v != p.stream}
            if p.stop == t and not ends[p.env, t - 1]:
                owner[int(traj[p.env, t - 1])] = p.stream
        return pieces

    def _segments(
        self,
        pieces: list[_Piece],
        values: dict[str, np.ndarray],
        ends: np.ndarray,
        truncated: np.ndarray,
        traj: np.ndarray | None,
    ) -> list[_Segment]:
        """Per piece, in order: the rows to write to its stream (a held row first),
        their flags, and what to hold back after; checked before anything is written."""
        assert self._buf is not None
        lane = self._buf.capacity // self._buf.num_streams
        out = []
        held = dict(self._held)
        totals: dict[int, int] = {}
        for p in pieces:
            rows = {k: v[p.env, p.start : p.stop] for k, v in values.items()}
            end = ends[p.env, p.start : p.stop]
            trunc = truncated[p.env, p.start : p.stop]
            before = held.pop(p.stream, None)
            if before is not None:
                goes_on = p.continues or traj is None or before.traj == int(traj[p.env, p.start])
                rows = {k: np.concatenate([before.values[k], v]) for k, v in rows.items()}
                end = np.concatenate([[not goes_on], end])
                trunc = np.concatenate([[not goes_on], trunc])
            after = None
            if not end[-1]:
                after = _Held({k: v[-1:].copy() for k, v in rows.items()}, None if traj is None else int(traj[p.env, p.stop - 1]))
                rows = {k: v[:-1] for k, v in rows.items()}
                end, trunc = end[:-1], trunc[:-1]
                held[p.stream] = after
            totals[p.stream] = totals.get(p.stream, 0) + len(end)
            if totals[p.stream] > lane:
                raise errors.CapacityError(
                    f"data: expected at most a lane of {lane} rows per stream per extend, got {totals[p.stream]} for "
                    f"stream {p.stream} (capacity {self._buf.capacity} over {self._buf.num_streams} streams)"
                )
            if len(end) and p.stream in self._dangling:
                raise errors.SchemaError(
                    f"data: stream {p.stream} of the store at {self.path} ends in an open episode written by other code; "
                    "expected none (its next observation is unknown, so no new episode can follow it)"
                )
            out.append(_Segment(p, rows, end, trunc, after, 0 if before is None else 1))
        return out

    def _write(self, segments: list[_Segment], lead: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Write planned segments; return the global row of each batch row (-1: held)."""
        assert self._buf is not None and self._layout is not None
        buf, layout = self._buf, self._layout
        index = np.full(shape, -1, dtype=np.int64)
        cursor = buf.view().written.copy()  # rows written per stream, advanced here
        for seg in segments:
            p, stream, n = seg.piece, seg.piece.stream, len(seg.end)
            if n:
                start = int(cursor[stream])
                cursor[stream] += n
                steps = {c: seg.rows[c] for c in layout.columns}
                steps["terminated"], steps["truncated"] = seg.end & ~seg.trunc, seg.trunc
                final = {c: seg.rows[f"next_{c}"][seg.end] for c in layout.derived} if layout.derived else None
                buf.extend(steps, stream=stream, final_obs=final)
                self._uncommitted[stream] += n
                written = buf.layout.rows(stream, start + np.arange(n))
                if "__priority__" in seg.rows:
                    buf.update_priorities(written, seg.rows["__priority__"])
                mine = written[seg.lead_in :]
                index[p.env, p.start : p.start + len(mine)] = mine
            self._held.pop(stream, None)
            if seg.after is not None:
                self._held[stream] = seg.after
        return torch.from_numpy(index.reshape(lead))

    def commit(self) -> int:
        """Write the held rows as truncated episode ends, then ``buffer.commit()``."""
        buf = self.buffer
        layout = self._layout
        assert layout is not None
        for stream, h in sorted(self._held.items()):
            steps = {c: h.values[c] for c in layout.columns}
            steps["terminated"], steps["truncated"] = np.zeros(1, bool), np.ones(1, bool)
            final = {c: h.values[f"next_{c}"] for c in layout.derived} if layout.derived else None
            start = int(buf.view().written[stream])
            buf.extend(steps, stream=stream, final_obs=final)
            if "__priority__" in h.values:
                buf.update_priorities(buf.layout.rows(stream, np.array([start])), h.values["__priority__"])
        self._held.clear()
        self._uncommitted[:] = 0
        return buf.commit()

    def close(self) -> None:
        """``commit`` and release the store (the object is unusable afterwards)."""
        if self._buf is not None:
            if self._buf.mode == "a":
                self.commit()
            self._buf.close()
            self._buf = None

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sampling ------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """A TensorDict of ``batch_size`` rows (default: the preset ``batch_size``) in
        TorchRL's layout; ``(td, info)`` with ``return_info=True`` (info: ``index``,
        and ``priority_weight`` when prioritized)."""
        tensordict = _tensordict()
        size = _positive("batch_size", batch_size) or self._batch_size
        if size is None:
            raise errors.InvalidArgumentError("batch_size: expected a number here or at construction, got None for both")
        buf, layout, spec = self.buffer, self._layout, self._sampler
        assert layout is not None
        items = size
        if spec.slices:
            length = int(getattr(spec, "slice_len"))
            if size % length:
                raise errors.InvalidArgumentError(
                    f"batch_size: expected a multiple of slice_len={length} (rows, as TorchRL's SliceSampler counts), got {size}"
                )
            items = size // length
        b = buf.sample(items, self.generator, sampler=spec)
        shape = tuple(b.indices.shape)
        out = tensordict.TensorDict({}, batch_size=shape)
        for name, key in layout.columns.items():
            out.set(key, b.data[name][..., None] if name in layout.squeezed else b.data[name])
        for name in layout.derived:
            out.set(("next", *layout.columns[name]), b.data[f"next_{name}"])
        term, trunc = b.data["terminated"], b.data["truncated"]
        mask = b.mask
        if spec.slices:
            trunc = trunc.clone()
            last = (mask.sum(1) - 1) if mask is not None else torch.full((shape[0],), shape[1] - 1)
            trunc[torch.arange(shape[0]), last] = True
            if mask is not None and not bool(getattr(spec, "strict", True)):
                out.set(("collector", "mask"), mask)
            init = _name_of(layout, ("is_init",))
            if init is not None:
                out.get(("is_init",))[:, 0] = True
        flags = {"terminated": term, "truncated": trunc, "done": term | trunc}
        fshape = shape + layout.flag_shape
        for f in layout.next_flags:
            out.set(("next", f), flags[f].reshape(fshape))
        for f in layout.root_flags:
            out.set((f,), torch.zeros(fshape, dtype=torch.bool))
        out.set("index", b.indices)
        prioritized = isinstance(spec, (samplers.Prioritized, samplers.PrioritizedSlices))
        if prioritized:
            out.set(WEIGHT_KEY, b.weights[:, None].expand(shape).contiguous() if spec.slices else b.weights)
        if spec.slices and self.flatten_slices:
            out = out.reshape(-1)
            out.set("index", out.get("index")[:, None])  # [B * L, 1], as SliceSampler returns it
        index = out.get("index")
        self._remember(index, b.written_at)
        if return_info:
            info = {"index": index}
            if prioritized:
                info[WEIGHT_KEY] = out.get(WEIGHT_KEY)
            return out, info
        return out

    # -- priorities ----------------------------------------------------------------------
    def update_priority(self, index: Any, priority: Any) -> None:
        """Set the priorities of sampled rows: ``index`` as ``sample`` returned it,
        ``priority`` of its shape (trailing singleton dims, ``[B, 1]``, are accepted).
        Nothing happens when the store has no priorities (as TorchRL does without a
        prioritized sampler)."""
        buf = self.buffer
        if buf.priorities is None:
            return
        idx = torch.as_tensor(index)
        pri = torch.as_tensor(priority).detach()
        while pri.ndim > idx.ndim and pri.shape[-1] == 1:
            pri = pri.squeeze(-1)
        entry = self._sampled.get(id(index))
        written = entry[1] if entry is not None and entry[0]() is index else None
        target: Any = Batch({}, idx, torch.ones(0), None, written) if written is not None else idx
        buf.update_priorities(target, pri.to(torch.float64).cpu())

    def update_tensordict_priority(self, data: Any) -> None:
        """``update_priority(data["index"], data[priority_key])`` (a loss, say
        ``DQNLoss``, writes ``td_error`` into the sampled TensorDict)."""
        td = _as_tensordict(data)
        if self.buffer.priorities is None:
            return
        self.update_priority(td.get("index"), td.get(self.priority_key))

    def _remember(self, index: torch.Tensor, written: np.ndarray | None) -> None:
        if len(self._sampled) >= _REMEMBERED:
            self._sampled = {k: v for k, v in self._sampled.items() if v[0]() is not None}
            while len(self._sampled) >= _REMEMBERED:
                self._sampled.pop(next(iter(self._sampled)))
        self._sampled[id(index)] = (weakref.ref(index), written)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Commit, then the state that reopens this buffer: store path and generation,
        batch size, generator state (no data: the store holds it)."""
        generation = self.commit()
        return {
            "path": str(self.path),
            "generation": generation,
            "batch_size": self._batch_size,
            "generator": None if self.generator is None else self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Reopen the store ``state`` names (refused if older than ``state``'s commit)."""
        try:
            path, generation = Path(state["path"]), int(state["generation"])
        except (KeyError, TypeError, ValueError):
            raise errors.InvalidArgumentError(f"state: expected a dict from state_dict(), got {state!r}") from None
        self._reopen(path)
        assert self._buf is not None
        if self._buf.generation < generation:
            raise errors.CorruptStoreError(
                f"{path}: expected a store at commit {generation} or later (the state's), got commit {self._buf.generation}"
            )
        self._batch_size = state.get("batch_size", self._batch_size)
        if state.get("generator") is not None:
            self.generator = self.generator or torch.Generator()
            self.generator.set_state(state["generator"])

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Commit; copy the store to ``path`` unless ``path`` is the store itself."""
        self.commit()
        if Path(path).resolve() != self.path.resolve():
            from .convert import copy

            copy(self.buffer, path, progress=False)

    def loads(self, path: str | os.PathLike[str]) -> None:
        """Make the store at ``path`` (from ``dumps``) this buffer's store."""
        self._reopen(Path(path))

    save = dump = dumps
    load = loads

    def _reopen(self, path: Path) -> None:
        if not path.exists():
            raise errors.StoreNotFoundError(f"path: expected a store at {path}, found nothing")
        self.close()
        self.path = path
        self._held.clear()
        self._attach(open_buffer(path))


# -- helpers -----------------------------------------------------------------------------
def _tensordict() -> Any:
    try:
        import tensordict
    except ImportError:  # pragma: no cover - the extra is installed where tests run
        raise errors.InvalidArgumentError(
            "mmbuffer.torchrl: expected tensordict installed (pip install 'mmbuffer[torchrl]'), got an ImportError"
        ) from None
    return tensordict


def _as_tensordict(data: Any) -> Any:
    if not isinstance(data, _tensordict().TensorDictBase):
        raise errors.InvalidArgumentError(f"data: expected a TensorDict, got {type(data).__name__}")
    return data


def _key(key: str | Iterable[str]) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def _name_of(layout: _Layout, key: Key) -> str | None:
    for name, k in layout.columns.items():
        if k == key:
            return name
    return None


def _positive(what: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise errors.InvalidArgumentError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)


def _infer(td: Any, priority_key: Key) -> tuple[_Layout, dict[str, tuple[tuple[int, ...], str]]]:
    """The layout and the store columns of a first batch (module docstring)."""
    lead = td.batch_dims
    leaves = {_key(k): v for k, v in td.items(include_nested=True, leaves_only=True)}
    root = {k: v for k, v in leaves.items() if k[0] != "next"}
    nxt = {k[1:]: v for k, v in leaves.items() if k[0] == "next" and len(k) > 1}
    for key, value in leaves.items():
        if not isinstance(value, torch.Tensor):
            raise errors.SchemaError(f"data[{key}]: expected a tensor, got {type(value).__name__}")
    skip = {("index",), (WEIGHT_KEY,), priority_key}
    layout_cols: dict[str, Key] = {}
    derived: list[str] = []
    for key in root:
        if key in skip or (len(key) == 1 and key[0] in _FLAGS):
            continue
        name = "obs" if key == ("observation",) and ("obs",) not in root else "/".join(key)
        layout_cols[name] = key
        if key in nxt:
            derived.append(name)
    for key in nxt:
        if key in root or (len(key) == 1 and key[0] in _FLAGS) or ("next", *key) in skip:
            continue
        name = "reward" if key == ("reward",) and "reward" not in layout_cols else "next/" + "/".join(key)
        layout_cols[name] = ("next", *key)
    next_flags = tuple(f for f in _FLAGS if (f,) in nxt)
    if not {"done", "terminated"} & set(next_flags):
        raise errors.SchemaError(
            f"data: expected ('next', 'terminated') or ('next', 'done') (episode ends), got keys {sorted(leaves)}"
        )
    flag = nxt[("terminated",) if "terminated" in next_flags else ("done",)]
    layout = _Layout(
        layout_cols,
        tuple(derived),
        next_flags,
        tuple(f for f in _FLAGS if (f,) in root),
        tuple(flag.shape[lead:]),
    )
    columns = {
        name: (tuple(leaves[key].shape[lead:]), str(leaves[key].dtype).removeprefix("torch."))
        for name, key in layout_cols.items()
    }
    return layout, columns
