"""Export a store as a Diffusion Policy / UMI Zarr replay buffer (:func:`export_diffusion_policy`).

Writes the layout :mod:`._diffusion` reads: ``data/<column>`` for every stored
column, ``data/terminated`` and ``data/truncated`` (so the flags come back
exactly; Diffusion Policy's loaders ignore keys they are not asked for) and
``meta/episode_ends``. Zarr format 2 by default, the one Diffusion Policy's
``ReplayBuffer`` (zarr-python 2) opens; ``zarr_format=3`` for newer readers.
Live complete episodes are written stream by stream, oldest first. What the
layout has no place for is refused by name unless the user opts in to leaving
it out: the rows of an open episode (no end to put in ``meta/episode_ends``;
``drop_open_episodes``) and the final observation of each episode of a
next-derived column (``drop_final_obs``; zeros standing for unknown final
observations, ``attrs["final_obs_source"] == "zeros"``, are no data and need no
opt-in). The group is written by a
:class:`DiffusionPolicyWriter` in the frame of :mod:`._frame` (``OUT.partial``,
verified by reading it back with :class:`~mmbuffer.convert.DiffusionPolicyReader`,
then renamed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError, InvalidArgumentError
from ..readers.diffusion import DiffusionPolicyReader
from .._pipeline.export import ExportWriter, write_export
from .._pipeline.frame import crc_hex, crc_update, progress_bar
from .._pipeline.readback import check_reader
from .._pipeline.reader import FLAGS, jsonable
from .._pipeline.walk import chunk_rows_for, data_columns, plan_episodes, walk

__all__ = ["DiffusionPolicyWriter", "export_diffusion_policy"]


def export_diffusion_policy(
    store: Any,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    zarr_format: int = 2,
    drop_open_episodes: bool = False,
    drop_final_obs: bool = False,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Write a store as a Diffusion Policy Zarr group (``data/<column>``, ``meta/episode_ends``).

    Converting the group back (``convert("diffusion_policy", ...)``) gives the
    same rows and flags. Open episodes and final observations have no place in
    the layout: refused, by name, unless ``drop_open_episodes`` /
    ``drop_final_obs`` leave them out (with a warning).

    Parameters
    ----------
    store
        A store path or an open ``mb.Buffer``.
    out
        The ``.zarr`` directory to write, or a ``.zarr.zip`` file (refused if it
        exists, unless ``overwrite`` and it is such a group or zip).
    zarr_format
        2 (default: what Diffusion Policy opens) or 3.
    drop_open_episodes
        Leave out the rows of open episodes (``--drop-open-episodes``).
    drop_final_obs
        Leave out the final observations of next-derived columns (``--drop-final-obs``).

    Returns
    -------
    dict
        Summary: ``rows``, ``episodes``, ``skipped_open_rows``, ``checksums``,
        ``verified``, ``seconds``, ``warnings``.

    Raises
    ------
    ConversionError
        No complete episode; open episodes (unless ``drop_open_episodes``);
        next-derived columns (unless ``drop_final_obs``).

    Examples
    --------
    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> d = tempfile.mkdtemp()
    >>> with mb.create(d + "/s", {"action": ((2,), "float32")}, capacity=8, next_keys=()) as buf:
    ...     buf.extend({"action": np.ones((4, 2)), "truncated": np.arange(4) % 2 == 1})
    >>> s = export_diffusion_policy(d + "/s", d + "/out.zarr", progress=False)
    >>> s["rows"], s["episodes"], s["verified"]
    (4, 2, True)
    """
    t0 = time.perf_counter()
    if zarr_format not in (2, 3):
        raise InvalidArgumentError(f"zarr_format: expected 2 or 3, got {zarr_format!r}")
    writer = DiffusionPolicyWriter(store, out, zarr_format=zarr_format, chunk_rows=chunk_rows, progress=progress,
                                   drop_open_episodes=drop_open_episodes, drop_final_obs=drop_final_obs)
    return write_export(writer, out, overwrite=overwrite, verify=verify, started=t0)


