"""Diffusion Policy / UMI replay buffers: a Zarr group with ``data/<key>`` and ``meta/episode_ends``.

Layout read (Diffusion Policy's ``ReplayBuffer``, also UMI's datasets), Zarr
format 2 or 3, a directory (``dataset.zarr``) or a zip file (``dataset.zarr.zip``)::

    data/<key>          [N, ...]  one array per key, one row per step
                                  (action, state, img, robot0_eef_pos, ...)
    meta/episode_ends   [E]       int, strictly increasing: episode i is rows
                                  [episode_ends[i-1], episode_ends[i]), the last is N

Each ``data/<key>`` becomes the store column ``<key>`` (arrays in sub-groups:
``<group>/<key>``), row for row. Demonstrations record no termination: the
last step of every episode gets ``truncated=True`` (the data stops there),
unless the group also holds ``data/terminated`` and ``data/truncated`` (what
:func:`~mmbuffer.convert.export_diffusion_policy` writes), whose flags are then
used, and must set a flag exactly at the episode ends. There is no
observation after an episode's last step, so the store has no next-derived
columns.

**Lossless by default.** What the group holds that the store cannot derive:
every ``data/<key>`` row inside an episode (kept, row for row; a non-numeric
array is refused); rows past ``episode_ends[-1]`` (arrays grown ahead of the
episodes, or an episode never closed): no episode holds them, so they are
refused, naming the key and the rows, unless ``drop_past_ends=True``
(``--drop-past-ends``) accepts leaving them out; other ``meta/<key>`` arrays
(per-episode values) of up to 4096 elements: kept in
``attrs["diffusion_policy"]["meta"]`` (values, dtype, shape), larger ones and
entries of the root besides ``data`` and ``meta``: refused unless
``drop_unsupported=True`` (``--drop-unsupported``); the root's attributes:
kept in ``attrs["diffusion_policy"]["attrs"]``. Chunking and compression are
the source's encoding, not data.

Untrusted input: only fixed-size numeric or bool arrays are read, every codec
must be a known compression or byte codec (a ``pickle``, JSON or object
codec would run or allocate arbitrary things: refused before any chunk is
decoded), and a directory holding a symbolic link is refused (it could point
outside the dataset). Arrays are read in row slices, so memory stays at about
one chunk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...schema import PriorityConfig
from .._pipeline.reader import Chunk, Reader, Schema, jsonable, reader_error
from .._pipeline.sniff import ZIP, expect
from .._pipeline.write import write_store

__all__ = ["DiffusionPolicyReader", "convert_diffusion_policy", "open_zarr_group"]

#: Codecs a source array may use (zarr v3 names and numcodecs ids): compression,
#: checksums and byte transforms. Image codecs registered by ``imagecodecs``
#: (``imagecodecs_*``, as Diffusion Policy's image arrays use) are accepted too.
SAFE_CODECS = frozenset({
    "bytes", "transpose", "crc32c", "sharding_indexed", "blosc", "zstd", "lz4", "gzip", "zlib",
    "bz2", "lzma", "shuffle", "delta", "fixedscaleoffset", "quantize", "bitround", "packbits",
    "astype", "adler32", "fletcher32", "crc32", "jenkins_lookup3", "zfpy", "pcodec",
})
FLAG_KEYS = ("terminated", "truncated")


def _codec_names(meta: Any) -> list[str]:
    """Every codec of an array's metadata dict: v2 ``filters``/``compressor`` ids, v3 ``codecs``
    names (and the codecs nested in a sharding codec). Anything unreadable is named as is."""
    out: list[str] = []

    def one(codec: Any, key: str) -> None:
        if codec is None:
            return
        if not isinstance(codec, dict) or not isinstance(codec.get(key), str):
            out.append(repr(codec))
            return
        out.append(codec[key])
        config = codec.get("configuration")
        if isinstance(config, dict):
            for nested in ("codecs", "index_codecs"):
                for c in config.get(nested) or ():
                    one(c, "name")

    for c in meta.get("filters") or ():
        one(c, "id")
    one(meta.get("compressor"), "id")
    for c in meta.get("codecs") or ():
        one(c, "name")
    return out


def _safe(name: str) -> bool:
    base = name.removeprefix("numcodecs.")
    return base in SAFE_CODECS or base.startswith("imagecodecs_")


def open_zarr_group(reader: Reader, path: Path) -> Any:
    """Open the Zarr group at ``path`` (a directory or a ``.zip``) read-only, for ``reader``."""
    import zarr

    kind = expect(path, ("directory", ZIP), "a Diffusion Policy Zarr group (a .zarr directory or a .zarr.zip)")
    try:
        if kind == ZIP:
            store: Any = zarr.storage.ZipStore(path, mode="r")
        else:
            for top, dirs, files in os.walk(path):
                for name in (*dirs, *files):
                    if os.path.islink(os.path.join(top, name)):
                        raise reader_error(reader, 
                            "expected a Zarr directory without symbolic links (they may point outside "
                            f"the dataset), found one at {os.path.relpath(os.path.join(top, name), path)!r}")
            store = zarr.storage.LocalStore(path, read_only=True)
        return zarr.open_group(store, mode="r")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise reader_error(reader, f"expected a Zarr group, could not open it ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # zarr's own errors (GroupNotFoundError, MetadataValidationError...)
        if type(exc).__module__.startswith("zarr"):
            raise reader_error(reader, f"expected a Zarr group, could not open it ({type(exc).__name__}: {exc})") from exc
        raise


class DiffusionPolicyReader(Reader):
    """Read a Diffusion Policy / UMI Zarr replay buffer (see the module docstring).

    Parameters
    ----------
    path
        The ``.zarr`` directory or ``.zarr.zip`` file.
    """

    format = "diffusion_policy"

    def __init__(self, path: str | os.PathLike[str], *, drop_past_ends: bool = False,
                 drop_unsupported: bool = False) -> None:
        super().__init__(path)
        root = self._root = open_zarr_group(self, self.path)
        for name in ("data", "meta"):
            if name not in root or not _is_group(root[name]):
                raise self._error(f"expected a group {name!r} (Diffusion Policy layout: data/<key>, "
                                  f"meta/episode_ends), got {sorted(root.keys())}", name)
        if "episode_ends" not in root["meta"] or _is_group(root["meta"]["episode_ends"]):
            raise self._error("expected an array meta/episode_ends", "meta/episode_ends")
        ends_arr = root["meta"]["episode_ends"]
        self._check_array("meta/episode_ends", ends_arr)
        if ends_arr.ndim != 1 or np.dtype(ends_arr.dtype).kind not in "iu":
            raise self._error(f"expected a 1-d integer array, got shape {ends_arr.shape} dtype {ends_arr.dtype}",
                              "meta/episode_ends")
        ends = np.asarray(ends_arr[:], np.int64)
        if not len(ends):
            raise self._error("expected at least one episode, got none", "meta/episode_ends")
        if ends[0] <= 0 or (len(ends) > 1 and np.any(np.diff(ends) <= 0)):
            raise self._error(f"expected strictly increasing positive ends (no empty episode), got "
                              f"{ends[:8].tolist()}", "meta/episode_ends")
        self._arrays = self._data_arrays(root["data"])
        if not self._arrays:
            raise self._error("expected at least one array in data/, got none", "data")
        n = int(ends[-1])
        past: dict[str, int] = {}
        for key, arr in self._arrays.items():
            if arr.ndim < 1 or int(arr.shape[0]) < n:
                raise self._error(f"expected at least {n} rows (meta/episode_ends[-1]), got shape {arr.shape}",
                                  f"data/{key}")
            if int(arr.shape[0]) > n:
                past[key] = int(arr.shape[0])
        if past and not drop_past_ends:
            key, rows = next(iter(past.items()))
            raise self._error(f"expected {n} rows (meta/episode_ends[-1]), got {rows}: rows [{n}, {rows}) belong "
                              f"to no episode{f' (also in {sorted(past)[1:9]})' if len(past) > 1 else ''}; "
                              "drop_past_ends=True (--drop-past-ends) converts without them", f"data/{key}")
        if past:
            self.stats["dropped_rows_past_ends"] = {f"data/{k}": rows - n for k, rows in past.items()}
        meta, dropped = self._meta(root, drop_unsupported)
        if dropped:
            self.stats["dropped_keys"] = dropped
        self._ends = ends
        self._n = n
        flags = [k for k in FLAG_KEYS if k in self._arrays]
        self._flags = {k: self._arrays.pop(k) for k in flags} if len(flags) == 2 else {}
        for k in self._flags:
            if self._flags[k].ndim != 1:
                raise self._error(f"expected one flag per row, got shape {self._flags[k].shape}", f"data/{k}")
        columns = {k: (tuple(int(s) for s in a.shape[1:]), np.dtype(a.dtype).newbyteorder("=").str)
                   for k, a in self._arrays.items()}
        attrs: dict[str, Any] = {"source_format": "diffusion_policy",
                                 "diffusion_policy": {"zarr_format": int(root.metadata.zarr_format),
                                                      "flags": "data/terminated, data/truncated" if self._flags
                                                      else "truncated at each episode end",
                                                      "attrs": jsonable(dict(root.attrs))}}
        if meta:
            attrs["diffusion_policy"]["meta"] = meta
        self._schema = Schema(columns, (), n, attrs, len(ends))

    def _meta(self, root: Any, drop_unsupported: bool) -> tuple[dict[str, Any], list[str]]:
        """``meta/<key>`` arrays besides ``episode_ends`` as attributes; what cannot be kept, refused or named."""
        kept: dict[str, Any] = {}
        refused: dict[str, str] = {}
        for name in sorted(root.keys()):
            if name not in ("data", "meta"):
                refused[name] = "an entry besides data/ and meta/"
        for name in sorted(root["meta"].keys()):
            if name == "episode_ends":
                continue
            node = root["meta"][name]
            if _is_group(node) or int(np.prod(node.shape, dtype=np.int64)) > 4096:
                refused[f"meta/{name}"] = "a group" if _is_group(node) else f"shape {node.shape}, over 4096 values"
                continue
            self._check_array(f"meta/{name}", node)
            kept[name] = {"dtype": str(node.dtype), "shape": list(node.shape), "values": jsonable(node[...])}
        if refused and not drop_unsupported:
            key, why = next(iter(refused.items()))
            more = f" (and {sorted(refused)[1:9]})" if len(refused) > 1 else ""
            raise self._error(f"cannot be kept in a store ({why}){more}; drop_unsupported=True "
                              "(--drop-unsupported) converts without it", key)
        return kept, sorted(refused)

    def _check_array(self, key: str, arr: Any) -> None:
        dtype = np.dtype(arr.dtype)
        if dtype.kind not in "biuf" or dtype.hasobject:
            raise self._error(f"expected a fixed-size numeric or bool array, got dtype {dtype}", key)
        bad = [c for c in _codec_names(arr.metadata.to_dict()) if not _safe(c)]
        if bad:
            raise self._error(f"expected compression/byte codecs only ({', '.join(sorted(SAFE_CODECS))}, "
                              f"imagecodecs_*), got {bad} (never decoded: a codec may run code)", key)

    def _data_arrays(self, group: Any, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            names = sorted(group.keys())
        except Exception as exc:  # metadata zarr refuses (an object dtype, an unknown codec)
            raise self._error(f"unreadable array metadata ({type(exc).__name__}: {exc})",
                              f"data/{prefix}") from exc
        for name in names:
            key = f"{prefix}{name}"
            try:
                node = group[name]
            except Exception as exc:  # metadata zarr refuses (an object dtype, an unknown codec)
                raise self._error(f"unreadable array metadata ({type(exc).__name__}: {exc})", f"data/{key}") from exc
            if _is_group(node):
                out.update(self._data_arrays(node, key + "/"))
            else:
                self._check_array(f"data/{key}", node)
                out[key] = node
        return out

    @property
    def schema(self) -> Schema:
        return self._schema

    def close(self) -> None:
        store = getattr(getattr(self, "_root", None), "store", None)
        if store is not None and hasattr(store, "close"):
            store.close()

    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        last = np.zeros(self._n, bool) if not self._flags else None
        if last is not None:
            last[self._ends - 1] = True
        for a in range(0, self._n, chunk_rows):
            b = min(self._n, a + chunk_rows)
            steps = {k: self._read(k, arr, a, b) for k, arr in self._arrays.items()}
            if last is not None:
                steps["terminated"] = np.zeros(b - a, bool)
                steps["truncated"] = last[a:b]
            else:
                steps.update({k: self._read(f"{k}", self._flags[k], a, b) != 0 for k in FLAG_KEYS})
                done = np.flatnonzero(steps["terminated"] | steps["truncated"]) + a
                want = self._ends[(self._ends > a) & (self._ends <= b)] - 1
                if not np.array_equal(done, want):
                    raise self._error(f"the flags of rows [{a}, {b}) end episodes at {done[:8].tolist()}, "
                                      f"meta/episode_ends at {want[:8].tolist()}", "data/terminated")
            yield Chunk(steps, {})

    def _read(self, key: str, arr: Any, a: int, b: int) -> np.ndarray:
        try:
            return np.asarray(arr[a:b])
        except Exception as exc:  # a codec that is not installed, a truncated chunk file
            raise self._error(f"could not read rows [{a}, {b}) ({type(exc).__name__}: {exc})", f"data/{key}") from exc


def _is_group(node: Any) -> bool:
    import zarr

    return isinstance(node, zarr.Group)


def convert_diffusion_policy(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    drop_past_ends: bool = False,
    drop_unsupported: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
) -> dict[str, Any]:
    """Convert a Diffusion Policy / UMI Zarr replay buffer into a new store at ``dst``.

    Options and the returned summary are those of :func:`~mmbuffer.convert.write_store`.
    Lossless by default (see :mod:`mmbuffer.convert.readers.diffusion`):
    ``drop_past_ends`` and ``drop_unsupported`` accept leaving out what a store
    cannot hold.

    Raises
    ------
    ConversionError
        Not a Zarr group with ``data/`` and ``meta/episode_ends``, ends that are not
        strictly increasing, arrays shorter than the episodes, a non-numeric array
        or an unsafe codec; rows past the last episode end (unless
        ``drop_past_ends``), meta arrays or entries a store cannot hold (unless
        ``drop_unsupported``).
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.

    Examples
    --------
    >>> import tempfile, numpy as np, zarr
    >>> d = tempfile.mkdtemp()
    >>> root = zarr.open_group(d + "/pusht.zarr", mode="w", zarr_format=2)
    >>> _ = root.create_array("data/action", data=np.random.rand(7, 2).astype("float32"))
    >>> _ = root.create_array("data/state", data=np.random.rand(7, 5).astype("float32"))
    >>> _ = root.create_array("meta/episode_ends", data=np.array([3, 7]))
    >>> s = convert_diffusion_policy(d + "/pusht.zarr", d + "/store", progress=False)
    >>> s["rows"], s["episodes"], s["verified"]
    (7, 2, True)
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    reader = DiffusionPolicyReader(Path(src).expanduser(), drop_past_ends=drop_past_ends,
                                   drop_unsupported=drop_unsupported)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )
