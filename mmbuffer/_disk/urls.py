"""URLs are never local paths: the one check every entry point that takes a path calls.

``pathlib.Path("s3://bucket/x")`` is the relative path ``s3:/bucket/x``, so a URL
handed to code that expects a directory would quietly create a folder named
``s3:``. Every public function that accepts a store path passes it through
:func:`local_path` (local only: ``mb.create``, converters' destinations) or
:func:`location` (a URL goes to :mod:`mmbuffer.remote`: ``mb.open(url, "r")``,
``mb.convert.copy``, ``BufferDataset``).

A URL is ``scheme://...`` with an RFC 3986 scheme of two or more characters
(``s3``, ``gs``, ``gcs``, ``az``, ``abfs``, ``http(s)``, ``file``, ``memory``, any
fsspec protocol, chained ones such as ``simplecache::s3://``); one letter is a
Windows drive (``C://``), never a URL.

>>> is_url("s3://bucket/prefix/store"), is_url("runs/replay"), is_url("file:///tmp/x")
(True, False, True)
>>> local_path("s3://bucket/x", "dst")
Traceback (most recent call last):
...
mmbuffer.errors.InvalidArgumentError: dst: expected a local path (this call writes a local store), got the URL 's3://bucket/x'
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import errors

__all__ = ["filesystem", "is_url", "join", "local_path", "location", "options_for", "protocol"]

_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.\-]*::)*([A-Za-z][A-Za-z0-9+.\-]+)://")


def protocol(path: object) -> str | None:
    """The URL's (last) protocol, lower case, or None for a local path."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        return None  # os.PathLike objects are local by construction
    m = _URL.match(path)
    return m.group(1).lower() if m else None


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``scheme://...``), not a local path."""
    return protocol(path) is not None


def local_path(path: str | os.PathLike[str], what: str, *, hint: str = "this call writes a local store") -> Path:
    """``path`` as a ``Path``; a URL is refused with ``InvalidArgumentError`` naming ``what``."""
    if is_url(path):
        raise errors.InvalidArgumentError(f"{what}: expected a local path ({hint}), got the URL {path!r}")
    return Path(path)


def location(path: str | os.PathLike[str]) -> str | Path:
    """A URL as its string (never collapsed by ``Path``), a local path as a ``Path``."""
    if is_url(path):
        return os.fsdecode(path) if isinstance(path, bytes) else str(path)
    return Path(path)


# -- URLs of object storage (fsspec) ----------------------------------------------------
# fsspec is the layer zarr, xarray and pandas users already configure
# (``storage_options``), and zarr-python reads arrays through it
# (``zarr.storage.FsspecStore``); s3fs, gcsfs, adlfs plug in by protocol. For S3,
# AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_PROFILE are read
# by botocore itself; AWS_ENDPOINT_URL (S3-compatible servers: MinIO, Ceph, a test
# server) and AWS_REGION are passed explicitly, since not every s3fs release forwards
# them. Explicit ``storage_options`` win.


def options_for(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` completed from the environment for ``url``'s protocol."""
    opts = dict(storage_options or {})
    if url.split("://", 1)[0].split("::")[-1].lower() in ("file", "local"):
        opts.setdefault("auto_mkdir", True)  # as object stores do: a key needs no parent
    if url.split("://", 1)[0].split("::")[-1].lower() in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        client = dict(opts.get("client_kwargs") or {})
        if endpoint and "endpoint_url" not in opts and "endpoint_url" not in client:
            opts["endpoint_url"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region and "region_name" not in client:
            client["region_name"] = region
        if client:
            opts["client_kwargs"] = client
    return opts


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fs, root)``: the fsspec filesystem of ``url`` and the path of ``url`` inside it."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - the "cloud" extra
        raise errors.InvalidArgumentError(f"{url}: expected the 'cloud' extra (pip install 'mmbuffer[cloud]') for URLs") from None
    try:
        fs, root = fsspec.core.url_to_fs(url, **options_for(url, storage_options))
    except (ImportError, ValueError) as exc:
        raise errors.InvalidArgumentError(f"url: expected a URL fsspec can open, got {url!r} ({exc})") from None
    return fs, str(root).rstrip("/")


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])
