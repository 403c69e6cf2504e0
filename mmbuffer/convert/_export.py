"""Stores back out: D4RL HDF5 and Minari datasets (and the store walk :mod:`._copy` shares).

Both walk the store the same way: lane by lane, each lane's live complete
episodes oldest first, then (where kept) the lane's open episode, reading about
``chunk_rows`` rows at a time with one ``get`` per chunk, so memory stays flat.
Each writes to ``OUT + ".partial"`` and renames at the end; an existing ``OUT``
is refused unless ``overwrite=True`` and it is an output of the same kind
(:mod:`._dest`). Each ends with a verification pass that
reads the result back (with this package's own readers, or ``mb.open``) and
compares row and episode counts and a CRC-32 per column with what was read from
the store, and returns a summary dict.

* :func:`export_d4rl`: ``next_observations`` holds each row's ``next_obs``, so
  converting the file back gives the same store (a converted file comes back
  as it was, an unflagged last row included). An open episode has no next
  observation for its last row: it is left out (warning) unless
  ``next_observations=False``, never given a next observation from another
  row.
* :func:`export_minari` writes complete episodes only (a Minari episode needs its
  final observation); spaces come from ``attrs["minari"]`` when the store was
  converted from Minari, otherwise ``Box`` spaces are built from the columns.
  ``jpeg_encoding`` is false: images are stored raw.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConversionError
from ._common import (
    _hex,
    as_bytes,
    jsonable,
    progress_bar,
)
from ._dest import check_destination, partial_path, remove_partial, replace_destination

__all__ = ["export_d4rl", "export_minari"]

_FLAGS = ("terminated", "truncated")
_DEFAULT_CHUNK_BYTES = 32 << 20


# -- walking a store ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    """Episodes in export order: global start row, length, complete?, lane."""

    starts: np.ndarray
    lengths: np.ndarray
    complete: np.ndarray
    lanes: np.ndarray
    lane_size: int

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())


def _open_episodes(buf: Any) -> list[tuple[int, int, int]]:
    """(lane, global start, length) of every lane's open episode with rows."""
    out = []
    view = buf.view()
    for lane, lv in enumerate(view.lanes):
        written = int(view.written[lane])
        n = written - int(lv.open_start)
        if n > 0:
            out.append((lane, int(buf.layout.rows(lane, lv.open_start)), n))
    return out


def _plan(buf: Any, open_episodes: str) -> tuple[_Plan, int]:
    """Episodes to walk; ``open_episodes`` is "all", "single-lane" or "none".

    Returns the plan and the number of open-episode rows left out.
    """
    starts_t, lengths_t = buf.episodes()
    starts = starts_t.numpy().astype(np.int64)
    lengths = lengths_t.numpy().astype(np.int64)
    ls = int(buf.lane_size)
    lanes = starts // ls
    opened = _open_episodes(buf)
    keep_open = open_episodes == "all" or (open_episodes == "single-lane" and buf.num_streams == 1)
    skipped = 0
    parts_s, parts_l, parts_c, parts_lane = [], [], [], []
    for lane in range(buf.num_streams):
        sel = lanes == lane
        parts_s.append(starts[sel])
        parts_l.append(lengths[sel])
        parts_c.append(np.ones(int(sel.sum()), bool))
        parts_lane.append(np.full(int(sel.sum()), lane, np.int64))
        for ol, os_, on in opened:
            if ol != lane:
                continue
            if keep_open:
                parts_s.append(np.array([os_], np.int64))
                parts_l.append(np.array([on], np.int64))
                parts_c.append(np.zeros(1, bool))
                parts_lane.append(np.array([lane], np.int64))
            else:
                skipped += on
    plan = _Plan(
        np.concatenate(parts_s), np.concatenate(parts_l), np.concatenate(parts_c),
        np.concatenate(parts_lane), ls,
    )
    return plan, skipped


