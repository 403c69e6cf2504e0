"""LeRobot v3 video features decoded into image columns (``mmbuffer convert lerobot``).

lerobot itself does not install beside this project's Python and torch, so the
datasets are written here in LeRobot's v3 layout (``lerobot/datasets/utils.py``
DEFAULT_DATA_PATH / DEFAULT_VIDEO_PATH / DEFAULT_EPISODES_PATH,
``dataset_writer.py``: episodes concatenated in one mp4 per chunk/file, each
episode's span given by ``videos/<key>/from_timestamp`` and ``to_timestamp``),
with mp4 files encoded by PyAV: ``libx264rgb`` at ``crf=0`` (lossless RGB, so the
decoded frames must equal the frames written byte for byte), and AV1
(``libsvtav1``, 4:2:0, lossy) checked with a tolerance.
"""

from __future__ import annotations

import contextlib
import fractions
import json
import os
from pathlib import Path

import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer._cli.main import main
from mmbuffer.convert import ConversionWarning, convert
from mmbuffer.errors import ConversionError, InvalidArgumentError, SchemaError

av = pytest.importorskip("av")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FPS = 10
TOP, WRIST = "observation.images.top", "observation.images.wrist"


def encode(path: Path, frames: np.ndarray, *, codec: str = "libx264rgb", fps: int = FPS) -> None:
    """``frames`` [T, H, W, 3] uint8 as one mp4, frame i at i / fps seconds."""
    options, pix_fmt = {"libx264rgb": ({"crf": "0"}, "rgb24"),
                        "libsvtav1": ({"preset": "12", "crf": "10"}, "yuv420p")}[codec]
    path.parent.mkdir(parents=True, exist_ok=True)
    with same_scheduling_policy(), av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=fps, options=options)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        s.time_base = fractions.Fraction(1, fps)
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            frame.pts = i
            c.mux(s.encode(frame))
        c.mux(s.encode())


