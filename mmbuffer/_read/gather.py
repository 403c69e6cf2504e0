"""Read rows for given indices: compiled copies from the mapped columns, out as torch tensors.

``next_<col>`` of a row is ``<col>`` of the following row of its lane, except at
an episode's last row, where it is the stored final observation (``final/<col>``,
at the slot of the row's episode: ``_ledger/finals.py``; the kernels find it).
Raw columns are copied by the kernels of ``mmbuffer.kernels.gather`` (a run of
consecutive rows as one ``memcpy``, ``next_<col>`` in the same pass, no GIL);
compressed ones are read through their backend. New tensors of a batch share one
block of memory, recycled once they are all gone (``_Recycler``).

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/s", {"obs": ((2,), "float32")}, capacity=8)
>>> buf.extend({"obs": np.arange(6, dtype="float32").reshape(3, 2),
...             "terminated": [False, False, True]}, final_obs={"obs": [[9.0, 9.0]]})
>>> out = gather(buf, np.array([1, 2]), keys=["obs", "next_obs"])
>>> out["next_obs"].tolist()
[[4.0, 5.0], [9.0, 9.0]]
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import errors
from .._disk.format import RESERVED_NAMES
from .._ledger.snapshot import Ledger
from .._ledger.store import Store
from ..kernels import load
from . import parallel
from .memory import RECYCLER


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


_ALLOWED: weakref.WeakKeyDictionary[Store, tuple[str, ...]] = weakref.WeakKeyDictionary()


def resolve_keys(store: Store, keys: Iterable[str] | None) -> list[str]:
    """Validate ``keys`` (default: every column and every ``next_<col>``)."""
    try:
        found = _ALLOWED.get(store)  # a store's columns never change once it is open
    except TypeError:  # not weakly referable: nothing kept
        found = None
    if found is None:
        found = (*store.columns, *(f"next_{k}" for k in store.next_keys))
        try:
            _ALLOWED[store] = found
        except TypeError:
            pass
    allowed = list(found)
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
    done_at: np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """Rows of ``store`` at global ids ``rows`` (any shape) as a dict of tensors.

    ``out`` may hold caller-owned CPU tensors (pinned, say) of the result shapes;
    they are filled in place and returned. One that is contiguous and of the
    column's dtype is written directly; any other is filled by ``copy_``.

    Raw columns are copied from their mapped bytes by the compiled kernels of
    ``mmbuffer.kernels.gather``, in the order given and without the GIL: a run of
    consecutive rows (a slice) as one ``memcpy``, ``next_<col>`` in the same pass
    as ``<col>``. Compressed columns are read through their backend. ``done_at``
    (windows ``[B, L]``: where each holds its episode's last row, -1: nowhere) lets a
    small batch read the done flags there only (``kernels.gather.gather_small``).
    """
    kernels = load("gather")
    if not isinstance(store, Store):  # a Buffer: its store
        store = store.store
    plan = _plan(store, keys)
    rows = np.asarray(rows, dtype=np.int64)
    flat = np.ascontiguousarray(rows).reshape(-1)
    if out is None and plan.small is not None:
        layout = _block(plan, rows.shape)
        if layout.nbytes < _SMALL:
            return _gather_small(kernels, store, plan, layout, flat, done_at, rows.shape[-1] if rows.ndim else 1)
    ledger = store.ledger  # where final observations are, as of now (_ledger/finals.py)
    cursors = ledger.cursors()
    starts, bad = kernels.runs(flat, store.capacity)
    if bad >= 0:
        _bad_row(store, flat, bad)
    for name in plan.fetched:  # their rows asked for at once: a remote store fetches them together
        store.column(name).ahead(flat)
    if out is None and plan.small is not None:
        return _gather_new(kernels, store, plan, flat, starts, rows.shape, cursors)
    targets = _targets(plan.keys, rows.shape, out)
    for own, after in plan.passes:
        if after is None:
            assert own is not None
            _copy(kernels, store, flat, starts, own, targets[own.name])
        else:
            _next_into(kernels, store, plan, flat, starts, after, targets[after.name],
                       None if own is None else targets[own.name], ledger)
    return {key.name: targets[key.name].finish() for key in plan.keys}


@dataclass(frozen=True, slots=True, eq=False)
class _Key:
    """One key a gather returns, as it is copied: fixed for the store's life (a
    store's columns and their maps never change once it is open)."""

    name: str
    base: str  # the stored column (``obs`` for ``next_obs``)
    row_shape: tuple[int, ...]
    dtype: np.dtype
    torch_dtype: torch.dtype
    row_bytes: int
    source: np.ndarray | None  # the column's mapped bytes; None: read through its backend
    # final, terminated and truncated as mapped bytes, for a ``next_`` key (None: read them)
    ends: tuple[np.ndarray, np.ndarray, np.ndarray] | None


@dataclass(frozen=True, slots=True, eq=False)
class _Plan:
    """The keys of one ``keys`` argument, and the passes that copy them: ``(own,
    after)`` copies ``own`` alone (``after`` None) or ``after`` = ``next_<col>``
    with ``own`` = ``<col>`` (when also asked) in the same pass."""

    keys: tuple[_Key, ...]
    passes: tuple[tuple[_Key | None, _Key | None], ...]
    # every key copied by the kernels (raw, mapped, with its ends for ``next_``): its
    # passes as ``kernels.gather_small`` takes them; else None
    small: _Small | None
    # the episode ends and whether final observations are found by episode (version 4)
    index: np.ndarray
    by_episode: bool
    # the stored columns read through their backend (compressed, remote), each once
    fetched: tuple[str, ...]
    # index shape -> where each key lies in a batch's one block of new memory (``_gather_new``)
    blocks: dict[tuple[int, ...], _Block] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class _Small:
    """A plan's passes of rows of at least a byte as ``kernels.gather_small`` takes
    them: the addresses and sizes of each pass's source and finals, then of the
    episode-end flags and the episode ends (``arrays`` keeps them alive); each pass's row bytes and the
    names it copies its rows and next rows to (None: not asked)."""

    arrays: tuple[np.ndarray, ...]
    addresses: np.ndarray
    sizes: np.ndarray
    row_bytes: np.ndarray
    owns: tuple[str | None, ...]
    afters: tuple[str | None, ...]
    sparse: np.ndarray  # per pass: a done flag alone, read at windows' episode ends only when known


def _small(kernels: Any, passes: tuple[tuple[_Key | None, _Key | None], ...], index: np.ndarray) -> _Small:
    none = np.zeros(0, np.uint8)
    flags = (none, none)
    arrays: list[np.ndarray] = []
    row_bytes, owns, afters, sparse = [], [], [], []
    for own, after in passes:
        key = after if after is not None else own
        assert key is not None and key.source is not None
        if not key.row_bytes:
            continue
        final = none
        if after is not None:
            assert after.ends is not None
            final, flags = after.ends[0], (after.ends[1], after.ends[2])
        arrays += [key.source, final]
        row_bytes.append(key.row_bytes)
        owns.append(None if own is None else own.name)
        afters.append(None if after is None else after.name)
        sparse.append(after is None and key.name in RESERVED_NAMES and key.row_bytes == 1)
    arrays += [*flags, index]
    where = np.array([kernels.address(a) for a in arrays], np.int64).reshape(-1, 2)
    return _Small(tuple(arrays), where[:, 0].copy(), where[:, 1].copy(), np.array(row_bytes, np.int64),
                  tuple(owns), tuple(afters), np.array(sparse, np.bool_))


@dataclass(frozen=True, slots=True, eq=False)
class _Block:
    """The new memory of a batch of one index shape: ``nbytes`` in all; per key its
    name, dtype, full shape, first byte and bytes; the first bytes of the rows and
    next rows of each ``gather_small`` pass (-1: not asked)."""

    nbytes: int
    keys: tuple[tuple[str, np.dtype, tuple[int, ...], int, int], ...]
    own_at: np.ndarray
    next_at: np.ndarray


def _block(plan: _Plan, index_shape: tuple[int, ...]) -> _Block:
    block = plan.blocks.get(index_shape)
    if block is None:
        keys, at, first = [], 0, {}
        for k in plan.keys:
            shape = (*index_shape, *k.row_shape)
            n = math.prod(shape) * k.dtype.itemsize
            keys.append((k.name, k.dtype, shape, at, n))
            first[k.name] = at
            at += -(-n // _ALIGN) * _ALIGN  # each key's memory starts on a cache line
        owns, afters = (plan.small.owns, plan.small.afters) if plan.small is not None else ((), ())
        own_at = np.array([-1 if o is None else first[o] for o in owns], np.int64)
        next_at = np.array([-1 if a is None else first[a] for a in afters], np.int64)
        if len(plan.blocks) >= _MAX_PLANS:
            plan.blocks.clear()
        block = plan.blocks[index_shape] = _Block(at, tuple(keys), own_at, next_at)
    return block


_SMALL = 1 << 16  # bytes: a batch below this takes ``Recycler.small`` memory and ``gather_small``


def _bad_row(store: Store, flat: np.ndarray, bad: int) -> None:
    raise errors.InvalidArgumentError(
        f"index: expected row ids in [0, {store.capacity}), got {int(flat[bad])} "
        f"(values from {flat.min()} to {flat.max()})"
    )


def _gather_small(
    kernels: Any, store: Store, plan: _Plan, layout: _Block, flat: np.ndarray, done_at: np.ndarray | None, width: int,
) -> dict[str, torch.Tensor]:
    """``gather`` of a small batch into new memory: one kernel call for every key
    (``kernels.gather_small``; a small batch's cost is mostly fixed). Its rows' lines
    are asked for first (``kernels.prefetch_rows``), so they arrive while the rest runs."""
    assert plan.small is not None
    small = plan.small  # referenced through the call: it keeps the arrays it gives by address
    kernels.prefetch_rows(small.addresses, small.sizes, small.row_bytes, flat, width,
                          None if done_at is None else small.sparse)
    cursors = store.ledger.cursors()  # where final observations are, as of now (_ledger/finals.py)
    memory = RECYCLER.small(layout.nbytes)
    bad = kernels.gather_small(small.addresses, small.sizes, small.row_bytes, layout.own_at, layout.next_at,
                               store.lane_size, flat, store.capacity, memory, cursors, plan.by_episode,
                               small.sparse, done_at, width)
    if bad >= 0:
        _bad_row(store, flat, bad)
    from_numpy, ndarray = torch.from_numpy, np.ndarray
    return {name: from_numpy(ndarray(shape, dtype, memory, a)) for name, dtype, shape, a, _ in layout.keys}


def _gather_new(
    kernels: Any, store: Store, plan: _Plan, flat: np.ndarray, starts: np.ndarray, index_shape: tuple[int, ...],
    cursors: np.ndarray,
) -> dict[str, torch.Tensor]:
    """``gather`` into new memory of keys the kernels copy (the common case, kept short:
    a small batch's fixed cost is mostly Python): one ``kernels.split.gather_runs`` call
    for every key, its runs offered to helper threads (``parallel.threads()`` in all)
    when the batch has at least ``_PART`` bytes for each (``parallel.py``: offered
    where that has been faster for batches of its size)."""
    assert plan.small is not None
    small = plan.small  # referenced through the call: it keeps the arrays it gives by address
    layout = _block(plan, index_shape)
    memory = RECYCLER.block(layout.nbytes)
    count = starts.shape[0] - 1
    threads = max(1, min(parallel.threads(), layout.nbytes // _PART))
    parallel.share(load("split").gather_runs, (small.addresses, small.sizes, small.row_bytes, layout.own_at, layout.next_at,
                                       store.lane_size, flat, starts, store.capacity, memory, cursors, plan.by_episode),
                   threads - 1, count, layout.nbytes)
    from_numpy, ndarray = torch.from_numpy, np.ndarray
    return {name: from_numpy(ndarray(shape, dtype, memory, a)) for name, dtype, shape, a, _ in layout.keys}


# bytes each thread copies at least: a batch under twice this is gathered on one
# thread (offering a batch under 0.7 MB to a helper cost 15-40% more on the dev VM:
# benchmarks/bench_gather.py --parts sweep, benchmarks/HISTORY.md)
_PART = 1 << 19


_MAX_PLANS = 64  # per store: distinct ``keys`` arguments seen
_PLANS: weakref.WeakKeyDictionary[Store, dict[Any, _Plan]] = weakref.WeakKeyDictionary()


def _plan(store: Store, keys: Iterable[str] | None) -> _Plan:
    """The plan of ``keys`` for ``store``, built once per store and keys (a batch's
    fixed Python cost was ~25-45 us of dtype, shape and map lookups before)."""
    if keys is not None and not isinstance(keys, str):
        keys = tuple(keys)
    plans = _PLANS.get(store)
    if plans is None:
        plans = _PLANS.setdefault(store, {})
    try:
        plan = plans.get(keys)
    except TypeError:  # unhashable names: resolve_keys says what is wrong with them
        resolve_keys(store, keys)
        raise
    if plan is None:
        names = resolve_keys(store, keys)
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        built = {name: _key(store, name) for name in dict.fromkeys(names)}
        wanted, done = set(names), set[str]()
        passes: list[tuple[_Key | None, _Key | None]] = []
        for name in built:
            base = built[name].base
            after = f"next_{base}"
            if base in done or after in done:
                continue
            if after in wanted:  # the column and its next values in one pass
                passes.append((built.get(base), built[after]))
                done.update((base, after))
            else:
                passes.append((built[name], None))
                done.add(name)
        kernels = load("gather")
        mapped = all(k.source is not None and (k.name == k.base or k.ends is not None) for k in built.values())
        index = kernels.bytes_of(store.ends)
        small = _small(kernels, tuple(passes), index) if mapped else None
        fetched = tuple(dict.fromkeys(k.base for k in built.values() if k.source is None))
        plan = plans[keys] = _Plan(tuple(built[n] for n in names), tuple(passes), small, store.ends, store.finals_by_episode,
                                   fetched)
    return plan


def _key(store: Store, name: str) -> _Key:
    kernels = load("gather")
    base = name[5:] if name.startswith("next_") else name
    col = store.columns[base]
    dtype = np.dtype(col.dtype)
    mapped = store.column(base).mapped()
    ends = None
    if name != base:
        final, terminated, truncated = (store.column(n).mapped() for n in (f"final/{base}", "terminated", "truncated"))
        if mapped is not None and final is not None and terminated is not None and truncated is not None:
            ends = (kernels.bytes_of(final), kernels.bytes_of(terminated), kernels.bytes_of(truncated))
    return _Key(name, base, tuple(col.shape), dtype, _torch_dtype(dtype), math.prod(col.shape) * dtype.itemsize,
                None if mapped is None else kernels.bytes_of(mapped), ends)


def _copy(kernels: Any, store: Store, flat: np.ndarray, starts: np.ndarray, key: _Key, target: _Target) -> None:
    if key.source is None:  # a compressed column: read through its backend
        target.array[...] = store.read(key.base, flat).reshape(target.array.shape)
    elif key.row_bytes:
        kernels.copy_rows(key.source, flat, starts, key.row_bytes, target.bytes(kernels))


class _Target:
    """Where one key's rows go: the caller's tensor itself when it fits (CPU,
    contiguous, that shape and dtype), else new memory that ``finish`` copies
    into the caller's tensor or returns as a tensor."""

    __slots__ = ("array", "caller", "dtype", "raw", "shape", "tensor")

    def __init__(self, shape: tuple[int, ...], key: _Key, caller: torch.Tensor | None) -> None:
        self.dtype = key.dtype
        self.shape = shape
        self.caller = caller
        self.tensor: torch.Tensor | None = None
        self.raw: np.ndarray | None = None  # the array's bytes, when placed in new memory
        if (
            caller is not None
            and caller.device.type == "cpu"
            and tuple(caller.shape) == shape
            and caller.dtype == key.torch_dtype
            and caller.is_contiguous()
            and not caller.requires_grad
        ):
            self.tensor, self.caller = caller, None
            self.array: np.ndarray = caller.numpy()

    @property
    def nbytes(self) -> int:
        """Bytes of new memory this target needs (0 when it writes the caller's tensor)."""
        return 0 if self.tensor is not None else math.prod(self.shape) * self.dtype.itemsize

    def place(self, memory: np.ndarray) -> None:
        """Take ``memory`` (``nbytes`` bytes) as this target's array."""
        self.raw = memory
        self.array = memory.view(self.dtype).reshape(self.shape)
        self.tensor = torch.from_numpy(self.array)

    def bytes(self, kernels: Any) -> np.ndarray:
        """The array as flat bytes, what the copy kernels write."""
        if self.raw is not None:
            return self.raw
        out: np.ndarray = kernels.bytes_of(self.array)
        return out

    def finish(self) -> torch.Tensor:
        assert self.tensor is not None
        if self.caller is None:
            return self.tensor
        self.caller.copy_(self.tensor)
        return self.caller


def _targets(keys: tuple[_Key, ...], index_shape: tuple[int, ...], out: Mapping[str, torch.Tensor] | None) -> dict[str, _Target]:
    """A target per key; the new memory of all of them is one recycled block."""
    targets = {k.name: _Target((*index_shape, *k.row_shape), k, None if out is None else out.get(k.name)) for k in keys}
    sizes = [t.nbytes for t in targets.values()]
    spans = [-(-n // _ALIGN) * _ALIGN for n in sizes]  # each key's memory starts on a cache line
    block = RECYCLER.block(sum(spans)) if sum(spans) else np.empty(0, np.uint8)
    at = 0
    for t, n, span in zip(targets.values(), sizes, spans):
        if t.tensor is None:
            t.place(block[at : at + n])
        at += span
    return targets


_ALIGN = 64  # each key's memory starts on a cache line


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return found


def _next_into(
    kernels: Any, store: Store, plan: _Plan, flat: np.ndarray, starts: np.ndarray, key: _Key, after: _Target,
    own: _Target | None, ledger: Ledger,
) -> None:
    """``next_<base>`` into ``after`` and, when ``own`` is given, ``<base>`` into it."""
    if key.source is not None and key.ends is not None:
        if key.row_bytes:
            kernels.copy_rows_next(
                key.source, *key.ends, flat, starts, store.layout.lane_size, key.row_bytes, after.bytes(kernels),
                None if own is None else own.bytes(kernels), *((plan.index, ledger.cursors()) if plan.by_episode else ()),
            )
        return
    # a compressed column: read through its backend
    values = store.read(key.base, flat)
    if own is not None:
        own.array[...] = values.reshape(own.array.shape)
    following = store.read(key.base, store.layout.following(flat))
    last = store.read("terminated", flat) | store.read("truncated", flat)
    if last.any():  # each episode's final observation; zeros where none ends (a row re-checked)
        at = store.final_slots(flat[last], ledger)
        finals = np.zeros((len(at), *key.row_shape), key.dtype)
        found = at >= 0
        finals[found] = store.column(f"final/{key.base}").read(at[found])
        following[last] = finals
    after.array[...] = following.reshape(after.array.shape)
