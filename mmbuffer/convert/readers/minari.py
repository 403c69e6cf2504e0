"""Minari datasets (HDF5, and the Arrow/Parquet variant when ``pyarrow`` is installed).

Layout read (Minari 0.4/0.5)::

    DATASET/data/metadata.json          total_episodes, total_steps, data_format,
                                        observation_space, action_space, env_spec, ...
    DATASET/data/main_data.hdf5         data_format "hdf5": one group per episode
        episode_<i>/observations        [T+1, ...] (a group of leaves for Dict/Tuple spaces)
        episode_<i>/actions             [T, ...]
        episode_<i>/rewards, terminations, truncations   [T]
        episode_<i>/infos/...           [T+1 or T, ...]
    DATASET/data/<i>/*.arrow|.parquet   data_format "arrow"/"parquet": one directory per
                                        episode, every column padded to T+1 rows

Row ``t`` of episode ``i`` becomes one store row (``obs``, ``action``, ``reward``,
``terminated``, ``truncated``); observation ``T`` (the T+1-th) is the episode's
final observation. An info leaf of T+1 rows (the reset info,
then the info of each step, as Minari records them) is kept whole like the
observations: ``infos/<name>`` row ``t`` is the info returned with observation
``t`` (row 0: the reset info), ``next_infos/<name>`` the info of step ``t``, and
info ``T`` is the episode's final value of the next-derived column; an info leaf
of T rows is row for row. Dict and Tuple spaces become one column per leaf:
``obs/pixels``, ``obs/_index_0`` (HDF5 names kept, so the export can rebuild
the group). JPEG-encoded image leaves are decoded (needs Pillow). An episode
whose last step has neither flag gets ``truncated=True`` there (it is a complete
Minari episode; counted as ``forced_truncations``, with a warning; every such
episode id, none left out, in ``attrs["convert"]["stats"]["forced_truncation_episodes"]``,
so the source's flags are recoverable exactly).
``metadata.json`` goes into ``attrs["minari"]`` (spaces and env spec as the JSON
strings Minari wrote). Episodes are read one at a time (an Arrow episode whole,
an HDF5 episode in row slices), so memory stays at about one chunk.

**Lossless by default.** What a dataset holds that the store cannot derive:
observations (T+1 per episode: T rows and the final observation), actions,
rewards and both flags, kept exactly; ``infos``: kept (``drop_infos=True``,
``--drop-infos``, leaves them out). An info leaf the store cannot hold as a
column (not numeric, a length other than T or T+1, missing from or shaped
differently in some episode, or T+1 rows in one episode and T in another) is
refused with :class:`~mmbuffer.errors.ConversionError` naming the leaf and the
episode, unless ``drop_unsupported=True`` (``--drop-unsupported``) accepts
leaving those leaves out (listed in the summary's ``dropped_keys``). An
episode whose last step has neither flag is a complete Minari episode ended by
the collector: it gets ``truncated=True`` (counted, see above). An Arrow
dataset pads every column with nulls to T+1 rows: the padding is not data.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...schema import PriorityConfig
from .minari_arrow import ArrowEpisodes
from .minari_spaces import decode_jpeg, is_image, parse_space, space_leaves
from .._pipeline.reader import Chunk, ChunkAssembler, Schema
from .._pipeline.sniff import expect
from .._pipeline.write import write_store

__all__ = ["MinariReader", "convert_minari"]

_EPISODE = re.compile(r"^episode_(\d+)$")
_TOP = {"observations": "obs", "actions": "action"}


#: Minari's dataset id: ``(namespace/)name(-vN)`` (``minari.dataset.minari_dataset.DATASET_ID_RE``).
DATASET_ID = re.compile(r"^(?:(?P<namespace>[-_\w][-_\w/]*[-_\w]+)/)?(?P<dataset>[-_\w]+?)(?:-v(?P<version>\d+))?$")


def datasets_root() -> Path:
    """Minari's local datasets directory: ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``."""
    env = os.environ.get("MINARI_DATASETS_PATH")
    return Path(env) if env else Path.home() / ".minari" / "datasets"


