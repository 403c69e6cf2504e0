"""Where one (rank, worker) pass of ``BufferDataset`` stands: a small, versioned state.

A pass is a function of counters, never of a stored index array:

- random mode: batch ``k`` of a pass is drawn with a ``torch.Generator`` seeded from
  ``(pass key, k)``; the pass key comes from ``seed``, ``set_epoch``, the rank, the
  worker and the ``DataLoader``'s per-pass seed, and is saved. Skipping ``k`` batches
  is O(1): nothing is drawn or read for them. A remote store's chunk pool is placed
  at its ``k``-th draw (``ChunkPool.set_shard(..., draws=k)``).
- epoch mode: the epoch's keyed permutation (``samplers/epoch.py``) at ``(epoch,
  position, num_items)``, plus per stream the ``(first row, items, fingerprint)`` of
  the snapshot the epoch started on (the fingerprint: a digest of the stored columns at
  the rows of the stream's first and last items), so that a newer snapshot can be
  checked and mapped (:func:`remap`).

:class:`PassState` is what ``BufferDataset.state_dict()`` returns, as a dict of
JSON-able values (about 400 bytes, plus 2 integers per stream in epoch mode);
:func:`PassState.load` checks every field of a foreign or tampered one.

>>> s = PassState.load(PassState(**_EXAMPLE).to_dict(), {"seed": 0})
>>> s.delivered, len(str(s.to_dict())) < 600
(3, True)
>>> PassState.load({**PassState(**_EXAMPLE).to_dict(), "seed": 1}, {"seed": 0})
Traceback (most recent call last):
...
mmbuffer.errors.InvalidArgumentError: state['seed']: expected 0 (this dataset's), got 1
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from .. import errors

KIND = "mmbuffer.data.BufferDataset"
VERSION = 1
_BIG = 1 << 63
_MASK = (1 << 64) - 1

#: per stream at an epoch's start: (first row, items, fingerprint of the rows of its first and last items)
Lanes = tuple[tuple[int, int, str], ...]


@dataclass(frozen=True, slots=True)
class PassState:
    """One (rank, worker) pass: its configuration, its data and how far it went."""

    mode: str  # "random" or "epoch"
    seed: int
    set_epoch: int
    batch_size: int
    slice_len: int | None
    sampler: str  # repr of the sampler spec
    store: str  # the path or URL
    rank: int
    world_size: int
    worker: int
    num_workers: int
    generation: int  # of the snapshot the pass (random) or epoch (epoch mode) started on
    snapshot: str  # a remote snapshot's id, "" for a local store
    pass_key: int  # random mode: the key of every batch's generator
    delivered: int  # batches delivered by this pass
    epoch: int  # epoch mode: completed epochs of this shard
    position: int  # epoch mode: items of the epoch delivered to this shard
    num_items: int  # epoch mode: items of the epoch (-1: not started)
    lanes: Lanes | None  # epoch mode: per stream at the epoch's start (see ``Lanes``)

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": KIND, "version": VERSION, **asdict(self)}
        out["lanes"] = None if self.lanes is None else [list(x) for x in self.lanes]
        return out

    @staticmethod
    def load(obj: Any, expected: dict[str, Any]) -> PassState:
        """Check ``obj`` (a ``to_dict()`` value): kind, version, every field's type and
        range, and the fields in ``expected`` equal to this dataset's; a mismatch is
        ``InvalidArgumentError`` naming the field, expected and received."""
        if not isinstance(obj, dict):
            raise errors.InvalidArgumentError(f"state: expected a dict from BufferDataset.state_dict(), got {type(obj).__name__}")
        _expect(obj, "kind", KIND)
        _expect(obj, "version", VERSION)
        names = {f.name for f in fields(PassState)} | {"kind", "version"}
        if set(obj) != names:
            raise errors.InvalidArgumentError(f"state: expected the keys {sorted(names)}, got {sorted(map(str, obj))}")
        for name in ("seed", "set_epoch", "rank", "worker", "pass_key", "delivered", "epoch", "position", "generation"):
            _int(obj, name, 0)
        for name in ("batch_size", "world_size", "num_workers"):
            _int(obj, name, 1)
        _int(obj, "num_items", -1)
        if obj["slice_len"] is not None:
            _int(obj, "slice_len", 1)
        for name in ("mode", "sampler", "store", "snapshot"):
            if not isinstance(obj[name], str):
                raise errors.InvalidArgumentError(f"state['{name}']: expected a string, got {obj[name]!r:.80}")
        if obj["mode"] not in ("random", "epoch"):
            raise errors.InvalidArgumentError(f"state['mode']: expected 'random' or 'epoch', got {obj['mode']!r}")
        for name, low, high in (("rank", 0, obj["world_size"]), ("worker", 0, obj["num_workers"])):
            if not low <= obj[name] < high:
                raise errors.InvalidArgumentError(f"state['{name}']: expected an integer in [{low}, {high}), got {obj[name]}")
        lanes = obj["lanes"]
        if lanes is not None:
            ok = isinstance(lanes, list) and all(
                isinstance(x, list) and len(x) == 3 and all(_is_int(v) and 0 <= v < _BIG for v in x[:2])
                and isinstance(x[2], str) and len(x[2]) <= 64 for x in lanes)
            if not ok or sum(x[1] for x in lanes) != obj["num_items"]:
                raise errors.InvalidArgumentError(
                    f"state['lanes']: expected [first row, items, fingerprint] per stream, items summing to num_items "
                    f"{obj['num_items']}, got {lanes!r:.120}")
            lanes = tuple((int(a), int(b), str(c)) for a, b, c in lanes)
        if obj["mode"] == "epoch" and obj["num_items"] >= 0 and obj["position"] > obj["num_items"]:
            raise errors.InvalidArgumentError(
                f"state['position']: expected at most num_items {obj['num_items']}, got {obj['position']}")
        for name, want in expected.items():
            if obj[name] != want:
                raise errors.InvalidArgumentError(f"state['{name}']: expected {want!r} (this dataset's), got {obj[name]!r}")
        values = {f.name: obj[f.name] for f in fields(PassState)}
        values["lanes"] = lanes
        return PassState(**values)

    def advanced(self, **changes: Any) -> PassState:
        return replace(self, **changes)


def pass_key(parts: list[int]) -> int:
    """A 63-bit key from non-negative integers (``numpy.random.SeedSequence``)."""
    return int(np.random.SeedSequence(parts).generate_state(1, np.uint64)[0]) >> 1


def batch_generator(key: int, k: int) -> torch.Generator:
    """The generator of batch ``k`` of the pass keyed ``key``: seeded with splitmix64 of
    ``(key, k)`` (a few microseconds a batch; ``SeedSequence`` took 20).

    >>> a, b = batch_generator(5, 0), batch_generator(5, 1)
    >>> torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=batch_generator(5, 0)))
    True
    >>> torch.equal(torch.rand(3, generator=batch_generator(5, 0)), torch.rand(3, generator=b))
    False
    """
    return torch.Generator().manual_seed(_splitmix(_splitmix(key) ^ k) >> 1)


def _splitmix(x: int) -> int:
    """splitmix64 (the increment, then the finalizer) on Python integers."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def remap(ranks: np.ndarray, old: tuple[tuple[int, int], ...], first: np.ndarray, items: np.ndarray,
          where: str) -> np.ndarray:
    """Ranks of an epoch started on a snapshot whose streams held ``old`` ((first row,
    items) each), as ranks of the snapshot with ``first`` rows and ``items`` per stream.

    Items are ranked stream by stream, oldest first; a stream that kept its first row
    and grew holds the old items as a prefix, at the same rows. Any other change (a
    ring that evicted rows, fewer items, another number of streams) is
    ``RowNotLiveError``: the epoch's items are gone, and other rows are never served
    in their place.

    >>> remap(np.array([0, 2, 3]), ((0, 2), (100, 2)), np.array([0, 100]), np.array([5, 2]), "s")
    array([0, 5, 6])
    """
    first, items = np.asarray(first, dtype=np.int64), np.asarray(items, dtype=np.int64)
    check_lanes(old, first, items, where)
    old_cum = np.concatenate([[0], np.cumsum([n for _, n in old])])
    new_cum = np.concatenate([[0], np.cumsum(items)])
    lane = np.searchsorted(old_cum, ranks, side="right") - 1
    mapped: np.ndarray = new_cum[lane] + (ranks - old_cum[lane])
    return mapped


