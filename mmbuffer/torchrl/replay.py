"""``ReplayBuffer``: TorchRL's replay-buffer interface over an mmbuffer store (see
:mod:`mmbuffer.torchrl` for the rules); key mapping in ``keys.py``, stream
planning in ``streams.py``, the writes and reads here."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Self

import numpy as np
import torch

from .. import errors, samplers
from ..buffer import Buffer
from .._read.gather import Batch
from ..opening import open_buffer as open_buffer
from .._ledger.appending import end_open_episode, reopen_last_episode
from ..schema import PriorityConfig
import mmbuffer.torchrl.access as access  # modules, not "from .": that names the package
import mmbuffer.torchrl.checkpoint as checkpoint
import mmbuffer.torchrl.nstep as nstep
import mmbuffer.torchrl.writing as writing
from .access import Prefetch, as_tensordict as _as_tensordict, positive as _positive, tensordict as _tensordict
from .keys import OPEN_ATTR, WEIGHT_KEY, Columns, Key, KeyMap, create_store, infer, leaves, read_batch, to_tensordict
from .translate import check_store, storage_path, translate

__all__ = ["ReplayBuffer"]


class ReplayBuffer:
    """A replay buffer with TorchRL's interface over an on-disk mmbuffer store.

    Parameters
    ----------
    path
        The store directory: reopened when it exists, else created at the first ``extend``.
    capacity
        Rows over all streams (rounded down to a multiple of the stream count);
        needed to create the store. ``storage=LazyMemmapStorage(N, scratch_dir=...)``
        (or ``LazyTensorStorage(N)``) says the same: ``N`` rows, at ``scratch_dir``
        unless ``path`` is given.
    batch_size
        The default of ``sample`` (rows, for slice samplers).
    sampler
        An ``mb.samplers`` spec (default ``Uniform()``) or a TorchRL sampler object
        (``RandomSampler``, ``PrioritizedSampler``, ``SliceSampler``, ...: ``translate.py``).
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
    transform, prefetch
        As TorchRL's: transforms (torchrl ``Transform`` or callables) applied to what
        ``sample`` and ``rb[...]`` return (a ``MultiStepTransform`` acts at ``extend``:
        ``nstep.py``); batches drawn ahead in threads.
    mode
        ``"a"``: the writer (one process); ``"r"``: a reader of a store that exists (a
        learner process) that follows the writer's commits; writes are ``ReadOnlyError``
        there. A pickled buffer unpickles as a reader.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        capacity: int | None = None,
        storage: Any = None,
        batch_size: int | None = None,
        sampler: Any = None,
        num_streams: int | None = None,
        priorities: PriorityConfig | None = None,
        priority_key: str | Key = "td_error",
        flatten_slices: bool = True,
        generator: torch.Generator | None = None,
        compression: str | None = None,
        transform: Any = None,
        prefetch: int | None = None,
        mode: str = "a",
    ) -> None:
        _tensordict()  # the extra must be installed
        if mode not in ("a", "r"):
            raise errors.InvalidArgumentError(f"mode: expected 'a' (the writer) or 'r' (a reader), got {mode!r}")
        self.mode = mode
        where, capacity = storage_path(storage, path, capacity)
        self.path = Path(where)
        self._batch_size = _positive("batch_size", batch_size)
        self._translated = translate(sampler if sampler is not None else samplers.Uniform(), self._batch_size)
        self._sampler = self._translated.spec
        self._capacity = _positive("capacity", capacity)
        self._num_streams = _positive("num_streams", num_streams)
        prioritized = self._sampler.prioritized
        self._priorities = priorities or self._translated.priorities or (PriorityConfig() if prioritized else None)
        self.priority_key: Key = (priority_key,) if isinstance(priority_key, str) else tuple(priority_key)
        self.flatten_slices = bool(flatten_slices)
        self.generator = generator
        self._compression = compression
        self._buf: Buffer | None = None
        self._layout: KeyMap | None = None
        self._pending = writing.Pending()  # held (provisionally ended) streams, uncommitted rows
        self._sampled = access.Sampled()  # lane cursors of recent batches, for update_priority
        self.transforms = access.transforms(transform)  # applied in order to what is read
        depth = _positive("prefetch", prefetch)
        if depth is not None and self._batch_size is None:
            raise errors.InvalidArgumentError("batch_size: expected one set at construction with prefetch, got None")
        self._prefetch = None if depth is None else Prefetch(depth)
        self._dirty = False  # extended or reprioritized since the last commit
        if self.path.exists() or mode == "r":
            self._attach(open_buffer(self.path, mode=mode))

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
        if self.mode == "r":
            self._buf.refresh()  # a reader follows the writer's commits
        return self._buf

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def sampler(self) -> samplers.Sampler:
        return self._sampler

    def set_sampler(self, sampler: Any) -> None:
        """Sample with ``sampler`` (a spec or a TorchRL sampler object) from now on."""
        t = translate(sampler, self._batch_size)
        if self._buf is not None:
            check_store(t, self._buf)
        self._translated, self._sampler = t, t.spec

    def __len__(self) -> int:
        """Rows extended that the store still holds (at most ``capacity``)."""
        return 0 if self._buf is None else len(self.buffer)

    @property
    def _traj_key(self) -> Key:
        return self._translated.traj_key or ("collector", "traj_ids")

    def _attach(self, buf: Buffer) -> None:
        try:
            if self._capacity is not None and buf.capacity != self._capacity // buf.num_streams * buf.num_streams:
                raise errors.SchemaError(
                    f"capacity: expected the store's {buf.capacity} at {buf.path}, got {self._capacity}"
                )
            check_store(self._translated, buf)
            layout = KeyMap.from_store(buf)
            if buf.mode == "a":
                nstep.check_store(self.transforms, layout, buf.path)
        except BaseException:
            buf.close()
            raise
        self._buf, self._layout = buf, layout
        pending = self._pending = writing.Pending(uncommitted=np.zeros(buf.num_streams, dtype=np.int64))
        view = buf.view()
        # streams whose last episode is open: kept open by a commit of this class (its final
        # observation is stored: ended here), or written by other code (nothing can close it)
        kept = buf.attrs.get(OPEN_ATTR) or {}
        pending.dangling = {s for s, lv in enumerate(view.lanes) if int(view.written[s]) > lv.open_start}
        if buf.mode == "a":
            for s in [s for s in pending.dangling if kept.get(str(s)) == int(view.written[s])]:
                self._dirty = end_open_episode(buf.store, s) or self._dirty
                pending.dangling.discard(s)

    # -- writing -------------------------------------------------------------------------
    def add(self, data: Any) -> Any:
        """One step (a TensorDict with no batch dims): ``extend(data.unsqueeze(0))``; its
        row (an int), or, while an n-step transform holds it back, an empty ``[0, 1]``
        tensor, as TorchRL's."""
        index = self.extend(data.unsqueeze(0))
        return int(index.reshape(-1)[0]) if index.numel() == 1 else index

    def extend(self, data: Any) -> torch.Tensor:
        """Append a collector's TensorDict (``[T]`` or ``[E, T]``) and return the global
        row of each of its rows (shape ``data.batch_size``); every row is sampleable
        when it returns. With a ``MultiStepTransform`` (``nstep.py``) the rows are
        those its ``inv`` returns, and so is the shape (``[0, 1]`` when it holds
        every row back), as TorchRL's.

        Raises ``SchemaError`` (keys, shapes, dtypes differ from the store's),
        ``InvalidArgumentError`` or ``CapacityError`` (a stream given more rows than
        its lane holds) before anything is written.
        """
        td = _as_tensordict(data)
        if self.mode == "r":
            raise errors.ReadOnlyError(f"extend: the buffer at {self.path} is opened with mode='r' (a reader)")
        if td.batch_dims == 0:
            raise errors.InvalidArgumentError("data: expected a TensorDict with batch dims [T] or [E, T], got [] (use add)")
        if self._nstep:
            nstep.check_store(self.transforms, self._layout, self.path)
            td = nstep.inverse(self.transforms, td)
            if td is None:
                return torch.zeros((0, 1), dtype=torch.int64)
        found = leaves(td)
        if td.numel() == 0:
            return torch.full(tuple(td.batch_size), -1, dtype=torch.int64)
        if ("collector", "mask") in found:
            raise errors.InvalidArgumentError(
                "data: expected a collector batch with split_trajs=False, got padded trajectories (('collector', 'mask'))"
            )
        if self._buf is None:
            layout, columns = infer(td, self.priority_key, derive=not self._nstep)
            rows_per_env = td.batch_size[-1] if td.batch_dims > 1 else 0
            n_streams = self._num_streams or (int(np.prod(td.batch_size[:-1])) if rows_per_env else 1)
            self._create(layout, columns, n_streams)
        assert self._buf is not None and self._layout is not None
        buf = self._buf
        values, ends, truncated, traj = read_batch(td, self._layout, buf, self.priority_key, self._traj_key, found)
        segments, over = writing.planned(buf, self._pending, ends, truncated, traj, self.path)
        if over:
            # commit first (provisional ends become truncations), before the store would
            # commit on its own with an episode open; then plan again
            self.commit()
            segments, _ = writing.planned(buf, self._pending, ends, truncated, traj, self.path)
        index = writing.write(buf, self._layout, segments, values, ends.shape, self._pending)
        self._dirty = True
        return torch.from_numpy(index.reshape(tuple(td.batch_size)))

    def _create(self, layout: KeyMap, columns: Columns, num_streams: int) -> None:
        self._attach(create_store(self.path, layout, columns, num_streams, self._capacity,
                                  compression=self._compression, priorities=self._priorities))

    def commit(self) -> int:
        """Make every row durable and visible to readers (``buffer.commit()``); return the
        generation. Open episodes stay open: their provisional ends are undone for the
        commit and set again after it (``attrs["torchrl_open"]`` records them, so a
        reopen after a crash ends them with the final observation already stored)."""
        return self._commit(keep_open=True)

    def _commit(self, *, keep_open: bool) -> int:
        """Commit; ``keep_open=False``: the provisional ends become truncations (what
        ``close``, ``state_dict`` and ``dumps`` keep: a store with no open episode)."""
        buf = self.buffer
        with buf.lock:
            store, streams = buf.store, sorted(self._pending.held) if keep_open else []
            streams = [s for s in streams if reopen_last_episode(store, s)]
            written = buf.view().written
            if streams or buf.attrs.get(OPEN_ATTR):
                buf.attrs = {**buf.attrs, OPEN_ATTR: {str(s): int(written[s]) for s in streams}}
            generation = buf.commit()
            for s in streams:
                end_open_episode(store, s)
            if not keep_open:
                self._pending.held.clear()
            self._pending.uncommitted[:] = 0
            self._dirty = bool(streams)  # the ends set again are not committed
            return generation

    def _commit_changes(self) -> int:
        """Commit (ending open episodes) if this buffer extended or reprioritized since the
        last commit; the generation."""
        return self._commit(keep_open=False) if self._dirty else self.buffer.generation

    def close(self) -> None:
        """Commit what changed and release the store (the object is unusable afterwards)."""
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
        if self._buf is not None:
            if self._buf.mode == "a" and self._dirty:
                self._commit(keep_open=False)
            self._buf.close()
            self._buf = None

    def empty(self) -> None:
        """Remove every row, as TorchRL's ``empty``: the store is deleted; the next
        ``extend`` creates it anew with the same capacity, streams, compression and
        priorities (its schema from that batch)."""
        if self._buf is None:
            return
        buf = self._buf
        if buf.mode != "a":
            raise errors.ReadOnlyError(f"empty: the buffer at {self.path} is opened with mode='r' (a reader)")
        self._capacity, self._num_streams = buf.capacity, buf.num_streams
        self._priorities, self._compression = buf.priorities, buf.compression
        depth = None if self._prefetch is None else self._prefetch.depth
        self.close()
        shutil.rmtree(self.path)
        self._layout = None
        self._pending = writing.Pending()
        self._sampled.clear()
        self._prefetch = None if depth is None else Prefetch(depth)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sampling ------------------------------------------------------------------------
    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """A TensorDict of ``batch_size`` rows (default: the preset ``batch_size``) in
        TorchRL's layout, the transforms applied; ``(td, info)`` with
        ``return_info=True`` (info: ``index``, and ``priority_weight`` when
        prioritized). With ``prefetch=k`` a default-size batch comes from the
        ``k`` drawn ahead in threads."""
        size = _positive("batch_size", batch_size) or self._batch_size
        if size is None:
            raise errors.InvalidArgumentError("batch_size: expected a number here or at construction, got None for both")
        if self._prefetch is not None and batch_size is None:
            out, written = self._prefetch.next(lambda: self._draw(size))
        else:
            out, written = self._draw(size)
        index = out.get("index")
        self._sampled.remember(index, written)
        info = {"index": index}
        if WEIGHT_KEY in out.keys():
            info[WEIGHT_KEY] = out.get(WEIGHT_KEY)
        out = self._transformed(out)
        return (out, info) if return_info else out

    def _draw(self, size: int) -> tuple[Any, np.ndarray | None]:
        buf, layout, spec = self.buffer, self._layout, self._sampler
        assert layout is not None
        items, num = size, self._translated.num_slices
        if num is not None:  # TorchRL's num_slices: the windows' length follows the batch size
            if size % num:
                raise errors.InvalidArgumentError(f"batch_size: expected a multiple of num_slices={num}, got {size}")
            spec = dataclasses.replace(spec, slice_len=size // num)  # type: ignore[type-var]
        if spec.slice_len is not None:
            length = spec.slice_len
            if size % length:
                raise errors.InvalidArgumentError(
                    f"batch_size: expected a multiple of slice_len={length} (rows, as TorchRL's SliceSampler counts), got {size}"
                )
            items = size // length
        with buf.lock:
            b = buf.sample(items, self.generator, sampler=spec)
            open_rows = self._open_rows()
        return to_tensordict(b, layout, spec, flatten=self.flatten_slices, open_rows=open_rows), b.written_at

    def __getitem__(self, index: Any) -> Any:
        """Rows as a TensorDict, transforms applied, as TorchRL's ``rb[index]``
        (``access.rows``): row ids (an int gives a TensorDict without batch dims), a
        slice or negative int of the live rows, or a key of every live row."""
        if access.is_key(index):
            return self[:][index]
        buf, layout = self.buffer, self._layout
        assert layout is not None
        with buf.lock:
            out = access.rows(buf, layout, index, self._open_rows())
        return self._transformed(out)

    def __iter__(self) -> Iterator[Any]:
        """``sample()`` batch after batch, as TorchRL iterates a buffer: endless, or,
        without replacement (an ``Epoch`` spec), to the end of the epoch (``access.iterate``)."""
        if self._batch_size is None:
            raise errors.InvalidArgumentError("batch_size: expected one set at construction to iterate, got None")
        return access.iterate(self.sample, self._batch_size, self._sampler, self.path)

    # -- transforms ----------------------------------------------------------------------
    def append_transform(self, transform: Any, *, invert: bool = False) -> Self:
        """Apply ``transform`` (a torchrl ``Transform`` or a callable TensorDict ->
        TensorDict) last to what ``sample`` and ``rb[...]`` return, as TorchRL's;
        ``invert=True`` (on writing) is ``InvalidArgumentError``: transform the batch."""
        return self.insert_transform(len(self.transforms), transform, invert=invert)

    def insert_transform(self, index: int, transform: Any, *, invert: bool = False) -> Self:
        """Apply ``transform`` at position ``index`` of :attr:`transforms`, as TorchRL's."""
        if invert:
            raise errors.InvalidArgumentError("invert: expected False (transforms apply to sampled data), got True")
        new = access.transforms(transform)
        nstep.check_store(new, self._layout, self.path)
        self.transforms[index:index] = new
        return self

    @property
    def _nstep(self) -> bool:
        """Whether a transform acts at ``extend`` (a ``MultiStepTransform``)."""
        return any(nstep.is_nstep(t) for t in self.transforms)

    def _transformed(self, data: Any) -> Any:
        for t in self.transforms:
            data = t(data)
        return data

    def _open_rows(self) -> np.ndarray:
        """The global rows whose episode end is provisional (each open stream's last row)."""
        return access.last_rows(self._buf, list(self._pending.held))

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
        written = self._sampled.written_at(index)
        target: Any = Batch({}, idx, torch.ones(0), None, written) if written is not None else idx
        buf.update_priorities(target, pri.to(torch.float64).cpu())
        self._dirty = True

    def update_tensordict_priority(self, data: Any) -> None:
        """``update_priority(data["index"], data[priority_key])`` (a loss, say
        ``DQNLoss``, writes ``td_error`` into the sampled TensorDict)."""
        td = _as_tensordict(data)
        if self.buffer.priorities is None:
            return
        self.update_priority(td.get("index"), td.get(self.priority_key))

    # -- checkpoints and processes (checkpoint.py) ------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Commit what changed; the state that names this store at this commit (path,
        generation, cursors), batch size and generator state (no data)."""
        self._commit_changes()
        return checkpoint.state_dict(self.buffer, self._batch_size, self.generator)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to ``state``: its store at its commit, or a typed refusal when that
        store changed since (``checkpoint.check``); never the current data silently."""
        want = checkpoint.parse(state)
        if self._buf is None or self.path.resolve() != want.path.resolve():
            self._reopen(want.path)
        checkpoint.check(self.buffer, want)
        self._batch_size = want.batch_size or self._batch_size
        if want.generator is not None:
            self.generator = self.generator or torch.Generator()
            self.generator.set_state(want.generator)

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Commit what changed; copy the store to ``path`` unless ``path`` is the store."""
        self._commit_changes()
        checkpoint.copy_store(self.buffer, path)

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
        self._pending.held.clear()
        self._attach(open_buffer(path, mode=self.mode))

    def share(self, shared: bool = True) -> Self:
        """TorchRL's ``share``: nothing to do, the store on disk is shared already;
        a pickled buffer opens it read-only in the process that unpickles it."""
        return self

    def __getstate__(self) -> dict[str, Any]:
        """The path and the settings, never the data nor the writer's lock."""
        depth = None if self._prefetch is None else self._prefetch.depth
        return {"path": str(self.path), "batch_size": self._batch_size, "sampler": self._sampler, "prefetch": depth,
                "priority_key": self.priority_key, "flatten_slices": self.flatten_slices, "transform": self.transforms,
                "generator": None if self.generator is None else self.generator.get_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Open the store read-only (``mode="r"``) with the pickled settings."""
        self.__init__(mode="r", **checkpoint.unpickled(state))  # type: ignore[misc]