class DiffusionPolicyWriter(ExportWriter):
    """Writes a store's complete episodes as a Diffusion Policy Zarr group."""

    kind = "diffusion_policy"

    def __init__(self, store: Any, out: str | os.PathLike[str], *, zarr_format: int, chunk_rows: int | None,
                 progress: bool, drop_open_episodes: bool = False, drop_final_obs: bool = False) -> None:
        super().__init__(store, out, chunk_rows=chunk_rows, progress=progress)
        self.zarr_format = zarr_format
        self.drop_open_episodes, self.drop_final_obs = drop_open_episodes, drop_final_obs

    def open(self) -> None:
        buf = self.buf = self.opened.open()
        self.where = getattr(buf, "path", self.store)
        self.plan, self.skipped = plan_episodes(buf, "none")
        if not self.plan.rows:
            raise ConversionError(f"{self.where}: expected at least one complete episode to export, got none")
        if self.skipped:
            what = (f"{self.skipped} rows of open (unfinished) episodes: meta/episode_ends has no place for an "
                    "episode without an end")
            self.leave_out(self.where, what, "drop_open_episodes", self.drop_open_episodes)
        finals = list(buf.next_keys) if buf.attrs.get("final_obs_source") != "zeros" else []
        if finals:
            what = (f"the final observations of {finals} (one per episode): the Diffusion Policy layout has no "
                    "observation after an episode's last step")
            self.leave_out(self.where, what, "drop_final_obs", self.drop_final_obs)

    def write(self, partial: Path) -> None:
        import zarr

        buf = self.buf
        rows_per = chunk_rows_for(buf, self.chunk_rows)
        keys = [*data_columns(buf), *FLAGS]
        if self.out_path.name.endswith(".zip"):
            # a zip is append-only: write the group as a directory beside it, then store it in the zip
            tmp = Path(tempfile.mkdtemp(prefix=".mmbuffer-dp-", dir=partial.parent))
            try:
                self._write_group(tmp, rows_per, keys, zarr)
                _zip_directory(tmp, partial)
            finally:
                shutil.rmtree(tmp)
        else:
            self._write_group(partial, rows_per, keys, zarr)

    def _source_meta(self, root: Any, rows: int, episodes: int) -> None:
        """A store converted from Diffusion Policy and unchanged since: the source group's other
        ``meta/<key>`` arrays and root attributes back (kept in ``attrs["diffusion_policy"]``)."""
        attrs = self.buf.attrs
        src, done = attrs.get("diffusion_policy"), attrs.get("convert") or {}
        if not isinstance(src, dict) or done.get("rows") != rows or done.get("episodes") != episodes:
            return
        if isinstance(src.get("attrs"), dict):
            root.attrs.update({k: v for k, v in src["attrs"].items() if k != "mmbuffer_attrs"})
        for name, m in (src.get("meta") or {}).items():
            if name != "episode_ends" and isinstance(m, dict) and {"dtype", "shape", "values"} <= set(m):
                value = np.asarray(m["values"], dtype=np.dtype(m["dtype"])).reshape(m["shape"])
                root.create_array(f"meta/{name}", data=value, chunks=tuple(max(1, d) for d in value.shape) or None)

    def _write_group(self, where: Path, rows_per: int, keys: list[str], zarr: Any) -> None:
        buf, plan, notes = self.buf, self.plan, self.notes
        n = plan.rows
        root = zarr.open_group(str(where), mode="w", zarr_format=self.zarr_format)
        root.attrs.update({"mmbuffer_attrs": jsonable(dict(buf.attrs))})
        arrays = {}
        for name in keys:
            col = buf.columns[name] if name in buf.columns else None
            shape = tuple(col.shape) if col else ()
            dtype = np.dtype(col.dtype) if col else np.dtype(bool)
            arrays[name] = root.create_array(f"data/{name}", shape=(n, *shape), dtype=dtype,
                                             chunks=(min(n, rows_per), *shape))
        crc: dict[str, int] = {}
        at = 0
        with progress_bar(n, "export diffusion_policy", self.progress) as bar:
            for piece in walk(buf, plan, keys, rows_per, release=self.opened.owned):
                m = len(piece.rows)
                for name in keys:
                    arrays[name][at : at + m] = piece.data[name]
                    crc_update(crc, name, piece.data[name])
                at += m
                bar.update(m)
        ends = np.cumsum(plan.lengths).astype(np.int64)
        root.create_array("meta/episode_ends", data=ends, chunks=(max(1, len(ends)),))
        self._source_meta(root, n, len(ends))
        self.crc = crc
        self.summary = {
            "format": "diffusion_policy",
            "store": str(self.where),
            "out": str(self.out_path),
            "zarr_format": self.zarr_format,
            "rows": n,
            "episodes": len(ends),
            "skipped_open_rows": self.skipped,
            "checksums": {k: crc_hex(v) for k, v in crc.items()},
            "verified": False,
            "warnings": notes,
        }

    def close(self) -> None:
        self.opened.close()

    def verify(self, partial: Path) -> None:
        check_reader(DiffusionPolicyReader(partial), self.summary, self.crc, None, partial)


def _zip_directory(src: Path, out: Path) -> None:
    """Store the files under ``src`` in the zip ``out`` (uncompressed, as Diffusion Policy's
    ``.zarr.zip`` files are: the chunks are compressed already)."""
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for top, _, files in os.walk(src):
            for name in sorted(files):
                full = Path(top) / name
                z.write(full, full.relative_to(src).as_posix())