def check_lanes(old: tuple[tuple[int, int], ...], first: np.ndarray, items: np.ndarray, where: str) -> None:
    """``RowNotLiveError`` unless every stream of ``old`` kept its first row and its items."""
    if len(old) != len(first):
        raise errors.RowNotLiveError(f"{where}: expected {len(old)} streams as when the epoch started, got {len(first)}")
    for lane, (f, n) in enumerate(old):
        if int(first[lane]) != f or int(items[lane]) < n:
            raise errors.RowNotLiveError(
                f"{where}: stream {lane}: expected the epoch's {n} items from row {f} (the snapshot it started on), "
                f"got {int(items[lane])} items from row {int(first[lane])}: rows were evicted or the store was "
                "rewritten; the rest of this epoch cannot be served (start a new epoch: drop the state)")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(obj: dict[str, Any], name: str, low: int) -> None:
    value = obj[name]
    if not _is_int(value) or not low <= value < _BIG:
        raise errors.InvalidArgumentError(f"state['{name}']: expected an integer in [{low}, 2**63), got {value!r:.80}")


def _expect(obj: dict[str, Any], name: str, want: Any) -> None:
    if obj.get(name) != want:
        raise errors.InvalidArgumentError(f"state['{name}']: expected {want!r}, got {obj.get(name)!r:.80}")


_EXAMPLE: dict[str, Any] = dict(  # noqa: C408 - keyword form reads as PassState(...)
    mode="random", seed=0, set_epoch=0, batch_size=8, slice_len=None, sampler="Uniform()", store="/s", rank=0,
    world_size=1, worker=0, num_workers=1, generation=1, snapshot="", pass_key=7, delivered=3, epoch=0,
    position=0, num_items=-1, lanes=None,
)
