"""LeRobot datasets, format v3.0 (``LeRobotDataset``): parquet frames plus ``meta/``.

Layout read (``lerobot/datasets/utils.py``, ``CODEBASE_VERSION = "v3.0"``)::

    meta/info.json        codebase_version "v3.x", fps, total_episodes, total_frames,
                          features: key -> {dtype, shape, names}
    meta/episodes/chunk-XXX/file-YYY.parquet   one row per episode: episode_index, length, ...
    meta/tasks.parquet    task strings (kept in attrs["lerobot"]["tasks"])
    data/chunk-XXX/file-YYY.parquet            one row per frame, in order: every feature
                          (timestamp, frame_index, episode_index, index, task_index included)
    videos/<key>/chunk-XXX/file-YYY.mp4        features of dtype "video"

Every numeric feature becomes a column: ``observation.<x>`` -> ``obs/<x>``
(``observation`` -> ``obs``), ``next.reward`` -> ``reward``, the others under
their own name (``action``, ``timestamp``, ``frame_index``, ``index``,
``episode_index``, ``task_index``, ``next.success``...). Episodes are the runs
of equal ``episode_index``; an episode's last frame is ``terminated`` when its
``next.done`` is set, else ``truncated`` (the recording stops there).
LeRobot stores no observation after an episode's last frame, so the store has
no next-derived columns. Episode lengths and totals must agree with ``meta/``
(``info.json``, ``meta/episodes``).

**Lossless by default.** What the dataset holds that the store cannot derive:
every numeric feature (kept, frame for frame); ``next.done`` (kept as the
flags: it may be set only on an episode's last frame, a frame inside an
episode with it set is refused); the task strings of ``meta/tasks.parquet``
(kept in ``attrs["lerobot"]["tasks"]``, ``task_index -> task``); ``info.json``
(in ``attrs["lerobot"]``). ``string`` features cannot be columns: refused,
naming them, unless ``drop_unsupported=True`` (``--drop-unsupported``) leaves
them out. The per-episode statistics of ``meta/episodes`` are computed from the
frames, not data of their own.

**Video features** are decoded (PyAV, ``pip install av``) into ``uint8`` image
columns of the shape ``info.json`` declares (``[H, W, C]``), one row per frame,
with frame counts and timestamps checked against ``meta/`` (see
:mod:`.lerobot_video`); ``codec`` names the per-column codec of those columns
(default: raw, lossless). ``image`` features (PNG in the parquet) are not
decoded: refused by name. ``skip_visual=True`` (``--skip-visual``) leaves video
and image features out instead (listed in ``dropped_keys``, with a warning).

Files are found by their fixed names (``data/chunk-*/file-*.parquet``), never
through the path templates in ``info.json`` (untrusted); symbolic links are
refused. Frames are read a record batch at a time, so memory stays at about
one chunk.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError
from ...schema import PriorityConfig
from .._pipeline.reader import DEFAULT_CHUNK_BYTES, Chunk, Reader, Schema, jsonable
from .._pipeline.sniff import expect
from .._pipeline.write import write_store
from .lerobot_video import VideoFeature, VideoFrames, episode_spans, span_columns, video_feature

__all__ = ["LeRobotReader", "convert_lerobot"]

_FILE = re.compile(r"^chunk-(\d+)/file-(\d+)\.parquet$")
_VISUAL = ("video", "image")


def _column_name(key: str) -> str:
    if key == "observation":
        return "obs"
    if key.startswith("observation."):
        return "obs/" + key[len("observation."):]
    if key == "next.reward":
        return "reward"
    return key


class LeRobotReader(Reader):
    """Read a LeRobot v3 dataset directory (see the module docstring).

    Parameters
    ----------
    path
        The dataset root (holding ``meta/info.json`` and ``data/``).
    skip_visual
        Leave video and image features out instead of refusing the dataset.
    drop_unsupported
        Leave ``string`` features out instead of refusing the dataset.
    codec
        The codec of the columns decoded from video features (an ``mb.Column``
        codec name); ``None``: raw.
    """

    format = "lerobot"

    def __init__(self, path: str | os.PathLike[str], *, skip_visual: bool = False,
                 drop_unsupported: bool = False, codec: str | None = None) -> None:
        self._drop_unsupported = drop_unsupported
        self._codec = codec
        self._videos: dict[str, VideoFeature] = {}
        self._decoders: list[VideoFrames] = []
        super().__init__(path)
        root = self.path
        expect(root, ("directory",), "a LeRobot dataset directory (holding meta/info.json)")
        info_path = root / "meta" / "info.json"
        if not info_path.is_file() or info_path.is_symlink():
            raise self._error("expected a LeRobot dataset: no meta/info.json", "meta/info.json")
        try:
            with open(info_path, "rb") as f:
                text = f.read(1 << 26)  # metadata, never gigabytes: a huge file is refused, not loaded
            if len(text) == 1 << 26:
                raise ValueError("larger than 64 MiB")
            info = json.loads(text)
        except (OSError, ValueError) as exc:
            raise self._error(f"unreadable JSON ({exc})", "meta/info.json") from exc
        if not isinstance(info, dict) or not isinstance(info.get("features"), dict):
            raise self._error("expected a JSON object with 'features'", "meta/info.json")
        version = str(info.get("codebase_version", ""))
        if not version.startswith("v3."):
            raise self._error(f"expected codebase_version v3.x (LeRobotDataset v3), got {version!r}; "
                              "convert older datasets with lerobot's convert_dataset_v21_to_v30 first",
                              "meta/info.json")
        self.info = info
        self._files = self._parquet_files(root / "data", "data")
        self._episode_files = self._parquet_files(root / "meta" / "episodes", "meta/episodes")
        self._features = self._pick_features(info["features"], skip_visual)
        self._done_key = "next.done" if "next.done" in self._features else None
        self._lengths = self._episode_lengths()
        self._spans = self._video_spans()
        self._schema = self._scan()

    @property
    def video_keys(self) -> tuple[str, ...]:
        """The video features decoded into columns."""
        return tuple(self._videos)

    # -- layout ------------------------------------------------------------------------------
    def _parquet_files(self, base: Path, where: str) -> list[Path]:
        if not base.is_dir() or base.is_symlink():
            raise self._error(f"expected a directory {where}/ of parquet files", where)
        found = []
        for top, dirs, files in os.walk(base):
            for name in (*dirs, *files):
                full = Path(top) / name
                if full.is_symlink():
                    raise self._error("expected no symbolic links (they may point outside the dataset), "
                                      f"found {full.relative_to(self.path)}", where)
                m = _FILE.match(full.relative_to(base).as_posix())
                if m:
                    found.append(((int(m.group(1)), int(m.group(2))), full))
        if not found:
            raise self._error(f"expected {where}/chunk-XXX/file-YYY.parquet files, found none", where)
        return [p for _, p in sorted(found)]

    def _pick_features(self, features: dict[str, Any], skip_visual: bool) -> dict[str, dict[str, Any]]:
        kept: dict[str, dict[str, Any]] = {}
        visual, text = [], []
        for key, ft in features.items():
            if not isinstance(ft, dict) or "dtype" not in ft or not isinstance(ft.get("shape"), (list, tuple)):
                raise self._error(f"feature {key!r}: expected {{dtype, shape}}, got {ft!r}", "meta/info.json")
            dtype = str(ft["dtype"])
            if dtype == "video" and not skip_visual:
                self._videos[key] = video_feature(key, ft, self._error)
            elif dtype in _VISUAL:
                visual.append(key)
            elif dtype == "string":
                text.append(key)
            else:
                try:
                    ok = np.dtype(dtype).kind in "biuf"
                except TypeError:
                    ok = False
                if not ok:
                    raise self._error(f"feature {key!r}: expected a numeric dtype, got {dtype!r}", "meta/info.json")
                kept[key] = ft
        if visual and not skip_visual:
            raise self._error(
                f"image features {visual} (PNG frames in the parquet files) are not decoded by mmbuffer; "
                "pass skip_visual=True (--skip-visual) to convert the other features without them",
                visual[0])
        if visual:
            self._warn(f"video/image features left out (skip_visual): {visual}")
        if text and not self._drop_unsupported:
            raise self._error(f"string features {text} cannot be stored as columns (a store holds numbers); "
                              "drop_unsupported=True (--drop-unsupported) converts the other features without them",
                              text[0])
        if visual or text:
            self.stats["dropped_keys"] = [*visual, *text]
        if "episode_index" not in kept:
            raise self._error("expected an 'episode_index' feature", "meta/info.json")
        if self._videos:
            try:
                import av  # noqa: F401
            except ImportError:
                raise self._error(f"decoding video features {list(self._videos)} needs PyAV (pip install av, "
                                  "or mmbuffer[formats]); skip_visual=True (--skip-visual) converts the "
                                  "other features without them", next(iter(self._videos))) from None
        return kept

    def _episode_columns(self, names: list[str]) -> dict[str, np.ndarray]:
        """Columns of ``meta/episodes`` (all files), in episode_index order."""
        import pyarrow.parquet as pq

        parts = []
        for path in self._episode_files:
            try:
                have = set(pq.read_schema(path).names)
            except Exception as exc:  # pyarrow's errors: not parquet
                raise self._error(f"expected a parquet file ({exc})", str(path.relative_to(self.path))) from exc
            if missing := [n for n in ("episode_index", *names) if n not in have]:
                raise self._error(f"expected columns episode_index and {', '.join(names)}, missing {missing}",
                                  str(path.relative_to(self.path)))
            try:
                table = pq.read_table(path, columns=["episode_index", *names])
                if any(table.column(n).null_count for n in names):
                    raise ValueError(f"missing values in {[n for n in names if table.column(n).null_count]}")
            except Exception as exc:  # pyarrow's errors: not parquet, missing column
                raise self._error(f"expected parquet with episode_index and {', '.join(names)} ({exc})",
                                  str(path.relative_to(self.path))) from exc
            parts.append({n: table.column(n).to_numpy() for n in ("episode_index", *names)})
        cols = {n: np.concatenate([p[n] for p in parts]) for n in ("episode_index", *names)}
        order = np.argsort(cols["episode_index"], kind="stable")
        return {n: v[order] for n, v in cols.items()}

    def _episode_lengths(self) -> np.ndarray:
        cols = self._episode_columns(["length"])
        index, lengths = cols["episode_index"].astype(np.int64), cols["length"].astype(np.int64)
        self._episode_ids = index
        if len(index) and (np.any(np.diff(index) <= 0) or np.any(lengths <= 0)):
            raise self._error("expected unique episode_index values and positive lengths", "meta/episodes")
        for key, want in (("total_episodes", len(lengths)), ("total_frames", int(lengths.sum()))):
            got = self.info.get(key)
            if got is not None and int(got) != want:
                raise self._error(f"{key}: expected {want} (meta/episodes), got {got}", "meta/info.json")
        return lengths

    def _video_spans(self) -> dict[str, tuple[list[str], np.ndarray, np.ndarray]]:
        """Per video feature: each episode's file and [from, to) span (checked: :func:`episode_spans`)."""
        return {key: episode_spans(self.path, key, self._episode_columns(span_columns(key)), self._episode_ids,
                                   self._error) for key in self._videos}

    def _scan(self) -> Schema:
        import pyarrow.parquet as pq

        try:
            arrow = pq.read_schema(self._files[0])
        except Exception as exc:
            raise self._error(f"expected a parquet file ({exc})", str(self._files[0].relative_to(self.path))) from exc
        columns: dict[str, tuple[tuple[int, ...], str]] = {}
        for key, ft in self._features.items():
            if key not in arrow.names:
                raise self._error(f"feature {key!r} is not a column of the frames", str(self._files[0].relative_to(self.path)))
            shape = tuple(int(s) for s in ft["shape"])
            if shape == (1,) and not _is_list(arrow.field(key).type):
                shape = ()
            if key == self._done_key:
                continue
            columns[_column_name(key)] = (shape, np.dtype(str(ft["dtype"])).str)
        specs = {}
        for key, video in self._videos.items():
            columns[_column_name(key)] = (video.shape, "|u1")
            if self._codec is not None:
                specs[_column_name(key)] = _column_spec(video.shape, self._codec)
        if self._codec is not None and not self._videos:
            raise InvalidArgumentError(f"codec: applies to the columns decoded from video features; "
                                       f"{self.path} has none to decode, got codec={self._codec!r}")
        wanted = len([k for k in self._features if k != self._done_key]) + len(self._videos)
        if len(set(columns)) != wanted:
            raise self._error("two features map to the same column name", "meta/info.json")
        attrs = {"source_format": "lerobot", "lerobot": jsonable({k: v for k, v in self.info.items()
                                                                 if k not in ("data_path", "video_path")})}
        tasks = self._tasks()
        if tasks is not None:
            attrs["lerobot"]["tasks"] = tasks
        return Schema(columns, (), int(self._lengths.sum()), attrs, len(self._lengths), specs)

    def _tasks(self) -> dict[str, str] | None:
        """``meta/tasks.parquet`` as ``{task_index: task}`` (the task is the pandas index, or a ``task`` column)."""
        import pyarrow.parquet as pq

        path = self.path / "meta" / "tasks.parquet"
        if not path.is_file() or path.is_symlink():
            return None
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's errors
            raise self._error(f"expected a parquet file ({exc})", "meta/tasks.parquet") from exc
        names = [n for n in table.column_names if n != "task_index"]
        text = next((n for n in ("task", "__index_level_0__", *names) if n in table.column_names), None)
        if "task_index" not in table.column_names or text is None:
            raise self._error(f"expected columns task_index and task, got {table.column_names}", "meta/tasks.parquet")
        index = table.column("task_index").to_pylist()
        return {str(i): str(t) for i, t in zip(index, table.column(text).to_pylist())}

    @property
    def schema(self) -> Schema:
        return self._schema

    # -- rows --------------------------------------------------------------------------------
    def _batches(self, chunk_rows: int) -> Iterator[Any]:
        """Record batches of at most ``chunk_rows`` frames, read a row group at a time.

        ``ParquetFile.iter_batches`` kept every decoded batch allocated until the
        file was done (pyarrow 26: +510 MB resident for 3M rows of 100 bytes);
        ``read_row_group`` frees each group once its batches are written. A group
        of at least half a chunk is cut into batches on its own, without a copy;
        smaller ones are joined (one copy) until they hold half a chunk, or the file
        ends. Joining up to a whole chunk held two groups and their copy per chunk:
        10M frames in groups of 262,144 peaked at 664 MB of anonymous memory, 551 MB
        this way (``benchmarks/HISTORY.md``).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        names = list(self._features)
        for path in self._files:
            where = str(path.relative_to(self.path))
            try:
                f = pq.ParquetFile(path)
                pending: list[Any] = []
                rows = 0
                for i in range(f.metadata.num_row_groups):
                    pending.append(f.read_row_group(i, columns=names))
                    rows += pending[-1].num_rows
                    if 2 * rows >= chunk_rows or i == f.metadata.num_row_groups - 1:
                        table = pending[0] if len(pending) == 1 else pa.concat_tables(pending)
                        pending, rows = [], 0
                        for batch in table.combine_chunks().to_batches(max_chunksize=chunk_rows):
                            yield where, batch
                        del table
            except Exception as exc:
                if type(exc).__module__.startswith("mmbuffer"):
                    raise
                raise self._error(f"unreadable parquet ({type(exc).__name__}: {exc})", where) from exc

    def _array(self, where: str, key: str, col: Any, n: int) -> np.ndarray:
        ft = self._features[key]
        shape = self._schema.columns[_column_name(key)][0] if key != self._done_key else ()
        dtype = np.dtype(str(ft["dtype"]))
        if col.null_count:
            raise self._error(f"feature {key!r}: expected no missing values, got {col.null_count}", where)
        values = col
        while _is_list(values.type):
            values = values.flatten()
        flat = values.to_numpy(zero_copy_only=False)
        want = n * int(np.prod(shape, dtype=np.int64))
        if len(flat) != want:
            raise self._error(f"feature {key!r}: expected {n} rows of shape {shape}, got {len(flat)} values", where)
        if flat.dtype.kind not in "biuf":
            raise self._error(f"feature {key!r}: expected numbers, got {flat.dtype}", where)
        out: np.ndarray = flat.astype(dtype, copy=False).reshape(n, *shape)
        return out

    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        ends = np.cumsum(self._lengths)
        total = int(ends[-1])
        self.close()
        fps = self.info.get("fps")
        if self._videos and not (isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0):
            raise self._error(f"fps: expected a positive number (video features), got {fps!r}", "meta/info.json")
        fps = float(fps or 1)
        self._decoders = [VideoFrames(self.path, v, *self._spans[k], self._lengths, self._error)
                          for k, v in self._videos.items()]
        row = 0
        inner_done: list[int] = []  # frames inside an episode with next.done set (the first 8)
        for where, batch in self._batches(chunk_rows):
            n = batch.num_rows
            if n == 0:
                continue
            if row + n > total:
                raise self._error(f"expected {total} frames (meta/episodes lengths), got more", where)
            data = {k: self._array(where, k, batch.column(k), n) for k in self._features}
            rows = np.arange(row, row + n, dtype=np.int64)
            # each frame's episode, from meta/episodes: episode_index must say the same
            expected = self._episode_ids[np.searchsorted(ends, rows, side="right")]
            got = data["episode_index"].reshape(n).astype(np.int64)
            if not np.array_equal(got, expected):
                bad = int(np.flatnonzero(got != expected)[0])
                raise self._error(f"frame {row + bad}: expected episode_index {expected[bad]} (meta/episodes "
                                  f"lengths, in episode order), got {got[bad]}", where)
            if self._decoders:
                episode = np.searchsorted(ends, rows, side="right")
                offsets = (data["timestamp"].reshape(n).astype(np.float64) if "timestamp" in data
                           else (rows - (ends - self._lengths)[episode]) / fps)
                for decoder in self._decoders:
                    data[decoder.feature.key] = decoder.take(offsets)
            done = np.zeros(n, bool)
            inside = ends[(ends > row) & (ends <= row + n)] - 1 - row
            done[inside] = True
            if self._done_key:
                flag = data[self._done_key].reshape(n) != 0
                inner_done.extend((np.flatnonzero(flag & ~done) + row)[: 8 - len(inner_done)].tolist())
                term = done & flag
            else:
                term = np.zeros(n, bool)
            steps = {_column_name(k): v for k, v in data.items() if k != self._done_key}
            steps["terminated"], steps["truncated"] = term, done & ~term
            row += n
            yield Chunk(steps, {})
        self.close()
        if inner_done:  # after every frame's episode_index is checked: a wrong length explains more
            raise self._error(f"expected next.done only on an episode's last frame (the store's flags end "
                              f"episodes there), got it on frames {inner_done}", self._done_key)


    def close(self) -> None:
        for decoder in self._decoders:
            decoder.close()


def _column_spec(shape: tuple[int, ...], codec: str) -> Any:
    """``mb.Column(shape, "uint8", codec=codec)``: the decoded frames in the codec the user named."""
    from ...schema import Column

    return Column(shape, "uint8", codec=codec)


def _is_list(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def convert_lerobot(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    skip_visual: bool = False,
    drop_unsupported: bool = False,
    codec: str | None = None,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
) -> dict[str, Any]:
    """Convert a LeRobot v3 dataset directory into a new store at ``dst`` (needs ``pyarrow``).

    Options and the returned summary are those of :func:`~mmbuffer.convert.write_store`;
    video features are decoded into ``uint8`` image columns (needs ``av``), stored
    with ``codec`` (default raw); ``skip_visual`` leaves video and image features
    out instead, ``drop_unsupported`` ``string`` features. ``chunk_rows`` defaults
    to about 32 MiB of rows, frames included.

    Raises
    ------
    ConversionError
        Not a LeRobot v3 dataset, an image feature or a depth-map video (unless
        ``skip_visual``), a ``string`` feature (unless ``drop_unsupported``),
        episode lengths or totals that disagree with ``meta/``, missing values,
        ``next.done`` inside an episode; a video file missing, or whose frames
        disagree with ``meta/`` (count, timestamps, size).
    InvalidArgumentError
        ``codec`` given where ``mb.Column`` takes none, or for a dataset without
        video features.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        from ...errors import ConversionError

        raise ConversionError(f"{src}: reading LeRobot datasets needs pyarrow (pip install pyarrow)") from exc
    reader = LeRobotReader(Path(src).expanduser(), skip_visual=skip_visual, drop_unsupported=drop_unsupported,
                           codec=codec)
    if chunk_rows is None and reader.video_keys:  # frames are large: keep chunks near 32 MiB, not 1024 rows
        chunk_rows = max(1, DEFAULT_CHUNK_BYTES // reader.schema.row_bytes())
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )
