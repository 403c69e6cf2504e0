"""mb.stream: same batches as direct sampling, clean shutdown, thread safety."""

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

import mmbuffer as mb


def _threads():
    return {t for t in threading.enumerate() if t.name == "mmbuffer-stream"}


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = _threads()
    yield
    gc.collect()
    assert _threads() <= before, "a stream thread outlived its iterator"


def _store(path, rows=600, episode=50, priorities=None, capacity=1000):
    buf = mb.create(
        path,
        {"obs": ((3,), "float32"), "x": ((), "int64"), "reward": ((), "float32")},
        capacity=capacity,
        priorities=priorities,
    )
    if rows:
        _append(buf, 0, rows, episode)
    return buf


def _append(buf, first, rows, episode):
    """Rows whose ``x`` counts up from ``first``; obs is x repeated, episodes of ``episode`` rows."""
    x = np.arange(first, first + rows)
    done = x % episode == episode - 1
    buf.extend(
        {"obs": np.repeat(x[:, None], 3, 1).astype("float32"), "x": x, "reward": np.ones(rows), "truncated": done},
        final_obs={"obs": -np.ones((int(done.sum()), 3))},
    )


def _same(a, b):
    assert a.data.keys() == b.data.keys()
    for k in a.data:
        assert torch.equal(a.data[k], b.data[k]), k
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(a.weights, b.weights)
    assert (a.mask is None) == (b.mask is None)
    if a.mask is not None:
        assert torch.equal(a.mask, b.mask)


# -- same batches as direct sampling ---------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"slice_len": 8},
        {"slice_len": 60, "strict": False},
        {"prioritized": True, "beta": 0.7},
        {"slice_len": 5, "prioritized": True},
        {"keys": ["x", "next_obs"]},
    ],
)
def test_stream_matches_direct_sampling(tmp_path, kwargs):
    buf = _store(tmp_path / "s", priorities=mb.PriorityConfig())
    # uneven priorities so that prioritized draws differ from uniform ones
    buf.update_priorities(np.arange(600), np.linspace(0.1, 5, 600))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    streamed = list(mb.stream(buf, 16, num_batches=12, generator=g1, prefetch=3, **kwargs))
    slice_len = kwargs.pop("slice_len", None)
    strict = kwargs.pop("strict", True)
    for b in streamed:
        if slice_len is None:
            direct = buf.sample(16, g2, **kwargs)
        else:
            direct = buf.sample_slices(16, slice_len, strict, g2, **kwargs)
        _same(b, direct)
    assert len(streamed) == 12


def test_num_batches_zero_and_delivered(tmp_path):
    buf = _store(tmp_path / "s")
    assert list(mb.stream(buf, 4, num_batches=0)) == []
    s = mb.stream(buf, 4, num_batches=5)
    assert sum(1 for _ in s) == 5 and s.delivered == 5
    with pytest.raises(StopIteration):
        next(s)


def test_infinite_stream_until_close(tmp_path):
    buf = _store(tmp_path / "s")
    s = mb.stream(buf, 4, prefetch=2)
    for i, _ in enumerate(s):
        if i == 50:
            break
    assert s.delivered == 51
    s.close()
    s.close()  # idempotent
    assert list(s) == []


# -- shutdown --------------------------------------------------------------------------------
def test_break_inside_with_joins(tmp_path):
    buf = _store(tmp_path / "s")
    before = _threads()
    with mb.stream(buf, 8) as s:
        assert len(_threads() - before) == 1
        for i, _ in enumerate(s):
            if i == 3:
                break
    assert _threads() == before


def test_break_in_bare_loop_then_release(tmp_path):
    buf = _store(tmp_path / "s")
    before = _threads()
    s = mb.stream(buf, 8, prefetch=1)
    for _ in s:
        break
    del s  # the worker holds no reference to the iterator: this closes it
    assert _threads() == before


def test_exception_in_loop_body(tmp_path):
    buf = _store(tmp_path / "s")
    before = _threads()
    with pytest.raises(ValueError, match="boom"):
        for _ in mb.stream(buf, 8, slice_len=4):
            raise ValueError("boom")
    gc.collect()
    assert _threads() == before


def test_garbage_collected_in_a_cycle(tmp_path):
    buf = _store(tmp_path / "s")
    before = _threads()
    s = mb.stream(buf, 8)
    next(s)
    holder = {"stream": s}
    holder["self"] = holder  # a reference cycle keeps it until the collector runs
    ref = weakref.ref(s)
    del s, holder
    gc.collect()
    assert ref() is None
    assert _threads() == before


def test_never_iterated(tmp_path):
    buf = _store(tmp_path / "s")
    before = _threads()
    s = mb.stream(buf, 8, prefetch=2)
    del s
    assert _threads() == before


