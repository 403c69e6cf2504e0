"""Export a store as a Minari dataset directory (:func:`export_minari`).

Only complete episodes are written (a Minari episode needs its final
observation): open episodes are refused, by name, unless ``drop_open_episodes``
leaves them out; so are columns with no place in a Minari dataset, unless
``drop_unsupported``. Spaces come from ``attrs["minari"]`` when the store was converted
from Minari, otherwise ``Box`` spaces are built from the columns.
``jpeg_encoding`` is false: images are stored raw. The dataset is written by a
:class:`MinariWriter` in the frame of :mod:`._frame` (``OUT.partial``, verified
by reading it back with :class:`~mmbuffer.convert.MinariReader`, then renamed).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError
from .._pipeline.export import ExportWriter, write_export
from .._pipeline.frame import crc_hex, crc_update, progress_bar
from ..readers.minari import MinariReader
from ..readers.minari_spaces import leaf_names, space_for
from .._pipeline.readback import check_reader
from .._pipeline.reader import FLAGS
from .._pipeline.walk import chunk_rows_for, data_columns, plan_episodes, walk

__all__ = ["MinariWriter", "export_minari"]

_ID = re.compile(r"^(?:[-_\w][-_\w/]*[-_\w]+/)?[-_\w]+?-v\d+$")


def export_minari(
    store: Any,
    out: str | os.PathLike[str],
    *,
    dataset_id: str | None = None,
    drop_open_episodes: bool = False,
    drop_unsupported: bool = False,
    overwrite: bool = False,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Write a store as a Minari dataset directory (HDF5 format, readable by ``minari``).

    ``out`` becomes the dataset directory (``out/data/main_data.hdf5`` and
    ``out/data/metadata.json``); place it at ``$MINARI_DATASETS_PATH/<dataset_id>``
    for ``minari.load_dataset(dataset_id)``, or open it with
    ``minari.MinariDataset(out / "data")``. Columns ``obs``/``obs/*`` become the
    observations (T+1 rows with the final observation), ``action``/``action/*``
    the actions, ``reward``, the flags, ``infos/*`` the infos; other columns are
    refused by name unless ``drop_unsupported`` leaves them out (with a warning).
    Only complete episodes are written: open episodes are refused unless
    ``drop_open_episodes`` leaves them out (with a warning).

    Parameters
    ----------
    store
        A store path or an open ``mb.Buffer``; it needs an ``obs`` and an
        ``action`` column, ``reward``, and ``obs`` next-derived.
    dataset_id
        ``namespace/name-vN``; default: the one in ``attrs["minari"]``, else
        ``mmbuffer/<out name>-v0``.
    drop_open_episodes
        Leave out the rows of open (unfinished) episodes (``--drop-open-episodes``).
    drop_unsupported
        Leave out columns with no place in a Minari dataset (``--drop-unsupported``).

    Raises
    ------
    ConversionError
        No ``obs``/``action``/``reward`` columns, ``obs`` not next-derived, a bad
        ``dataset_id``; open episodes (unless ``drop_open_episodes``); other
        columns (unless ``drop_unsupported``).
    """
    t0 = time.perf_counter()
    writer = MinariWriter(store, out, dataset_id=dataset_id, chunk_rows=chunk_rows, progress=progress,
                          drop_open_episodes=drop_open_episodes, drop_unsupported=drop_unsupported)
    return write_export(writer, out, overwrite=overwrite, verify=verify, started=t0)


