"""A writer group read as one buffer: ``mb.open_group(url)`` on a URL that writers publish to by name.

Writers on many hosts publish their own stores into one group
(``mb.convert.publish(path, url, writer="host-3")``, ``mmbuffer.remote._group``);
``mb.open_group(url)`` returns a :class:`GroupBuffer`: one read-only buffer over the snapshots
that one read of ``group.json`` names (one consistent set, all whole), one read-only
:class:`~mmbuffer.Buffer` per writer underneath.

Sampling draws over the union. A batch of ``n`` picks the writer of each item at once
(``torch.multinomial``, vectorised) with probability ``mass_w / sum(mass)``, where
``mass_w`` is what the sampler spec gives writer ``w`` (``Sampler.mass``: sampleable
rows, valid windows, eligible episodes, or the priority of the sampleable rows), then
asks each writer's buffer for its share in one call: an item's probability is the same
as in one store holding every writer's rows (uniform over all rows, priorities
normalised by the union's total). Windows never cross writers or episodes. Prioritized
weights are normalised against the union's smallest live priority:
``(p_i / min_union)^-beta`` (each writer's ``(p_i / min_w)^-beta`` times
``(min_union / min_w)^beta``). The batch is in draw order (items of one writer are not
contiguous: item ``j`` comes from the writer drawn for it); ``indices`` are union ids, ``offsets[w] + row`` (``locate`` splits them).
The split is exact for the spec; a writer with a chunk pool (``pool=``) draws its share
as a pooled buffer does. ``refresh()`` moves every writer to the group's newest
snapshot at once, or to none of it. A group published with ``engine="icechunk"`` is one
Icechunk repository (``mmbuffer.remote._icegroup``): its writers are read at one commit.

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> d = tempfile.mkdtemp()
>>> for w in range(2):
...     with mb.create(f"{d}/w{w}", {"x": ((), "float32")}, capacity=64, next_keys=()) as buf:
...         buf.extend({"x": np.arange(30) + 100 * w, "terminated": np.arange(30) % 10 == 9})
...     _ = mb.convert.publish(f"{d}/w{w}", f"file://{d}/group", writer=f"host-{w}", progress=False)
>>> g = mb.open_group(f"file://{d}/group", cache_dir=d + "/cache")
>>> g.writers, len(g), g.num_episodes
(('host-0', 'host-1'), 60, 6)
>>> b = g.sample_slices(8, 5, generator=torch.Generator().manual_seed(0))
>>> bool(((b.data["x"][:, 1:] - b.data["x"][:, :-1]) == 1).all())  # windows stay in one episode
True
>>> g.close()
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Mapping
from typing import Any, Self

import numpy as np
import torch

from . import errors, samplers, tree
from ._disk.checks import check_int
from ._disk.urls import filesystem
from ._read.gather import Batch
from .buffer import Buffer
from .remote import RemoteSource
from .remote import _group, _icegroup
from .remote._group import entries, read_group, writer_url
from .remote._refresh import Refresher

__all__ = ["GroupBuffer", "is_group"]


def is_group(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``url`` holds a writer group (its ``group.json``, or an Icechunk repository
    of writers)."""
    fs, root = filesystem(url.rstrip("/"), storage_options)
    return _group.is_group(fs, root, url) or (_icechunk_scheme(url) and _icegroup.is_group_repo(url.rstrip("/"), storage_options))


def _icechunk_scheme(url: str) -> bool:
    if url.split("://", 1)[0] not in ("s3", "s3a", "file", "local"):
        return False
    try:
        import icechunk  # noqa: F401
    except ImportError:  # pragma: no cover - the "cloud" extra
        return False
    return True