def test_buffer_released_after_stream(tmp_path):
    buf = _store(tmp_path / "s")
    with mb.stream(buf, 8, num_batches=2) as s:
        list(s)
    ref = weakref.ref(buf)
    del buf, s
    gc.collect()
    assert ref() is None  # the lock wrappers hold the buffer weakly
    mb.open(tmp_path / "s").close()  # and its writer lock was released


# -- errors ----------------------------------------------------------------------------------
def test_worker_errors_reraise(tmp_path):
    empty = _store(tmp_path / "e", rows=0)
    s = mb.stream(empty, 4)
    with pytest.raises(mb.errors.EmptyBufferError):
        next(s)
    assert list(s) == []
    buf = _store(tmp_path / "s")
    with pytest.raises(mb.errors.NoValidSliceError):
        next(iter(mb.stream(buf, 4, slice_len=51)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": 4, "prefetch": 0},
        {"batch_size": 4, "slice_len": 0},
        {"batch_size": 4, "num_batches": -1},
        {"batch_size": 4, "prioritized": True},
        {"batch_size": 4, "keys": ["nope"]},
        {"batch_size": 4, "generator": 0},
    ],
)
def test_bad_arguments_raise_at_once(tmp_path, kwargs):
    buf = _store(tmp_path / "s")
    before = _threads()
    with pytest.raises(mb.errors.InvalidArgumentError):
        mb.stream(buf, **kwargs)
    assert _threads() == before


# -- devices ---------------------------------------------------------------------------------
@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator fallback")
def test_pin_memory_without_accelerator_warns(tmp_path):
    buf = _store(tmp_path / "s")
    with pytest.warns(UserWarning, match="pin_memory"):
        s = mb.stream(buf, 4, pin_memory=True, num_batches=2)
    assert len(list(s)) == 2


def test_device_cpu(tmp_path):
    buf = _store(tmp_path / "s")
    out = list(mb.stream(buf, 4, device="cpu", num_batches=2))
    assert out[0]["obs"].device == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_side_stream(tmp_path):
    buf = _store(tmp_path / "s")
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for b in mb.stream(buf, 32, slice_len=8, device="cuda", pin_memory=True, num_batches=20, generator=g1):
        assert b["obs"].is_cuda
        _same(b.to("cpu"), buf.sample_slices(32, 8, generator=g2))


# -- thread safety ---------------------------------------------------------------------------
def test_update_priorities_while_streaming(tmp_path):
    buf = _store(tmp_path / "s", priorities=mb.PriorityConfig(alpha=1.0))
    rng = np.random.default_rng(0)
    n = 0
    with mb.stream(buf, 32, slice_len=4, prioritized=True, prefetch=2, num_batches=300) as s:
        for b in s:
            assert torch.isfinite(b.weights).all() and (b.weights > 0).all()
            buf.update_priorities(b.indices, rng.random(32) * 10)
            n += 1
    assert n == 300


def test_writes_while_streaming_never_tear_slices(tmp_path):
    """The training thread appends (wrapping the ring) and reprioritizes while the
    worker samples and gathers: every slice stays one run of consecutive rows and
    every weight stays finite. (Without the buffer lock this fails within a few
    hundred batches at this switch interval: torn slices, zero-priority draws.)"""
    import sys

    buf = _store(tmp_path / "s", rows=300, episode=30, capacity=600, priorities=mb.PriorityConfig())
    written = 300
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so that races show
    try:
        with mb.stream(buf, 64, slice_len=10, prioritized=True, prefetch=1, num_batches=300) as s:
            for b in s:
                x = b["x"]
                assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones_like(x[:, 1:]))
                assert torch.equal(b["obs"][..., 0].long(), x)
                nxt = b["next_obs"][..., 0].long()
                last = (x % 30) == 29
                assert torch.equal(nxt[~last], x[~last] + 1) and (nxt[last] == -1).all()
                assert torch.isfinite(b.weights).all()
                for _ in range(3):
                    _append(buf, written, 10, 30)
                    written += 10
                    buf.update_priorities(b.indices, torch.rand(64))
                if written % 300 == 0:
                    buf.commit()
    finally:
        sys.setswitchinterval(interval)
    assert written > 3 * 600  # the ring wrapped many times


def test_switch_interval_lowered_while_running_then_restored(tmp_path):
    import sys

    buf = _store(tmp_path / "s")
    before = sys.getswitchinterval()
    a = mb.stream(buf, 4)
    b = mb.stream(buf, 4, switch_interval=1e-4)
    assert sys.getswitchinterval() == pytest.approx(1e-4)
    a.close()
    assert sys.getswitchinterval() == pytest.approx(1e-4)  # b still runs
    b.close()
    assert sys.getswitchinterval() == before
    with mb.stream(buf, 4, switch_interval=None):
        assert sys.getswitchinterval() == before
    with pytest.raises(mb.errors.InvalidArgumentError):
        mb.stream(buf, 4, switch_interval=0)
