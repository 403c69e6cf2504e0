"""Export a store as a D4RL-layout HDF5 file (:func:`export_d4rl`).

``next_observations`` holds each row's ``next_obs``, so converting the file
back gives the same store (a converted file comes back as it was, an unflagged
last row included). An open episode has no next observation for its last row:
it is refused, by name, unless ``next_observations=False`` keeps it without
next observations or ``drop_open_episodes=True`` leaves it out; it is never
given a next observation from another row. The file is written by a :class:`D4RLWriter`
in the frame of :mod:`._frame` (``OUT.partial``, verified by reading it back
with :class:`~mmbuffer.convert.D4RLReader`, then renamed).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError
from ..readers.d4rl import D4RLReader
from .._pipeline.flat import TAIL_ATTR
from .._pipeline.export import ExportWriter, write_export
from .._pipeline.frame import crc_hex, crc_update, progress_bar
from .._pipeline.readback import check_reader
from .._pipeline.reader import FLAGS, jsonable
from .._pipeline.walk import Plan, chunk_rows_for, data_columns, plan_episodes, walk

__all__ = ["D4RLWriter", "export_d4rl"]

_D4RL_NAMES = {"obs": "observations", "action": "actions", "reward": "rewards",
               "terminated": "terminals", "truncated": "timeouts"}


def _d4rl_key(name: str) -> str:
    top, sep, rest = name.partition("/")
    if top in _D4RL_NAMES:
        return _D4RL_NAMES[top] + sep + rest
    if name.startswith("next/obs"):
        return "next_observations" + name[len("next/obs"):]
    return name


def export_d4rl(
    store: Any,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    next_observations: bool | None = None,
    drop_open_episodes: bool = False,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Write a store as a D4RL-layout HDF5 file.

    ``obs -> observations``, ``action -> actions``, ``reward -> rewards``,
    ``terminated -> terminals``, ``truncated -> timeouts``, ``next_obs ->
    next_observations`` (see ``next_observations``), other columns under their
    own path (``infos/qpos``, ``next/obs -> next_observations`` for a store
    that keeps a file's next observations explicitly: converted from a file
    whose next observations differ from the following row, or with
    ``keep_next_obs``); ``attrs`` as JSON in
    ``metadata/mmbuffer_attrs`` plus ``attrs["source_metadata"]`` entries as
    ``metadata/<key>``.

    Converting the file back gives the same rows, flags and final observations.
    What D4RL cannot hold is refused, never made up: the last row of an open
    (unfinished) episode has no next observation, so open episodes are written
    only when no ``next_observations`` are derived (and only for a one-lane
    store: a D4RL file has one unflagged episode, at its end); otherwise they
    are refused unless ``drop_open_episodes`` leaves them out (with a warning). A store converted from a file that stopped inside an episode
    (``attrs["tail_truncated_row"]``, see :mod:`._flat`) gets that row's
    ``timeouts`` flag back unset, as in the source.

    Parameters
    ----------
    store
        A store path or an open ``mb.Buffer``.
    out
        The ``.hdf5`` file to write (refused if it exists, unless ``overwrite``
        and it is a D4RL HDF5 file).
    next_observations
        Write ``next_observations`` derived from the store (carrying each
        episode's final observation). ``None`` (default): unless the store's
        final observations are zeros standing for unknown ones
        (``attrs["final_obs_source"] == "zeros"``, a source without next
        observations), which would come back as real data.
    drop_open_episodes
        Leave out the rows of open episodes the file cannot hold instead of
        refusing the store (``--drop-open-episodes``; counted in ``skipped_open_rows``).

    Returns
    -------
    dict
        Summary: ``rows``, ``episodes``, ``open_episode_rows``,
        ``skipped_open_rows``, ``checksums``, ``verified``, ``seconds``,
        ``warnings``.

    Raises
    ------
    ConversionError
        No ``obs``/``action``/``reward`` columns; open episodes the file cannot
        hold (unless ``drop_open_episodes``).
    """
    t0 = time.perf_counter()
    writer = D4RLWriter(store, out, next_observations=next_observations, drop_open_episodes=drop_open_episodes,
                        chunk_rows=chunk_rows, progress=progress)
    return write_export(writer, out, overwrite=overwrite, verify=verify, started=t0)


