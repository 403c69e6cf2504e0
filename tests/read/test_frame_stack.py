"""Frame stacks (``stack={"pixels": k}``) against a naive reference written here.

The reference keeps, per lane, every frame written (by absolute row), the episode
each row belongs to and each episode's final observation, and builds a stack with
a Python loop per row and frame. Frames are random uint8 images, so a frame from
the wrong row, episode or lane shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import errors, samplers
from mmbuffer._read import recheck

FRAME = (6, 5)


class Model:
    """What was written, lane by lane (absolute rows), and the reference stacks."""

    def __init__(self, num_streams: int) -> None:
        self.frames: list[list[np.ndarray]] = [[] for _ in range(num_streams)]
        self.episode: list[list[int]] = [[] for _ in range(num_streams)]
        self.end: list[list[bool]] = [[] for _ in range(num_streams)]
        self.final: dict[tuple[int, int], np.ndarray] = {}
        self.current = [-1] * num_streams  # the open episode of each lane
        self.left = [0] * num_streams  # its rows still to come
        self.next_episode = 0

    def write(self, buf: mb.Buffer, rng: np.random.Generator, lane: int, rows: int, lengths: list[int]) -> None:
        """Extend ``rows`` rows into ``lane`` in chunks of random sizes (1 to 10 rows),
        episodes of lengths drawn from ``lengths``, terminated or truncated at random;
        the last episode may stay open (continued by the next call)."""
        frames, episode, end = self.frames[lane], self.episode[lane], self.end[lane]
        start = len(frames)
        terminated, truncated, finals = [], [], []
        for _ in range(rows):
            if self.left[lane] == 0:
                self.current[lane], self.next_episode = self.next_episode, self.next_episode + 1
                self.left[lane] = int(rng.choice(lengths))
            frames.append(rng.integers(0, 256, FRAME, dtype=np.uint8))
            episode.append(self.current[lane])
            self.left[lane] -= 1
            done = self.left[lane] == 0
            end.append(done)
            term = done and bool(rng.integers(2))
            terminated.append(term)
            truncated.append(done and not term)
            if done:
                self.final[(lane, self.current[lane])] = rng.integers(0, 256, FRAME, dtype=np.uint8)
                finals.append(self.final[(lane, self.current[lane])])
        at = start
        while at < len(frames):
            stop = min(at + int(rng.integers(1, 11)), len(frames))
            t = np.array(terminated[at - start : stop - start], bool)
            tr = np.array(truncated[at - start : stop - start], bool)
            k = int((t | tr).sum())
            fin, finals = finals[:k], finals[k:]
            buf.extend(
                {"pixels": np.stack(frames[at:stop]), "action": np.arange(at, stop), "terminated": t, "truncated": tr},
                stream=lane,
                final_obs={"pixels": np.stack(fin) if fin else np.zeros((0, *FRAME), np.uint8)},
            )
            at = stop

    def absolute(self, lane_size: int, row: int, written: int) -> int:
        w = written
        return w - 1 - (w - 1 - row % lane_size) % lane_size

    def stack(self, lane: int, a: int, k: int, pad: str) -> tuple[np.ndarray, np.ndarray]:
        """The reference stack of absolute row ``a`` of ``lane`` and its next stack."""
        frames, episode, end = self.frames[lane], self.episode[lane], self.end[lane]
        out = []
        for j in range(k - 1, -1, -1):
            b = a - j
            if b >= 0 and episode[b] == episode[a]:
                out.append(frames[b])
            else:
                first = a
                while first > 0 and episode[first - 1] == episode[a]:
                    first -= 1
                out.append(frames[first] if pad == "first" else np.zeros(FRAME, np.uint8))
        nxt = self.final[(lane, episode[a])] if end[a] else frames[a + 1]
        return np.stack(out), np.stack([*out[1:], nxt])


def make(tmp_path, *, streams: int, capacity: int, rows: int, lengths: list[int], seed: int = 0, priorities: bool = False):
    rng = np.random.default_rng(seed)
    buf = mb.create(
        tmp_path / "s", {"pixels": (FRAME, "uint8"), "action": ((), "int64")}, capacity=capacity,
        num_streams=streams, next_keys=("pixels",), priorities=mb.PriorityConfig() if priorities else None,
    )
    model = Model(streams)
    for lane in range(streams):
        model.write(buf, rng, lane, rows, lengths)
    buf.commit()
    return buf, model


def check_batch(buf: mb.Buffer, model: Model, batch: mb.Batch, k: int, pad: str) -> int:
    """Compare every item of ``batch`` with the reference; return how many items were checked."""
    rows = batch.indices.numpy().reshape(-1)
    mask = None if batch.mask is None else batch.mask.numpy().reshape(-1)
    pixels = batch["pixels"].numpy().reshape(-1, k, *FRAME)
    nxt = batch["next_pixels"].numpy().reshape(-1, k, *FRAME)
    action = batch["action"].numpy().reshape(-1)
    checked = 0
    for i, r in enumerate(rows):
        if mask is not None and not mask[i]:
            assert not pixels[i].any() and not nxt[i].any()
            continue
        lane = int(r) // buf.lane_size
        a = model.absolute(buf.lane_size, int(r), len(model.frames[lane]))
        want, want_next = model.stack(lane, a, k, pad)
        assert action[i] == a
        np.testing.assert_array_equal(pixels[i], want, err_msg=f"row {r} (lane {lane}, absolute {a})")
        np.testing.assert_array_equal(nxt[i], want_next, err_msg=f"next of row {r} (lane {lane}, absolute {a})")
        checked += 1
    return checked


LENGTHS = [1, 1, 2, 3, 4, 5, 7, 11]


@pytest.mark.parametrize("pad", ["first", "zero"])
@pytest.mark.parametrize("k", [1, 4])
def test_sample_matches_reference_on_wrapped_lanes(tmp_path, pad, k):
    buf, model = make(tmp_path, streams=3, capacity=3 * 37, rows=150, lengths=LENGTHS)
    assert all(len(f) > buf.lane_size for f in model.frames)  # every lane wrapped
    g = torch.Generator().manual_seed(1)
    checked = 0
    for _ in range(6):
        b = buf.sample(256, g, stack={"pixels": k}, stack_pad=pad)
        assert tuple(b["pixels"].shape) == (256, k, *FRAME)
        assert tuple(b["next_pixels"].shape) == (256, k, *FRAME)
        checked += check_batch(buf, model, b, k, pad)
    assert checked == 6 * 256
    buf.close()


def test_episodes_shorter_than_the_stack_and_the_open_episode(tmp_path):
    """Every live row once (rank lookup): length-1 episodes, ones shorter than k, the
    open episode (started at the lane's open start), across the ring's wrap."""
    buf, model = make(tmp_path, streams=2, capacity=2 * 29, rows=101, lengths=[1, 2, 3, 9], seed=3)
    view = buf.view()
    total = int(sum(lv.visible_end - lv.first_start for lv in view.lanes))
    rows = samplers._draw.rows_at(view, np.arange(total))

    def draw(positions):
        return rows[positions], np.ones(len(positions), np.float32), None, view.written.copy()

    for pad in ("first", "zero"):
        b = buf.read_batch(draw, total, ["pixels", "next_pixels", "action"], stack=mb._read.frames.check({"pixels": 5}, pad))
        assert check_batch(buf, model, b, 5, pad) == total
    buf.close()


@pytest.mark.parametrize("strict", [True, False])
def test_slices(tmp_path, strict):
    buf, model = make(tmp_path, streams=2, capacity=2 * 41, rows=120, lengths=[1, 3, 6, 10, 13], seed=5)
    g = torch.Generator().manual_seed(2)
    for pad in ("first", "zero"):
        b = buf.sample_slices(64, 6, strict, g, stack={"pixels": 3}, stack_pad=pad)
        assert tuple(b["pixels"].shape) == (64, 6, 3, *FRAME)
        assert tuple(b["next_pixels"].shape) == (64, 6, 3, *FRAME)
        assert check_batch(buf, model, b, 3, pad) == int(b.mask.sum())
        if not strict:
            assert not b.mask.all()  # padded windows were checked to read zeros
    buf.close()


def test_prioritized(tmp_path):
    buf, model = make(tmp_path, streams=2, capacity=2 * 31, rows=90, lengths=LENGTHS, seed=7, priorities=True)
    g = torch.Generator().manual_seed(3)
    b = buf.sample(128, g, stack={"pixels": 4})
    buf.update_priorities(b, torch.rand(128, generator=g) * 10)
    b = buf.sample(128, g, sampler=samplers.Prioritized(beta=0.6), stack={"pixels": 4}, stack_pad="zero")
    assert check_batch(buf, model, b, 4, "zero") == 128
    assert not torch.all(b.weights == 1)
    b = buf.sample_slices(32, 4, generator=g, prioritized=True, stack={"pixels": 2})
    assert check_batch(buf, model, b, 2, "first") == 32 * 4
    buf.close()


def test_keys_and_several_stacked_columns(tmp_path):
    buf, model = make(tmp_path, streams=1, capacity=40, rows=70, lengths=LENGTHS, seed=9)
    g = torch.Generator().manual_seed(4)
    b = buf.sample(32, g, keys=["next_pixels", "action"], stack={"pixels": 3})
    assert list(b.data) == ["next_pixels", "action"]
    assert tuple(b["next_pixels"].shape) == (32, 3, *FRAME)
    b = buf.sample(32, g, keys=["action", "pixels"], stack={"pixels": 2, "action": 3})
    assert tuple(b["action"].shape) == (32, 3)
    rows = b.indices.numpy()
    for i, r in enumerate(rows):
        a = model.absolute(buf.lane_size, int(r), len(model.frames[0]))
        want, _ = model.stack(0, a, 2, "first")
        np.testing.assert_array_equal(b["pixels"][i].numpy(), want)
        assert b["action"][i, -1] == a and b["action"][i, 0] <= b["action"][i, 1] <= a
    buf.close()


def test_reader_rechecks_the_earliest_frame(tmp_path):
    """A writer overwrites a stack's oldest frames while a reader gathers it (the
    sampled row itself intact): the reader must redraw the item."""
    lane = 32
    buf = mb.create(tmp_path / "s", {"pixels": (FRAME, "uint8"), "action": ((), "int64")}, capacity=lane,
                    next_keys=("pixels",))
    model = Model(1)
    rng = np.random.default_rng(11)
    model.write(buf, rng, 0, 20, [20])  # one complete episode: absolute rows 0..19
    model.write(buf, rng, 0, 8, [31])  # the open episode: rows 20..27
    buf.commit()
    reader = mb.open(tmp_path / "s", "r")
    target = 19  # the last row of the complete episode: its 8-stack reads rows 12..19
    calls = []

    def draw(positions):
        view = reader.view()
        if not calls:
            calls.append(view.written.copy())
            # the writer now rewrites ring rows 0..13 (absolute 32..45) before the reader's check
            model.write(buf, rng, 0, 18, [40])
            return np.array([target]), np.ones(1, np.float32), None, view.written.copy()
        calls.append(view.written.copy())
        rows = np.array([21 + len(calls)])[: len(positions)]  # rows of the open episode, intact
        return rows, np.ones(len(positions), np.float32), None, view.written.copy()

    b = reader.read_batch(draw, 1, ["pixels", "next_pixels", "action"], stack=mb._read.frames.check({"pixels": 8}))
    assert len(calls) == 2, "the item reading overwritten frames was not redrawn"
    row = int(b.indices[0])
    assert row != target
    # the sampled row alone would have passed the old check; its oldest frame does not
    assert not recheck.overwritten(buf.layout, np.array([target]), np.array([28]), buf.reservation())[0]
    assert recheck.overwritten(buf.layout, np.array([12]), np.array([28]), buf.reservation())[0]
    # what the reader returned is the committed rows' reference
    a = row
    frames = model.frames[0]
    want = [frames[max(a - j, 20)] for j in range(7, -1, -1)]
    np.testing.assert_array_equal(b["pixels"][0].numpy(), np.stack(want))
    reader.close()
    buf.close()


def test_reader_sees_the_same_stacks_as_the_writer(tmp_path):
    buf, model = make(tmp_path, streams=2, capacity=2 * 33, rows=100, lengths=LENGTHS, seed=13)
    reader = mb.open(tmp_path / "s", "r")
    b = reader.sample(200, torch.Generator().manual_seed(5), stack={"pixels": 4}, stack_pad="zero")
    assert check_batch(buf, model, b, 4, "zero") == 200
    reader.close()
    buf.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_stream_threads(tmp_path, workers):
    buf, model = make(tmp_path, streams=2, capacity=2 * 37, rows=110, lengths=LENGTHS, seed=17)
    with mb.stream(buf, 32, num_batches=4, workers=workers, stack={"pixels": 4}, stack_pad="zero",
                   generator=torch.Generator().manual_seed(6)) as s:
        batches = list(s)
    assert len(batches) == 4
    for b in batches:
        assert check_batch(buf, model, b, 4, "zero") == 32
    with mb.stream(buf, 8, slice_len=5, num_batches=2, pin_memory=False, stack={"pixels": 2}) as s:
        for b in s:
            assert tuple(b["pixels"].shape) == (8, 5, 2, *FRAME)
            assert check_batch(buf, model, b, 2, "first") == 40
    buf.close()


def test_stream_processes(tmp_path):
    buf, model = make(tmp_path, streams=2, capacity=2 * 37, rows=110, lengths=LENGTHS, seed=19)
    with mb.stream(buf, 16, slice_len=3, num_batches=3, processes=1, stack={"pixels": 4}) as s:
        batches = [b for b in s]
    assert len(batches) == 3
    for b in batches:
        assert tuple(b["pixels"].shape) == (16, 3, 4, *FRAME)
        assert check_batch(buf, model, b, 4, "first") == 48
    buf.close()


def test_buffer_dataset(tmp_path):
    from torch.utils.data import DataLoader

    buf, model = make(tmp_path, streams=2, capacity=2 * 37, rows=110, lengths=LENGTHS, seed=23)
    ds = mb.data.BufferDataset(tmp_path / "s", 16, num_batches=3, stack={"pixels": 3}, stack_pad="zero")
    got = list(DataLoader(ds, batch_size=None))
    assert len(got) == 3
    for b in got:
        assert tuple(b["pixels"].shape) == (16, 3, *FRAME)
        assert check_batch(buf, model, b, 3, "zero") == 16
    ds = mb.data.BufferDataset(tmp_path / "s", 16, slice_len=4, epoch=True, num_batches=2, stack={"pixels": 2})
    for b in ds:
        assert tuple(b["pixels"].shape) == (16, 4, 2, *FRAME)
        assert check_batch(buf, model, b, 2, "first") == 64
    buf.close()


def test_refusals(tmp_path):
    buf, _ = make(tmp_path, streams=1, capacity=20, rows=10, lengths=[3])
    cases = [
        ({"stack": {"pix": 4}}, r"stack: expected stored column names among .* got unknown 'pix'"),
        ({"stack": {"pixels": 0}}, r"stack\['pixels'\]: expected an integer >= 1 .* got 0"),
        ({"stack": {"pixels": 2.0}}, r"stack\['pixels'\]: expected an integer >= 1 .* got 2.0"),
        ({"stack": {"pixels": True}}, r"stack\['pixels'\]: expected an integer >= 1 .* got True"),
        ({"stack": ["pixels"]}, r"stack: expected a mapping column -> frames per stack .* got list"),
        ({"stack": {"pixels": 4}, "stack_pad": "edge"}, r"stack_pad: expected one of \['first', 'zero'\], got 'edge'"),
    ]
    for kwargs, match in cases:
        with pytest.raises(errors.InvalidArgumentError, match=match):
            buf.sample(4, **kwargs)
        with pytest.raises(errors.InvalidArgumentError, match=match):
            buf.sample_slices(2, 2, **kwargs)
        with pytest.raises(errors.InvalidArgumentError, match=match):
            mb.stream(buf, 4, **kwargs)
    with pytest.raises(errors.InvalidArgumentError, match="stack_pad"):
        mb.data.BufferDataset(tmp_path / "s", 4, stack={"pixels": 2}, stack_pad=None)
    with pytest.raises(errors.InvalidArgumentError, match="got unknown 'pix'"):
        next(iter(mb.data.BufferDataset(tmp_path / "s", 4, stack={"pix": 2})))
    buf.close()


def test_epoch_sampler(tmp_path):
    buf, model = make(tmp_path, streams=2, capacity=2 * 29, rows=80, lengths=LENGTHS, seed=29)
    seen = 0
    for b in mb.EpochSampler(buf, 20, seed=1, name="stacks", stack={"pixels": 3}, stack_pad="zero"):
        assert tuple(b["pixels"].shape[1:]) == (3, *FRAME)
        seen += check_batch(buf, model, b, 3, "zero")
    assert seen == int(samplers._draw.transition_counts(buf.view()).sum())  # every sampleable row once
    with pytest.raises(errors.InvalidArgumentError, match="got unknown 'pix'"):
        mb.EpochSampler(buf, 20, stack={"pix": 3})
    buf.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_stream_while_the_writer_wraps_the_ring(tmp_path, workers):
    """Workers gather stacks while the training thread keeps extending (two workers
    gather outside the lock and re-check at the earliest frame): every item must
    still be the reference stack of the absolute row it read (``action`` holds it)."""
    buf, model = make(tmp_path, streams=2, capacity=2 * 40, rows=60, lengths=LENGTHS, seed=31)
    rng = np.random.default_rng(32)
    checked = 0
    with mb.stream(buf, 24, num_batches=40, workers=workers, prefetch=2, stack={"pixels": 4},
                   generator=torch.Generator().manual_seed(7)) as s:
        for b in s:
            for lane in range(2):
                model.write(buf, rng, lane, int(rng.integers(5, 30)), LENGTHS)
            rows, action = b.indices.numpy(), b["action"].numpy()
            for i, r in enumerate(rows):
                lane = int(r) // buf.lane_size
                want, want_next = model.stack(lane, int(action[i]), 4, "first")
                np.testing.assert_array_equal(b["pixels"][i].numpy(), want)
                np.testing.assert_array_equal(b["next_pixels"][i].numpy(), want_next)
                checked += 1
    assert checked == 40 * 24
    assert all(len(f) > 4 * buf.lane_size for f in model.frames)  # the ring wrapped several times meanwhile
    buf.close()
