"""Columns with a codec (issue 23, items 1-3): Zarr shards of zstd chunks, a staging area per
lane, one compiled decode per batch through a bounded cache; every read path bit-identical
to a raw store holding the same rows; corruption is a typed error, never wrong pixels."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
import torch
import warm

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer._disk.columns import sharded, sharding
from mmbuffer.kernels import codec

SHAPE = (6, 5)  # 30-byte rows: with INNER_BYTES = 64, inner chunks of 2 rows, shards of 8


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    """Small chunks and shards, so that a few hundred rows fill many shards and wrap rings."""
    monkeypatch.setattr(sharding, "INNER_BYTES", 64)
    monkeypatch.setattr(sharding, "SHARD_CHUNKS", 4)


def _columns(codec_name):
    x = mb.Column(SHAPE, "uint8", codec=codec_name) if codec_name else (SHAPE, "uint8")
    return {"x": x, "a": ((), "int64")}


def _frames(rng, n):
    """Compressible frames: a few gray levels."""
    return (rng.integers(0, 4, size=(n, *SHAPE)) * 60).astype(np.uint8)


def _fill(bufs, *, steps=250, seed=0, commit_every=20):
    """The same random rows (1-8 per extend, random lanes, episodes of random length,
    rings wrapped several times) into every store of ``bufs``."""
    rng = np.random.default_rng(seed)
    t = 0
    open_len = [0] * bufs[0].num_streams
    for step in range(steps):
        s = int(rng.integers(0, bufs[0].num_streams))
        n = int(rng.integers(1, 9))
        done = rng.random(n) < 0.1
        if open_len[s] + n > 20:  # episodes of at most 20 rows: they fit the lanes
            done[min(n, 20 - open_len[s]) - 1] = True
        last = np.flatnonzero(done)
        open_len[s] = n - 1 - int(last[-1]) if last.size else open_len[s] + n
        rows = {"x": _frames(rng, n), "a": np.arange(t, t + n), "terminated": done}
        fin = {"x": _frames(rng, int(done.sum()))}
        t += n
        for b in bufs:
            b.extend(rows, stream=s, final_obs=fin)
            if step % commit_every == 0:
                b.commit()
    for b in bufs:
        b.commit()
    return t


@pytest.fixture(params=["zstd:5", "lz4"])
def pair(tmp_path, request):
    kw = dict(capacity=2 * 48, num_streams=2, next_keys=("x",))
    raw = mb.create(tmp_path / "raw", _columns(None), **kw)
    z = mb.create(tmp_path / "z", _columns(request.param), **kw)
    total = _fill([raw, z])
    assert total > 4 * raw.capacity  # every ring wrapped
    yield raw, z
    raw.close()
    z.close()


def _same(b1, b2):
    assert b1.data.keys() == b2.data.keys()
    for k in b1.data:
        assert torch.equal(b1.data[k], b2.data[k]), k
    assert torch.equal(b1.indices, b2.indices)


def _both(fn, raw, z, seed):
    return fn(raw, torch.Generator().manual_seed(seed)), fn(z, torch.Generator().manual_seed(seed))


def test_the_geometry_and_the_manifest(pair, tmp_path):
    raw, z = pair
    col = z.store.column("x")
    assert (col._inner, col._shard) == (2, 8)
    name = z.columns["x"].codec
    assert name in ("zstd:5", "lz4") and z.columns["x"] == mb.Column(SHAPE, "uint8", codec=name)
    assert raw.columns["x"].codec is None
    spec = json.loads((tmp_path / "z" / "manifest.json").read_text())["columns"]
    assert spec["x"]["codec"] == name and "codec" not in spec["a"]
    with mb.open(tmp_path / "z", mode="r") as ro:
        assert ro.columns["x"].codec == name


@pytest.mark.parametrize("bad", ["gzip", "zstd:0", "zstd:23", "zstd:x", "lz4:3", "jpeg:101", 3])
def test_an_unknown_codec_is_refused_naming_the_column(tmp_path, bad):
    with pytest.raises(errors.SchemaError, match=r"column 'x': codec"):
        mb.create(tmp_path / "s", {"x": mb.Column((2,), "uint8", codec=bad)}, capacity=8, next_keys=())
    assert not (tmp_path / "s").exists()


def test_a_manifest_naming_an_unknown_codec_is_corrupt(pair, tmp_path):
    path = tmp_path / "z"
    pair[1].close()
    m = json.loads((path / "manifest.json").read_text())
    m["columns"]["x"]["codec"] = "brotli"
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(errors.CorruptStoreError, match=r"columns\['x'\]\.codec"):
        mb.open(path, mode="r")


@pytest.mark.parametrize("mode", ["a", "r"])
def test_every_read_path_matches_a_raw_store_bit_for_bit(pair, tmp_path, mode):
    """sample, sample_slices (strict or padded), frame stacks (both pads), get, episodes and
    read_range, in the writer and in a reader, give exactly what the raw store gives."""
    raw, z = pair
    if mode == "r":
        raw, z = mb.open(tmp_path / "raw", mode="r"), mb.open(tmp_path / "z", mode="r")
    for seed in range(4):
        _same(*_both(lambda b, g: b.sample(32, generator=g), raw, z, seed))
        _same(*_both(lambda b, g: b.sample_slices(6, 3, generator=g), raw, z, seed))
        _same(*_both(lambda b, g: b.sample_slices(6, 9, strict=False, generator=g), raw, z, seed))
        for pad in ("first", "zero"):
            _same(*_both(lambda b, g: b.sample(16, stack={"x": 4}, stack_pad=pad, generator=g), raw, z, seed))
            _same(*_both(lambda b, g: b.sample_slices(4, 3, stack={"x": 3}, stack_pad=pad, generator=g), raw, z, seed))
    rows = np.arange(raw.capacity)
    for key in ("x", "next_x") if mode == "a" else ("x",):
        assert torch.equal(raw.get(rows[:40], keys=[key])[key], z.get(rows[:40], keys=[key])[key])
    assert np.array_equal(raw.read_range("x", 3, 45), z.read_range("x", 3, 45))
    for e1, e2 in zip(raw.iter_episodes(), z.iter_episodes()):
        assert all(torch.equal(e1[k], e2[k]) for k in e1)


def test_stream_and_the_dataset_read_the_same_batches(pair, tmp_path):
    raw, z = pair
    s1 = list(mb.stream(raw, 16, num_batches=5, generator=torch.Generator().manual_seed(3), stack={"x": 2}))
    s2 = list(mb.stream(z, 16, num_batches=5, generator=torch.Generator().manual_seed(3), stack={"x": 2}))
    for b1, b2 in zip(s1, s2, strict=True):
        _same(b1, b2)
    raw.close()
    z.close()
    d1 = mb.data.BufferDataset(tmp_path / "raw", 8, slice_len=3, seed=5, num_batches=4)
    d2 = mb.data.BufferDataset(tmp_path / "z", 8, slice_len=3, seed=5, num_batches=4)
    for b1, b2 in zip(d1, d2, strict=True):
        _same(b1, b2)


def test_complete_shards_read_through_plain_zarr(pair, tmp_path):
    """zarr-python opens the column unchanged (crc32c of every chunk and index checked) and
    reads in every complete shard what mmbuffer reads; the rows of a lane's shard being
    filled are in the staging array, also plain Zarr."""
    import zarr

    _, z = pair
    col = z.store.column("x")
    arr = zarr.open_array(str(tmp_path / "z" / "columns" / "x"), mode="r")
    S, L = col._shard, z.lane_size
    checked = 0
    for lane, written in enumerate(z.view().written.tolist()):
        complete = [(written // S - j) for j in range(1, L // S)]  # the lane's other shards
        for k in complete:
            rows = lane * L + (k % (L // S)) * S + np.arange(S)
            assert np.array_equal(arr[rows[0] : rows[-1] + 1], z.get(rows, keys=["x"])["x"].numpy())
            checked += S
        k, off = divmod(written, S)
        staged = zarr.open_array(str(tmp_path / "z" / "staging" / "x" / "rows"), mode="r")
        half = (lane * 2 + k % 2) * S
        rows = lane * L + (k % (L // S)) * S + np.arange(off)
        assert np.array_equal(staged[half : half + off], z.get(rows, keys=["x"])["x"].numpy())
    assert checked >= 2 * (L - 8)
    ts = pytest.importorskip("tensorstore")  # tensorstore reads the same shards (crc32c checked)
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "z" / "columns" / "x")}}).result()
    k = int(z.view().written[0]) // S - 1  # lane 0's last complete shard
    rows = (k % (L // S)) * S + np.arange(S)
    assert np.array_equal(t[rows[0] : rows[-1] + 1].read().result(), z.get(rows, keys=["x"])["x"].numpy())


def _shard_file(path, f=0):
    return path / "columns" / "x" / "c" / str(f) / "0" / "0"


@pytest.mark.parametrize("where", ["chunk", "index", "truncated", "crc"])
def test_corruption_is_a_typed_error_naming_column_and_chunk(pair, tmp_path, where):
    """A flipped byte in a chunk, in the shard index or in a chunk's crc32c, or a truncated
    shard file: every read of it raises CorruptStoreError naming the column (and the inner
    chunk), in a fresh reader; the other shards still read."""
    raw, z = pair
    path = tmp_path / "z"
    S, per_lane = 8, z.lane_size // 8
    k = int(z.view().written[0]) // S - 1  # lane 0's last complete shard: its rows are read from its file
    shard = k % per_lane
    f = _shard_file(path, shard)
    data = bytearray(f.read_bytes())
    per = 4
    index = np.frombuffer(bytes(data[len(data) - 16 * per - 4 : -4]), "<u8").reshape(per, 2)
    off, nb = (int(v) for v in index[1])
    if where == "chunk":
        data[off + 3] ^= 0x10
    elif where == "crc":
        data[off + nb - 1] ^= 0x01
    elif where == "index":
        data[len(data) - 10] ^= 0x04
    else:
        data = data[: len(data) // 2]
    f.write_bytes(bytes(data))
    with mb.open(path, mode="r") as ro:
        match = r"column 'x'.*inner chunk 1" if where in ("chunk", "crc") else r"column 'x'"
        with pytest.raises(errors.CorruptStoreError, match=match):
            ro.get(shard * S + np.arange(S), keys=["x"])
        other = ((shard - 1) % per_lane) * S + np.arange(S)  # the shard before is intact
        assert torch.equal(ro.get(other, keys=["x"])["x"], raw.get(other, keys=["x"])["x"])


def test_per_step_extend_encodes_each_shard_once(tmp_path, monkeypatch):
    """One row per extend: nothing is encoded until a shard is complete, then it is encoded
    once; the rows read back bit-exact before and after."""
    calls = []
    real = codec.encode_shard
    monkeypatch.setattr(codec, "encode_shard", lambda *a, **k: (calls.append(a[5]), real(*a, **k))[1])
    buf = mb.create(tmp_path / "s", _columns("zstd"), capacity=40, next_keys=())  # shards of 8 rows
    rng = np.random.default_rng(0)
    frames = _frames(rng, 100)
    for i in range(100):
        buf.extend({"x": frames[i : i + 1], "a": [i], "terminated": [i % 10 == 9]})
        assert len(calls) == (i + 1) // 8
    assert calls == list(range(12))  # shards 0..11, each once, in order
    rows = np.arange(60, 100) % 40
    assert np.array_equal(buf.get(rows, keys=["x"])["x"].numpy(), frames[60:100])
    buf.close()


def test_rows_are_written_in_each_lanes_order(tmp_path):
    buf = mb.create(tmp_path / "s", _columns("zstd"), capacity=40, next_keys=())
    col = buf.store.column("x")
    with pytest.raises(errors.InvalidArgumentError, match="in each lane's order"):
        col.write_range(5, np.zeros((2, *SHAPE), np.uint8))
    with pytest.raises(errors.InvalidArgumentError, match="in each lane's order"):
        col.write_at(np.array([0]), np.zeros((1, *SHAPE), np.uint8))
    buf.close()


def test_a_dead_writer_that_reused_the_staging_half_loses_no_committed_row(tmp_path):
    """The writer commits inside a shard, then writes two more shards (reusing the staging
    half of the committed rows) and is killed before committing: a reader reads the committed
    rows from the shard file, and the next writer reloads them into staging and carries on."""
    path = tmp_path / "z"
    code = textwrap.dedent(f"""
        import os, numpy as np, mmbuffer as mb
        from mmbuffer._disk.columns import sharding
        sharding.INNER_BYTES, sharding.SHARD_CHUNKS = 64, 4
        buf = mb.create({str(path)!r}, {{"x": mb.Column({SHAPE}, "uint8", codec="zstd"), "a": ((), "int64")}},
                        capacity=40, next_keys=())
        x = (np.arange(100 * 30) % 251).astype(np.uint8).reshape(100, *{SHAPE})
        buf.extend({{"x": x[:13], "a": np.arange(13)}}); buf.commit()
        buf.extend({{"x": x[13:33], "a": np.arange(13, 33)}})
        os._exit(0)
    """)
    warm.run(code, check=True)
    x = (np.arange(100 * 30) % 251).astype(np.uint8).reshape(100, *SHAPE)
    with mb.open(path, mode="r") as ro:
        tags = ro.store.column("x")._tags.tolist()
        assert tags == [4, 3]  # the committed shard 1's half now holds shard 3
        assert len(ro) == 13 and np.array_equal(ro.get(np.arange(13), keys=["x"])["x"].numpy(), x[:13])
    with mb.open(path) as buf:
        buf.extend({"x": x[13:20], "a": np.arange(13, 20)})
        assert buf.store.column("x")._tags.tolist() == [2, 1]
        assert np.array_equal(buf.get(np.arange(20), keys=["x"])["x"].numpy(), x[:20])
    with mb.open(path, mode="r") as ro:
        assert np.array_equal(ro.get(np.arange(20), keys=["x"])["x"].numpy(), x[:20])


def test_the_decoded_chunk_cache_is_bounded_and_shared_across_batches(pair):
    """A cache of two sets still reads right (chunks evicted within a batch are decoded
    again); a larger one decodes each chunk once, then serves later batches from memory."""
    raw, z = pair
    col = z.store.column("x")
    chunk_bytes = col._inner * col._row_bytes
    rows = np.arange(raw.capacity)
    col._cache = codec.Cache(chunk_bytes, 2 * codec.WAYS * chunk_bytes)
    assert col._cache.data.nbytes == 2 * codec.WAYS * chunk_bytes
    for _ in range(2):
        assert torch.equal(raw.get(rows, keys=["x"])["x"], z.get(rows, keys=["x"])["x"])
    assert col._cache.stats[1] > raw.capacity // col._inner  # evicted, decoded again
    col._cache = codec.Cache(chunk_bytes, 1 << 20)
    z.get(rows, keys=["x"])
    hits, decoded = col._cache.stats.tolist()
    assert decoded > 0
    assert torch.equal(raw.get(rows, keys=["x"])["x"], z.get(rows, keys=["x"])["x"])
    assert col._cache.stats.tolist() == [hits + decoded, decoded]  # every chunk a hit the second time


WRITER = textwrap.dedent("""
    import sys, numpy as np, mmbuffer as mb
    from mmbuffer._disk.columns import sharding
    sharding.INNER_BYTES, sharding.SHARD_CHUNKS = 64, 4
    buf = mb.open(sys.argv[1])
    rng = np.random.default_rng(0)
    t = [int(w) for w in buf.view().written]
    for step in range(int(sys.argv[2])):
        s = step % buf.num_streams
        n = int(rng.integers(1, 4))
        a = t[s] + np.arange(n)
        x = ((a[:, None] * 7 + s * 13 + np.arange(30)) % 251).astype(np.uint8).reshape(n, 6, 5)
        buf.extend({"x": x, "a": a * 10 + s, "terminated": a % 9 == 8}, stream=s,
                   final_obs={"x": np.full((int((a % 9 == 8).sum()), 6, 5), 255, np.uint8)})
        t[s] += n
        if step % 3 == 0:
            buf.commit()
    buf.close()
