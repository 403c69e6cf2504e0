"""The video features of a LeRobot v3 dataset, decoded into image columns (PyAV).

Layout read (``lerobot/datasets/utils.py``, ``dataset_writer.py``): a feature of
dtype ``"video"`` in ``meta/info.json`` has ``shape`` ``[height, width, channels]``
(``names`` say the order; ``[channels, height, width]`` is read too) and ``info``
(``video.codec``, ``video.pix_fmt``, ``video.is_depth_map``...). Its frames live in
``videos/<key>/chunk-XXX/file-YYY.mp4``, several episodes one after the other; the
row of episode ``e`` in ``meta/episodes`` names the file
(``videos/<key>/chunk_index``, ``videos/<key>/file_index``) and the episode's span
in it (``videos/<key>/from_timestamp``, ``videos/<key>/to_timestamp``, seconds).

**What a frame becomes.** LeRobot's loader seeks to ``from_timestamp +
timestamp`` for each frame, takes the nearest decoded frame within
``tolerance_s`` (1e-4 s) and returns it as float32 ``[C, H, W]`` in ``[0, 1]``.
The store keeps the decoded pixels instead: ``uint8`` in the shape
``info.json`` declares (``[H, W, C]`` as LeRobot writes it), RGB (``rgb24``, the
conversion LeRobot's PyAV path uses) or one gray channel; ``frame / 255``,
channels first, is what LeRobot's loader gives. Nothing is resampled: the
frames of an episode are exactly the decoded frames whose time lies in
``[from_timestamp, to_timestamp)``, and they are checked against the metadata:

* their number must be the episode's ``length`` (``meta/episodes``);
* the ``k``-th frame's time minus ``from_timestamp`` must be the frame's
  ``timestamp`` (the data's ``timestamp`` feature, else ``k / fps`` with
  ``info.json``'s ``fps``) within :data:`TOLERANCE_S` (plus the rounding of a
  float32 timestamp, which LeRobot writes: 1.6e-4 s at 68 minutes);
* its size must be the feature's shape.

A mismatch raises :class:`~mmbuffer.errors.ConversionError` naming the feature,
the episode and the file. Depth-map videos (``video.is_depth_map``) are
quantized by LeRobot with settings a store would have to keep: refused, by name.

Decoding is one pass per file: each file is opened once and its frames decoded
in order (never a seek per frame); only the frames of the chunk being written
are held in memory. PyAV (``pip install av``, in the ``formats`` extra) bundles
FFmpeg's decoders (AV1 through dav1d, H.264, HEVC...).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError

__all__ = ["TOLERANCE_S", "VideoFeature", "VideoFrames", "episode_spans", "span_columns", "video_feature"]

#: Largest difference, in seconds, between a decoded frame's time and the time the
#: metadata gives it (LeRobot's default ``tolerance_s``).
TOLERANCE_S = 1e-4

_KEY = re.compile(r"^[A-Za-z0-9_.\-]+$")

Error = Callable[[str, str], ConversionError]


@dataclass(frozen=True)
class VideoFeature:
    """One video feature: its key, the stored row shape (uint8) and the decoded pixel format."""

    key: str
    shape: tuple[int, ...]
    channels_first: bool
    pix_fmt: str  # "rgb24" or "gray"


def video_feature(key: str, ft: dict[str, Any], error: Error) -> VideoFeature:
    """The :class:`VideoFeature` of ``info.json``'s feature ``key`` (checked)."""
    if not _KEY.match(key) or key in (".", ".."):
        raise error(f"video feature {key!r}: expected a name of letters, digits, '.', '_', '-' "
                    "(it names a directory under videos/)", key)
    shape = tuple(int(s) for s in ft["shape"])
    names = [str(n) for n in ft.get("names") or []]
    channels_first = len(names) == 3 and names[0] in ("channels", "channel", "c")
    if len(shape) != 3 or min(shape) < 1:
        raise error(f"video feature {key!r}: expected shape [height, width, channels], got {list(shape)}", key)
    channels = shape[0] if channels_first else shape[2]
    if channels not in (1, 3):
        raise error(f"video feature {key!r}: expected 1 or 3 channels, got {channels} (shape {list(shape)})", key)
    info = ft.get("info")
    if isinstance(info, dict) and info.get("video.is_depth_map"):
        raise error(f"video feature {key!r} is a depth map (video.is_depth_map): LeRobot quantizes depth "
                    "with encoder settings a store cannot keep; pass skip_visual=True (--skip-visual) "
                    "to convert the other features without it", key)
    return VideoFeature(key, shape, channels_first, "rgb24" if channels == 3 else "gray")


