"""Column backends behind one protocol (:class:`ColumnArray`); see ``base.py``.

>>> import tempfile, numpy as np
>>> from pathlib import Path
>>> from mmbuffer._disk import format as fmt
>>> root = Path(tempfile.mkdtemp())
>>> fmt.create_compressed(root, "x", 8, (), np.dtype("int64"), "zstd")
>>> col = open_array(root, "x", compressed=True, writable=True)
>>> col.write_range(2, np.arange(3)); col.read_range(0, 6).tolist()
[0, 0, 0, 1, 2, 0]
"""

from __future__ import annotations

from pathlib import Path

from .. import format as fmt
from .base import ColumnArray
from .compressed import ZarrArray
from .raw import RawArray
from .sharded import ShardedArray

__all__ = ["ColumnArray", "RawArray", "ShardedArray", "ZarrArray", "open_array"]


def open_array(
    root: Path, name: str, *, compressed: bool, writable: bool, expect: fmt.Expect | None = None
) -> ColumnArray:
    """Open the array ``root/name`` with the backend its layout needs."""
    kind = ZarrArray if compressed else RawArray
    return kind.open(root, name, writable=writable, expect=expect)
