"""Re-encode a store: raw memory-mapped <-> zstd/lz4 archive.

:func:`copy` keeps the geometry (capacity, streams, priority settings), the
``attrs`` and every lane's open episode, and changes the encoding
(``compression``). It walks the source like the exporters (:mod:`._export`:
lane by lane, live complete episodes oldest first, then the open episode) and
verifies like the converters (:mod:`._common`): every written piece is read back
from the new store's files and compared byte for byte, and the reopened copy
must hold the same episodes. The stored priorities of a prioritized store are
copied exactly (:meth:`~mmbuffer.Buffer.set_leaf_priorities`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._common import (
    SEGMENT_BYTES,
    _hex,
    _mismatch,
    _ReadBack,
    abandon,
    jsonable,
    progress_bar,
    same_bytes,
)
from ._dest import check_destination, partial_path, remove_partial, replace_destination
from ._export import (
    _FLAGS,
    _chunk_rows,
    _crc_update,
    _data_columns,
    _Opened,
    _plan,
    _row_bytes,
    _walk,
)

__all__ = ["copy", "copy_store"]


def copy(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    compression: str | None = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Copy a store into a new one with another encoding (``compression``).

    ``None`` gives a raw memory-mapped store (for training), ``"zstd"`` /
    ``"lz4"`` a compressed archive. Capacity, streams, columns, next keys,
    priority settings and ``attrs`` are kept; every lane's live episodes are
    written oldest first, then its open episode, so the copy samples the same
    data with the same probabilities (its rows start at row 0 of each lane;
    each row keeps its stored priority). Built at ``dst + ".partial"``,
    verified, then renamed.

    Parameters
    ----------
    src
        A store path or an open ``mb.Buffer``.
    dst
        The new store's path.
    compression
        ``None``, ``"zstd"`` or ``"lz4"``.
    chunk_rows
        Rows per read and ``extend`` (default: about 32 MiB of rows).
    verify
        Read every written piece back and compare it; reopen the copy and
        compare its episodes.

    Returns
    -------
    dict
        Summary: ``rows``, ``episodes``, ``open_episode_rows``, ``checksums``
        (``"<lane>:<column>"`` -> CRC-32 of the source rows), ``verified``,
        ``seconds``, ``rows_per_s``, ``mb_per_s``.

    Examples
    --------
    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> d = tempfile.mkdtemp()
    >>> with mb.create(d + "/raw", {"x": ((), "float32")}, capacity=8, next_keys=()) as buf:
    ...     buf.extend({"x": np.arange(5), "terminated": np.arange(5) == 2})
    >>> copy(d + "/raw", d + "/zst", compression="zstd", progress=False)["verified"]
    True
    >>> mb.open(d + "/zst", mode="r").get(np.arange(5))["x"].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0]
    """
    import mmbuffer as mb

    t0 = time.perf_counter()
    dst_path = check_destination(dst, overwrite)
    partial = partial_path(dst_path)
    remove_partial(partial)
    opened = _Opened(src)
    with opened as buf:
        rows_per = min(_chunk_rows(buf, chunk_rows), int(buf.lane_size))
        plan, _ = _plan(buf, "all")
        cols = _data_columns(buf)
        keys = [*cols, *_FLAGS]
        crc: dict[str, int] = {}
        out = None
        try:
            out = mb.create(
                str(partial),
                columns={k: (tuple(buf.columns[k].shape), buf.columns[k].dtype) for k in cols},
                capacity=int(buf.capacity),
                num_streams=int(buf.num_streams),
                compression=compression,
                priorities=getattr(buf, "priorities", None),
                next_keys=tuple(buf.next_keys),
                attrs=jsonable(dict(buf.attrs)),
            )
            readback = _ReadBack(partial) if verify else None
            written = np.zeros(int(buf.num_streams), np.int64)  # rows per lane of the copy
            segment = max(rows_per, SEGMENT_BYTES // max(1, _row_bytes(buf)))
            since = 0
            with progress_bar(plan.rows, "copy", progress) as bar:
                for piece in _walk(buf, plan, keys, rows_per, release=opened.owned):
                    for name in keys:
                        _crc_update(crc, f"{piece.lane}:{name}", piece.data[name])
                    out.extend(piece.data, stream=piece.lane, final_obs=piece.final or None)
                    n = len(piece.rows)
                    row = piece.lane * int(buf.lane_size) + int(written[piece.lane])
                    if out.priorities is not None:  # the stored priorities, exactly
                        leaves, rows = buf.leaf_priorities(piece.rows), np.arange(row, row + n)
                        out.set_leaf_priorities(rows, leaves)
                        if readback is not None and not same_bytes(out.leaf_priorities(rows), leaves):
                            raise _mismatch(partial, f"priorities of rows [{row}, {row + n})", "the source's", "others")
                    if readback is not None:
                        readback.check(out, row, piece.data, piece.final)
                    written[piece.lane] += n
                    bar.update(n)
                    since += n
                    if since >= segment:  # unmap what was written through the maps (flat memory)
                        out.release_memory()
                        since = 0
            out.commit()
            out.close()
            out = None
        except BaseException as exc:
            abandon(out, partial, exc)
            raise
        summary: dict[str, Any] = {
            "format": "copy",
            "store": str(getattr(buf, "path", src)),
            "out": str(dst_path),
            "compression": compression,
            "rows": plan.rows,
            "episodes": int(plan.complete.sum()),
            "open_episode_rows": int(plan.lengths[~plan.complete].sum()),
            "checksums": {k: _hex(v) for k, v in crc.items()},
            "verified": False,
        }
        nbytes = _row_bytes(buf) * plan.rows
    if verify:
        _verify_episodes(partial, plan)
        summary["verified"] = True
    replace_destination(partial, dst_path, overwrite=overwrite)
    seconds = time.perf_counter() - t0
    summary.update(
        seconds=round(seconds, 3),
        rows_per_s=round(plan.rows / seconds, 1) if seconds else None,
        mb_per_s=round(nbytes / seconds / 1e6, 1) if seconds else None,
    )
    return summary


def _verify_episodes(path: Path, plan: Any) -> None:
    """The reopened copy holds the plan's episodes, lane by lane, in order."""
    import mmbuffer as mb

    with mb.open(str(path), mode="r") as new:
        got, _ = _plan(new, "all")
    if got.rows != plan.rows:
        raise _mismatch(path, "rows", plan.rows, got.rows)
    if int(got.complete.sum()) != int(plan.complete.sum()):
        raise _mismatch(path, "episodes", int(plan.complete.sum()), int(got.complete.sum()))
    if not (np.array_equal(got.lengths, plan.lengths) and np.array_equal(got.lanes, plan.lanes)):
        raise _mismatch(path, "episode lengths by lane", plan.lengths[:8].tolist(), got.lengths[:8].tolist())


#: Alias that does not shadow the standard library's ``copy`` in ``from ... import *``.
copy_store = copy