def resolve_dataset(src: str | os.PathLike[str]) -> Path:
    """``src`` as a path when it exists, else as a Minari dataset id in :func:`datasets_root`.

    An id without a version (``cartpole/random``) names the highest local
    version, as ``minari.load_dataset`` does. Nothing is downloaded.

    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.makedirs(root + "/cartpole/random-v0/data"); os.makedirs(root + "/cartpole/random-v2/data")
    >>> os.environ["MINARI_DATASETS_PATH"] = root
    >>> resolve_dataset("cartpole/random").relative_to(root).as_posix()
    'cartpole/random-v2'
    >>> del os.environ["MINARI_DATASETS_PATH"]
    """
    from ...errors import ConversionError

    path = Path(src).expanduser()
    text = os.fspath(src)
    if os.path.lexists(path) or not isinstance(text, str):
        return path
    m = DATASET_ID.match(text)
    if m is None:
        return path  # neither a path nor an id: the reader says what is there
    root = datasets_root()
    if m.group("version") is not None:
        candidate = root / text
    else:
        parent = root / m.group("namespace") if m.group("namespace") else root
        pattern = re.compile(re.escape(m.group("dataset")) + r"-v(\d+)$")
        versions = sorted((int(v.group(1)), e) for e in (os.listdir(parent) if parent.is_dir() else [])
                          if (v := pattern.match(e)))
        candidate = parent / versions[-1][1] if versions else root / text
    if not os.path.lexists(candidate):
        raise ConversionError(
            f"{text}: expected a Minari dataset directory or a dataset id found in Minari's local "
            f"datasets directory {root} (MINARI_DATASETS_PATH), found neither; nothing is downloaded "
            f"(run `minari download {text}` first)")
    return candidate


