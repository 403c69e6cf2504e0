"""Resumable ``BufferDataset``: ``state_dict`` mid-pass, a restart, the rest of the pass.

Each test compares a run interrupted and resumed from a saved state (in a new
dataset, loader or process) with the same run uninterrupted: the batches after the
state must be exactly those (same rows, same order, bit for bit), none twice and none
skipped; epoch mode splits over (rank, worker) pairs without overlap. A newer
snapshot, a store whose rows were evicted, and foreign or tampered states are covered
at the end; the remote store's versions are in tests/remote/test_resume_remote.py.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import errors, samplers

BufferDataset = mb.data.BufferDataset
# torchdata 0.11's StatefulDataLoader calls torch.set_vital, which torch 2.13 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def _store(path, rows=400, episode=40, capacity=4096, streams=1, open_tail=False):
    """``x`` is the row's global id; stream ``s`` holds rows ``s * lane + t``."""
    lane = capacity // streams
    with mb.create(path, {"x": ((), "int64"), "obs": ((2,), "float32")}, capacity=capacity, num_streams=streams) as buf:
        for s in range(streams):
            _append(buf, s, s * lane, rows // streams, episode, open_tail)
    return path


def _append(buf, stream, first, rows, episode, open_tail=False):
    x = np.arange(first, first + rows)
    done = (x - x[0]) % episode == episode - 1
    if open_tail:
        done[-1] = False  # the stream's last episode stays open
    buf.extend({"x": x, "obs": np.stack([x, -x], 1).astype("float32"), "truncated": done}, stream=stream,
               final_obs={"obs": np.zeros((int(done.sum()), 2))})


def _equal(a: list[mb.Batch], b: list[mb.Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.indices, y.indices) and all(torch.equal(x.data[k], y.data[k]) for k in x.data) for x, y in zip(a, b))


def _items(batches: list[mb.Batch]) -> list[int]:
    """Item ids of epoch batches: a transition's row, or a window's first row."""
    return [int(v) for b in batches for v in (b["x"] if b["x"].dim() == 1 else b["x"][:, 0])]


calls: list[int] = []


@dataclass(frozen=True)
class Counting(samplers.Uniform):
    """Uniform transitions, counting its draws (to prove skipped batches are not drawn)."""

    def indices(self, snapshot, n, generator, state):  # type: ignore[no-untyped-def]
        calls.append(n)
        return super().indices(snapshot, n, generator, state)


# -- random mode ------------------------------------------------------------------------------------
@pytest.mark.parametrize("slice_len", [None, 4])
def test_random_resume_is_bit_identical_and_draws_only_the_rest(tmp_path, slice_len):
    path = _store(tmp_path / "s")
    spec = Counting() if slice_len is None else samplers.Slices(slice_len=slice_len)

    def dataset():
        return BufferDataset(path, 16, num_batches=12, seed=3, sampler=spec)

    full = list(dataset())
    ds = dataset()
    it = iter(ds)
    head = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(ds.state_dict()))  # JSON-able: it goes into any checkpoint
    assert state["delivered"] == 5 and state["version"] == 1 and len(json.dumps(state)) < 800
    del it, ds
    resumed = dataset()
    resumed.load_state_dict(state)
    calls.clear()
    rest = list(resumed)
    assert len(rest) == 7 and _equal(head + rest, full)
    if slice_len is None:
        assert calls == [16] * 7  # the 5 delivered batches were skipped, never drawn
    assert resumed.state_dict()["delivered"] == 12
    again = list(resumed)  # the next pass is a fresh one: a loaded state resumes one pass
    assert len(again) == 12 and not torch.equal(again[0].indices, full[0].indices)


def test_random_resume_on_a_newer_snapshot_draws_the_rest_from_it(tmp_path):
    path = _store(tmp_path / "s", rows=200)

    def dataset():
        return BufferDataset(path, 64, num_batches=10, seed=1)

    ds = dataset()
    it = iter(ds)
    [next(it) for _ in range(4)]
    state = ds.state_dict()
    del it
    with mb.open(path) as w:
        _append(w, 0, 200, 2000, 40)  # ten times the rows: the newer snapshot is mostly new rows
    runs = []
    for _ in range(2):
        resumed = dataset()
        resumed.load_state_dict(state)
        runs.append(list(resumed))
        assert resumed.state_dict()["generation"] == 2  # the rest came from the newer snapshot
    assert len(runs[0]) == 6 and _equal(runs[0], runs[1])  # the same keys: the same batches again
    drawn = torch.cat([b.indices for b in runs[0]])
    assert int((drawn >= 200).sum()) > len(drawn) // 2 and torch.equal(torch.cat([b["x"] for b in runs[0]]), drawn)


