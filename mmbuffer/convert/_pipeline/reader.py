"""The reader contract: what every source format yields, and the helpers readers share.

A **reader** (:class:`Reader`) knows one source format. It declares a
:class:`Schema` (columns, next-derived keys, row count, attributes) and yields
the source in order as chunks ``(steps, final_obs)``: ``steps`` maps each column
to ``[T, *shape]`` numpy rows, ``final_obs`` maps each next-derived column to
one row per episode that *ends* inside the chunk (terminated or truncated), in
order. A reader never holds more than about one chunk of the source in memory.
:func:`~mmbuffer.convert.write_store` (:mod:`._write`) writes any reader into a
new store.
"""

from __future__ import annotations

import math
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ...errors import ConversionError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FLAGS",
    "Chunk",
    "ChunkAssembler",
    "ConversionWarning",
    "Reader",
    "Schema",
    "as_flag",
    "default_chunk_rows",
    "jsonable",
    "reader_error",
    "reader_warn",
]

#: Target size of one chunk (all columns together) when ``chunk_rows`` is not given.
DEFAULT_CHUNK_BYTES = 32 << 20
#: The two flag columns every store has.
FLAGS = ("terminated", "truncated")


class ConversionWarning(UserWarning):
    """Something in a source was kept but changed or is suspicious (open episode, ...)."""


class Chunk(NamedTuple):
    """One piece of a source, in order.

    ``steps``: column -> ``[T, *shape]`` array (``terminated``/``truncated`` bool
    ``[T]`` always present). ``final_obs``: next-derived column -> ``[E, *shape]``,
    one row per episode that ends inside ``steps``.
    """

    steps: dict[str, np.ndarray]
    final_obs: dict[str, np.ndarray]


@dataclass(frozen=True)
class Schema:
    """What a reader will produce.

    ``columns`` maps a store column name to ``(shape, dtype)`` (without the two
    flag columns, which every store has). ``next_keys`` are the columns whose next
    value is derived by the store (their final observation comes in
    ``Chunk.final_obs``). ``num_rows`` is the exact number of rows the reader
    yields; ``num_episodes`` the number of ended episodes when the source tells it
    up front (``None`` otherwise). ``attrs`` are JSON-serializable store attributes.
    ``specs`` maps a column to the spec :func:`~mmbuffer.create` gets in place of
    ``(shape, dtype)`` (an ``mb.Column`` with a codec the user named).
    """

    columns: dict[str, tuple[tuple[int, ...], str]]
    next_keys: tuple[str, ...]
    num_rows: int
    attrs: dict[str, Any] = field(default_factory=dict)
    num_episodes: int | None = None
    specs: dict[str, Any] = field(default_factory=dict)

    def row_bytes(self) -> int:
        total = 2  # the two flags
        for shape, dtype in self.columns.values():
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return total


class Reader(ABC):
    """A source format opened for streaming; see the module docstring.

    Subclasses set ``format`` and implement :attr:`schema` and :meth:`chunks`.
    ``notes`` collects the warnings raised while reading (they also go through
    :mod:`warnings` as :class:`ConversionWarning`).
    """

    format: str = "?"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.notes: list[str] = []
        self.stats: dict[str, Any] = {}

    @property
    @abstractmethod
    def schema(self) -> Schema:
        """The columns, next keys, row count and attributes of the source."""

    @abstractmethod
    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        """Yield the whole source in order, at most about ``chunk_rows`` rows at a time."""

    def close(self) -> None:  # noqa: B027 - optional hook, most readers hold no file
        """Release open files (idempotent)."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _warn(self, message: str) -> None:
        reader_warn(self, message, stacklevel=4)

    def _error(self, message: str, key: str | None = None) -> ConversionError:
        return reader_error(self, message, key)


def reader_warn(reader: Reader, message: str, *, stacklevel: int = 3) -> None:
    """Record ``message`` in ``reader.notes`` and issue it as a :class:`ConversionWarning`."""
    reader.notes.append(message)
    warnings.warn(f"{reader.path}: {message}", ConversionWarning, stacklevel=stacklevel)


def reader_error(reader: Reader, message: str, key: str | None = None) -> ConversionError:
    """A :class:`~mmbuffer.errors.ConversionError` naming ``reader``'s file (and ``key``)."""
    where = f"{reader.path}" + (f" [{key}]" if key else "")
    return ConversionError(f"{where}: {message}")


# -- helpers shared by the readers ------------------------------------------------------------
def jsonable(value: Any, *, max_items: int = 4096) -> Any:
    """Turn numpy / bytes / nested values into JSON-serializable ones (big arrays are summarized)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, max_items=max_items) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v, max_items=max_items) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        if value.size > max_items:
            return {"shape": list(value.shape), "dtype": str(value.dtype), "omitted": True}
        if value.dtype.kind in "SO":
            return jsonable(value.tolist(), max_items=max_items)
        return jsonable(value.tolist(), max_items=max_items)
    if isinstance(value, np.generic):
        return jsonable(value.item(), max_items=max_items)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def as_flag(arr: np.ndarray) -> np.ndarray:
    """A flag array of any numeric dtype and shape ``[T]`` or ``[T, 1]`` as bool ``[T]``."""
    a = np.asarray(arr)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.dtype != np.bool_:
        a = a != 0
    return a


def default_chunk_rows(schema: Schema, chunk_rows: int | None) -> int:
    """``chunk_rows`` checked, or about :data:`DEFAULT_CHUNK_BYTES` of ``schema``'s rows."""
    if chunk_rows is not None:
        if int(chunk_rows) < 1:
            raise ConversionError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
        return int(chunk_rows)
    return max(1024, DEFAULT_CHUNK_BYTES // max(1, schema.row_bytes()))


class ChunkAssembler:
    """Collect episode pieces and hand them back as chunks of about ``chunk_rows`` rows.

    Used by episode-structured readers (Minari, TD-MPC2): each piece is part of one
    episode; pieces are concatenated column-wise once ``chunk_rows`` rows are pending.
    """

    def __init__(self, chunk_rows: int) -> None:
        self.chunk_rows = chunk_rows
        self._steps: list[dict[str, np.ndarray]] = []
        self._final: list[dict[str, np.ndarray]] = []
        self._rows = 0

    def add(self, steps: dict[str, np.ndarray], final: dict[str, np.ndarray] | None) -> Chunk | None:
        self._steps.append(steps)
        if final:
            self._final.append(final)
        self._rows += len(steps["terminated"])
        if self._rows >= self.chunk_rows:
            return self.flush()
        return None

    def flush(self) -> Chunk | None:
        if not self._steps:
            return None
        if len(self._steps) == 1:
            steps = self._steps[0]
        else:
            steps = {k: np.concatenate([s[k] for s in self._steps]) for k in self._steps[0]}
        final: dict[str, np.ndarray] = {}
        if self._final:
            final = {k: np.stack([f[k] for f in self._final]) for k in self._final[0]}
        self._steps, self._final, self._rows = [], [], 0
        return Chunk(steps, final)