class D4RLWriter(ExportWriter):
    """Writes a store's rows into a D4RL HDF5 file (the :func:`export_d4rl` steps)."""

    kind = "d4rl"

    def __init__(self, store: Any, out: str | os.PathLike[str], *, next_observations: bool | None,
                 chunk_rows: int | None, progress: bool, drop_open_episodes: bool = False) -> None:
        super().__init__(store, out, chunk_rows=chunk_rows, progress=progress)
        self.next_observations = next_observations
        self.drop_open_episodes = drop_open_episodes

    def open(self) -> None:
        buf = self.buf = self.opened.open()
        self.where = getattr(buf, "path", self.store)
        missing = [k for k in ("obs", "action", "reward")
                   if k not in buf.columns and not any(c.startswith(k + "/") for c in buf.columns)]
        if missing:
            raise ConversionError(
                f"{self.where}: expected columns obs, action and reward for a D4RL file "
                f"(observations, actions, rewards), got {sorted(buf.columns)}; missing {missing}"
            )
        cols = data_columns(buf)
        explicit_next = [c for c in cols if _d4rl_key(c).startswith("next_observations")]
        zeros = buf.attrs.get("final_obs_source") == "zeros"
        next_observations = not zeros if self.next_observations is None else self.next_observations
        # D4RL has next observations only: other next-derived columns (Minari's infos) stay row for row
        obs_next = [k for k in buf.next_keys if _d4rl_key(k).startswith("observations")]
        derive_next = next_observations and bool(obs_next) and not explicit_next
        if derive_next and zeros:
            self.notes.append(f"{self.out_path}: the store's final observations are zeros standing for unknown "
                              "ones (its source had no next observations); they are written as next_observations")
        self.plan, self.skipped = plan_episodes(buf, "none" if derive_next else "single-lane")
        if self.skipped:
            why = (f"the last row of an open episode has no next observation for next_observations (derived "
                   f"from {obs_next}); next_observations=False keeps them without next_observations" if derive_next
                   else f"a D4RL file holds one unflagged episode, at its end (the store has {buf.num_streams} streams)")
            what = f"{self.skipped} rows of open (unfinished) episodes cannot be written: {why}"
            self.leave_out(self.where, what, "drop_open_episodes", self.drop_open_episodes)
        self.cols, self.explicit, self.obs_next, self.derive_next = cols, explicit_next, obs_next, derive_next

    def write(self, partial: Path) -> None:
        import h5py

        buf, out_path = self.buf, self.out_path
        rows_per = chunk_rows_for(buf, self.chunk_rows)
        cols, explicit_next, obs_next, derive_next = self.cols, self.explicit, self.obs_next, self.derive_next
        keys = [*cols, *FLAGS]
        plan, skipped = self.plan, self.skipped
        n = plan.rows
        tail = _tail_row(buf, plan) if derive_next else None
        crc: dict[str, int] = {}
        final_crc: dict[str, int] = {}
        with h5py.File(partial, "w") as f, progress_bar(n, "export d4rl", self.progress) as bar:
            dsets: dict[str, Any] = {}
            for name in keys:
                col = buf.columns[name] if name in buf.columns else None
                shape = tuple(col.shape) if col else ()
                dtype = np.dtype(col.dtype) if col else np.dtype(bool)
                dsets[name] = f.create_dataset(_d4rl_key(name), shape=(n, *shape), dtype=dtype)
            nxt: dict[str, Any] = {}
            if derive_next:
                for k in obs_next:
                    col = buf.columns[k]
                    nxt[k] = f.create_dataset(
                        _d4rl_key(k).replace("observations", "next_observations", 1),
                        shape=(n, *col.shape), dtype=np.dtype(col.dtype),
                    )
            at = 0
            walk_keys = [*keys, *(f"next_{k}" for k in nxt)]
            for piece in walk(buf, plan, walk_keys, rows_per, release=self.opened.owned):
                m = len(piece.rows)
                for name in keys:
                    dsets[name][at : at + m] = piece.data[name]
                    crc_update(crc, name, piece.data[name])  # the store's rows: what reconverting gives
                for k in nxt:
                    nxt[k][at : at + m] = piece.data[f"next_{k}"]
                for k, v in piece.final.items():
                    if k in obs_next:
                        crc_update(final_crc, k, v)
                at += m
                bar.update(m)
            if tail is not None:
                dsets["truncated"][tail] = False  # as the source had it
            _write_d4rl_metadata(f, buf.attrs)
        self.crc, self.final_crc = crc, (final_crc if derive_next else None)
        self.explicit_next = bool(explicit_next)
        self.summary = {
            "format": "d4rl",
            "store": str(self.where),
            "out": str(out_path),
            "rows": n,
            "episodes": int(plan.complete.sum()),
            "open_episode_rows": int(plan.lengths[~plan.complete].sum()),
            "skipped_open_rows": skipped,
            "next_observations": bool(derive_next or explicit_next),
            "tail_unflagged_row": tail,
            "checksums": {k: crc_hex(v) for k, v in crc.items()},
            "final_obs_checksums": {k: crc_hex(v) for k, v in final_crc.items()},
            "verified": False,
            "warnings": self.notes,
        }

    def close(self) -> None:
        self.opened.close()

    def verify(self, partial: Path) -> None:
        reader = D4RLReader(partial, keep_next_obs=self.explicit_next, zero_unknown_finals=True)
        check_reader(reader, self.summary, self.crc, self.final_crc, partial)


def _tail_row(buf: Any, plan: Plan) -> int | None:
    """The file row whose ``timeouts`` the converter set (``attrs["tail_truncated_row"]``), if
    the store still holds that dataset as converted; ``None`` otherwise."""
    row = buf.attrs.get(TAIL_ATTR)
    if not isinstance(row, int) or isinstance(row, bool) or buf.num_streams != 1 or not len(plan.lengths):
        return None
    written = int(buf.view().written[0])
    last = int(plan.starts[-1] + plan.lengths[-1] - 1)
    if written != row + 1 or last != row or plan.rows != written or not plan.complete[-1]:
        return None  # rows were added since the conversion: the flag is the store's own now
    flags = buf.read_range("truncated", row, row + 1)
    return row if bool(flags[0]) and not bool(buf.read_range("terminated", row, row + 1)[0]) else None


def _write_d4rl_metadata(f: Any, attrs: dict[str, Any]) -> None:
    meta = f.require_group("metadata")
    meta.create_dataset("mmbuffer_attrs", data=json.dumps(jsonable(attrs)))
    src = attrs.get("source_metadata") or {}
    if isinstance(src, dict):
        for key, value in src.items():
            if not isinstance(key, str) or key.startswith("@") or key in meta:
                continue
            try:
                if isinstance(value, (dict, list)) and not _is_numeric_list(value):
                    meta.create_dataset(key, data=json.dumps(value))
                else:
                    meta.create_dataset(key, data=value)
            except (TypeError, ValueError):
                meta.create_dataset(key, data=json.dumps(value))


def _is_numeric_list(value: Any) -> bool:
    if not isinstance(value, list):
        return False
    try:
        return np.asarray(value).dtype.kind in "biuf"
    except (ValueError, TypeError):
        return False