def test_state_dict_needs_a_pass_in_this_process(tmp_path):
    path = _store(tmp_path / "s", rows=100)
    ds = BufferDataset(path, 8, num_batches=4)
    with pytest.raises(errors.InvalidArgumentError, match="iterated in this process"):
        ds.state_dict()
    it = iter(ds)
    assert ds.state_dict()["delivered"] == 0  # a pass started: its state is taken before its first batch too
    next(it)
    state = ds.state_dict()
    other = BufferDataset(path, 8, num_batches=4)
    other.load_state_dict(state)
    assert other.state_dict() == state  # loaded, not yet resumed: saved again as is


# -- under a DataLoader: torchdata's StatefulDataLoader, 2 ranks x 2 workers ----------------------------
def _stateful_run(ds, stop=None, state=None, seed=0):
    """Batches of a StatefulDataLoader over ``ds`` (2 workers), after ``load_state_dict(state)``;
    with ``stop``: the first ``stop`` batches and the loader's state then."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    torch.manual_seed(seed)  # the loader's per-pass seed: another one after a restart
    loader = sdl.StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for b in loader:
        out.append(b)
        if stop is not None and len(out) == stop:
            saved = json.loads(json.dumps(loader.state_dict()))
            return out, saved
    return out, None


@pytest.mark.parametrize("epoch", [True, False])
def test_stateful_dataloader_two_ranks_two_workers(tmp_path, epoch):
    path = _store(tmp_path / "s", rows=997, episode=37)
    with mb.open(path, "r") as ro:
        n = len(ro)
    per_rank = []
    for rank in range(2):
        def dataset(rank=rank):
            return BufferDataset(path, 16, epoch=epoch, num_batches=None if epoch else 10, seed=9, name="r",
                                 rank=rank, world_size=2)

        dataset().reset() if epoch else None
        full, _ = _stateful_run(dataset())
        dataset().reset() if epoch else None
        head, state = _stateful_run(dataset(), stop=5)
        rest, _ = _stateful_run(dataset(), state=state, seed=1)  # a new loader, new worker processes
        assert len(head) == 5 and len(rest) == len(full) - 5
        assert _equal(head + rest, full)
        per_rank.append(full)
    if epoch:  # every (rank, worker) pair its own part: together each transition once
        items = [_items(b) for b in per_rank]
        assert not set(items[0]) & set(items[1])
        assert sorted(items[0] + items[1]) == list(range(n))
        for r in range(2):  # DataLoader alternates workers 0, 1: their items are disjoint too
            w0 = _items(per_rank[r][0::2])
            w1 = _items(per_rank[r][1::2])
            assert not set(w0) & set(w1)


def test_stateful_dataloader_resumes_a_later_epoch_before_a_worker_delivered(tmp_path):
    """The checkpoint comes after the first batch of epoch 1: worker 1 has delivered
    nothing yet, and its state must still name epoch 1 (the one the store's sampler
    files are at), not epoch 0."""
    path = _store(tmp_path / "s", rows=300, episode=30)
    for name in ("a", "b"):  # epoch 0 of both, to its end
        _stateful_run(BufferDataset(path, 16, epoch=True, seed=4, name=name))
    full, _ = _stateful_run(BufferDataset(path, 16, epoch=True, seed=4, name="a"))
    head, state = _stateful_run(BufferDataset(path, 16, epoch=True, seed=4, name="b"), stop=1)
    worker1 = state["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    assert (worker1["delivered"], worker1["epoch"], worker1["num_items"]) == (0, 1, 300)
    rest, _ = _stateful_run(BufferDataset(path, 16, epoch=True, seed=4, name="b"), state=state, seed=1)
    assert _equal(head + rest, full)
    assert sorted(_items(full)) == list(range(300))


def test_worker_count_change_is_refused(tmp_path):
    path = _store(tmp_path / "s", rows=200)
    _, state = _stateful_run(BufferDataset(path, 8, num_batches=20), stop=3)
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    loader = sdl.StatefulDataLoader(BufferDataset(path, 8, num_batches=20), batch_size=None, num_workers=1,
                                    multiprocessing_context="fork")
    loader.load_state_dict(state)
    with pytest.raises(errors.InvalidArgumentError, match=r"state\['num_workers'\]: expected 1 .*got 2"):
        list(loader)
    worker_state = state["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    ds = BufferDataset(path, 8, num_batches=20)
    ds.load_state_dict(worker_state)  # a worker's state, iterated in one process
    with pytest.raises(errors.InvalidArgumentError, match=r"state\['worker'\]: expected 0 .*got 1"):
        list(ds)


# -- epoch mode on a newer snapshot ------------------------------------------------------------------
@pytest.mark.parametrize("slice_len", [None, 3])
def test_epoch_resumes_on_a_newer_snapshot_with_the_items_it_started_on(tmp_path, slice_len):
    """After the state, the writer grows the open episodes and adds new ones (a newer
    commit): the resumed epoch serves exactly the items of the snapshot it started on,
    at the same rows, in the same order; the new items come in the next epoch."""
    path = _store(tmp_path / "s", rows=300, episode=25, capacity=2048, streams=2, open_tail=True)

    def dataset(name="e"):
        return BufferDataset(path, 8, slice_len, epoch=True, seed=2, name=name)

    full = list(dataset("reference"))  # uninterrupted, on the old snapshot
    ds = dataset()
    it = iter(ds)
    head = [next(it) for _ in range(4)]
    state = ds.state_dict()
    assert len(state["lanes"]) == 2 and state["generation"] == 1
    del it, ds
    with mb.open(path) as w:
        for s in range(2):  # the open episode grows, then new episodes
            _append(w, s, s * 1024 + 150, 60, 25)
    resumed = dataset()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert _equal(head + rest, full)
    with mb.open(path, "r") as ro:
        grown = mb.EpochSampler(ro, 8, slice_len, name="probe").__len__()
    next_epoch = list(resumed)
    assert len(next_epoch) == grown and len(_items(next_epoch)) > len(_items(full))


def test_epoch_state_whose_items_were_evicted_is_refused(tmp_path):
    path = _store(tmp_path / "s", rows=200, episode=20, capacity=256)
    ds = BufferDataset(path, 8, epoch=True)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    with mb.open(path) as w:  # the ring wraps: the oldest episodes are evicted
        _append(w, 0, 200, 100, 20)
    resumed = BufferDataset(path, 8, epoch=True)
    resumed.load_state_dict(state)
    with pytest.raises(errors.RowNotLiveError, match=r"stream 0: expected the epoch's 200 items from row 0"):
        list(resumed)


@pytest.mark.parametrize("epoch", [False, True])
def test_state_of_a_store_rolled_back_or_recreated_is_refused(tmp_path, epoch):
    path = _store(tmp_path / "s", rows=100)
    with mb.open(path) as w:
        _append(w, 0, 100, 20, 20)  # generation 2
    ds = BufferDataset(path, 8, epoch=epoch, num_batches=4)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    import shutil

    shutil.rmtree(path)
    _store(path, rows=120)  # another store at the path, generation 1
    resumed = BufferDataset(path, 8, epoch=epoch, num_batches=4)
    resumed.load_state_dict(state)
    with pytest.raises(errors.RowNotLiveError, match="generation 2"):
        list(resumed)


def test_epoch_state_on_other_data_at_the_same_rows_is_refused(tmp_path):
    """A store re-created at the path with the same streams, rows and generation, but
    other values: the fingerprint of each stream's first and last items tells them apart."""
    path = _store(tmp_path / "s", rows=100, streams=2)
    ds = BufferDataset(path, 8, epoch=True)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    import shutil

    shutil.rmtree(path)
    with mb.create(path, {"x": ((), "int64"), "obs": ((2,), "float32")}, capacity=4096, num_streams=2) as buf:
        _append(buf, 0, 0, 50, 40)
        x = np.arange(2048, 2098)
        buf.extend({"x": x, "obs": np.stack([x, x], 1).astype("float32"),  # obs differs: [x, x], not [x, -x]
                    "truncated": (x - 2048) % 40 == 39}, stream=1, final_obs={"obs": np.zeros((1, 2))})
    with mb.open(path, "r") as ro:
        assert ro.generation == state["generation"] and ro.view().first_starts.tolist() == [0, 0]
        assert [n for _, n, _ in state["lanes"]] == ro.view().transitions.tolist()  # same rows counts
    resumed = BufferDataset(path, 8, epoch=True)
    resumed.load_state_dict(state)
    with pytest.raises(errors.RowNotLiveError, match="stream 1: expected the data fingerprinted"):
        list(resumed)


# -- foreign or tampered states ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("version", 2, "expected 1"),
        ("kind", "torch.utils.data.Dataset", "expected 'mmbuffer.data.BufferDataset'"),
        ("seed", 4, "expected 3"),
        ("batch_size", 9, "expected 8"),
        ("slice_len", 2, "expected None"),
        ("mode", "epoch", "expected 'random'"),
        ("sampler", "Prioritized(beta=0.4)", r"expected 'Uniform\(\)'"),
        ("store", "/elsewhere", "expected '"),
        ("delivered", -1, r"expected an integer in \[0, 2\*\*63\)"),
        ("delivered", "5", r"expected an integer"),
        ("pass_key", True, r"expected an integer"),
        ("worker", 2, r"expected an integer in \[0, 1\)"),
        ("lanes", [[0, 100, 5]], "expected \\[first row, items, fingerprint\\]"),
        ("position", 10**20, "expected an integer"),
    ],
)
def test_foreign_or_tampered_state_is_refused(tmp_path, field, value, message):
    path = _store(tmp_path / "s", rows=100)
    ds = BufferDataset(path, 8, seed=3, num_batches=4)
    it = iter(ds)
    next(it)
    good = ds.state_dict()
    target = BufferDataset(path, 8, seed=3, num_batches=4)
    with pytest.raises(errors.InvalidArgumentError, match=rf"state\['{field}'\]: {message}"):
        target.load_state_dict({**good, field: value})
    with pytest.raises(errors.InvalidArgumentError, match="iterated in this process"):
        target.state_dict()  # a refused load changes nothing
    for bad in ({**good, "extra": 1}, {k: v for k, v in good.items() if k != "lanes"}):
        with pytest.raises(errors.InvalidArgumentError, match="state: expected the keys"):
            target.load_state_dict(bad)
    with pytest.raises(errors.InvalidArgumentError, match="state: expected a dict"):
        target.load_state_dict([1, 2])  # type: ignore[arg-type]


def test_rank_mismatch_is_refused_when_the_pass_starts(tmp_path):
    path = _store(tmp_path / "s", rows=100)
    ds = BufferDataset(path, 8, num_batches=4, rank=0, world_size=2)
    it = iter(ds)
    next(it)
    other = BufferDataset(path, 8, num_batches=4, rank=1, world_size=2)
    other.load_state_dict(ds.state_dict())
    with pytest.raises(errors.InvalidArgumentError, match=r"state\['rank'\]: expected 1 .*got 0"):
        list(other)


# -- real processes: two gloo ranks, killed mid-epoch, restarted from their saved states --------------------
def _rank(rank: int, path: str, out: str, phase: str) -> None:
    import os

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{out}/rdv-{phase}", rank=rank, world_size=2)
        ds = BufferDataset(path, 10, 4, epoch=True, seed=5, name=phase if phase == "full" else "run")
        got = []
        if phase == "resume":
            ds.load_state_dict(json.loads(Path(out, f"state{rank}.json").read_text()))
        for b in ds:
            got.append(b.indices.tolist())
            if phase == "head" and len(got) == 3:
                Path(out, f"state{rank}.json").write_text(json.dumps(ds.state_dict()))
                break
        Path(out, f"{phase}{rank}.json").write_text(json.dumps(got))
        dist.barrier()
        if phase == "head":
            os._exit(0)  # a crash: no cleanup, no close
        dist.destroy_process_group()
    except BaseException:
        Path(out, f"{phase}{rank}.err").write_text(traceback.format_exc())
        raise


def test_two_processes_resume_after_a_restart(tmp_path):
    path = _store(tmp_path / "s", rows=480, episode=30, streams=2)
    out = tmp_path / "out"
    out.mkdir()
    ctx = mp.get_context("fork")
    results = {}
    for phase in ("full", "head", "resume"):
        procs = [ctx.Process(target=_rank, args=(r, str(path), str(out), phase)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
        errs = [f.read_text() for f in out.glob("*.err")]
        assert not errs, errs[0]
        assert all(p.exitcode == 0 for p in procs)
        results[phase] = [json.loads((out / f"{phase}{r}.json").read_text()) for r in range(2)]
    starts = []
    for r in range(2):
        assert len(results["head"][r]) == 3
        assert results["head"][r] + results["resume"][r] == results["full"][r]
        starts.append({w[0] for b in results["full"][r] for w in b})
    assert not starts[0] & starts[1]
    with mb.open(path, "r") as ro:
        assert len(starts[0]) + len(starts[1]) == len(mb.EpochSampler(ro, 1, 4, name="count"))