class MinariWriter(ExportWriter):
    """Writes a store's complete episodes into a Minari dataset (the :func:`export_minari` steps)."""

    kind = "minari"

    def __init__(self, store: Any, out: str | os.PathLike[str], *, dataset_id: str | None,
                 chunk_rows: int | None, progress: bool, drop_open_episodes: bool = False,
                 drop_unsupported: bool = False) -> None:
        super().__init__(store, out, chunk_rows=chunk_rows, progress=progress)
        self.dataset_id = dataset_id
        self.drop_open_episodes, self.drop_unsupported = drop_open_episodes, drop_unsupported

    def open(self) -> None:
        buf = self.buf = self.opened.open()
        self.rows_per = chunk_rows_for(buf, self.chunk_rows)
        attrs = dict(buf.attrs)
        src_meta = self.src_meta = attrs.get("minari") if isinstance(attrs.get("minari"), dict) else {}
        obs_cols = self.obs_cols = [c for c in buf.columns if c == "obs" or c.startswith("obs/")]
        act_cols = self.act_cols = [c for c in buf.columns if c == "action" or c.startswith("action/")]
        where = self.where = str(getattr(buf, "path", self.store))
        if not obs_cols or not act_cols or "reward" not in buf.columns:
            raise ConversionError(
                f"{where}: a Minari export needs obs, action and reward columns, got {sorted(buf.columns)}"
            )
        if set(obs_cols) - set(buf.next_keys):
            raise ConversionError(
                f"{where}: a Minari export needs the final observation of every episode: "
                f"obs columns must be next-derived (next_keys={list(buf.next_keys)})"
            )
        self.info_cols = [c for c in buf.columns if c.startswith("infos/")]
        keep = {*obs_cols, *act_cols, *self.info_cols, "reward"}
        self.dropped = [c for c in data_columns(buf) if c not in keep]
        if self.dropped:
            what = (f"columns {self.dropped} have no place in a Minari dataset (observations obs/*, actions "
                    "action/*, rewards, flags, infos/*)")
            self.leave_out(where, what, "drop_unsupported", self.drop_unsupported)
        self.plan, self.skipped = plan_episodes(buf, "none")
        if self.skipped:
            what = (f"{self.skipped} rows of open (unfinished) episodes: a Minari episode needs its final "
                    "observation")
            self.leave_out(where, what, "drop_open_episodes", self.drop_open_episodes)
        self.spaces = {}
        for key, prefix in (("observation_space", "obs"), ("action_space", "action")):
            own = space_for(buf, prefix)
            given = src_meta.get(key) if src_meta else None
            parsed = None
            if isinstance(given, str):
                try:
                    parsed = json.loads(given)
                except json.JSONDecodeError:
                    parsed = None
            cols = obs_cols if prefix == "obs" else act_cols
            if parsed is not None and leaf_names(parsed, prefix) == set(cols):
                self.spaces[key] = given
            else:
                self.spaces[key] = json.dumps(own)
        dataset_id = self.dataset_id
        if dataset_id is None:
            dataset_id = src_meta.get("dataset_id") if src_meta else None
            if not isinstance(dataset_id, str) or not _ID.match(dataset_id):
                name = re.sub(r"[^-_\w]", "_", self.out_path.name) or "export"
                dataset_id = f"mmbuffer/{re.sub(r'-v[0-9]+$', '', name)}-v0"
        elif not _ID.match(dataset_id):
            raise ConversionError(f"dataset_id: expected (namespace/)name-vN, got {dataset_id!r}")
        self.dataset_id = dataset_id

    def write(self, partial: Path) -> None:
        import h5py

        buf, plan_keys = self.buf, (*self.obs_cols, *self.act_cols, "reward", *self.info_cols, *FLAGS)
        obs_cols, act_cols, info_cols = self.obs_cols, self.act_cols, self.info_cols
        plan, skipped = self.plan, self.skipped
        n = plan.rows
        keys = list(plan_keys)
        crc: dict[str, int] = {}
        final_crc: dict[str, int] = {}
        data_dir = partial / "data"
        data_dir.mkdir(parents=True)
        with h5py.File(data_dir / "main_data.hdf5", "w", track_order=True) as f, \
                progress_bar(n, "export minari", self.progress) as bar:
            groups: dict[int, dict[str, Any]] = {}
            next_id = 0
            for piece in walk(buf, plan, keys, self.rows_per, release=self.opened.owned):
                for name in keys:
                    crc_update(crc, name, piece.data[name])
                for k, v in piece.final.items():
                    crc_update(final_crc, k, v)
                # split the piece by episode
                cuts = np.flatnonzero(np.diff(piece.episode)) + 1
                fi = 0
                for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(piece.rows)]):
                    e = int(piece.episode[a])
                    if e not in groups:
                        groups[e] = _minari_episode(f, next_id, int(plan.lengths[e]), buf, obs_cols,
                                                    act_cols, info_cols)
                        next_id += 1
                    ds = groups[e]
                    o0, o1 = int(piece.offset[a]), int(piece.offset[b - 1]) + 1
                    for name in keys:
                        ds[name][o0:o1] = piece.data[name][a:b]
                    if piece.last[b - 1]:
                        for k in (*obs_cols, *(c for c in info_cols if c in buf.next_keys)):
                            ds[k][o1] = piece.final[k][fi]
                        fi += 1
                        del groups[e]
                bar.update(len(piece.rows))
        meta: dict[str, Any] = {}
        for k, v in (self.src_meta or {}).items():
            if k not in {"total_episodes", "total_steps", "data_format", "dataset_size",
                         "jpeg_encoding", "observation_space", "action_space", "dataset_id"}:
                meta[k] = v
        meta.update(
            total_episodes=int(plan.complete.sum()),
            total_steps=n,
            data_format="hdf5",
            jpeg_encoding=False,
            observation_space=self.spaces["observation_space"],
            action_space=self.spaces["action_space"],
            dataset_id=self.dataset_id,
        )
        meta.setdefault("minari_version", _minari_version())
        meta["dataset_size"] = round(sum(p.stat().st_size for p in data_dir.iterdir()) / 1e6, 1)
        (data_dir / "metadata.json").write_text(json.dumps(meta))
        self.crc, self.final_crc = crc, final_crc
        self.summary = {
            "format": "minari",
            "store": self.where,
            "out": str(self.out_path),
            "dataset_id": self.dataset_id,
            "rows": n,
            "episodes": int(plan.complete.sum()),
            "skipped_open_rows": skipped,
            "dropped_columns": self.dropped,
            "checksums": {k: crc_hex(v) for k, v in crc.items()},
            "final_obs_checksums": {k: crc_hex(v) for k, v in final_crc.items()},
            "verified": False,
            "warnings": self.notes,
        }

    def close(self) -> None:
        self.opened.close()

    def verify(self, partial: Path) -> None:
        check_reader(MinariReader(partial), self.summary, self.crc, self.final_crc, partial)


def _minari_version() -> str:
    try:
        import minari

        return str(minari.__version__)
    except Exception:  # minari is optional
        return "0.5.0"


def _minari_episode(f: Any, ep_id: int, t: int, buf: Any, obs_cols: list[str], act_cols: list[str],
                    info_cols: list[str]) -> dict[str, Any]:
    g = f.create_group(f"episode_{ep_id}")
    g.attrs["id"] = ep_id
    g.attrs["total_steps"] = t
    out: dict[str, Any] = {}

    def make(name: str, path: str, rows: int) -> None:
        col = buf.columns.get(name)
        shape = tuple(col.shape) if col is not None else ()
        dtype = np.dtype(col.dtype) if col is not None else np.dtype(bool)
        out[name] = g.create_dataset(path, shape=(rows, *shape), dtype=dtype)

    for c in obs_cols:
        make(c, "observations" + c[3:], t + 1)
    for c in act_cols:
        make(c, "actions" + c[6:], t)
    make("reward", "rewards", t)
    make("terminated", "terminations", t)
    make("truncated", "truncations", t)
    g.require_group("infos")
    for c in info_cols:  # a next-derived info holds the reset info too: T+1 rows, like obs
        make(c, c, t + 1 if c in buf.next_keys else t)
    return out
