"""How far a writer's overwrite got: ``index/progress``, trusted within one boot.

``index/reserved`` (``writer.py``) is the durable bound on the rows a writer may
have rewritten: msync'ed before the rows it covers, so it holds after a power cut
too. But it runs a window (a lane/16) ahead of the cursor, because an msync per
``extend`` would cost a disk flush each. Recovering from it alone gave up every
committed episode in that window.

``index/progress`` is int64 ``[2 + num_streams]``: the kernel's boot id (two int64
halves of ``/proc/sys/kernel/random/boot_id``) and, per lane, the absolute row up
to which the writer may have written: stored through the shared map before the rows
of each ``extend``, never msync'ed. A killed process leaves its stores in the page
cache, which every later process of the same boot reads, so after a kill the
record is exact; after a power cut or a reboot it may be stale, and the boot id
tells: it no longer matches, and recovery falls back to ``index/reserved``. The lanes
are stored before the boot id, so a record of this boot has lanes of this boot.
A record that contradicts the counters (below the commit, above the reservation)
is not trusted either: it can only ever narrow what recovery gives up, to what
``index/reserved`` allows.

Readers do not use it: they keep to ``index/reserved`` (docs/design.md, "Readers and
the writer"). Stores made before it existed get it when a writer first opens them
(built beside and renamed into place).
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import uuid
from pathlib import Path

import numpy as np

from .._disk import files as _files, format as fmt, safe_io as _safe_io
from .._disk.columns import RawArray
from .index import Lane

NAME = "index/progress"


@functools.cache
def boot_id() -> tuple[int, int]:
    """This boot's id as two int64, or ``(0, 0)`` where the kernel does not say
    (then no record is ever trusted)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            raw = uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return (0, 0)
    hi, lo = np.frombuffer(raw, dtype=">i8").tolist()
    return (int(hi), int(lo)) if (hi, lo) != (0, 0) else (0, 1)


def create(root: Path, num_streams: int) -> None:
    """Create the (empty, untrusted) record of a store being laid out at ``root``."""
    fmt.create_raw(root, NAME, 2 + num_streams, (), np.dtype(np.int64), allocate=True)


def open_record(root: Path, num_streams: int) -> tuple[RawArray, np.ndarray]:
    """The writer's record of store ``root`` (created first if the store predates it)."""
    arr, mapped, _ = open_or_add(root, NAME, 2 + num_streams, np.dtype(np.int64))
    return arr, mapped


def open_or_add(root: Path, name: str, rows: int, dtype: np.dtype) -> tuple[RawArray, np.ndarray, bool]:
    """Open the writer's raw array ``name`` of store ``root`` (mapped, writable), and
    say whether it was just added: a store made before it existed gets it first, all
    blocks allocated (a store through the map then never meets a full disk), built
    beside and renamed into place."""
    expect = (rows, (), dtype)
    added = not _safe_io.lexists(root, f"{name}/zarr.json")
    if added:
        parent, leaf = name.rsplit("/", 1)
        tmp = f"{parent}/.{leaf}-{secrets.token_hex(6)}"
        try:
            fmt.create_raw(root, f"{tmp}/{leaf}", rows, (), dtype, allocate=True)
            _files.fsync_tree(root / tmp)
            os.rename(root / tmp / leaf, root / name)
            _files.fsync_dir(root / parent)
        finally:
            shutil.rmtree(root / tmp, ignore_errors=True)
    arr = RawArray.open(root, name, writable=True, expect=expect)
    mapped = arr.mapped()
    assert mapped is not None
    return arr, mapped, added


def trusted(record: np.ndarray) -> bool:
    """Whether ``record`` was written in this boot (its stores then survived any kill)."""
    return tuple(int(v) for v in record[:2]) == boot_id() and boot_id() != (0, 0)


def limits(record: np.ndarray, reserved: np.ndarray, committed: tuple[Lane, ...]) -> list[int]:
    """Per lane, the absolute row below which a dead writer may have written: the
    record's, when it is of this boot and within ``[committed written, reserved]``,
    else ``reserved``."""
    ok = trusted(record)
    out = []
    for lane, st in enumerate(committed):
        got, bound = int(record[2 + lane]), int(reserved[lane])
        out.append(got if ok and st.written <= got <= bound else bound)
    return out


def start(record: np.ndarray, lanes: list[int]) -> None:
    """Record ``lanes`` as this writer's starting point, then this boot's id."""
    record[2:] = lanes
    record[:2] = boot_id()


def raise_reservation(root: Path, rows: list[int]) -> None:
    """Raise the reservation of the closed store ``root`` to ``rows`` per lane (never
    lowered): its readers then leave out every episode that starts below ``rows[lane] -
    lane_size``, as they would beside a writer that reserved that far (a publish's copy
    leaves out what the source's readers did: ``convert/_pipeline/staged.py``). Durable
    when this returns."""
    arr = RawArray.open(root, "index/reserved", writable=True, expect=(len(rows), (), np.dtype(np.int64)))
    try:
        mapped = arr.mapped()
        assert mapped is not None
        arr.write_range(0, np.maximum(mapped, np.asarray(rows, np.int64)))
        _files.fsync_in(root, "index/reserved/c/0")
    finally:
        arr.close()