class MinariReader(ArrowEpisodes):
    """Read a Minari dataset directory (see the module docstring).

    Parameters
    ----------
    path
        The dataset directory (``.../<dataset_id>``, holding ``data/``) or its ``data/``.
    drop_infos
        Leave ``infos`` out. By default numeric ``infos`` leaves are kept as
        ``infos/<name>`` columns, reset info included (a T+1-row leaf is
        next-derived, like ``obs``: see the module docstring).
    drop_unsupported
        Leave out the info leaves a store cannot hold instead of refusing them.
    keep_infos
        Deprecated: ``True`` is the default, ``False`` is ``drop_infos=True``.
    """

    format = "minari"

    def __init__(self, path: str | os.PathLike[str], *, drop_infos: bool = False, drop_unsupported: bool = False,
                 keep_infos: bool | None = None) -> None:
        from .d4rl import infos_option

        super().__init__(resolve_dataset(path))
        keep = not infos_option(self, keep_infos, drop_infos)
        p = self.path
        expect(p, ("directory",), "a Minari dataset directory (holding data/metadata.json)")
        data = p / "data" if (p / "data" / "metadata.json").is_file() else p
        meta_path = data / "metadata.json"
        if not meta_path.is_file():
            raise self._error(
                "not a Minari dataset: no data/metadata.json (expected the dataset directory)"
            )
        try:
            self.metadata: dict[str, Any] = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise self._error(f"unreadable metadata.json ({exc})", "metadata.json") from exc
        self._data = data
        self._keep_infos = keep
        self._drop_unsupported = drop_unsupported
        self.data_format = self.metadata.get("data_format", "hdf5")
        self._obs_space = parse_space(self.metadata, "observation_space")
        self._act_space = parse_space(self.metadata, "action_space")
        self._jpeg = bool(self.metadata.get("jpeg_encoding", True))
        self._leaf_space = {**space_leaves(self._obs_space, "obs"), **space_leaves(self._act_space, "action")}
        self._h5: Any = None
        if self.data_format == "hdf5":
            self._schema = self._scan_hdf5()
        elif self.data_format in ("arrow", "parquet"):
            self._schema = self._scan_arrow()
        else:
            raise self._error(f"unknown data_format {self.data_format!r} (hdf5, arrow, parquet)", "metadata.json")

    @property
    def schema(self) -> Schema:
        return self._schema

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None

    # -- HDF5 ----------------------------------------------------------------------------------
    def _episode_names(self) -> list[str]:
        names = []
        for name in self._h5:
            m = _EPISODE.match(name)
            if m is None:
                raise self._error(f"unexpected entry {name!r} (expected episode_<i> groups)", "main_data.hdf5")
            names.append((int(m.group(1)), name))
        names.sort()
        return [n for _, n in names]

    def _scan_hdf5(self) -> Schema:
        import h5py

        path = self._data / "main_data.hdf5"
        if not path.is_file():
            raise self._error("data_format is hdf5 but data/main_data.hdf5 is missing", "main_data.hdf5")
        try:
            self._h5 = h5py.File(path, "r")
        except OSError as exc:
            raise self._error(f"not an HDF5 file ({exc})", "main_data.hdf5") from exc
        self._episodes = self._episode_names()
        if not self._episodes:
            raise self._error("no episodes", "main_data.hdf5")
        columns: dict[str, tuple[tuple[int, ...], str]] = {}
        self._lengths: list[int] = []
        first = True
        dropped: dict[str, str] = {}
        info_whole: dict[str, bool] = {}
        for name in self._episodes:
            g = self._h5[name]
            for key in ("observations", "actions", "rewards", "terminations", "truncations"):
                if key not in g:
                    raise self._error(f"missing key {key!r}", f"{name}/{key}")
            rew = g["rewards"]
            t = int(rew.shape[0])
            self._lengths.append(t)
            leaves = self._h5_leaves(g, name)
            for col, (ds, rows) in leaves.items():
                want = t + 1 if col.startswith("obs") else t
                if col.startswith("infos/"):
                    if rows not in (t, t + 1):
                        dropped.setdefault(col, f"{name}: {rows} rows, expected {t} or {t + 1} ({t} steps)")
                        continue
                elif rows != want:
                    raise self._error(
                        f"mismatched lengths: {rows} rows, expected {want} ({t} steps)", f"{name}/{ds.name.split('/', 2)[-1]}"
                    )
                shape, dtype = self._leaf_schema(col, ds)
                if col.startswith("infos/") and np.dtype(dtype).kind not in "biuf":
                    dropped.setdefault(col, f"{name}: dtype {ds.dtype}, not numeric")
                    continue
                if col.startswith("infos/"):
                    whole = rows == t + 1  # reset info + one per step: next-derived, like obs
                    if first:
                        info_whole[col] = whole
                    elif info_whole.get(col) != whole:
                        dropped.setdefault(col, f"{name}: {rows} rows ({t} steps), where the first episode's "
                                                f"had {'T+1' if info_whole.get(col) else 'T'}")
                        continue
                if first:
                    columns[col] = (shape, dtype)
                elif col not in columns:
                    if not col.startswith("infos/"):
                        raise self._error(f"column {col!r} is not in episode 0", name)
                    dropped.setdefault(col, f"{name}: present, but not in the first episode")
                elif columns[col] != (shape, dtype):
                    if col.startswith("infos/") and self._drop_unsupported:
                        dropped.setdefault(col, f"{name}: shape/dtype {shape} {dtype}, the first episode's "
                                                f"{columns[col]}")
                        continue
                    raise self._error(
                        f"shape/dtype {shape} {dtype} differ from the first episode's {columns[col]}",
                        f"{name}/{col}",
                    )
            if not first:
                missing = [c for c in columns if c not in leaves]
                info_missing = [c for c in missing if c.startswith("infos/")]
                for c in info_missing:
                    dropped.setdefault(c, f"{name}: missing")
                    columns.pop(c)
                if len(missing) > len(info_missing):
                    raise self._error(f"missing {sorted(set(missing) - set(info_missing))}", name)
            first = False
        for c in dropped:
            columns.pop(c, None)
        self._refuse_or_drop(dropped)
        self._cols = columns
        self._check_totals(sum(self._lengths), len(self._episodes))
        next_keys = tuple(c for c in columns if c == "obs" or c.startswith("obs/") or info_whole.get(c))
        return Schema(columns, next_keys, sum(self._lengths), self._attrs(), len(self._episodes))

    def _h5_leaves(self, g: Any, ep: str) -> dict[str, tuple[Any, int]]:
        import h5py

        out: dict[str, tuple[Any, int]] = {}

        def walk(node: Any, col: str) -> None:
            if isinstance(node, h5py.Dataset):
                out[col] = (node, int(node.shape[0]) if node.shape else -1)
            else:
                for k in node:
                    walk(node[k], f"{col}/{k}")

        for key, col in (*_TOP.items(), ("rewards", "reward")):
            walk(g[key], col)
        if self._keep_infos and "infos" in g:
            walk(g["infos"], "infos")
        return out

    def _leaf_schema(self, col: str, ds: Any) -> tuple[tuple[int, ...], str]:
        space = self._leaf_space.get(col)
        if ds.dtype.kind in "OV" or h5py_vlen(ds):
            if space is not None and self._jpeg and is_image(space):
                return tuple(space["shape"]), "|u1"
            if col.startswith("infos/"):
                return (), ds.dtype.str  # refused or dropped by the caller, by name
            raise self._error(f"unsupported non-numeric data (dtype {ds.dtype})", col)
        if ds.dtype.kind not in "biuf":
            if col.startswith("infos/"):
                return (), ds.dtype.str
            raise self._error(f"unsupported dtype {ds.dtype} (text spaces are not stored)", col)
        shape = tuple(int(s) for s in ds.shape[1:])
        if col == "reward":
            if shape == (1,):
                shape = ()
        return shape, np.dtype(ds.dtype).newbyteorder("=").str

    def _read_leaf(self, col: str, ds: Any, a: int, b: int) -> np.ndarray:
        space = self._leaf_space.get(col)
        if ds.dtype.kind in "OV" or h5py_vlen(ds):
            return decode_jpeg(ds[a:b], f"{self._data}/main_data.hdf5:{ds.name}")
        rows = np.asarray(ds[a:b])
        if col == "reward":
            rows = rows.reshape(b - a)
        del space
        return rows

    def _chunks_hdf5(self, chunk_rows: int) -> Iterator[Chunk]:
        asm = ChunkAssembler(chunk_rows)
        obs_cols = list(self._schema.next_keys)
        for name, t in zip(self._episodes, self._lengths):
            ep = int(name.rsplit("_", 1)[1])  # the Minari episode id (episode_<i>, checked by _episode_names)
            g = self._h5[name]
            leaves = self._h5_leaves(g, name)
            term_ds, trunc_ds = g["terminations"], g["truncations"]
            for a in range(0, t, chunk_rows):
                b = min(t, a + chunk_rows)
                steps: dict[str, np.ndarray] = {}
                for col in self._cols:
                    ds, rows = leaves[col]
                    steps[col] = self._read_leaf(col, ds, a, b)
                term = np.asarray(term_ds[a:b]).reshape(b - a).astype(bool)
                trunc = np.asarray(trunc_ds[a:b]).reshape(b - a).astype(bool)
                last = b == t
                if last:
                    self._finish_episode(ep, term, trunc)
                inner = term[:-1] | trunc[:-1] if last else term | trunc
                if inner.any():
                    raise self._error(
                        f"a terminated/truncated flag before the last step (row {a + int(np.flatnonzero(inner)[0])})",
                        f"{name}/terminations",
                    )
                steps["terminated"], steps["truncated"] = term, trunc
                final = None
                if last:
                    final = {c: self._read_leaf(c, leaves[c][0], t, t + 1)[0] for c in obs_cols}
                out = asm.add(steps, final)
                if out is not None:
                    yield out
        out = asm.flush()
        if out is not None:
            yield out

    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        if self.data_format == "hdf5":
            yield from self._chunks_hdf5(chunk_rows)
        else:
            yield from self._chunks_arrow(chunk_rows)