@contextlib.contextmanager
def same_scheduling_policy():
    """SVT-AV1, run as root, puts the thread that opens an encoder on SCHED_FIFO
    priority 99 (processes started later inherit it): restore the policy after."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, param)


def smooth(n: int, h: int, w: int, seed: int) -> np.ndarray:
    """Frames a 4:2:0 codec keeps close: 2x2 blocks of one gray level, a different level per frame."""
    rng = np.random.default_rng(seed)
    small = rng.integers(40, 216, (n, h // 2, w // 2, 1)).astype(np.uint8)
    return np.repeat(np.repeat(np.repeat(small, 2, 1), 2, 2), 3, 3)


def write_dataset(root: Path, lengths: list[int], *, keys: dict[str, tuple[int, int]] | None = None,
                  files: int = 2, codec: str = "libx264rgb", seed: int = 0, fps: int = FPS) -> dict[str, np.ndarray]:
    """A LeRobot v3 dataset with video features ``keys`` (name -> (height, width), RGB); returns
    the frames written per key ([rows, H, W, 3], dataset order) and the action column."""
    keys = {TOP: (24, 32), WRIST: (16, 16)} if keys is None else keys
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    starts = np.cumsum(lengths) - np.array(lengths)
    frame = np.concatenate([np.arange(k) for k in lengths])
    out: dict[str, np.ndarray] = {"action": rng.random((n, 2)).astype("float32")}
    cols = {
        "action": pa.FixedSizeListArray.from_arrays(pa.array(out["action"].reshape(-1)), 2),
        "timestamp": pa.array((frame / fps).astype("float32")),
        "frame_index": pa.array(frame.astype("int64")),
        "episode_index": pa.array(np.repeat(np.arange(len(lengths)), lengths).astype("int64")),
        "index": pa.array(np.arange(n, dtype="int64")),
        "task_index": pa.array(np.zeros(n, "int64")),
    }
    (root / "data" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.table(cols), root / "data" / "chunk-000" / "file-000.parquet", row_group_size=8)
    features: dict[str, dict] = {
        "action": {"dtype": "float32", "shape": [2], "names": ["x", "y"]},
        **{k: {"dtype": "float32" if k == "timestamp" else "int64", "shape": [1], "names": None}
           for k in ("timestamp", "frame_index", "episode_index", "index", "task_index")},
    }
    episodes = {
        "episode_index": np.arange(len(lengths), dtype="int64"), "length": np.array(lengths, "int64"),
        "dataset_from_index": starts.astype("int64"), "dataset_to_index": (starts + lengths).astype("int64"),
        "data/chunk_index": np.zeros(len(lengths), "int64"), "data/file_index": np.zeros(len(lengths), "int64"),
    }
    # the first half of the episodes in file-000, the rest in file-001 (each file's clock starts at 0)
    file_of = (np.arange(len(lengths)) >= (len(lengths) + 1) // 2).astype("int64") if files == 2 \
        else np.zeros(len(lengths), "int64")
    for j, (key, (h, w)) in enumerate(keys.items()):
        if codec == "libx264rgb":
            frames = np.random.default_rng(seed + 1 + j).integers(0, 256, (n, h, w, 3)).astype(np.uint8)
        else:
            frames = smooth(n, h, w, seed + 1 + j)
        out[key] = frames
        lo = np.zeros(len(lengths))
        for f in np.unique(file_of):
            eps = np.flatnonzero(file_of == f)
            rows = np.concatenate([np.arange(starts[e], starts[e] + lengths[e]) for e in eps])
            encode(root / "videos" / key / "chunk-000" / f"file-{f:03d}.mp4", frames[rows], codec=codec, fps=fps)
            lo[eps] = (np.cumsum(np.array(lengths)[eps]) - np.array(lengths)[eps]) / fps
        episodes[f"videos/{key}/chunk_index"] = np.zeros(len(lengths), "int64")
        episodes[f"videos/{key}/file_index"] = file_of
        episodes[f"videos/{key}/from_timestamp"] = lo
        episodes[f"videos/{key}/to_timestamp"] = lo + np.array(lengths) / fps
        features[key] = {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                         "info": {"video.height": h, "video.width": w, "video.codec": codec, "video.fps": fps,
                                  "video.channels": 3, "video.is_depth_map": False, "has_audio": False}}
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.table({k: pa.array(v) for k, v in episodes.items()}),
                   root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    info = {"codebase_version": "v3.0", "robot_type": "aloha", "total_episodes": len(lengths), "total_frames": n,
            "fps": fps, "chunks_size": 1000,
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
            "features": features}
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    return out


def read_all(path: Path) -> dict[str, np.ndarray]:
    with mb.open(path, mode="r") as buf:
        return {k: v.numpy() for k, v in buf.get(np.arange(len(buf))).items()}


def edit_episodes(root: Path, column: str, fn) -> None:
    path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(path)
    i = t.schema.get_field_index(column)
    pq.write_table(t.set_column(i, column, pa.array(fn(t.column(column).to_numpy().copy()))), path)


LENGTHS = [7, 12, 5, 9]


@pytest.mark.parametrize("chunk_rows", [5, None])
def test_video_frames_are_decoded_frame_exact_one_pass_per_file(tmp_path, monkeypatch, chunk_rows):
    written = write_dataset(tmp_path / "src", LENGTHS)
    opened: list[str] = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda p, *a, **k: opened.append(Path(p).relative_to(tmp_path / "src").as_posix())
                        or real_open(p, *a, **k))
    s = convert("lerobot", tmp_path / "src", tmp_path / "s", chunk_rows=chunk_rows, progress=False)
    assert (s["rows"], s["episodes"], s["verified"]) == (33, 4, True)
    assert s["columns"]["obs/images.top"] == [[24, 32, 3], "|u1"]
    # each file decoded once, in one pass (chunks of 5 rows cut episodes and files anywhere)
    assert sorted(opened) == sorted(f"videos/{k}/chunk-000/file-00{i}.mp4" for k in (TOP, WRIST) for i in (0, 1))
    got = read_all(tmp_path / "s")
    assert got["obs/images.top"].dtype == np.uint8
    np.testing.assert_array_equal(got["obs/images.top"], written[TOP])
    np.testing.assert_array_equal(got["obs/images.wrist"], written[WRIST])
    np.testing.assert_array_equal(got["action"], written["action"])
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert buf.episodes()[1].tolist() == LENGTHS


def _encodes(codec: str) -> bool:
    try:
        return av.codec.Codec(codec, "w") is not None
    except av.codec.codec.UnknownCodecError:
        return False


@pytest.mark.skipif(not _encodes("libsvtav1"), reason="this PyAV wheel encodes no AV1")
def test_av1_video_is_decoded_within_a_tolerance(tmp_path):
    """AV1 as LeRobot writes it is 4:2:0 and lossy: frames are compared with a tolerance (each decoded
    frame must be nearest to the frame written at its place), not byte for byte."""
    written = write_dataset(tmp_path / "src", [6, 4, 5], keys={TOP: (32, 32)}, codec="libsvtav1")
    with av.open(str(tmp_path / "src" / "videos" / TOP / "chunk-000" / "file-000.mp4")) as c:
        assert c.streams.video[0].codec_context.name in ("libdav1d", "av1")  # really AV1
    convert("lerobot", tmp_path / "src", tmp_path / "s", progress=False)
    got = read_all(tmp_path / "s")["obs/images.top"].astype(int)
    want = written[TOP].astype(int)
    assert got.shape == want.shape
    assert np.abs(got - want).mean() < 3
    dist = np.abs(got[:, None] - want[None]).mean(axis=(2, 3, 4))  # [decoded, written]
    assert dist.argmin(axis=1).tolist() == list(range(len(want)))


def test_frame_count_and_timestamps_are_checked_against_meta(tmp_path):
    write_dataset(tmp_path / "a", LENGTHS, keys={TOP: (16, 16)})
    # episode 1's span one frame short: 11 frames in it where meta/episodes says 12
    edit_episodes(tmp_path / "a", f"videos/{TOP}/to_timestamp", lambda v: v - np.array([0, 1, 0, 0]) / FPS)
    with pytest.raises(ConversionError, match=rf"\[{TOP}\]: video feature '{TOP}', episode 1: expected 12 frames "
                                              r"\(meta/episodes length\) in \[0.700000 s, 1.800000 s\) of "
                                              rf"videos/{TOP}/chunk-000/file-000.mp4.*got 11"):
        convert("lerobot", tmp_path / "a", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()
    write_dataset(tmp_path / "b", LENGTHS, keys={TOP: (16, 16)})
    # the data's timestamps at 15 fps where the video runs at 10: frame 1 of episode 0 is late
    path = tmp_path / "b" / "data" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(path)
    ts = (t.column("frame_index").to_numpy() / 15).astype("float32")
    pq.write_table(t.set_column(t.schema.get_field_index("timestamp"), "timestamp", pa.array(ts)), path)
    with pytest.raises(ConversionError, match=rf"video feature '{TOP}', episode 0, frame 1: expected a frame "
                                              r"0.066667 s after .*got one at 0.100000 s"):
        convert("lerobot", tmp_path / "b", tmp_path / "s", progress=False)
    write_dataset(tmp_path / "c", LENGTHS, keys={TOP: (16, 16)})
    info = json.loads((tmp_path / "c" / "meta" / "info.json").read_text())
    info["features"][TOP]["shape"] = [16, 18, 3]
    (tmp_path / "c" / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ConversionError, match=rf"'{TOP}', episode 0: expected frames of 16x18.*got 16x16"):
        convert("lerobot", tmp_path / "c", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_missing_video_file_and_depth_maps_are_refused_by_name(tmp_path):
    write_dataset(tmp_path / "a", LENGTHS)
    (tmp_path / "a" / "videos" / WRIST / "chunk-000" / "file-001.mp4").unlink()
    with pytest.raises(ConversionError, match=rf"video feature '{WRIST}': videos/{WRIST}/chunk-000/file-001.mp4 "
                                              r"\(episode 2, meta/episodes\) is missing"):
        convert("lerobot", tmp_path / "a", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    (tmp_path / "a" / "videos" / WRIST / "chunk-000" / "file-001.mp4").symlink_to(tmp_path / "a" / "meta" / "info.json")
    with pytest.raises(ConversionError, match=rf"videos/{WRIST}/chunk-000/file-001.mp4 \(episode 2, meta/episodes\) "
                                              r"is a symbolic link \(refused\)"):
        convert("lerobot", tmp_path / "a", tmp_path / "s", progress=False)
    info_path = tmp_path / "a" / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"][WRIST]["info"]["video.is_depth_map"] = True
    info_path.write_text(json.dumps(info))
    with pytest.raises(ConversionError, match=rf"video feature '{WRIST}' is a depth map.*skip_visual=True"):
        convert("lerobot", tmp_path / "a", tmp_path / "s", progress=False)
    info["features"]["../../x"] = info["features"].pop(WRIST)
    info_path.write_text(json.dumps(info))
    with pytest.raises(ConversionError, match=r"video feature '../../x': expected a name of letters"):
        convert("lerobot", tmp_path / "a", tmp_path / "s", progress=False)


def test_skip_visual_leaves_video_out_by_name(tmp_path):
    written = write_dataset(tmp_path / "src", LENGTHS)
    with pytest.warns(ConversionWarning, match="video/image features left out"):
        s = convert("lerobot", tmp_path / "src", tmp_path / "s", skip_visual=True, progress=False)
    assert s["dropped_keys"] == [TOP, WRIST] and s["rows"] == 33
    got = read_all(tmp_path / "s")
    assert not any(k.startswith("obs/images") for k in got)
    np.testing.assert_array_equal(got["action"], written["action"])


def test_codec_is_passed_as_the_column_spec_or_refused_by_name(tmp_path):
    written = write_dataset(tmp_path / "src", [4, 3], keys={TOP: (16, 16)}, files=1)
    convert("lerobot", tmp_path / "src", tmp_path / "s", codec="zstd", progress=False)
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert buf.columns["obs/images.top"].codec == "zstd"
    np.testing.assert_array_equal(read_all(tmp_path / "s")["obs/images.top"], written[TOP])  # lossless
    with pytest.raises(SchemaError, match="obs/images.top"):
        convert("lerobot", tmp_path / "src", tmp_path / "bad", codec="gzip", progress=False)
    assert not (tmp_path / "bad").exists()
    write_dataset(tmp_path / "novideo", [4, 3], keys={}, files=1)
    with pytest.raises(InvalidArgumentError, match="codec: applies to the columns decoded from video"):
        convert("lerobot", tmp_path / "novideo", tmp_path / "s2", codec="zstd", progress=False)


def test_cli_converts_video_with_a_progress_bar(tmp_path, capsys):
    written = write_dataset(tmp_path / "src", LENGTHS, keys={TOP: (16, 16)})
    assert main(["convert", "lerobot", str(tmp_path / "src"), str(tmp_path / "s"), "--json"]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert summary["rows"] == 33 and "obs/images.top" in summary["checksums"]
    assert "convert lerobot" in out.err and "/33.0 " in out.err  # a tqdm bar over the 33 frames decoded
    np.testing.assert_array_equal(read_all(tmp_path / "s")["obs/images.top"], written[TOP])
    assert main(["convert", "lerobot", str(tmp_path / "src"), str(tmp_path / "k"), "--skip-visual",
                 "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dropped_keys"] == [TOP]
    assert main(["convert", "lerobot", str(tmp_path / "src"), str(tmp_path / "z"), "--codec", "zstd",
                 "--no-progress"]) == 0
    np.testing.assert_array_equal(read_all(tmp_path / "z")["obs/images.top"], written[TOP])
    assert main(["convert", "npz", str(tmp_path / "src"), str(tmp_path / "n"), "--codec", "zstd"]) == 2
    assert "--codec: not an option of format 'npz' (only lerobot)" in capsys.readouterr().err


def test_episodes_stored_out_of_order_in_a_file_are_still_matched(tmp_path, monkeypatch):
    """A file whose episodes are not in episode order (episode 1's frames first): each episode's
    frames are the ones in its span; a span behind the decoder opens the file for another pass."""
    written = write_dataset(tmp_path / "src", [4, 6], keys={TOP: (16, 16)}, files=1)
    frames = written[TOP]
    encode(tmp_path / "src" / "videos" / TOP / "chunk-000" / "file-000.mp4", np.concatenate([frames[4:], frames[:4]]))
    edit_episodes(tmp_path / "src", f"videos/{TOP}/from_timestamp", lambda v: np.array([0.6, 0.0]))
    edit_episodes(tmp_path / "src", f"videos/{TOP}/to_timestamp", lambda v: np.array([1.0, 0.6]))
    opened = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    convert("lerobot", tmp_path / "src", tmp_path / "s", progress=False)
    np.testing.assert_array_equal(read_all(tmp_path / "s")["obs/images.top"], frames)
    assert len(opened) == 2  # episode 1's span lies before episode 0's: a second pass


@pytest.mark.slow
def test_float32_timestamps_of_a_long_episode_are_accepted(tmp_path):
    """LeRobot writes timestamps as float32: past 68 minutes into an episode at 3 fps their rounding
    (up to 1.6e-4 s here) exceeds LeRobot's 1e-4 s tolerance; the check allows for it."""
    n = 12_300
    written = write_dataset(tmp_path / "src", [n], keys={TOP: (8, 8)}, files=1, fps=3)
    ts = pq.read_table(tmp_path / "src" / "data" / "chunk-000" / "file-000.parquet").column("timestamp").to_numpy()
    assert np.abs(ts.astype(np.float64) - np.arange(n) / 3).max() > 1e-4  # the case this test is about
    s = convert("lerobot", tmp_path / "src", tmp_path / "s", progress=False)
    assert s["rows"] == n
    np.testing.assert_array_equal(read_all(tmp_path / "s")["obs/images.top"], written[TOP])
