"""What a Zarr reader sees of a store: named dimensions, and which rows are live.

A store is a Zarr v3 group (``_disk/format.py``), so zarr-python, tensorstore and
xarray open its arrays without mmbuffer. Two things make what they read usable:

* every array's ``zarr.json`` carries ``dimension_names`` (:func:`dimension_names`;
  xarray refuses arrays without them). ``columns/*`` and ``final/*`` share the row
  axis ``"row"`` (global row ids), so ``xr.open_zarr(path, group="columns",
  consolidated=False)`` is one dataset.
* the root group's attributes, under ``"mmbuffer"``, say which rows are live and
  where the episodes are, refreshed by every commit (:func:`publish`): a column
  holds ``capacity`` rows, unwritten ones read as zeros, and a wrapped ring's
  oldest row is anywhere in its lane, so the arrays alone do not say it.

The attributes (every counter an absolute row or episode number of its lane
that never wraps, as in ``manifest.json``)::

    {"format_version": 2, "generation": 7, "capacity": 20, "num_streams": 2,
     "lane_size": 10,
     "lanes": [{"written": 14, "first_start": 5, "ep_head": 1, "ep_tail": 2,
                "rows": [[5, 10], [0, 4]],    # global row ranges, oldest first
                "ends": [[1, 2]]}, ...]}      # ranges of index/ends, oldest first

Lane ``l``'s live rows are its absolute rows ``[first_start, written)``, at global
rows ``l * lane_size + a % lane_size``: the ``rows`` ranges, in order (at most two:
one before the ring's seam, one after). Its complete episodes are numbers
``ep_head .. ep_tail - 1``; their exclusive absolute ends are
``index/ends[a:b]`` over the ``ends`` ranges, in order; episode ``k`` starts where
``k - 1`` ended, the first at ``first_start``. Rows past the last end belong to
the open episode. ``docs/format.md`` has the reading recipe as runnable code
(zarr and numpy only), including what to check when a writer may be running.

Mid-commit: the attributes are replaced atomically (``zarr.json.partial``, then a
rename) after ``manifest.json``, so they describe a finished commit, the last or
(between the two renames, or if the write failed) the one before. A writer
running meanwhile may have rewritten rows they describe: a reader drops every
row below ``index/reserved[l] - lane_size``, read after its data (the rule
mmbuffer's own readers follow, docs/design.md "Readers and the writer").

>>> import tempfile, numpy as np, zarr, mmbuffer as mb
>>> path = tempfile.mkdtemp() + "/s"
>>> buf = mb.create(path, {"x": ((), "int64")}, capacity=8, next_keys=())
>>> for a in (0, 6):
...     buf.extend({"x": a + np.arange(6), "terminated": (a + np.arange(6)) % 4 == 3})
>>> _ = buf.commit()
>>> lane = zarr.open_group(path, mode="r").attrs["mmbuffer"]["lanes"][0]
>>> lane["first_start"], lane["rows"], lane["ep_head"], lane["ep_tail"]
(4, [[4, 8], [0, 4]], 1, 3)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._disk import files as _files, safe_io as _safe_io
from .. import errors
from .._disk import format as fmt
from .._disk.format import dimension_names
from .index import Lane, slot_ranges
from .layout import Layout

__all__ = ["attributes", "dimension_names", "publish"]


def attributes(layout: Layout, lanes: Sequence[Lane], generation: int, version: int = fmt.FORMAT_VERSION) -> dict[str, Any]:
    """The ``"mmbuffer"`` attributes of the root group for a commit (module docstring)."""
    n = layout.lane_size
    out = []
    for lane, st in enumerate(lanes):
        rows = [[a, b] for a, b in layout.segments(lane, st.first_start, st.written)]
        ends = [[a, b] for a, b in slot_ranges(lane, n, st.ep_head, st.ep_tail)]
        out.append({**st.to_json(), "rows": rows, "ends": ends})
    return {
        "format_version": version,
        "generation": generation,
        "capacity": layout.capacity,
        "num_streams": layout.num_streams,
        "lane_size": n,
        "lanes": out,
    }


def publish(path: Path, layout: Layout, lanes: Sequence[Lane], generation: int, version: int = fmt.FORMAT_VERSION) -> None:
    """Replace the root ``zarr.json`` by one whose ``"mmbuffer"`` attributes describe
    commit ``generation`` (called by ``Store.commit`` after the manifest).

    Other attributes and fields of the group are kept. A failed write (a full disk,
    or something not a file at ``zarr.json.partial``) leaves the previous ``zarr.json`` in place: it describes an older commit, which
    a reader that follows the reservation rule reads safely, and the next commit
    writes it again; the commit itself has succeeded by then, so it is not undone.
    """
    try:
        meta = json.loads(_safe_io.read_bytes(path, "zarr.json", limit=1 << 20))
    except (OSError, ValueError, RecursionError, errors.CorruptStoreError):  # missing, a link, not JSON
        meta = None  # written anew
    if not isinstance(meta, dict) or meta.get("node_type") != "group":
        meta = {"zarr_format": 3, "node_type": "group", "attributes": {}}
    attrs = meta.get("attributes")
    attrs = dict(attrs) if isinstance(attrs, dict) else {}
    attrs["mmbuffer"] = attributes(layout, lanes, generation, version)
    meta["attributes"] = attrs
    try:
        _files.atomic_write_json(path / "zarr.json", meta)
    except (OSError, errors.CorruptStoreError):  # a full disk; something planted at zarr.json.partial
        pass
