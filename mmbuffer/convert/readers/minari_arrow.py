"""Minari's Arrow/Parquet episodes: Arrow columns into numpy leaves (needs ``pyarrow``), and
the reader's Arrow half (:class:`ArrowEpisodes`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .minari_common import MinariCommon
from .minari_spaces import decode_jpeg, is_image
from .._pipeline.reader import Chunk, ChunkAssembler, Reader, Schema, reader_error

__all__ = ["ArrowEpisodes", "arrow_info_leaves", "arrow_leaves", "null_fill", "null_rows"]


def null_rows(arr: Any) -> np.ndarray:
    """The rows of the Arrow array ``arr`` that are null (missing)."""
    if not arr.null_count:
        return np.zeros(0, np.int64)
    return np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))


def arrow_leaves(arr: Any, space: dict[str, Any] | None, col: str, out: dict[str, np.ndarray],
                 reader: Reader, *, jpeg: bool, nulls: dict[str, np.ndarray] | None = None) -> None:
    """Put the numpy leaves of the Arrow column ``arr`` into ``out`` as ``col/...`` (images decoded).

    Null rows (Minari pads an episode's step columns with one, at row T) are filled
    with 0/False; ``nulls`` gets the null rows of each column that has any.
    """
    import pyarrow as pa

    if nulls is not None and arr.null_count:
        nulls[col] = null_rows(arr)
    kind = (space or {}).get("type")
    if pa.types.is_struct(arr.type):
        for i, field in enumerate(arr.type):
            sub = None
            if kind == "Dict":
                sub = space["subspaces"].get(field.name)  # type: ignore[index]
                name = field.name
            elif kind == "Tuple":
                sub = space["subspaces"][int(field.name)]  # type: ignore[index]
                name = f"_index_{field.name}"
            else:
                name = field.name
            arrow_leaves(arr.field(i), sub, f"{col}/{name}", out, reader, jpeg=jpeg, nulls=nulls)
        return
    if space is not None and jpeg and is_image(space) and pa.types.is_binary(arr.type):
        frames = [np.frombuffer(x.as_py() or b"", np.uint8) for x in arr]
        # the action column of an Arrow episode is padded with one null row
        valid = [f for f in frames if len(f)]
        img = decode_jpeg(valid, f"{reader.path}:{col}")
        if len(valid) < len(frames):
            img = np.concatenate([img, np.zeros((len(frames) - len(valid), *img.shape[1:]), np.uint8)])
        out[col] = img
        return
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        flat = arr.flatten().fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
        n = len(arr)
        shape = tuple(space["shape"]) if space and "shape" in space else (width,)
        if kind == "MultiBinary" and space is not None:
            nsp = space.get("n")
            shape = tuple(nsp) if isinstance(nsp, list) else (int(str(nsp)),)
        if kind == "MultiDiscrete" and space is not None:
            shape = tuple(np.asarray(space["nvec"]).shape)
        if int(np.prod(shape)) != width:
            shape = (width,)
        out[col] = flat.reshape(n, *shape)
        return
    if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        out[col] = arr.fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
        return
    raise reader_error(reader, f"unsupported Arrow type {arr.type}", col)


def null_fill(arr: Any) -> Any:
    """A fill value for the nulls Minari pads Arrow episodes with (False for bool)."""
    import pyarrow as pa

    typ = arr.type.value_type if pa.types.is_fixed_size_list(arr.type) else arr.type
    return pa.scalar(False if pa.types.is_boolean(typ) else 0, type=typ)


def arrow_info_leaves(arr: Any, col: str, out: dict[str, np.ndarray], n: int,
                      unsupported: dict[str, str] | None = None) -> None:
    """Put the numeric leaves of the Arrow ``infos`` column ``arr`` into ``out`` as ``col/...``.

    Leaves of any other type, or with missing (null) values, are named in
    ``unsupported`` (leaf -> why), never silently left out or filled.
    """
    import pyarrow as pa

    if unsupported is not None and arr.null_count and not pa.types.is_struct(arr.type):
        unsupported[col] = f"missing (null) values at rows {null_rows(arr)[:8].tolist()}"
        return

    if pa.types.is_struct(arr.type):
        for i, field in enumerate(arr.type):
            arrow_info_leaves(arr.field(i), f"{col}/{field.name}", out, n, unsupported)
            if f"{col}/{field.name}" in out and field.metadata and b"shape" in field.metadata:
                shape = tuple(int(s) for s in field.metadata[b"shape"].split(b",") if s)
                out[f"{col}/{field.name}"] = out[f"{col}/{field.name}"].reshape(-1, *shape)
        return
    if pa.types.is_fixed_size_list(arr.type):
        flat = arr.flatten().fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
        out[col] = flat.reshape(len(arr), arr.type.list_size)
    elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        out[col] = arr.fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
    elif unsupported is not None:
        unsupported[col] = f"Arrow type {arr.type}, not numeric"


class ArrowEpisodes(MinariCommon):
    """A Minari reader's Arrow/Parquet episodes (``data/episode_id=<i>/`` directories)."""

    def _episode_dirs(self) -> list[tuple[int, Path]]:
        dirs = []
        for d in self._data.iterdir():
            if d.is_dir() and d.name.isdigit():
                dirs.append((int(d.name), d))
            elif d.is_dir() and d.name.startswith("episode_id="):
                dirs.append((int(d.name.split("=", 1)[1]), d))
        dirs.sort()
        return dirs

    def _arrow_table(self, d: Path, columns: list[str] | None = None) -> Any:
        try:
            import pyarrow.dataset as pds
        except ImportError as exc:
            raise self._error(f"data_format {self.data_format!r} needs pyarrow (pip install pyarrow)") from exc
        ds = pds.dataset(str(d), format=self.data_format, ignore_prefixes=["_", ".", "metadata.json"])
        if columns is not None:
            columns = [c for c in columns if c in ds.schema.names]
        return ds.to_table(columns=columns)

    def _arrow_infos(self) -> None:
        """Read every episode's ``infos`` column (only it) before writing: the leaves a store cannot
        hold (not numeric, missing values, not in every episode) are refused or, with
        ``drop_unsupported``, left out of every episode (:attr:`_dropped_leaves`)."""
        why: dict[str, str] = {}
        first: set[str] | None = None
        for _, d in self._dirs:
            table = self._arrow_table(d, ["infos"])
            leaves: dict[str, np.ndarray] = {}
            if "infos" in table.column_names:
                unsupported: dict[str, str] = {}
                arrow_info_leaves(table.column("infos").combine_chunks(), "infos", leaves, table.num_rows, unsupported)
                for col, arr in leaves.items():
                    if arr.dtype.kind not in "biuf":
                        unsupported[col] = f"dtype {arr.dtype}, not numeric"
                for col, reason in unsupported.items():
                    why.setdefault(col, f"{d.name}: {reason}")
            names = set(leaves) | set(why)
            if first is None:
                first = names
            for col in sorted(names ^ first):
                why.setdefault(col, f"{d.name}: " + ("not in the first episode" if col in names else "missing"))
        self._refuse_or_drop(why)
        self._dropped_leaves = set(why)

    def _arrow_episode(self, d: Path) -> dict[str, np.ndarray]:
        table = self._arrow_table(d)
        n = table.num_rows
        out: dict[str, np.ndarray] = {}
        nulls: dict[str, np.ndarray] = {}
        for key, col in (("observations", "obs"), ("actions", "action")):
            if key not in table.column_names:
                raise self._error(f"missing key {key!r}", f"{d.name}/{key}")
            space = self._obs_space if key == "observations" else self._act_space
            arrow_leaves(table.column(key).combine_chunks(), space, col, out, self, jpeg=self._jpeg, nulls=nulls)
        for key, col in (("rewards", "reward"), ("terminations", "terminated"), ("truncations", "truncated")):
            if key not in table.column_names:
                raise self._error(f"missing key {key!r}", f"{d.name}/{key}")
            arr = table.column(key).combine_chunks()
            if arr.null_count:
                nulls[col] = null_rows(arr)
            out[col] = arr.fill_null(null_fill(arr)).to_numpy(zero_copy_only=False)
        for col, rows in nulls.items():  # only the padding row T of a step column may be null
            obs = col == "obs" or col.startswith("obs/")
            bad = rows if obs else rows[rows != n - 1]
            if len(bad):
                where = "" if obs else f" before the padding row {n - 1}"
                raise self._error(f"expected no missing (null) values{where}, got nulls at rows {bad[:8].tolist()} "
                                  "(they cannot be stored, and filling them would change the data)", f"{d.name}/{col}")
        if self._keep_infos and "infos" in table.column_names:
            unsupported: dict[str, str] = {}
            arrow_info_leaves(table.column("infos").combine_chunks(), "infos", out, n, unsupported)
            for col, arr in list(out.items()):
                if col.startswith("infos/") and arr.dtype.kind not in "biuf":
                    unsupported[col] = f"dtype {arr.dtype}, not numeric"
            for col in self._dropped_leaves:  # found by _arrow_infos, left out of every episode as asked
                out.pop(col, None)
                unsupported.pop(col, None)
            if unsupported:  # _arrow_infos read them all: only if the files changed since
                col, why = next(iter(unsupported.items()))
                raise self._error(f"info leaf {col!r} cannot be stored as a column: {d.name}: {why}", col)
        return out

    def _scan_arrow(self) -> Schema:
        self._dirs = self._episode_dirs()
        if not self._dirs:
            raise self._error(f"data_format is {self.data_format} but data/ holds no episode directories")
        self._lengths = []
        self._dropped_leaves = set[str]()
        if self._keep_infos:
            self._arrow_infos()
        columns: dict[str, tuple[tuple[int, ...], str]] = {}
        for ep, d in self._dirs:
            meta_file = d / "metadata.json"
            t = None
            if meta_file.is_file() and ep != self._dirs[0][0]:
                t = json.loads(meta_file.read_text()).get("total_steps")
            if t is None or not columns:
                data = self._arrow_episode(d)
                t = len(data["reward"]) - 1
                if not columns:
                    for col, arr in data.items():
                        if col in ("terminated", "truncated"):
                            continue
                        shape = tuple(arr.shape[1:])
                        columns[col] = (shape, np.dtype(arr.dtype).newbyteorder("=").str)
            self._lengths.append(int(t))
        self._cols = columns
        self._check_totals(sum(self._lengths), len(self._dirs))
        # Arrow pads every column to T+1 rows: infos are kept whole (reset info first), like obs
        next_keys = tuple(c for c in columns if c == "obs" or c.startswith("obs/") or c.startswith("infos/"))
        return Schema(columns, next_keys, sum(self._lengths), self._attrs(), len(self._dirs))

    def _chunks_arrow(self, chunk_rows: int) -> Iterator[Chunk]:
        asm = ChunkAssembler(chunk_rows)
        obs_cols = list(self._schema.next_keys)
        for (ep, d), t in zip(self._dirs, self._lengths):
            data = self._arrow_episode(d)
            if len(data["reward"]) != t + 1:
                raise self._error(
                    f"mismatched lengths: {len(data['reward']) - 1} steps, metadata says {t}", f"{d.name}"
                )
            for col in self._cols:
                if col not in data:
                    raise self._error(f"missing column {col!r}", d.name)
            steps = {c: data[c][:t] for c in self._cols}
            for c in obs_cols:
                if len(data[c]) != t + 1:
                    raise self._error(f"expected {t + 1} rows (reset + {t} steps), got {len(data[c])}",
                                      f"{d.name}/{c}")
            term = data["terminated"][:t].astype(bool)
            trunc = data["truncated"][:t].astype(bool)
            self._finish_episode(ep, term, trunc)
            steps["terminated"], steps["truncated"] = term, trunc
            final = {c: data[c][t] for c in obs_cols}
            for a in range(0, t, chunk_rows):
                b = min(t, a + chunk_rows)
                piece = {k: v[a:b] for k, v in steps.items()}
                out = asm.add(piece, final if b == t else None)
                if out is not None:
                    yield out
        out = asm.flush()
        if out is not None:
            yield out
