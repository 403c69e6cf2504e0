"""Checks of user input shared by the store's entry points: each raises a typed error
from :mod:`mmbuffer.errors` that names the argument, the expected and the received value.

>>> check_int("batch_size", 256, 1)
256
>>> check_int("batch_size", 0, 1)
Traceback (most recent call last):
    ...
mmbuffer.errors.InvalidArgumentError: batch_size: expected an integer >= 1, got 0
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from . import format as fmt
from .. import errors
from ..schema import Column


def check_schema(columns: Mapping[str, tuple[Any, Any]], next_keys: Iterable[str]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    if not isinstance(columns, Mapping) or not columns:
        raise errors.SchemaError(f"columns: expected a non-empty mapping name -> (shape, dtype), got {columns!r}")
    schema: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for name, spec in columns.items():
        fmt.check_column_name(name)
        if name in fmt.RESERVED_NAMES:
            raise errors.SchemaError(f"column {name!r}: reserved (always present as bool), remove it from columns")
        try:
            shape, dtype = spec
        except (TypeError, ValueError):
            raise errors.SchemaError(f"column {name!r}: expected (shape, dtype), got {spec!r}") from None
        schema[name] = (fmt.check_shape(name, shape), fmt.check_dtype(name, dtype))
    names = sorted(schema)
    for a, b in zip(names, names[1:]):
        if b.startswith(a + "/"):
            raise errors.SchemaError(f"column {b!r}: nested under column {a!r}; a name cannot be both a column and a group")
    for flag in sorted(fmt.RESERVED_NAMES):
        schema[flag] = ((), np.dtype(bool))
    if isinstance(next_keys, str):
        raise errors.SchemaError(f"next_keys: expected a sequence of column names, got the string {next_keys!r}")
    for key in next_keys:
        if key not in schema or key in fmt.RESERVED_NAMES:
            raise errors.SchemaError(f"next_keys: expected names among columns {sorted(columns)}, got {key!r}")
    return schema


def check_codecs(columns: Mapping[str, Any]) -> dict[str, str]:
    """The codec of each column given as ``mb.Column(..., codec=...)`` with one (checked:
    ``fmt.parse_codec``); a ``(shape, dtype)`` tuple means raw.

    >>> check_codecs({"pixels": Column((84, 84), "uint8", codec="zstd:5"), "action": ((), "int64")})
    {'pixels': 'zstd:5'}
    """
    out: dict[str, str] = {}
    for name, spec in columns.items():
        codec = spec.codec if isinstance(spec, Column) else None
        if codec is not None:
            check_column_codec(name, codec, spec.shape, spec.dtype)
            out[name] = codec
    return out


def check_column_codec(name: str, codec: object, shape: Any, dtype: Any) -> None:
    """``fmt.check_codec`` (the codec, and the frames a lossy image codec takes), and for
    ``jpeg`` its library (``SchemaError`` naming the column and the extra)."""
    kind, _ = fmt.check_codec(name, codec, fmt.check_shape(name, shape), fmt.check_dtype(name, dtype))
    if kind == "jpeg":
        from .columns.jpeg import imagecodecs

        imagecodecs(name)


def check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
        raise errors.InvalidArgumentError(f"{name}: expected an integer >= {low}, got {value!r}")
    return int(value)


def check_stream(stream: object, num_streams: int) -> int:
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)) or not 0 <= int(stream) < num_streams:
        raise errors.InvalidArgumentError(f"stream: expected an integer in [0, {num_streams}), got {stream!r}")
    return int(stream)


def check_json(obj: Any) -> None:
    try:
        json.dumps(obj)
    except (TypeError, ValueError) as exc:
        raise errors.InvalidArgumentError(f"attrs: expected JSON-serializable values, got {exc}") from None


def as_numpy(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise errors.SchemaError(f"{name}: expected an array, got {type(value).__name__} ({exc})") from None


def cast_to(arr: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """``arr`` as ``dtype``: a ``same_kind`` cast whose values all fit (an integer in
    the column's range, a finite float still finite), else ``SchemaError``."""
    if arr.dtype == dtype:
        return arr
    if not np.can_cast(arr.dtype, dtype, "same_kind"):
        raise errors.SchemaError(f"{what}: expected dtype {dtype}, got {arr.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
        out = arr.astype(dtype)
    if np.can_cast(arr.dtype, dtype, "safe") or arr.size == 0:
        return out
    if arr.dtype.kind in "iu" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise errors.SchemaError(
                f"{what}: expected values of {dtype} in [{info.min}, {info.max}], got {arr.dtype} values in [{lo}, {hi}]"
            )
    elif arr.dtype.kind == "f" and dtype.kind == "f":
        grew = np.isinf(out) & np.isfinite(arr)
        if grew.any():
            raise errors.SchemaError(
                f"{what}: expected values that fit {dtype} (|x| <= {np.finfo(dtype).max}), got {arr.dtype} values {arr[grew][:3].tolist()}"
            )
    return out


def row_ids(value: Any, capacity: int) -> np.ndarray:
    """Integer row ids as a flat int64 array (range checked by the caller); a float
    id would be truncated to another row, so any other dtype is refused."""
    raw = as_numpy(value, "indices")
    if raw.dtype.kind not in "iu" and raw.size:
        raise errors.InvalidArgumentError(f"indices: expected integer row ids, got dtype {raw.dtype}")
    if raw.dtype == np.uint64 and raw.size and int(raw.max()) >= capacity:  # would wrap to negative
        raise errors.InvalidArgumentError(f"indices: expected row ids in [0, {capacity}), got {raw[raw >= capacity][:3].tolist()}")
    return raw.astype(np.int64, copy=False).reshape(-1)


def validate_steps(columns: Mapping[str, Column], steps: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The block as arrays of the columns' dtypes (flags filled in) and its end flags."""
    if not isinstance(steps, Mapping):
        raise errors.SchemaError(f"steps: expected a mapping column -> array, got {type(steps).__name__}")
    given = set(steps)
    required = set(columns) - fmt.RESERVED_NAMES
    if not required <= given or not given <= set(columns):
        raise errors.SchemaError(
            f"steps: expected columns {sorted(required)} (+ optional terminated, truncated), "
            f"got {sorted(given)}; missing {sorted(required - given)}, unknown {sorted(given - set(columns))}"
        )
    arrays = {}
    for name in steps:
        arr = as_numpy(steps[name], name)
        col = columns[name]
        if arr.shape[1:] != col.shape or arr.ndim != 1 + len(col.shape):
            raise errors.SchemaError(
                f"column {name!r}: expected rows of shape {col.shape} (array [T, {', '.join(map(str, col.shape))}]), "
                f"got array of shape {tuple(arr.shape)}"
            )
        arrays[name] = cast_to(arr, np.dtype(col.dtype), f"column {name!r}")
    lengths = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise errors.SchemaError(f"steps: expected the same number of rows in every column, got {lengths}")
    rows = next(iter(lengths.values()))
    for flag in fmt.RESERVED_NAMES - given:
        arrays[flag] = np.zeros(rows, dtype=bool)
    return arrays, arrays["terminated"] | arrays["truncated"]

def validate_final(
    columns: Mapping[str, Column], next_keys: tuple[str, ...], final_obs: Mapping[str, Any] | None, n_done: int
) -> dict[str, np.ndarray]:
    """The final observations of the ``n_done`` episodes that end in a block, as arrays."""
    if not next_keys:
        if final_obs:
            raise errors.SchemaError(
                f"final_obs: this store derives no next columns (next_keys=()), got keys {sorted(final_obs)}"
            )
        return {}
    if final_obs is None:
        if n_done == 0:
            return {}
        raise errors.SchemaError(
            f"final_obs: expected {n_done} final observations for {list(next_keys)} "
            f"(episodes ending in this block), got None"
        )
    if set(final_obs) != set(next_keys):
        raise errors.SchemaError(f"final_obs: expected keys {sorted(next_keys)}, got {sorted(final_obs)}")
    out = {}
    for name in next_keys:
        arr = as_numpy(final_obs[name], f"final_obs[{name!r}]")
        col = columns[name]
        if arr.shape != (n_done, *col.shape):
            raise errors.SchemaError(
                f"final_obs[{name!r}]: expected shape {(n_done, *col.shape)} "
                f"({n_done} episodes end in this block), got {tuple(arr.shape)}"
            )
        out[name] = cast_to(arr, np.dtype(col.dtype), f"final_obs[{name!r}]")
    return out