def span_columns(key: str) -> list[str]:
    """The ``meta/episodes`` columns that place video feature ``key``'s episodes in its files."""
    return [f"videos/{key}/{n}" for n in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]


def episode_spans(root: Path, key: str, cols: dict[str, np.ndarray], episode_ids: np.ndarray,
                  error: Error) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Each episode's video file (relative to ``root``) and ``[from, to)`` span, from the
    :func:`span_columns` of ``meta/episodes`` (in episode order); the files must exist."""
    names = span_columns(key)
    chunk, file = (cols[n].astype(np.int64) for n in names[:2])
    lo, hi = (cols[n].astype(np.float64) for n in names[2:])
    bad = np.flatnonzero((chunk < 0) | (file < 0) | ~np.isfinite(lo) | ~(hi > lo))
    if len(bad):
        i = int(bad[0])
        raise error(f"video feature {key!r}, episode {int(episode_ids[i])}: expected chunk/file indices >= 0 "
                    f"and from_timestamp < to_timestamp, got {chunk[i]}, {file[i]}, {lo[i]}, {hi[i]}", key)
    files = [f"videos/{key}/chunk-{c:03d}/file-{f:03d}.mp4" for c, f in zip(chunk.tolist(), file.tolist())]
    for name in sorted(set(files)):
        full = root / name
        if full.is_symlink() or not full.is_file():
            first = int(episode_ids[files.index(name)])
            what = "a symbolic link (refused)" if full.is_symlink() else "missing"
            raise error(f"video feature {key!r}: {name} (episode {first}, meta/episodes) is {what}", key)
    return files, lo, hi


class VideoFrames:
    """The frames of one video feature, in dataset order, decoded one file at a time.

    ``files[e]``, ``start[e]``, ``stop[e]``: episode ``e``'s video file (relative
    to ``root``) and span in seconds; ``lengths[e]`` its frame count. :meth:`take`
    returns the next frames; a file is decoded in one pass as long as its episodes
    come in the order of their spans (as LeRobot writes them).
    """

    def __init__(self, root: Path, feature: VideoFeature, files: list[str], start: np.ndarray,
                 stop: np.ndarray, lengths: np.ndarray, error: Error) -> None:
        self.root, self.feature, self.files = root, feature, files
        self.start, self.stop, self.lengths = start, stop, lengths
        self.error = error
        self._frames = self._decode()
        self._container: Any = None

    def take(self, episode_offsets: np.ndarray) -> np.ndarray:
        """The next ``len(episode_offsets)`` frames ``[n, *shape]`` uint8.

        ``episode_offsets[i]``: the time the metadata gives the ``i``-th frame,
        in seconds from its episode's ``from_timestamp``.
        """
        f = self.feature
        n = len(episode_offsets)
        out = np.empty((n, *f.shape), np.uint8)
        got = np.empty(n, np.float64)
        episode = np.empty(n, np.int64)
        index = np.empty(n, np.int64)
        view = out.transpose(0, 2, 3, 1) if f.channels_first else out  # rows as [H, W, C]
        hw = view.shape[1:3]
        for i in range(n):  # PyAV hands frames one at a time: the copy is all this loop does
            e, k, t, pixels = next(self._frames)
            if pixels.shape[:2] != hw:
                raise self.error(f"video feature {f.key!r}, episode {e}: expected frames of {hw[0]}x{hw[1]} "
                                 f"(info.json shape {list(f.shape)}), got {pixels.shape[0]}x{pixels.shape[1]} "
                                 f"in {self.files[e]}", f.key)
            view[i] = pixels.reshape(view.shape[1:])
            got[i], episode[i], index[i] = t - self.start[e], e, k
        # LeRobot's timestamps are float32: past ~30 minutes their rounding alone exceeds TOLERANCE_S
        tolerance = TOLERANCE_S + np.abs(episode_offsets) * float(np.finfo(np.float32).eps)
        bad = np.flatnonzero(~(np.abs(got - episode_offsets) <= tolerance))
        if len(bad):
            i = int(bad[0])
            e = int(episode[i])
            raise self.error(
                f"video feature {f.key!r}, episode {e}, frame {int(index[i])}: expected a frame "
                f"{float(episode_offsets[i]):.6f} s after the episode's from_timestamp "
                f"{float(self.start[e]):.6f} (the frame's timestamp), got one at {float(got[i]):.6f} s in "
                f"{self.files[e]} ({len(bad)} frames of this chunk off by more than {TOLERANCE_S} s)", f.key)
        return out

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None

    # -- decoding ----------------------------------------------------------------------------
    def _open(self, name: str) -> Iterator[tuple[float, np.ndarray]]:
        """The frames of ``name`` in decoding order, as (time in seconds, pixels [H, W, C])."""
        import av

        self.close()
        key = self.feature.key
        try:
            container = self._container = av.open(str(self.root / name))
            streams = container.streams.video
            if not streams:
                raise self.error(f"video feature {key!r}: expected a video stream in {name}, found none", key)
            stream = streams[0]
            stream.thread_type = "AUTO"
            base = stream.time_base
            for frame in container.decode(stream):
                if frame.pts is None or base is None:
                    raise self.error(f"video feature {key!r}: a frame without a timestamp in {name}", key)
                pixels = frame.to_ndarray(format=self.feature.pix_fmt)
                yield float(frame.pts * base), pixels.reshape(*pixels.shape[:2], -1)
        except av.FFmpegError as exc:
            raise self.error(f"video feature {key!r}: cannot decode {name} ({type(exc).__name__}: {exc})",
                             key) from exc

    def _decode(self) -> Iterator[tuple[int, int, float, np.ndarray]]:
        """(episode, frame in episode, time, pixels) of every frame, episode after episode."""
        key, tol = self.feature.key, TOLERANCE_S
        name: str | None = None
        frames: Iterator[tuple[float, np.ndarray]] = iter(())
        pending: tuple[float, np.ndarray] | None = None
        last = -np.inf
        for e, length in enumerate(self.lengths.tolist()):
            lo, hi = float(self.start[e]), float(self.stop[e])
            if self.files[e] != name or lo < last - tol:  # another file, or a span behind: a new pass
                name, pending, last = self.files[e], None, -np.inf
                frames = self._open(name)
            count = 0
            while True:
                item = pending if pending is not None else next(frames, None)
                pending = None
                if item is None or item[0] >= hi - tol:
                    pending = item
                    if count == length:
                        break
                    where = "the end of the file" if item is None else f"a frame at {item[0]:.6f} s"
                    raise self.error(
                        f"video feature {key!r}, episode {e}: expected {length} frames (meta/episodes length) in "
                        f"[{lo:.6f} s, {hi:.6f} s) of {name} (from_timestamp, to_timestamp), got {count} "
                        f"before {where}", key)
                last = item[0]
                if item[0] < lo - tol:
                    continue  # a frame before the episode's span (of an episode not listed)
                if count == length:
                    raise self.error(
                        f"video feature {key!r}, episode {e}: expected {length} frames (meta/episodes length) in "
                        f"[{lo:.6f} s, {hi:.6f} s) of {name} (from_timestamp, to_timestamp), got more (a frame "
                        f"at {item[0]:.6f} s)", key)
                yield e, count, item[0], item[1]
                count += 1
        self.close()