@dataclass
class _Piece:
    lane: int
    rows: np.ndarray  # global row ids
    episode: np.ndarray  # plan index per row
    offset: np.ndarray  # row offset inside its episode
    data: dict[str, np.ndarray]
    last: np.ndarray  # bool: last row of a *complete* episode
    final: dict[str, np.ndarray]  # next-derived column -> rows for ``last``


def _walk(buf: Any, plan: _Plan, keys: list[str], chunk_rows: int, *, release: bool = False) -> Iterator[_Piece]:
    """Read the plan's rows in order, ``chunk_rows`` at a time, never across lanes.

    Stored columns are read with ``Buffer.read_range`` (a lane's live episodes
    are consecutive in its ring: one or two runs a chunk); derived ``next_*``
    keys are gathered. With ``release`` (a read-only handle this module
    opened), the pages the gathers mapped are unmapped every ``SEGMENT_BYTES``
    of rows, so resident memory stays flat.
    """
    from ._common import SEGMENT_BYTES

    next_keys = list(buf.next_keys)
    stored = [n for n in keys if n in buf.columns]
    derived = [n for n in keys if n not in buf.columns]
    segment = max(chunk_rows, SEGMENT_BYTES // max(1, _row_bytes(buf)))
    since = 0
    for lane in np.unique(plan.lanes) if len(plan.lanes) else []:
        idx = np.flatnonzero(plan.lanes == lane)
        lengths = plan.lengths[idx]
        cum = np.cumsum(lengths)
        total = int(cum[-1]) if len(cum) else 0
        base = int(lane) * plan.lane_size
        for p0 in range(0, total, chunk_rows):
            p1 = min(total, p0 + chunk_rows)
            pos = np.arange(p0, p1, dtype=np.int64)
            k = np.searchsorted(cum, pos, side="right")
            off = pos - (cum[k] - lengths[k])
            rows = base + (plan.starts[idx][k] - base + off) % plan.lane_size
            ep = idx[k]
            data = _read_runs(buf, rows, stored)
            if derived:
                data.update({n: _np(v) for n, v in buf.get(rows, keys=derived).items()})
            last = (off == lengths[k] - 1) & plan.complete[ep]
            final: dict[str, np.ndarray] = {}
            if next_keys and last.any():
                got = buf.get(rows[last], keys=[f"next_{n}" for n in next_keys])
                final = {n: _np(got[f"next_{n}"]) for n in next_keys}
            yield _Piece(int(lane), rows, ep, off, data, last, final)
            since += len(rows)
            if release and since >= segment:
                buf.release_memory()
                since = 0


def _read_runs(buf: Any, rows: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """``names`` at ``rows``, read a contiguous run at a time."""
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cuts) if len(r)]
    out = {}
    for name in names:
        parts = [buf.read_range(name, a, b) for a, b in runs]
        out[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


def _np(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _data_columns(buf: Any) -> list[str]:
    """The store's columns without the two flags (which every store has)."""
    return [c for c in buf.columns if c not in _FLAGS]


def _row_bytes(buf: Any) -> int:
    total = 2
    for col in (buf.columns[c] for c in _data_columns(buf)):
        total += int(np.prod(col.shape, dtype=np.int64)) * np.dtype(col.dtype).itemsize
    return total


def _chunk_rows(buf: Any, chunk_rows: int | None) -> int:
    from ..errors import InvalidArgumentError

    if chunk_rows is not None:
        if int(chunk_rows) < 1:
            raise InvalidArgumentError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
        return int(chunk_rows)
    return max(1024, _DEFAULT_CHUNK_BYTES // max(1, _row_bytes(buf)))


class _Opened:
    """``mb.open(path, "r")`` for a path, or the caller's open buffer (left open)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.buf: Any = None

    @property
    def owned(self) -> bool:
        """Whether this module opened the store (read-only), so it may reopen it."""
        return self.buf is not None

    def __enter__(self) -> Any:
        if isinstance(store_path := self.store, (str, os.PathLike)):
            import mmbuffer as mb

            if not os.path.isdir(store_path):
                from ..errors import StoreNotFoundError
                from ._sniff import sniff

                raise StoreNotFoundError(f"{store_path}: expected an mmbuffer store directory, found {sniff(store_path)}")
            self.buf = mb.open(str(store_path), mode="r")
            return self.buf
        return self.store

    def __exit__(self, *exc: object) -> None:
        if self.buf is not None:
            self.buf.close()


def _crc_update(crc: dict[str, int], name: str, arr: np.ndarray) -> None:
    crc[name] = zlib.crc32(as_bytes(arr), crc.get(name, 0))


# -- D4RL -------------------------------------------------------------------------------------
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
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Write a store as a D4RL-layout HDF5 file.

    ``obs -> observations``, ``action -> actions``, ``reward -> rewards``,
    ``terminated -> terminals``, ``truncated -> timeouts``, ``next_obs ->
    next_observations`` (see ``next_observations``), other columns under their
    own path (``infos/qpos``, ``next/obs -> next_observations`` for a store
    converted with ``keep_next_obs``); ``attrs`` as JSON in
    ``metadata/mmbuffer_attrs`` plus ``attrs["source_metadata"]`` entries as
    ``metadata/<key>``.

    Converting the file back gives the same rows, flags and final observations.
    What D4RL cannot hold is left out with a warning, never made up: the last
    row of an open (unfinished) episode has no next observation, so open
    episodes are written only when no ``next_observations`` are derived (and
    only for a one-lane store: a D4RL file has one unflagged episode, at its
    end). A store converted from a file that stopped inside an episode
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

    Returns
    -------
    dict
        Summary: ``rows``, ``episodes``, ``open_episode_rows``,
        ``skipped_open_rows``, ``checksums``, ``verified``, ``seconds``,
        ``warnings``.
    """
    import h5py

    t0 = time.perf_counter()
    out_path = check_destination(out, overwrite, "d4rl")
    partial = partial_path(out_path)
    opened = _Opened(store)
    notes: list[str] = []
    with opened as buf:
        where = getattr(buf, "path", store)
        missing = [k for k in ("obs", "action", "reward") if k not in buf.columns]
        if missing:
            raise ConversionError(
                f"{where}: expected columns obs, action and reward for a D4RL file "
                f"(observations, actions, rewards), got {sorted(buf.columns)}; missing {missing}"
            )
        remove_partial(partial, "d4rl")
        rows_per = _chunk_rows(buf, chunk_rows)
        cols = _data_columns(buf)
        keys = [*cols, *_FLAGS]
        explicit_next = [c for c in cols if _d4rl_key(c).startswith("next_observations")]
        zeros = buf.attrs.get("final_obs_source") == "zeros"
        if next_observations is None:
            next_observations = not zeros
        derive_next = next_observations and bool(buf.next_keys) and not explicit_next
        if derive_next and zeros:
            notes.append(f"{out_path}: the store's final observations are zeros standing for unknown ones "
                         "(its source had no next observations); they are written as next_observations")
        plan, skipped = _plan(buf, "none" if derive_next else "single-lane")
        if skipped:
            why = ("the last row of an open episode has no next observation (pass next_observations=False "
                   "to keep them without next_observations)" if derive_next else
                   "a D4RL file holds one unflagged episode, at its end")
            notes.append(f"{out_path}: {skipped} rows of open (unfinished) episodes were left out: {why}")
        n = plan.rows
        tail = _tail_row(buf, plan) if derive_next else None
        crc: dict[str, int] = {}
        final_crc: dict[str, int] = {}
        try:
            with h5py.File(partial, "w") as f, progress_bar(n, "export d4rl", progress) as bar:
                dsets: dict[str, Any] = {}
                for name in keys:
                    col = buf.columns[name] if name in buf.columns else None
                    shape = tuple(col.shape) if col else ()
                    dtype = np.dtype(col.dtype) if col else np.dtype(bool)
                    dsets[name] = f.create_dataset(_d4rl_key(name), shape=(n, *shape), dtype=dtype)
                nxt: dict[str, Any] = {}
                if derive_next:
                    for k in buf.next_keys:
                        col = buf.columns[k]
                        nxt[k] = f.create_dataset(
                            _d4rl_key(k).replace("observations", "next_observations", 1),
                            shape=(n, *col.shape), dtype=np.dtype(col.dtype),
                        )
                at = 0
                walk_keys = [*keys, *(f"next_{k}" for k in nxt)]
                for piece in _walk(buf, plan, walk_keys, rows_per, release=opened.owned):
                    m = len(piece.rows)
                    for name in keys:
                        dsets[name][at : at + m] = piece.data[name]
                        _crc_update(crc, name, piece.data[name])  # the store's rows: what reconverting gives
                    for k in nxt:
                        nxt[k][at : at + m] = piece.data[f"next_{k}"]
                    for k, v in piece.final.items():
                        _crc_update(final_crc, k, v)
                    at += m
                    bar.update(m)
                if tail is not None:
                    dsets["truncated"][tail] = False  # as the source had it
                _write_d4rl_metadata(f, buf.attrs)
        except BaseException:
            remove_partial(partial, "d4rl")
            raise
        summary: dict[str, Any] = {
            "format": "d4rl",
            "store": str(where),
            "out": str(out_path),
            "rows": n,
            "episodes": int(plan.complete.sum()),
            "open_episode_rows": int(plan.lengths[~plan.complete].sum()),
            "skipped_open_rows": skipped,
            "next_observations": bool(derive_next or explicit_next),
            "tail_unflagged_row": tail,
            "checksums": {k: _hex(v) for k, v in crc.items()},
            "final_obs_checksums": {k: _hex(v) for k, v in final_crc.items()},
            "verified": False,
            "warnings": notes,
        }
    for note in notes:
        _warn(note)
    if verify:
        from ._d4rl import D4RLReader

        reader = D4RLReader(partial, keep_infos=True, keep_next_obs=bool(explicit_next))
        _check_reader(reader, summary, crc, final_crc if derive_next else None, partial, warn_open=False)
        summary["verified"] = True
    replace_destination(partial, out_path, "d4rl", overwrite=overwrite)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _tail_row(buf: Any, plan: _Plan) -> int | None:
    """The file row whose ``timeouts`` the converter set (``attrs["tail_truncated_row"]``), if
    the store still holds that dataset as converted; ``None`` otherwise."""
    from ._flat import TAIL_ATTR

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


def _check_reader(
    reader: Any, summary: dict[str, Any], crc: dict[str, int], final_crc: dict[str, int] | None,
    where: Path, *, warn_open: bool,
) -> None:
    """Stream ``reader`` and compare its columns with the checksums taken while writing."""
    import warnings

    got: dict[str, int] = {}
    got_final: dict[str, int] = {}
    rows = episodes = 0
    with reader, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for steps, final in reader.chunks(1 << 18):
            for k, v in steps.items():
                _crc_update(got, k, v)
            for k, v in final.items():
                _crc_update(got_final, k, v)
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
    for k, v in crc.items():
        if got.get(k) != v:
            raise fail(f"column {k!r} checksum", _hex(v), _hex(got[k]) if k in got else "no such column")
    if final_crc is not None:
        for k, v in final_crc.items():
            if got_final.get(k, 0) != v:
                raise fail(f"final observation {k!r} checksum", _hex(v), _hex(got_final.get(k, 0)))


def _warn(message: str) -> None:
    import warnings

    from ._common import ConversionWarning

    warnings.warn(message, ConversionWarning, stacklevel=3)


# -- Minari -----------------------------------------------------------------------------------
_ID = re.compile(r"^(?:[-_\w][-_\w/]*[-_\w]+/)?[-_\w]+?-v\d+$")


def _box_space(shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        low, high = -np.inf, np.inf
    elif dt.kind == "b":
        dt, low, high = np.dtype(np.int8), 0, 1
    else:
        info = np.iinfo(dt)
        low, high = info.min, info.max
    lo = np.full(shape, low, dtype=np.float64 if dt.kind == "f" else dt)
    hi = np.full(shape, high, dtype=np.float64 if dt.kind == "f" else dt)
    return {"type": "Box", "dtype": str(dt), "shape": list(shape), "low": lo.tolist(), "high": hi.tolist()}


def _space_for(buf: Any, prefix: str) -> dict[str, Any] | None:
    """A Minari JSON space for the columns ``prefix`` / ``prefix/...`` of ``buf``."""
    leaves = {n: c for n, c in buf.columns.items() if n == prefix or n.startswith(prefix + "/")}
    if not leaves:
        return None
    if prefix in leaves:
        c = leaves[prefix]
        return _box_space(tuple(c.shape), c.dtype)
    tree: dict[str, Any] = {}
    for name, c in leaves.items():
        node = tree
        parts = name[len(prefix) + 1 :].split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = _box_space(tuple(c.shape), c.dtype)

    def build(node: dict[str, Any]) -> dict[str, Any]:
        if "type" in node and isinstance(node.get("type"), str):
            return node
        items = {k: build(v) for k, v in node.items()}
        if items and all(re.fullmatch(r"_index_\d+", k) for k in items):
            return {"type": "Tuple", "subspaces": [items[f"_index_{i}"] for i in range(len(items))]}
        return {"type": "Dict", "subspaces": items}

    return build(tree)


def _leaf_names(space: dict[str, Any], prefix: str) -> set[str]:
    from ._minari import _space_leaves

    return set(_space_leaves(space, prefix))


def export_minari(
    store: Any,
    out: str | os.PathLike[str],
    *,
    dataset_id: str | None = None,
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
    left out (warning). Only complete episodes are written.

    Parameters
    ----------
    store
        A store path or an open ``mb.Buffer``; it needs an ``obs`` and an
        ``action`` column, ``reward``, and ``obs`` next-derived.
    dataset_id
        ``namespace/name-vN``; default: the one in ``attrs["minari"]``, else
        ``mmbuffer/<out name>-v0``.
    """
    import h5py

    t0 = time.perf_counter()
    out_path = check_destination(out, overwrite, "minari")
    partial = partial_path(out_path)
    remove_partial(partial, "minari")
    opened = _Opened(store)
    with opened as buf:
        rows_per = _chunk_rows(buf, chunk_rows)
        attrs = dict(buf.attrs)
        src_meta = attrs.get("minari") if isinstance(attrs.get("minari"), dict) else {}
        obs_cols = [c for c in buf.columns if c == "obs" or c.startswith("obs/")]
        act_cols = [c for c in buf.columns if c == "action" or c.startswith("action/")]
        where = str(getattr(buf, "path", store))
        if not obs_cols or not act_cols or "reward" not in buf.columns:
            raise ConversionError(
                f"{where}: a Minari export needs obs, action and reward columns, got {sorted(buf.columns)}"
            )
        if set(obs_cols) - set(buf.next_keys):
            raise ConversionError(
                f"{where}: a Minari export needs the final observation of every episode: "
                f"obs columns must be next-derived (next_keys={list(buf.next_keys)})"
            )
        info_cols = [c for c in buf.columns if c.startswith("infos/")]
        dropped = [c for c in _data_columns(buf) if c not in {*obs_cols, *act_cols, *info_cols, "reward"}]
        spaces = {}
        for key, prefix in (("observation_space", "obs"), ("action_space", "action")):
            own = _space_for(buf, prefix)
            given = src_meta.get(key) if src_meta else None
            parsed = None
            if isinstance(given, str):
                try:
                    parsed = json.loads(given)
                except json.JSONDecodeError:
                    parsed = None
            cols = obs_cols if prefix == "obs" else act_cols
            if parsed is not None and _leaf_names(parsed, prefix) == set(cols):
                spaces[key] = given
            else:
                spaces[key] = json.dumps(own)
        if dataset_id is None:
            dataset_id = src_meta.get("dataset_id") if src_meta else None
            if not isinstance(dataset_id, str) or not _ID.match(dataset_id):
                name = re.sub(r"[^-_\w]", "_", out_path.name) or "export"
                dataset_id = f"mmbuffer/{re.sub(r'-v[0-9]+$', '', name)}-v0"
        elif not _ID.match(dataset_id):
            raise ConversionError(f"dataset_id: expected (namespace/)name-vN, got {dataset_id!r}")
        plan, skipped = _plan(buf, "none")
        n = plan.rows
        keys = [*obs_cols, *act_cols, "reward", *info_cols, *_FLAGS]
        walk_keys = keys
        crc: dict[str, int] = {}
        final_crc: dict[str, int] = {}
        data_dir = partial / "data"
        try:
            data_dir.mkdir(parents=True)
            with h5py.File(data_dir / "main_data.hdf5", "w", track_order=True) as f, \
                    progress_bar(n, "export minari", progress) as bar:
                groups: dict[int, dict[str, Any]] = {}
                next_id = 0
                for piece in _walk(buf, plan, walk_keys, rows_per, release=opened.owned):
                    for name in keys:
                        _crc_update(crc, name, piece.data[name])
                    for k, v in piece.final.items():
                        _crc_update(final_crc, k, v)
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
                        for name in (*obs_cols, *act_cols, "reward", *info_cols, *_FLAGS):
                            ds[name][o0:o1] = piece.data[name][a:b]
                        if piece.last[b - 1]:
                            for k in obs_cols:
                                ds[k][o1] = piece.final[k][fi]
                            fi += 1
                            del groups[e]
                    bar.update(len(piece.rows))
            meta: dict[str, Any] = {}
            for k, v in (src_meta or {}).items():
                if k not in {"total_episodes", "total_steps", "data_format", "dataset_size",
                             "jpeg_encoding", "observation_space", "action_space", "dataset_id"}:
                    meta[k] = v
            meta.update(
                total_episodes=int(plan.complete.sum()),
                total_steps=n,
                data_format="hdf5",
                jpeg_encoding=False,
                observation_space=spaces["observation_space"],
                action_space=spaces["action_space"],
                dataset_id=dataset_id,
            )
            meta.setdefault("minari_version", _minari_version())
            meta["dataset_size"] = round(sum(p.stat().st_size for p in data_dir.iterdir()) / 1e6, 1)
            (data_dir / "metadata.json").write_text(json.dumps(meta))
        except BaseException:
            remove_partial(partial, "minari")
            raise
        summary: dict[str, Any] = {
            "format": "minari",
            "store": where,
            "out": str(out_path),
            "dataset_id": dataset_id,
            "rows": n,
            "episodes": int(plan.complete.sum()),
            "skipped_open_rows": skipped,
            "dropped_columns": dropped,
            "checksums": {k: _hex(v) for k, v in crc.items()},
            "final_obs_checksums": {k: _hex(v) for k, v in final_crc.items()},
            "verified": False,
            "warnings": [],
        }
    if dropped:
        summary["warnings"].append(f"{out_path}: columns with no place in a Minari dataset were left out: {dropped}")
    if skipped:
        summary["warnings"].append(f"{out_path}: {skipped} rows of open (unfinished) episodes were left out")
    for note in summary["warnings"]:
        _warn(note)
    if verify:
        from ._minari import MinariReader

        reader = MinariReader(partial, keep_infos=True)
        _check_reader(reader, summary, crc, final_crc, partial, warn_open=False)
        summary["verified"] = True
    replace_destination(partial, out_path, "minari", overwrite=overwrite)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


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
    for c in info_cols:
        make(c, c, t)
    return out


# -- copy -------------------------------------------------------------------------------------
