"""Creating a store: validate the schema, lay out every file in a directory of this
call's own, and rename it into place so that the store appears whole or not at all."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._disk import files as _files
from .. import errors, tree
from .._disk import format as fmt
from .._disk.checks import check_codecs, check_int, check_json, check_schema
from .._disk.columns import RawArray, sharding
from .._disk.guards import raise_typed
from . import progress, touched
from .manifest import Manifest
from .index import Lane
from ..schema import PriorityConfig


def create_store(
    path: str | os.PathLike[str],
    columns: Mapping[str, tuple[Any, Any]],
    capacity: int,
    *,
    num_streams: int = 1,
    compression: str | None = None,
    priorities: PriorityConfig | None = None,
    next_keys: Iterable[str] = ("obs",),
    attrs: Mapping[str, Any] | None = None,
    starts: Sequence[Lane] | None = None,
) -> None:
    """Validate a schema and lay out an empty store at ``path`` (see ``mb.create``).

    ``starts``: per lane, an empty lane state (``written == first_start``, ``ep_tail ==
    ep_head``) to begin at instead of row 0 and episode 0, so that the rows and episode
    slots written next land where another store's with those counters are (a publish
    keeps the source's positions: ``convert/_pipeline/copy.py``)."""
    path = Path(path)
    if path.exists():
        raise errors.StoreExistsError(f"{path}: expected a path that does not exist, got an existing {'directory' if path.is_dir() else 'file'}")
    schema = check_schema(columns, next_keys)
    codecs = check_codecs(columns)
    next_keys = tuple(next_keys)
    capacity = check_int("capacity", capacity, 1)
    num_streams = check_int("num_streams", num_streams, 1)
    if capacity % num_streams:
        raise errors.InvalidArgumentError(
            f"capacity: expected a multiple of num_streams={num_streams}, got {capacity}"
        )
    if compression not in fmt.COMPRESSIONS:
        raise errors.InvalidArgumentError(f"compression: expected one of {fmt.COMPRESSIONS}, got {compression!r}")
    if priorities is not None and not isinstance(priorities, PriorityConfig):
        raise errors.InvalidArgumentError(f"priorities: expected mb.PriorityConfig or None, got {priorities!r}")
    lane_size = capacity // num_streams
    lanes = tuple(Lane() for _ in range(num_streams)) if starts is None else tuple(starts)
    if len(lanes) != num_streams or any(st.written != st.first_start or st.ep_tail != st.ep_head or st.written < 0
                                        for st in lanes):
        raise errors.InvalidArgumentError(f"starts: expected {num_streams} empty lane states, got {lanes!r}")
    manifest = Manifest(
        generation=0,
        capacity=capacity,
        num_streams=num_streams,
        lane_size=lane_size,
        compression=compression,
        columns=schema,
        next_keys=next_keys,
        priorities=None if priorities is None else priorities.to_json(),
        lanes=lanes,
        attrs=dict(attrs or {}),
        codecs=codecs,
        store_id=secrets.token_hex(16),
    )
    check_json(manifest.attrs)
    try:
        tmp = _creation_dir(path)
    except OSError as exc:
        raise_typed(exc, "create", path)
        raise
    try:
        import zarr

        zarr.open_group(str(tmp), mode="w", zarr_format=3, attributes={"mmbuffer": {"format_version": fmt.FORMAT_VERSION}})
        for name, (shape, dtype) in schema.items():
            if name in codecs:  # Zarr shards of small chunks, staging per lane
                sharding.create(tmp, name, capacity, shape, dtype, codecs[name], lane_size,
                                starts=[st.written for st in lanes])
            elif compression is None or name in fmt.RESERVED_NAMES:
                fmt.create_raw(tmp, f"columns/{name}", capacity, shape, dtype)
            else:
                fmt.create_compressed(tmp, f"columns/{name}", capacity, shape, dtype, compression)
        for name in next_keys:  # one slot per episode, sparse; compressed like the columns (_ledger/finals.py)
            shape, dtype = schema[name]
            if compression is None:
                fmt.create_raw(tmp, f"final/{name}", capacity, shape, dtype)
            else:
                fmt.create_compressed(tmp, f"final/{name}", capacity, shape, dtype, compression)
        fmt.create_raw(tmp, "index/ends", num_streams * 2 * lane_size, (), np.dtype(np.int64))
        fmt.create_raw(tmp, "index/reserved", num_streams, (), np.dtype(np.int64), allocate=True)
        if any(st.written for st in lanes):  # a reservation is never below the rows written
            reserved = RawArray.open(tmp, "index/reserved", writable=True)
            reserved.write_range(0, np.array([st.written for st in lanes], np.int64))
            reserved.close()
        progress.create(tmp, num_streams)
        if priorities is not None:
            for name, (shape, kind) in tree.layout(capacity).items():
                # sparse: zero bytes are an empty tree (mmbuffer.tree), so nothing is written
                fmt.create_raw(tmp, f"priority/{name}", shape[0], tuple(shape[1:]), np.dtype(kind))
            fmt.create_raw(tmp, touched.NAME, touched.nblocks(capacity), (), np.dtype(np.uint8))  # sparse
        (tmp / "sampler").mkdir()
        _files.atomic_write_json(tmp / fmt.MANIFEST, manifest.to_json())
        _files.fsync_tree(tmp)  # zarr's metadata and the shard files are durable before the store appears
        try:
            _files.rename_noreplace(tmp, path)  # the store appears whole or not at all
        except FileExistsError:
            raise errors.StoreExistsError(
                f"{path}: expected a path that does not exist, got one created meanwhile (by another process?)"
            ) from None
        _files.fsync_dir(path.parent.resolve())
    except BaseException as exc:
        if tmp.exists():  # only this call's own directory, never another's
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise_typed(exc, "create", path)
        raise


def _creation_dir(path: Path) -> Path:
    """A new, empty directory beside ``path``, unique to this call, to build a store in.

    Made with ``mkdir`` (the umask applies, unlike ``tempfile.mkdtemp``'s 0700), so
    the finished store has the permissions of any directory its owner creates.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.creating-{secrets.token_hex(6)}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
