"""The lossy image codec ``jpeg`` (issue 23, item 1): camera frames within a stated
tolerance of what was written, the same decoded bytes on every read path, refused on
anything but uint8 frames, never chosen by mmbuffer, and corruption a typed error."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer._disk.columns import jpeg
from mmbuffer.kernels import images

pytest.importorskip("imagecodecs")  # the "images" extra (installed with "test")

SHAPE = (48, 56, 3)
ROWS = 300  # with shards of 64 frames: 4 encoded shards, 44 rows still staged (raw)


def camera_frames(n, shape=SHAPE, seed=0):
    """Camera-like frames: a camera panning over a real photograph (matplotlib's
    grace_hopper.jpg), each frame a crop scaled to ``shape``."""
    import matplotlib.cbook
    from PIL import Image

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
        photo = Image.open(f).convert("RGB" if len(shape) == 3 and shape[2] == 3 else "L")
    w, h = photo.size
    rng = np.random.default_rng(seed)
    out = np.empty((n, *shape), np.uint8)
    x, y, s = w // 4, h // 4, min(w, h) // 2
    for i in range(n):  # a test helper: a random walk of the crop window
        x = int(np.clip(x + rng.integers(-6, 7), 0, w - s))
        y = int(np.clip(y + rng.integers(-6, 7), 0, h - s))
        crop = photo.crop((x, y, x + s, y + s)).resize(shape[1::-1], Image.BILINEAR)
        out[i] = np.asarray(crop).reshape(shape)
    return out


def _episodes(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.random(n) < 0.05


def _fill(path, frames, codec, done, finals=None):
    """A store of ``frames`` (episodes ending where ``done``), extended 37 rows at a time;
    ``finals``: the final observations (default: the episodes' last frames, mirrored)."""
    buf = mb.create(path, {"cam": mb.Column(frames.shape[1:], "uint8", codec=codec), "a": ((), "int64")},
                    capacity=512, next_keys=("cam",))
    finals = frames[done][:, ::-1].copy() if finals is None else finals
    ends = np.concatenate([[0], np.cumsum(done)])
    for s in range(0, len(frames), 37):  # extends of 37 rows, shards of 64: encoded mid-extend
        e = slice(s, s + 37)
        buf.extend({"cam": frames[e], "a": np.arange(len(frames))[e], "terminated": done[e]},
                   final_obs={"cam": finals[ends[s] : ends[min(s + 37, len(frames))]]})
    return buf


@pytest.fixture(scope="module")
def frames():
    return camera_frames(ROWS)


@pytest.mark.parametrize("quality", [95, 75])
def test_frames_read_back_within_the_stated_tolerance(tmp_path, frames, quality):
    """Encoded rows differ from the frames written (lossy reached) by at most
    ``jpeg.tolerance(quality)`` mean absolute error per frame; the rows of the shard still
    being filled read back exact; the shard files hold several times fewer bytes."""
    done = _episodes(ROWS)
    buf = _fill(tmp_path / "j", frames, f"jpeg:{quality}", done)
    got = buf.get(np.arange(ROWS), keys=["cam"])["cam"].numpy()
    encoded = 256
    mae = np.abs(got[:encoded].astype(np.int16) - frames[:encoded]).reshape(encoded, -1).mean(axis=1)
    assert (mae > 0).all()  # every encoded frame went through JPEG
    assert mae.max() <= jpeg.tolerance(quality), (mae.max(), quality)
    assert np.array_equal(got[encoded:], frames[encoded:])  # staged: raw until the shard is complete
    shards = sorted((tmp_path / "j" / "columns" / "cam" / "c").rglob("0"))
    files = [p for p in shards if p.is_file()]
    assert len(files) == 4
    assert sum(p.stat().st_size for p in files) * 3 < encoded * frames[0].nbytes
    buf.close()


def test_every_read_path_returns_the_same_decoded_bytes(tmp_path, frames):
    """A raw store holding exactly what the jpeg store decodes (same episodes, same final
    observations) gives the same sample, slices, frame stacks, stream, dataset, get and
    read_range, in the writer and in a reader; zarr-python decodes the same bytes."""
    done = _episodes(ROWS)
    z = _fill(tmp_path / "j", frames, "jpeg:90", done)
    decoded = z.read_range("cam", 0, ROWS)
    assert not np.array_equal(decoded[:256], frames[:256])
    raw = _fill(tmp_path / "raw", decoded, None, done, finals=frames[done][:, ::-1].copy())
    # the final observations are stored raw in both (the column's own rows are what is lossy)
    for b in (z, raw):
        b.commit()
    def same(fn):
        for seed in range(3):
            b1, b2 = fn(raw, torch.Generator().manual_seed(seed)), fn(z, torch.Generator().manual_seed(seed))
            assert b1.data.keys() == b2.data.keys()
            for k in b1.data:
                assert torch.equal(b1.data[k], b2.data[k]), k
    writers = (raw, z)
    for pair in (writers, (mb.open(tmp_path / "raw", mode="r"), mb.open(tmp_path / "j", mode="r"))):
        raw, z = pair
        same(lambda b, g: b.sample(32, generator=g))
        same(lambda b, g: b.sample_slices(6, 4, generator=g))
        same(lambda b, g: b.sample(16, stack={"cam": 4}, stack_pad="first", generator=g))
        same(lambda b, g: b.sample(16, stack={"cam": 3}, stack_pad="zero", generator=g))
        assert np.array_equal(raw.read_range("cam", 5, 290), z.read_range("cam", 5, 290))
        rows = np.arange(ROWS)
        assert torch.equal(raw.get(rows, keys=["cam"])["cam"], z.get(rows, keys=["cam"])["cam"])
    s1 = list(mb.stream(raw, 16, num_batches=3, generator=torch.Generator().manual_seed(3), stack={"cam": 2}))
    s2 = list(mb.stream(z, 16, num_batches=3, generator=torch.Generator().manual_seed(3), stack={"cam": 2}))
    for b1, b2 in zip(s1, s2, strict=True):
        assert torch.equal(b1.data["cam"], b2.data["cam"]) and torch.equal(b1.data["next_cam"], b2.data["next_cam"])
    for b in (raw, z, *writers):
        b.close()
    d1 = mb.data.BufferDataset(tmp_path / "raw", 8, slice_len=3, seed=5, num_batches=3)
    d2 = mb.data.BufferDataset(tmp_path / "j", 8, slice_len=3, seed=5, num_batches=3)
    for b1, b2 in zip(d1, d2, strict=True):
        assert torch.equal(b1.data["cam"], b2.data["cam"])
    import zarr

    mb.register_zarr_codecs()
    arr = zarr.open_array(str(tmp_path / "j" / "columns" / "cam"), mode="r")
    assert np.array_equal(arr[:256], decoded[:256])  # an independent decoder: the naive reference


def test_threads_and_the_cache_change_nothing(tmp_path, frames, monkeypatch):
    """Decoding on one thread or split over the pool gives the same bytes; a second read
    is served from the decoded-chunk cache (no frame decoded again)."""
    z = _fill(tmp_path / "j", frames, "jpeg", _episodes(ROWS))
    rows = np.random.default_rng(0).integers(0, 256, 200)
    monkeypatch.setattr(images, "THREADS", 1)
    one = z.get(rows, keys=["cam"])["cam"]
    col = z.store.column("cam")
    col.release()  # drop the cache and the maps: decode again
    monkeypatch.setattr(images, "THREADS", 3)
    assert torch.equal(one, z.get(rows, keys=["cam"])["cam"])
    hits, decoded = col._cache.stats.tolist()
    assert decoded == len(np.unique(rows))
    assert torch.equal(one, z.get(rows, keys=["cam"])["cam"])
    assert col._cache.stats.tolist() == [hits + decoded, decoded]
    z.close()


@pytest.mark.parametrize("shape", [(32, 40), (32, 40, 1)])
def test_grayscale_frames(tmp_path, shape):
    frames = camera_frames(100, shape=shape)
    with mb.create(tmp_path / "g", {"g": mb.Column(shape, "uint8", codec="jpeg:95")}, capacity=128, next_keys=()) as buf:
        buf.extend({"g": frames})
        got = buf.get(np.arange(64), keys=["g"])["g"].numpy()
    assert got.shape == (64, *shape)
    err = np.abs(got.astype(np.int16) - frames[:64]).reshape(64, -1).mean(axis=1)
    assert 0 < err.max() <= jpeg.tolerance(95)


@pytest.mark.parametrize(("shape", "dtype"), [((3, 48, 48), "uint8"), ((48, 48, 4), "uint8"), ((48, 48, 3), "float32"),
                                              ((48, 48), "int16"), ((48,), "uint8"), ((), "uint8")])
def test_only_uint8_frames_take_jpeg(tmp_path, shape, dtype):
    with pytest.raises(errors.SchemaError, match=r"column 'cam': codec 'jpeg:90': expected uint8 frames of shape "
                                                 r"\(H, W\), \(H, W, 1\) or \(H, W, 3\), got shape .* and dtype"):
        mb.create(tmp_path / "s", {"cam": mb.Column(shape, dtype, codec="jpeg:90")}, capacity=8, next_keys=())
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("bad", ["jpeg:0", "jpeg:101", "jpeg:9x", "jpeg:095", "JPEG", "jpg"])
def test_a_bad_quality_is_refused_naming_the_column(tmp_path, bad):
    with pytest.raises(errors.SchemaError, match=r"column 'cam': codec"):
        mb.create(tmp_path / "s", {"cam": mb.Column(SHAPE, "uint8", codec=bad)}, capacity=8, next_keys=())
    assert not (tmp_path / "s").exists()


def test_without_imagecodecs_jpeg_is_refused_naming_the_column_and_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imagecodecs", None)  # import imagecodecs -> ImportError
    with pytest.raises(errors.SchemaError, match=r"column 'cam': codec 'jpeg'.*mmbuffer\[images\]"):
        mb.create(tmp_path / "s", {"cam": mb.Column(SHAPE, "uint8", codec="jpeg")}, capacity=8, next_keys=())
    assert not (tmp_path / "s").exists()


def _shard_file(path, f=0):
    return path / "columns" / "cam" / "c" / str(f) / "0" / "0" / "0"


def _chunk(data, i, per=64):
    index = np.frombuffer(bytes(data[len(data) - 16 * per - 4 : -4]), "<u8").reshape(per, 2)
    return (int(v) for v in index[i])


@pytest.mark.parametrize("where", ["flip", "crafted"])
def test_a_corrupt_frame_is_a_typed_error_naming_column_and_chunk(tmp_path, frames, where):
    """A flipped byte in a JPEG chunk fails its crc32c; a chunk replaced by a valid JPEG of
    another size (its crc32c recomputed: a hostile store) fails to decode into the frame.
    Both raise CorruptStoreError naming the column and the chunk; other shards still read."""
    from mmbuffer.kernels import codec

    with _fill(tmp_path / "j", frames, "jpeg", _episodes(ROWS)) as z:
        good = z.get(64 + np.arange(64), keys=["cam"])["cam"]
    f = _shard_file(tmp_path / "j", 0)
    data = bytearray(f.read_bytes())
    off, nb = _chunk(data, 5)
    if where == "flip":
        data[off + nb // 2] ^= 0x20
        reason = "crc32c mismatch"
    else:
        import imagecodecs

        other = bytes(imagecodecs.jpeg8_encode(np.zeros((8, 8, 3), np.uint8), level=90))
        other = other[: nb - 4].ljust(nb - 4, b"\0") if len(other) > nb - 4 else other + b"\0" * (nb - 4 - len(other))
        data[off : off + nb - 4] = other
        data[off + nb - 4 : off + nb] = codec.crc32c(np.frombuffer(other, np.uint8)).to_bytes(4, "little")
        reason = "libjpeg cannot decode it"
    f.write_bytes(bytes(data))
    with mb.open(tmp_path / "j", mode="r") as ro:
        with pytest.raises(errors.CorruptStoreError, match=rf"column 'cam': inner chunk 5 \(row 5\).*{reason}"):
            ro.get(np.arange(8), keys=["cam"])
        assert torch.equal(ro.get(64 + np.arange(64), keys=["cam"])["cam"], good)


def test_mmbuffer_never_picks_jpeg_on_its_own(tmp_path, frames):
    """A copy keeps jpeg only where the source has it; a raw or zstd source never becomes
    jpeg unless a column is named (``--codec COL=jpeg:Q``), and then only that column; a
    copy to raw drops it. The lossy column of a copy is verified against the codec's own
    round trip."""
    done = _episodes(ROWS)
    with _fill(tmp_path / "raw", frames, None, done):
        pass
    for compression in (None, "zstd"):
        out = tmp_path / f"c{compression}"
        mb.convert.copy(tmp_path / "raw", out, compression=compression, progress=False)
        cols = json.loads((out / "manifest.json").read_text())["columns"]
        assert all("codec" not in c for c in cols.values())
    cli = subprocess.run([sys.executable, "-m", "mmbuffer", "copy", str(tmp_path / "raw"), str(tmp_path / "j"),
                          "--codec", "cam=jpeg:90", "--no-progress"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    cols = json.loads((tmp_path / "j" / "manifest.json").read_text())["columns"]
    assert cols["cam"]["codec"] == "jpeg:90" and "codec" not in cols["a"]
    mb.convert.copy(tmp_path / "j", tmp_path / "kept", progress=False)
    mb.convert.copy(tmp_path / "j", tmp_path / "r", codec=None, progress=False)
    with mb.open(tmp_path / "kept", mode="r") as kept, mb.open(tmp_path / "r", mode="r") as r:
        assert kept.columns["cam"].codec == "jpeg:90" and r.columns["cam"].codec is None
        with mb.open(tmp_path / "j", mode="r") as j:
            assert np.array_equal(r.read_range("cam", 0, ROWS), j.read_range("cam", 0, ROWS))  # decoded once, kept raw
    bad = subprocess.run([sys.executable, "-m", "mmbuffer", "copy", str(tmp_path / "raw"), str(tmp_path / "x"),
                          "--codec", "a=jpeg", "--no-progress"], capture_output=True, text=True)
    assert bad.returncode != 0 and "column 'a'" in bad.stderr and not (tmp_path / "x").exists()


def test_info_shows_the_jpeg_codec_and_its_bytes_per_frame(tmp_path, frames, capsys):
    from mmbuffer._cli.main import main

    with _fill(tmp_path / "j", frames, "jpeg:80", _episodes(ROWS)):
        pass
    assert main(["info", str(tmp_path / "j"), "--json"]) == 0
    cam = json.loads(capsys.readouterr().out)["columns"]["cam"]
    files = [p for p in (tmp_path / "j" / "columns" / "cam" / "c").rglob("*") if p.is_file()]
    assert cam["codec"] == "jpeg:80" and cam["shard_rows"] == 256
    assert cam["bytes_per_row"] == sum(p.stat().st_size for p in files) / 256 < frames[0].nbytes / 3


@pytest.mark.parametrize("change", ["level", "rows_per_chunk", "bytes_first"])
def test_a_zarr_json_other_than_the_codec_implies_is_corrupt(tmp_path, frames, change):
    """The manifest says jpeg:90: a zarr.json naming another quality, two frames per chunk
    or a ``bytes`` codec before the JPEG one is CorruptStoreError, never read."""
    with _fill(tmp_path / "j", frames[:64], "jpeg:90", _episodes(64)):
        pass
    where = tmp_path / "j" / "columns" / "cam" / "zarr.json"
    meta = json.loads(where.read_text())
    conf = meta["codecs"][0]["configuration"]
    if change == "level":
        conf["codecs"][0]["configuration"]["level"] = 50
    elif change == "rows_per_chunk":
        conf["chunk_shape"][0] = 2
    else:
        conf["codecs"].insert(0, {"name": "bytes", "configuration": {"endian": "little"}})
    where.write_text(json.dumps(meta))
    with pytest.raises(errors.CorruptStoreError, match=r"columns/cam/zarr.json: codecs"):
        mb.open(tmp_path / "j", mode="r")


def test_dataloader_workers_forked_after_a_decode_read_the_same_frames(tmp_path, frames, monkeypatch):
    """The parent decodes on its thread pool first; DataLoader workers forked after it (their
    inherited pool has no threads) decode on pools of their own: same batches as in-process."""
    monkeypatch.setattr(images, "THREADS", 2)
    with _fill(tmp_path / "j", frames, "jpeg", _episodes(ROWS)) as z:
        z.get(np.arange(64), keys=["cam"])  # 64 frames: the pool is used, so it exists before the fork
    loader = torch.utils.data.DataLoader(mb.data.BufferDataset(tmp_path / "j", 16, seed=3, num_batches=4),
                                         batch_size=None, num_workers=1, multiprocessing_context="fork", timeout=120)
    there = list(loader)
    assert len(there) == 4
    with mb.open(tmp_path / "j", mode="r") as ro:
        for b in there:
            assert torch.equal(b.data["cam"], ro.get(b.indices, keys=["cam"])["cam"])


def test_lerobot_video_converts_into_a_jpeg_column_verified(tmp_path):
    """``convert lerobot --codec jpeg:90``: the frames decoded from video go into a jpeg column,
    verified by reading back (encoded rows against the codec's own round trip, staged rows
    exact): what the store returns is exactly ``roundtrip(frames)`` then the raw tail."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
    try:
        from test_lerobot_video import TOP, write_dataset
    finally:
        sys.path.pop(0)
    from mmbuffer.convert import convert

    written = write_dataset(tmp_path / "src", [70, 10], keys={TOP: (32, 32)}, files=1)
    s = convert("lerobot", tmp_path / "src", tmp_path / "s", codec="jpeg:90", progress=False)
    assert s["rows"] == 80
    with mb.open(tmp_path / "s", mode="r") as buf:
        col = "obs/images.top"
        assert buf.columns[col].codec == "jpeg:90"
        shard = buf.store.column(col)._shard  # a lane of 80 rows: shards of 40 frames
        got = buf.read_range(col, 0, 80)
    frames = written[TOP]
    encoded = 80 // shard * shard
    assert encoded >= 40  # complete shards: encoded, lossy
    assert np.array_equal(got[:encoded], jpeg.roundtrip(col, frames[:encoded], 90))
    assert not np.array_equal(got[:encoded], frames[:encoded])
    assert np.array_equal(got[encoded:], frames[encoded:])


def test_reading_a_jpeg_store_without_imagecodecs_names_the_column_and_the_extra(tmp_path, frames, monkeypatch):
    with _fill(tmp_path / "j", frames[:128], "jpeg", _episodes(128)):
        pass
    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    with mb.open(tmp_path / "j", mode="r") as ro:
        assert ro.columns["cam"].codec == "jpeg"  # opening and inspecting need no decoder
        with pytest.raises(errors.SchemaError, match=r"column 'cam'.*mmbuffer\[images\]"):
            ro.get(np.arange(4), keys=["cam"])