def h5py_vlen(ds: Any) -> bool:
    import h5py

    return h5py.check_vlen_dtype(ds.dtype) is not None


def convert_minari(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    drop_infos: bool = False,
    drop_unsupported: bool = False,
    keep_infos: bool | None = None,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
) -> dict[str, Any]:
    """Convert a Minari dataset directory into a new store at ``dst``.

    ``src`` is the dataset's directory (e.g. ``~/.minari/datasets/D4RL/door/human-v2``)
    or its ``data/`` directory, or a dataset id (``D4RL/door/human-v2``) looked up
    in Minari's local datasets directory (:func:`resolve_dataset`: never a
    download); Minari itself is not needed to read it. Options
    and the returned summary are those of :func:`convert_d4rl`.

    Raises
    ------
    ConversionError
        Not a Minari dataset, a missing key, observations not ``T+1`` rows, totals
        that disagree with ``metadata.json``, an info leaf a store cannot hold
        (unless ``drop_unsupported``).
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.

    Examples
    --------
    ``convert_minari("~/.minari/datasets/D4RL/door/human-v2", "stores/door")``;
    ``tests/convert/test_convert.py`` runs it on datasets written by ``minari.DataCollector``.
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    reader = MinariReader(src, drop_infos=drop_infos, drop_unsupported=drop_unsupported, keep_infos=keep_infos)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )
