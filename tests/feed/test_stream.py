"""mb.stream: same batches as direct sampling, clean shutdown, thread safety."""

import gc
import time
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


# -- several workers, one block per batch, the ring of host blocks -------------------------
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize(
    "kwargs", [{"slice_len": 8}, {"slice_len": 60, "strict": False}, {"prioritized": True}]
)
def test_workers_deliver_the_plain_loops_batches_in_order(tmp_path, workers, kwargs):
    buf = _store(tmp_path / "s", priorities=mb.PriorityConfig())
    buf.update_priorities(np.arange(600), np.linspace(0.1, 5, 600))
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    before = _threads()
    with mb.stream(buf, 16, num_batches=25, generator=g1, prefetch=2, workers=workers, **kwargs) as s:
        assert len(_threads() - before) == workers
        streamed = list(s)
    assert len(streamed) == 25
    slice_len, strict = kwargs.pop("slice_len", None), kwargs.pop("strict", True)
    for b in streamed:
        direct = buf.sample(16, g2, **kwargs) if slice_len is None else buf.sample_slices(16, slice_len, strict, g2)
        _same(b, direct)
    # the generator advanced past exactly the delivered batches (num_batches bounds the draws)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_workers_gather_outside_the_lock_yet_never_tear_slices(tmp_path):
    """As test_writes_while_streaming_never_tear_slices, with three workers gathering
    outside the buffer lock: the buffer re-checks each item against the writer's
    reservation after the copy and redraws what an extend may have overwritten."""
    import sys

    buf = _store(tmp_path / "s", rows=300, episode=30, capacity=600)
    written = 300
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with mb.stream(buf, 64, slice_len=10, prefetch=2, num_batches=200, workers=3) as s:
            for b in s:
                x = b["x"]
                assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones_like(x[:, 1:]))
                assert torch.equal(b["obs"][..., 0].long(), x)
                nxt = b["next_obs"][..., 0].long()
                last = (x % 30) == 29
                assert torch.equal(nxt[~last], x[~last] + 1) and (nxt[last] == -1).all()
                for _ in range(3):
                    _append(buf, written, 10, 30)
                    written += 10
    finally:
        sys.setswitchinterval(interval)
    assert written > 3 * 600


def test_workers_reraise_errors_in_order(tmp_path):
    empty = _store(tmp_path / "e", rows=0)
    s = mb.stream(empty, 4, workers=3)
    with pytest.raises(mb.errors.EmptyBufferError):
        next(s)
    assert list(s) == []
    with pytest.raises(mb.errors.InvalidArgumentError):
        mb.stream(empty, 4, workers=0)


def _batch(tmp_path, **kwargs):
    buf = _store(tmp_path / "b")
    return buf, buf.sample_slices(16, 60, False, torch.Generator().manual_seed(2), **kwargs)


def test_block_layout_views_are_the_batch(tmp_path):
    from mmbuffer._feed.blocks import ALIGN, BlockLayout, PackedBatch

    _, batch = _batch(tmp_path)
    assert not batch.mask.all()  # padded windows: every field is in play
    layout = BlockLayout.of(batch)
    packed = layout.pack(batch)
    assert isinstance(packed, PackedBatch) and isinstance(packed, mb.Batch)
    _same(packed, batch)
    base = packed.block.data_ptr()
    spans = []
    for t in [*packed.data.values(), packed.indices, packed.weights, packed.mask]:
        assert t.untyped_storage().data_ptr() == base  # every tensor is a view into the block
        start = t.data_ptr() - base
        assert start % ALIGN == 0 and t.is_contiguous()
        spans.append((start, start + t.numel() * t.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two overlap
    assert spans[-1][1] <= layout.nbytes == packed.block.numel()
    # to() moves the block once; the copy is a packed batch equal to the original
    moved = packed.to("cpu", non_blocking=False)
    _same(moved, batch)
    assert layout.matches(batch) and not layout.matches(_batch_of(batch, 8))


class _CountCalls(torch.overrides.TorchFunctionMode):
    """Names of the torch functions and tensor methods called inside the block."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_packed_batch_makes_each_view_on_first_use(tmp_path):
    from mmbuffer._feed.blocks import BlockLayout, PackedBatch

    buf, batch = _batch(tmp_path)
    layout = BlockLayout.of(batch)
    block = layout.pack(batch).block
    with _CountCalls() as made:
        packed = PackedBatch(block, layout, batch.written_at)
    assert "as_strided" not in made.calls and "view" not in made.calls  # no view made yet
    with _CountCalls() as made:
        obs, again = packed["obs"], packed["obs"]
    assert made.calls.count("as_strided") == 1 and again is obs  # one view, made once
    assert torch.equal(obs, batch["obs"]) and obs.untyped_storage().data_ptr() == block.data_ptr()
    with _CountCalls() as made:
        packed["reward"]  # a column of the same dtype: no second view of the whole block
    assert made.calls.count("as_strided") == 1 and "view" not in made.calls
    _same(packed, batch)  # data, indices, weights and mask all made on use, all equal
    with pytest.raises(KeyError, match="nope"):
        packed["nope"]
    packed.data = {"obs": torch.zeros(2)}  # a Batch's fields stay assignable
    packed.mask = None
    assert packed["obs"].shape == (2,) and packed.mask is None
    # a batch without a mask (transitions) has none; make_views makes every view at once
    flat = buf.sample(8, torch.Generator().manual_seed(0))
    flat_layout = BlockLayout.of(flat)
    flat_block = flat_layout.pack(flat).block
    with _CountCalls() as made:
        ready = PackedBatch(flat_block, flat_layout).make_views()
    assert made.calls.count("as_strided") == len(flat_layout.entries) and ready.mask is None
    with _CountCalls() as made:
        _same(ready, flat)
    assert "as_strided" not in made.calls


def _batch_of(batch, n):
    return mb.Batch({k: v[:n] for k, v in batch.data.items()}, batch.indices[:n], batch.weights[:n], batch.mask[:n])


def test_packed_batch_crosses_processes_as_one_block(tmp_path):
    import pickle

    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions (as DataLoader does)

    from mmbuffer._feed.blocks import BlockLayout

    _, batch = _batch(tmp_path)
    packed = BlockLayout.of(batch).pack(batch)
    wire = ForkingPickler.dumps(packed)
    assert packed.block.is_shared()  # the block itself went to shared memory: one segment
    assert ForkingPickler.loads(wire).block.is_shared()
    for clone in (pickle.loads(pickle.dumps(packed)), ForkingPickler.loads(ForkingPickler.dumps(packed))):
        _same(clone, batch)
        assert type(clone) is type(packed) and np.array_equal(clone.written_at, batch.written_at)
        assert {t.untyped_storage().data_ptr() for t in clone.data.values()} == {clone.block.data_ptr()}


@pytest.mark.parametrize("kwargs", [{"slice_len": 8}, {"slice_len": 60, "strict": False}, {}])
def test_read_into_a_block_equals_sampling(tmp_path, kwargs):
    from mmbuffer._feed.blocks import BlockLayout, PackedBatch, read_into
    from mmbuffer._read.gather import resolve_keys

    buf = _store(tmp_path / "s")
    spec = mb.samplers.from_flags(kwargs.get("slice_len"), strict=kwargs.get("strict", True))
    names = resolve_keys(buf, None)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    layout = BlockLayout.of(buf.sample(16, g1, sampler=spec))
    buf.sample(16, g2, sampler=spec)
    for hold_lock in (True, False):
        block = layout.empty()
        block.fill_(0xAB)  # stale bytes from an earlier batch must not survive
        got = read_into(buf, spec, 16, names, g1, block=block, layout=layout, hold_lock=hold_lock)
        assert isinstance(got, PackedBatch) and got.block is block
        _same(got, buf.sample(16, g2, sampler=spec))
    # a draw of another shape (here: another size) comes back as a plain batch of its own
    got = read_into(buf, spec, 5, names, g1, block=layout.empty(), layout=layout)
    assert not isinstance(got, PackedBatch)
    _same(got, buf.sample(5, g2, sampler=spec))


class _Fence:
    """A fence that passes when the test says so (a CUDA event's role)."""

    def __init__(self):
        self.passed = threading.Event()

    def synchronize(self):
        self.passed.wait()


def test_ring_waits_for_the_fence_before_handing_a_slot_out_again():
    from mmbuffer._feed.blocks import Ring, Stopped

    ring = Ring(128, 2, pin=False)
    a, b = ring.acquire(), ring.acquire()
    assert a != b and ring.free() == 0
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        ring.acquire(stop)  # none free: gives up once stopped
    fence = _Fence()
    ring.release(a, fence)
    got = []
    t = threading.Thread(target=lambda: got.append(ring.acquire()))
    t.start()
    t.join(0.3)
    assert t.is_alive() and got == []  # slot a is free but its copy has not finished
    fence.passed.set()
    t.join(5)
    assert got == [a]


def test_ring_never_refills_a_slot_its_copy_still_reads():
    """Four threads fill slots of a three-slot ring and hand each to a "copy" that
    checks the slot's bytes later, on another thread; the slot's fence passes only
    after that check. A ring that handed a slot out before its fence passed would
    let a filler overwrite bytes a copy had yet to read."""
    import random

    from mmbuffer._feed.blocks import Ring

    ring = Ring(4096, 3, pin=False)
    errors, done = [], []

    class CopyFence(_Fence):
        def __init__(self, block, token):
            super().__init__()
            threading.Thread(target=self.copy, args=(block, token)).start()

        def copy(self, block, token):
            time.sleep(random.random() * 2e-3)
            if not bool((block == token).all()):
                errors.append(token)
            done.append(token)
            self.passed.set()

    def fill(seed):
        for i in range(40):
            slot = ring.acquire()
            token = (seed * 40 + i) % 251
            ring.blocks[slot].fill_(token)
            ring.release(slot, CopyFence(ring.blocks[slot], token))

    threads = [threading.Thread(target=fill, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for _ in range(3):
        ring.acquire()  # every fence has passed once all three slots are back
    assert len(done) == 160 and errors == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("workers", [1, 3])
def test_cuda_ring_one_block_per_batch(tmp_path, workers):
    buf = _store(tmp_path / "s", priorities=mb.PriorityConfig())
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    batches = []
    with mb.stream(buf, 32, slice_len=60, strict=False, device="cuda", workers=workers, num_batches=60, generator=g1) as s:
        for b in s:
            assert b.block.is_cuda and all(t.untyped_storage().data_ptr() == b.block.data_ptr() for t in b.data.values())
            batches.append(b)  # held: the device blocks are the batch's own, the host slots are reused
    for b in batches:
        _same(b.to("cpu"), buf.sample_slices(32, 60, False, g2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pin_memory_without_device_gives_pinned_blocks(tmp_path):
    buf = _store(tmp_path / "s")
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    for b in mb.stream(buf, 8, slice_len=4, pin_memory=True, num_batches=5, generator=g1, workers=2):
        assert b.block.is_pinned() and b["obs"].is_pinned()
        _same(b, buf.sample_slices(8, 4, generator=g2))
        _same(b.to("cuda", non_blocking=True).to("cpu"), b)


def test_pool_orders_items_by_ticket_and_reraises_in_place():
    """Items come out in ticket order although later tickets finish first; an error
    raised after a ticket surfaces at that ticket's place, one raised before any
    ticket at the next get."""
    from mmbuffer._feed.threads import Pool

    order = threading.Lock()

    def make(ticket, stop):
        with order:
            n = ticket()
        time.sleep(0.02 if n % 3 == 0 else 0)  # ticket 0, 3, ... finish last
        if n == 7:
            raise KeyError(n)
        return n

    p = Pool(make, workers=3, depth=6, limit=None, name="mmbuffer-stream")
    p.start()
    assert [p.get() for _ in range(7)] == list(range(7))
    with pytest.raises(KeyError):
        p.get()
    assert p.failed
    p.close()

    def broken(ticket, stop):
        raise ValueError("before the ticket")

    q = Pool(broken, workers=2, depth=2, limit=None, name="mmbuffer-stream")
    q.start()
    with pytest.raises(ValueError, match="before the ticket"):
        q.get()
    q.close()


@pytest.mark.parametrize("offset", [0, 64, 4096])
def test_block_views_are_the_batch_wherever_the_block_lies(tmp_path, offset):
    """``BlockLayout.views`` builds each tensor from one dtype view of the block (a
    ring's slot lies at an offset in a larger tensor): exactly the batch packed there."""
    from mmbuffer._feed.blocks import BlockLayout

    buf = _store(tmp_path / "s")
    b = buf.sample_slices(8, 4, generator=torch.Generator().manual_seed(1))
    layout = BlockLayout.of(b)
    room = torch.zeros(layout.nbytes + 8192, dtype=torch.uint8)
    block = room[offset : offset + layout.nbytes]
    packed = layout.pack(b, block)
    for k, v in b.data.items():
        assert packed[k].dtype == v.dtype and packed[k].is_contiguous()
        assert torch.equal(packed[k], v), k
    assert torch.equal(packed.indices, b.indices) and torch.equal(packed.weights, b.weights)
    assert torch.equal(packed.mask, b.mask)
    assert room[:offset].count_nonzero() == 0 and room[offset + layout.nbytes :].count_nonzero() == 0
