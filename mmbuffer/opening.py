"""``mb.create`` and ``mb.open``: where a path (local, or a URL) becomes a ``Buffer``.

(Beside ``buffer.py`` rather than in it only to keep both files short.)

A URL (``s3://...``, any fsspec URL) is never taken for a local path: ``create``
refuses one, ``open`` hands it to :mod:`mmbuffer.remote` (``urls.py`` says what a
URL is).

>>> import tempfile, mmbuffer as mb
>>> path = tempfile.mkdtemp() + "/replay"
>>> mb.create(path, {"obs": ((3,), "float32")}, capacity=100).close()
>>> mb.open(path, mode="r").capacity
100
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import errors
from .buffer import Buffer

if TYPE_CHECKING:
    from .groups import GroupBuffer
from ._ledger.create import create_store
from .schema import PriorityConfig
from ._disk.urls import is_url, local_path

__all__ = ["create", "open", "open_group"]


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
    path = local_path(path, "path", hint="mb.create makes a local store; publish it with mb.convert.copy(path, url)")
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


def open(  # noqa: A001 - API name
    path: str | os.PathLike[str], mode: str = "a", *, cache_dir: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None, pool: Any = "default", cache_limit: int | None = None,
) -> Buffer:
    """Open an existing store: ``mode="a"`` the single writer, ``mode="r"`` a reader.

    A URL (``s3://bucket/prefix/store``, ``gs://``, ``file://``, any fsspec URL) opens a
    published store read-only (a ``Buffer`` over a :class:`~mmbuffer.remote.RemoteSource`); ``cache_dir``,
    ``cache_limit`` (bytes held there at most; None: unbounded), ``storage_options`` and ``pool``
    are its options (a local path takes none of them). A URL that writers publish to by
    name (``mb.convert.publish(path, url, writer=...)``) is a group: :func:`open_group`
    opens it, ``open`` refuses it (``InvalidArgumentError`` naming ``open_group``).
    """
    if is_url(path):
        from .remote import RemoteSource, pool_config

        config = pool_config(str(path), mode, pool)
        try:
            return Buffer(path, "r", source=RemoteSource(
                str(path), cache_dir=cache_dir, storage_options=storage_options, pool=config, cache_limit=cache_limit))
        except errors.StoreNotFoundError:
            from .groups import is_group

            if not is_group(str(path), storage_options):
                raise
        raise errors.InvalidArgumentError(f"path: expected one store, got the writer group {str(path)!r} "
                                          "(open it with mb.open_group(url))")
    if cache_dir is not None or storage_options is not None or pool != "default" or cache_limit is not None:
        raise errors.InvalidArgumentError(
            f"cache_dir, cache_limit, storage_options, pool: expected none of them for the local path {str(path)!r} (they are for URLs)"
        )
    return Buffer(path, mode)


def open_group(
    url: str, *, cache_dir: str | os.PathLike[str] | None = None, storage_options: Mapping[str, Any] | None = None,
    pool: Any = "default", cache_limit: int | None = None,
) -> GroupBuffer:
    """Open the writer group at ``url`` (``mb.convert.publish(path, url, writer=...)``) as one
    read-only :class:`~mmbuffer.groups.GroupBuffer` sampling the union of its writers'
    stores; the options are :func:`open`'s for a URL. Not a group: ``StoreNotFoundError``."""
    from .groups import GroupBuffer
    from .remote import pool_config

    return GroupBuffer(str(url), cache_dir=cache_dir, storage_options=storage_options,
                       pool=pool_config(str(url), "r", pool), cache_limit=cache_limit)
