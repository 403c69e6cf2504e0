"""Verification by read-back: compare what was written with what was read.

* :class:`ReadBack` reads each chunk back from a store's files right after it
  was written (``pread``, while its pages are still in the page cache) and
  compares it byte for byte with the chunk the writer was given, final
  observations included. Used by the converters and :func:`~mmbuffer.convert.copy`.
* :func:`check_reader` streams a finished export back through this package's
  own reader of that format and compares rows, episodes and a CRC-32 per
  column with the checksums taken while writing.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError
from .frame import crc_hex, crc_update, mismatch, same_bytes
from .reader import Reader

__all__ = ["ReadBack", "check_reader"]


class ReadBack:
    """Reads each written chunk back from the store's files and compares its bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._scratch: dict[str, np.ndarray] = {}  # reused: no fresh pages per chunk

    def _out(self, buf: Any, name: str, rows: int) -> np.ndarray:
        out = self._scratch.get(name)
        if out is None or len(out) < rows:
            col = buf.columns[name]
            out = self._scratch[name] = np.empty((rows, *col.shape), dtype=np.dtype(col.dtype).newbyteorder("<"))
        return out[:rows]

    def check(self, buf: Any, row: int, steps: Mapping[str, np.ndarray], final: Mapping[str, np.ndarray]) -> None:
        """Compare rows ``[row, row + len(steps))`` of ``buf`` and their final observations."""
        n = len(steps["terminated"])
        for name, arr in steps.items():
            back = buf.read_range(name, row, row + n, out=self._out(buf, name, n))
            src = np.ascontiguousarray(arr, dtype=back.dtype)
            if not same_bytes(back, src):
                differs = (back.reshape(n, -1).view(np.uint8) != src.reshape(n, -1).view(np.uint8)).any(axis=1)
                src = _lossy(buf, name, src, differs)
                differs = (back.reshape(n, -1).view(np.uint8) != src.reshape(n, -1).view(np.uint8)).any(axis=1)
                if differs.any():
                    bad = int(np.flatnonzero(differs)[0])
                    raise mismatch(self.path, f"column {name!r} at row {row + bad}", src[bad], back[bad])
        ends = row + np.flatnonzero(steps["terminated"] | steps["truncated"])
        for name, arr in final.items():
            if len(arr):
                back = buf.read(f"final/{name}", ends)
                if not same_bytes(np.ascontiguousarray(back), np.ascontiguousarray(arr, dtype=back.dtype)):
                    raise mismatch(self.path, f"final observations {name!r} of the episodes ending in "
                                   f"rows [{row}, {row + n})", "the source's", "other values")


def _lossy(buf: Any, name: str, src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """What a column with a lossy codec returns for ``src``: the rows ``rows`` (those
    read back other than written: their shard is encoded) as the codec's own round
    trip, which is deterministic; ``src`` itself for any other column."""
    from ..._disk.columns.jpeg import roundtrip
    from ..._disk.format import parse_codec

    codec = buf.columns[name].codec
    if codec is None or parse_codec(name, codec)[0] != "jpeg" or not rows.any():
        return src
    out = src.copy()
    out[rows] = roundtrip(name, src[rows], parse_codec(name, codec)[1])
    return out


def check_reader(
    reader: Reader, summary: dict[str, Any], crc: dict[str, int], final_crc: dict[str, int] | None,
    where: Path,
) -> None:
    """Stream ``reader`` and compare its columns with the checksums taken while writing."""
    got: dict[str, int] = {}
    got_final: dict[str, int] = {}
    rows = episodes = 0
    with reader, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for steps, final in reader.chunks(1 << 18):
            for k, v in steps.items():
                crc_update(got, k, v)
            for k, v in final.items():
                crc_update(got_final, k, v)
            rows += len(steps["terminated"])
            episodes += int((steps["terminated"] | steps["truncated"]).sum())

    def fail(what: str, expected: Any, value: Any) -> ConversionError:
        return ConversionError(
            f"{where}: verification failed: {what}: expected {expected}, got {value} "
            "(the partial output is left for inspection)"
        )

    if rows != summary["rows"]:
        raise fail("rows", summary["rows"], rows)
    if episodes != summary["episodes"]:
        raise fail("episodes", summary["episodes"], episodes)
    for name, want in crc.items():
        if got.get(name) != want:
            raise fail(f"column {name!r} checksum", crc_hex(want),
                       crc_hex(got[name]) if name in got else "no such column")
    if final_crc is not None:
        for name, want in final_crc.items():
            if got_final.get(name, 0) != want:
                raise fail(f"final observation {name!r} checksum", crc_hex(want), crc_hex(got_final.get(name, 0)))