""")


def _pattern(a):
    """What row ``a // 10`` (absolute) of lane ``a % 10`` holds."""
    absolute, lane = a // 10, a % 10
    return ((absolute[..., None] * 7 + lane[..., None] * 13 + np.arange(30)) % 251).astype(np.uint8)


def test_a_reader_in_another_process_never_gets_torn_or_mixed_rows(tmp_path):
    """A writer process extends a few rows at a time and commits every third extend, lapping
    its rings many times, while this process samples (plain and 3-frame stacks) from the
    last commit: every row's pixels are the pattern of its own ``a`` (a raw column read in
    the same batch), and rows were read both from staging and from shard files."""
    path = tmp_path / "z"
    mb.create(path, {"x": mb.Column((6, 5), "uint8", codec="zstd"), "a": ((), "int64")}, capacity=2 * 48,
              num_streams=2, next_keys=("x",)).close()
    proc = warm.start(WRITER, [str(path), "1200"])
    staged = decoded = batches = 0
    try:
        with mb.open(path, mode="r") as ro:
            while proc.poll() is None or batches < 20:  # a stated amount of work, not what fits in a time
                ro.refresh()
                if len(ro) < 8:
                    continue
                try:
                    b = ro.sample(32, keys=["x", "a"])
                    s = ro.sample(8, stack={"x": 3}, keys=["x", "a"])
                except errors.EmptyBufferError:  # the writer's reservation covers every committed row now
                    continue
                assert np.array_equal(b["x"].numpy().reshape(32, 30), _pattern(b["a"].numpy()))
                last = s["x"].numpy()[:, -1].reshape(8, 30)
                assert np.array_equal(last, _pattern(s["a"].numpy()))
                written = ro.view().written
                lane = b.indices.numpy() // ro.lane_size
                w = written[lane]
                a = w - 1 - (w - 1 - b.indices.numpy() % ro.lane_size) % ro.lane_size
                staged += int((a // 8 == w // 8).sum())
                batches += 1
            col = ro.store.column("x")
            decoded = int(col._cache.stats[1]) if col._cache is not None else 0
            ro.refresh()
            final_written = ro.view().written.tolist()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0
    assert min(final_written) > 10 * 48  # the rings lapped while the reader read
    assert batches >= 20 and staged > 0 and decoded > 0, (batches, staged, decoded)


@pytest.mark.parametrize("codec_name", ["zstd", "lz4"])
def test_chunks_of_whole_words_read_back_after_many_laps(tmp_path, codec_name):
    """Chunks whose size is a multiple of 8 bytes reach the cache with streaming stores
    (``kernels/codec.py``): after rings lapped many times, every live row (from shard files
    and staging, through a cache smaller than the store) is what was written."""
    buf = mb.create(tmp_path / "s", {"x": mb.Column((8,), "uint8", codec=codec_name)}, capacity=2 * 96,
                    num_streams=2, next_keys=())
    col = buf.store.column("x")
    assert (col._inner * 8) % 8 == 0 and col._inner >= 2
    rng = np.random.default_rng(1)
    truth = {0: [], 1: []}
    for step in range(120):
        s = step % 2
        x = rng.integers(0, 5, size=(int(rng.integers(1, 12)), 8)).astype(np.uint8)
        buf.extend({"x": x, "terminated": np.arange(len(x)) == len(x) - 1}, stream=s)
        truth[s].extend(x)
    col._cache = codec.Cache(col._inner * 8, 4 * codec.WAYS * col._inner * 8)
    for _ in range(2):
        for lane in (0, 1):
            w = len(truth[lane])
            a = np.arange(w - 96, w)
            rows = lane * 96 + a % 96
            assert np.array_equal(buf.get(rows, keys=["x"])["x"].numpy(), np.array(truth[lane])[a])
    assert col._cache.stats[1] > 0
    buf.close()


def _locate_reference(flat, written, L, S, tags, ver, stage):
    """staging.locate, one row at a time in plain Python."""
    out = np.zeros((len(flat), stage.shape[1]), np.uint8)
    todo = []
    for i, r in enumerate(flat.tolist()):
        lane, p = divmod(r, L)
        w = int(written[lane])
        a = w - 1 - (w - 1 - p) % L
        if a < 0:
            continue
        k = a // S
        half = lane * 2 + k % 2
        if k >= w // S and tags[half] == k:
            out[i] = stage[half * S + a % S]
        else:
            todo.append((r, k, i))
    return out, sorted(todo), any(ver[r // S] != k for r, k, _ in todo)


@pytest.mark.parametrize("seed", range(6))
def test_locate_kernel_matches_a_row_by_row_reference(seed):
    """The compiled pass that sorts rows into staged / in a shard file / never written."""
    from mmbuffer.kernels import staging

    rng = np.random.default_rng(seed)
    streams, S = int(rng.integers(2, 4)), int(rng.choice([2, 4, 8]))
    L = S * int(rng.integers(1, 6))
    written = rng.integers(L, 4 * L, streams)  # lanes wrapped: rows in shard files
    written[0] = int(rng.integers(0, L))  # a lane not yet wrapped (rows never written)
    k_now = written // S
    tags = np.stack([np.where(k_now % 2 == h, k_now, k_now - 1) for h in (0, 1)], 1).reshape(-1)
    tags[rng.random(tags.size) < 0.3] += 2  # halves the writer took meanwhile
    ver = rng.integers(-1, 6, streams * L // S)
    stage = rng.integers(0, 255, (streams * 2 * S, 5), dtype=np.uint8)
    flat = rng.integers(0, streams * L, 200)
    want, want_todo, want_stale = _locate_reference(flat, written, L, S, tags, ver, stage)
    out = np.full((len(flat), 5), 7, np.uint8)
    todo, stale = staging.locate(flat, written, L, S, tags, ver, stage, out)
    got_todo = sorted(map(tuple, todo.T.tolist()))
    assert got_todo == want_todo and stale == want_stale
    done = np.setdiff1d(np.arange(len(flat)), todo[2])
    assert np.array_equal(out[done], want[done])  # staged rows copied, never-written rows zero
    assert len(want_todo) and len(done) > len(flat) // 10  # both kinds were exercised


def test_final_observations_of_a_codec_column_stay_raw_and_sparse(tmp_path):
    """docs/format.md, "Final observations": a codec column's ``final/<col>`` is a raw
    sharded array (the ``bytes`` codec only), holding the frames given at episode ends."""
    path = tmp_path / "s"
    ends = np.zeros(10, bool)
    ends[[4, 9]] = True
    finals = np.stack([np.full((84, 84), 7, np.uint8), np.full((84, 84), 9, np.uint8)])
    with mb.create(path, {"pixels": mb.Column((84, 84), "uint8", codec="zstd")}, capacity=1000,
                   next_keys=("pixels",)) as buf:
        buf.extend({"pixels": np.ones((10, 84, 84), np.uint8), "terminated": ends, "truncated": np.zeros(10, bool)},
                   final_obs={"pixels": finals})
        buf.commit()
        got = buf.get(np.array([4, 9]), keys=["next_pixels"])["next_pixels"].numpy()
    assert np.array_equal(got, finals)
    meta = json.loads((path / "final" / "pixels" / "zarr.json").read_text())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    assert meta["codecs"][0]["configuration"]["codecs"] == [{"name": "bytes"}]
    column = json.loads((path / "columns" / "pixels" / "zarr.json").read_text())
    assert any(c["name"] == "zstd" for c in column["codecs"][0]["configuration"]["codecs"])  # the column: zstd
    shard = path / "final" / "pixels" / "c" / "0" / "0" / "0"
    assert os.stat(shard).st_blocks * 512 < 1000 * 84 * 84 // 4  # sparse: not the capacity's frames


READ_UNDER_A_LOW_FD_LIMIT = textwrap.dedent(
    """
    import os, resource, sys
    import numpy as np, mmbuffer as mb
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    with mb.open(sys.argv[1], mode="r") as buf:
        rows = np.random.default_rng(0).permutation(len(buf))
        most = 0
        for part in np.array_split(rows, 40):
            got = buf.get(part, keys=["frames"])["frames"].numpy()
            assert (got[:, 0, 0] == (part // 8) % 251).all()
            most = max(most, len(os.listdir("/proc/self/fd")))
    print(most)
    """
)


def test_a_store_of_more_shard_files_than_file_descriptors_reads_whole(tmp_path):
    """Each mapped shard file holds a file descriptor: a column keeps at most an eighth
    of the soft ``RLIMIT_NOFILE`` mapped (``sharded.default_max_maps``), so a reader
    under a limit of 256 reads a store of over 512 shard files (before: a
    ``CorruptStoreError`` ... ``Too many open files``)."""
    streams, lane = 600, 8  # this file's small shards: several shard files a lane
    path = tmp_path / "s"
    with mb.create(path, {"frames": mb.Column((64, 128), "uint8", codec="zstd")}, capacity=streams * lane,
                   num_streams=streams, next_keys=()) as buf:
        rows = np.arange(streams * lane).reshape(streams, lane)
        frames = np.broadcast_to((((rows // 8) % 251).astype(np.uint8))[:, :, None, None], (streams, lane, 64, 128))
        buf.extend({"frames": np.ascontiguousarray(frames), "terminated": np.ones((streams, lane), bool),
                    "truncated": np.zeros((streams, lane), bool)}, stream=list(range(streams)))
    files = [f for f in (path / "columns" / "frames" / "c").rglob("*") if f.is_file()]
    assert len(files) >= 2 * 256  # more shard files than the reader may hold descriptors
    out = warm.run(READ_UNDER_A_LOW_FD_LIMIT, [str(path)], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) <= 256
