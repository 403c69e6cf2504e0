"""Minari's Arrow/Parquet episodes: Arrow columns into numpy leaves (needs ``pyarrow``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .minari_spaces import decode_jpeg, is_image
from .._pipeline.reader import Reader, reader_error

__all__ = ["arrow_info_leaves", "arrow_leaves", "null_fill", "null_rows"]


def null_rows(arr: Any) -> np.ndarray:
    """The rows of the Arrow array ``arr`` that are null (missing)."""
    if not arr.null_count:
        return np.zeros(0, np.int64)
    return np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))


def arrow_leaves(arr: Any, space: dict[str, Any] | None, col: str, out: dict[str, np.ndarray],
                 reader: Reader, *, jpeg: bool, nulls: dict[str, np.ndarray] | None = None) -> None:
    """Put the numpy leaves of the Arrow column ``arr`` into ``out`` as ``col/...`` (images decoded).

    Null rows (Minari pads an episode's step columns with one, at row T) are filled
    with 0/False; ``nulls`` gets the null rows of each column that has any.
    """
    import pyarrow as pa

    if nulls is not None and arr.null_count:
        nulls[col] = null_rows(arr)
    kind = (space or {}).get("type")
    if pa.types.is_struct(arr.type):
        for i, field in enumerate(arr.type):
            sub = None
            if kind == "Dict":
                sub = space["subspaces"].get(field.name)  # type: ignore[index]
                name = field.name
            elif kind == "Tuple":
                sub = space["subspaces"][int(field.name)]  # type: ignore[index]
                name = f"_index_{field.name}"
            else:
                name = field.name
            arrow_leaves(arr.field(i), sub, f"{col}/{name}", out, reader, jpeg=jpeg, nulls=nulls)
        return
    if space is not None and jpeg and is_image(space) and pa.types.is_binary(arr.type):
        frames = [np.frombuffer(x.as_py() or b"", np.uint8) for x in arr]
        # the action column of an Arrow episode is padded with one null row
        valid = [f for f in frames if len(f)]
        img = decode_jpeg(valid, f"{reader.path}:{col}")
        if len(valid) < len(frames):
            img = np.concatenate([img, np.zeros((len(frames) - len(valid), *img.shape[1:]), np.uint8)])
        out[col] = img
        return
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        flat = arr.flatten().fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
        n = len(arr)
        shape = tuple(space["shape"]) if space and "shape" in space else (width,)
        if kind == "MultiBinary" and space is not None:
            nsp = space.get("n")
            shape = tuple(nsp) if isinstance(nsp, list) else (int(str(nsp)),)
        if kind == "MultiDiscrete" and space is not None:
            shape = tuple(np.asarray(space["nvec"]).shape)
        if int(np.prod(shape)) != width:
            shape = (width,)
        out[col] = flat.reshape(n, *shape)
        return
    if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        out[col] = arr.fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
        return
    raise reader_error(reader, f"unsupported Arrow type {arr.type}", col)


def null_fill(arr: Any) -> Any:
    """A fill value for the nulls Minari pads Arrow episodes with (False for bool)."""
    import pyarrow as pa

    typ = arr.type.value_type if pa.types.is_fixed_size_list(arr.type) else arr.type
    return pa.scalar(False if pa.types.is_boolean(typ) else 0, type=typ)


def arrow_info_leaves(arr: Any, col: str, out: dict[str, np.ndarray], n: int,
                      unsupported: dict[str, str] | None = None) -> None:
    """Put the numeric leaves of the Arrow ``infos`` column ``arr`` into ``out`` as ``col/...``.

    Leaves of any other type, or with missing (null) values, are named in
    ``unsupported`` (leaf -> why), never silently left out or filled.
    """
    import pyarrow as pa

    if unsupported is not None and arr.null_count and not pa.types.is_struct(arr.type):
        unsupported[col] = f"missing (null) values at rows {null_rows(arr)[:8].tolist()}"
        return

    if pa.types.is_struct(arr.type):
        for i, field in enumerate(arr.type):
            arrow_info_leaves(arr.field(i), f"{col}/{field.name}", out, n, unsupported)
            if f"{col}/{field.name}" in out and field.metadata and b"shape" in field.metadata:
                shape = tuple(int(s) for s in field.metadata[b"shape"].split(b",") if s)
                out[f"{col}/{field.name}"] = out[f"{col}/{field.name}"].reshape(-1, *shape)
        return
    if pa.types.is_fixed_size_list(arr.type):
        flat = arr.flatten().fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
        out[col] = flat.reshape(len(arr), arr.type.list_size)
    elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        out[col] = arr.fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
    elif unsupported is not None:
        unsupported[col] = f"Arrow type {arr.type}, not numeric"