class GroupBuffer:
    """The union of a writer group's published stores, read-only (use ``mb.open_group(url)``).

    ``writers``: the names published (sorted); ``buffers``: name -> its read-only
    ``Buffer``; ``offsets``: name -> the first union id of its rows; ``sequence``: the
    ``group.json`` version open. Holds :attr:`lock` around every read.
    """

    def __init__(self, url: str, *, cache_dir: str | os.PathLike[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None, pool: Any = None,
                 cache_limit: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.lock = threading.RLock()
        self._options = dict(cache_dir=cache_dir, storage_options=storage_options, pool=pool, cache_limit=cache_limit)
        self._fs, self._root = filesystem(self.url, storage_options)
        self._repo: _icegroup.GroupRepo | None = None  # a group in one Icechunk repository
        if not _group.is_group(self._fs, self._root, self.url) and _icechunk_scheme(self.url) \
                and _icegroup.is_group_repo(self.url, storage_options):
            self._repo = _icegroup.GroupRepo(self.url, storage_options)
        self._buffers: dict[str, Buffer] = {}
        self._snapshots: dict[str, str] = {}
        self._states: dict[str, samplers.SamplerState] = {}
        self._masses: dict[tuple[str, samplers.Sampler], float] = {}
        self.sequence = -1
        self.offsets: dict[str, int] = {}
        self._refresher: Refresher[tuple[dict[str, Any], dict[str, Buffer]]] = Refresher(
            self._newer, self._take, self._discard)
        first = self._newer()
        assert first is not None  # nothing open yet: every named writer is new
        self._take(first)

    # -- snapshots ------------------------------------------------------------------------
    def _open_writer(self, name: str, pointer: dict[str, Any]) -> Buffer:
        repo = None if self._repo is None else self._repo.writer(name)
        src = RemoteSource(writer_url(self.url, name), pointer=lambda: pointer, repo=repo, **self._options)
        return Buffer(src.url, "r", source=src)

    def _newer(self) -> tuple[dict[str, Any], dict[str, Buffer]] | None:
        """``group.json`` now and every writer's buffer on its snapshot (the changed ones
        opened beside the open ones, which stay as they are), or None when nothing changed."""
        if self._repo is not None:
            body = self._repo.read()
            named = body["writers"]
        else:
            body = read_group(self._fs, self._root, self.url)[0]
            named = entries(body)
        if not named:
            raise errors.StoreNotFoundError(f"{self.url}: expected a writer group with a published writer, got none yet")
        if {n: str(p["snapshot"]) for n, p in named.items()} == self._snapshots:
            return None
        new: dict[str, Buffer] = {n: b for n, b in self._buffers.items()
                                  if n in named and self._snapshots.get(n) == named[n]["snapshot"]}
        try:
            todo = [n for n in named if n not in new]
            with ThreadPoolExecutor(max_workers=min(8, max(1, len(todo)))) as pool:  # the mirrors' requests overlap
                futures = {n: pool.submit(self._open_writer, n, named[n]) for n in todo}
            failed: BaseException | None = None
            for n in todo:  # every opened one joins ``new`` (closed below if another failed)
                exc = futures[n].exception()
                if exc is None:
                    new[n] = futures[n].result()
                failed = failed or exc
            if failed is not None:
                raise failed
            new = {n: new[n] for n in named}
            first = next(iter(new))
            for name, buf in new.items():
                want, got = _schema(new[first]), _schema(buf)
                if got != want:
                    raise errors.SchemaError(
                        f"{self.url}: writer {name!r}: expected the schema of writer {first!r}, {want}, got {got}")
        except BaseException:
            self._discard((body, new))
            raise
        return body, new

    def _discard(self, prepared: tuple[dict[str, Any], dict[str, Buffer]]) -> None:
        for name, buf in prepared[1].items():
            if buf is not self._buffers.get(name):
                buf.close()

    def _take(self, prepared: tuple[dict[str, Any], dict[str, Buffer]]) -> None:
        body, new = prepared
        with self.lock:
            closed = [b for n, b in self._buffers.items() if new.get(n) is not b]
            self._states = {n: s for n, s in self._states.items() if new.get(n) is self._buffers.get(n)}
            self._buffers, self.sequence = new, int(body["sequence"])
            self._snapshots = {n: str(b.remote.snapshot) for n, b in new.items() if b.remote is not None}
            if self._repo is not None:  # writers kept as they were are read at the new commit (older ones expire)
                for n, b in new.items():
                    if b.remote is not None and b.remote.repo is not None:
                        b.remote.repo.follow(str(b.remote.snapshot), str(body["writers"][n]["commit"]))
            self._masses.clear()
            starts = np.cumsum([0] + [b.capacity for b in new.values()])
            self.offsets = {n: int(s) for n, s in zip(new, starts)}
            for buf in closed:
                buf.close()

    def refresh(self, wait: bool = True) -> bool:
        """Move every writer to the snapshots ``group.json`` names now (all or none);
        return whether anything changed. The changed writers are opened while samples read
        the old ones, then swapped in under :attr:`lock`; ``wait=False``: opened in a
        background thread, adopted by a later call (as ``Buffer.refresh``)."""
        return self._refresher.refresh(wait)

    # -- what the union is ------------------------------------------------------------------
    @property
    def writers(self) -> tuple[str, ...]:
        """The writers' names, sorted."""
        return tuple(self._buffers)

    @property
    def buffers(self) -> dict[str, Buffer]:
        """Name -> the writer's read-only ``Buffer``."""
        return dict(self._buffers)

    @property
    def columns(self) -> dict[str, Any]:
        """The columns every writer shares."""
        return next(iter(self._buffers.values())).columns

    @property
    def priorities(self) -> Any:
        """The priority settings every writer shares (or None)."""
        return next(iter(self._buffers.values())).priorities

    @property
    def capacity(self) -> int:
        """Rows over all writers' capacities (union ids lie below it)."""
        return sum(b.capacity for b in self._buffers.values())

    def __len__(self) -> int:
        """Rows over all writers."""
        return sum(len(b) for b in self._buffers.values())

    @property
    def num_episodes(self) -> int:
        """Live episodes over all writers."""
        return sum(b.num_episodes for b in self._buffers.values())

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """Union ids as ``(writer position in writers, row in that writer's store)``."""
        idx = np.asarray(indices, dtype=np.int64)
        starts = np.fromiter(self.offsets.values(), np.int64)
        w = np.searchsorted(starts, idx, side="right") - 1
        return w, idx - starts[w]

    def __repr__(self) -> str:
        return f"GroupBuffer({self.url!r}, writers={list(self._snapshots)}, rows={len(self)}, sequence={self.sequence})"

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, batch_size: int, generator: torch.Generator | None = None, *, prioritized: bool = False,
               beta: float = 0.4, keys: Iterable[str] | None = None, sampler: samplers.Sampler | None = None,
               stack: Mapping[str, int] | None = None, stack_pad: str = "first") -> Batch:
        """``Buffer.sample`` over the union of the writers (see the module docstring)."""
        spec = samplers.resolve(sampler, prioritized=prioritized, beta=beta)
        return self._draw(spec, check_int("batch_size", batch_size, 1), generator, keys, stack, stack_pad)

    def sample_slices(self, num_slices: int, slice_len: int, strict: bool = True,
                      generator: torch.Generator | None = None, *, prioritized: bool = False, beta: float = 0.4,
                      weighting: str = "windows", keys: Iterable[str] | None = None,
                      stack: Mapping[str, int] | None = None, stack_pad: str = "first") -> Batch:
        """``Buffer.sample_slices`` over the union: windows never cross writers or episodes."""
        spec = samplers.resolve(None, slice_len, prioritized=prioritized, beta=beta, strict=strict, weighting=weighting)
        return self._draw(spec, check_int("num_slices", num_slices, 1), generator, keys, stack, stack_pad)

    def _mass(self, name: str, spec: samplers.Sampler) -> float:
        key = (name, spec)
        if key not in self._masses:
            buf = self._buffers[name]
            spec.check(buf)
            state = self._states.setdefault(name, samplers.SamplerState())
            self._masses[key] = spec.mass(buf.view(), state)
        return self._masses[key]

    def _draw(self, spec: samplers.Sampler, n: int, generator: torch.Generator | None, keys: Iterable[str] | None,
              stack: Mapping[str, int] | None, stack_pad: str) -> Batch:
        with self.lock:
            names = list(self._buffers)
            mass = np.array([self._mass(name, spec) for name in names], np.float64)
            if not mass.sum() > 0:
                what = "valid windows" if spec.slices else "sampleable rows"
                raise errors.EmptyBufferError(f"{self.url}: expected {what} in some writer, got none in {names}")
            picks = torch.multinomial(torch.from_numpy(mass / mass.sum()), n, replacement=True, generator=generator)
            counts = torch.bincount(picks, minlength=len(names)).tolist()
            floors = {name: _floor(self._buffers[name]) for name in names} if spec.prioritized else {}
            floor = min(floors.values()) if floors else 1.0
            parts: list[Batch] = []
            for name, k in zip(names, counts):
                if k == 0:
                    continue
                b = self._buffers[name].sample(k, generator, sampler=spec, keys=keys, stack=stack, stack_pad=stack_pad)
                weights = b.weights
                if spec.prioritized:
                    weights = weights * float((floor / floors[name]) ** getattr(spec, "beta"))
                parts.append(Batch(b.data, b.indices + self.offsets[name], weights, b.mask))
        # item j of the batch is from writer picks[j]: each writer's items go to its positions
        # (numpy: a small torch.cat + index costs milliseconds on a loaded 2-core machine)
        where = np.argsort(picks.numpy(), kind="stable")

        def place(arrays: list[torch.Tensor]) -> torch.Tensor:
            joined = np.concatenate([a.numpy() for a in arrays])
            out = np.empty_like(joined)
            out[where] = joined
            return torch.from_numpy(out)

        data = {key: place([p.data[key] for p in parts]) for key in parts[0].data}
        masks = [p.mask for p in parts if p.mask is not None]
        return Batch(data, place([p.indices for p in parts]), place([p.weights for p in parts]),
                     place(masks) if masks else None)

    def close(self) -> None:
        """Close every writer's buffer (their pins and pools), after a refresh under way."""
        self._refresher.close()
        with self.lock:
            for buf in self._buffers.values():
                buf.close()
            self._buffers, self._snapshots = {}, {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _floor(buf: Buffer) -> float:
    """The smallest live priority of ``buf`` (its tree's, O(1))."""
    ptree = buf.view().tree
    if ptree is None:  # pragma: no cover - spec.check refused it before
        raise errors.InvalidArgumentError("prioritized: expected stores with priorities, got priorities=None")
    return tree.min_live(ptree)


def _schema(buf: Buffer) -> tuple[Any, ...]:
    """What every writer of a group must share: columns, next keys, priority settings
    (capacity, streams and codecs may differ)."""
    return buf.store.manifest.schema()[4:7]
