"""Minari, TorchRL and Tianshou readers keep what they read or refuse it by name: every flag a
converter sets is recorded, every one of them (the source's flags are recoverable exactly), and a
flag the source leaves ambiguous (TorchRL's ``("next", "done")`` alone) is refused unless the user
says what it means. Real data: a Minari DataCollector on a gymnasium env, a TorchRL collector."""

from __future__ import annotations

import re
import warnings

import h5py
import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer._cli.main import main
from mmbuffer.convert import ConversionWarning, convert
from mmbuffer.errors import ConversionError, InvalidArgumentError

gym = pytest.importorskip("gymnasium")


def _listing(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _store_flags(path) -> tuple[np.ndarray, np.ndarray]:
    with mb.open(path, mode="r") as buf:
        n = int(buf.view().written[0])
        got = buf.get(np.arange(n), keys=["terminated", "truncated"])
        return got["terminated"].numpy().astype(bool), got["truncated"].numpy().astype(bool)


# -- Minari: an episode with neither flag ------------------------------------------------------------
def _collect_minari(tmp_path, monkeypatch, episodes: int) -> str:
    minari = pytest.importorskip("minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    env = gym.make("CartPole-v1", max_episode_steps=2)  # short episodes: many of them, quickly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collector = minari.DataCollector(env)
        collector.action_space.seed(0)
        for i in range(episodes):
            collector.reset(seed=i)
            while True:
                *_, term, trunc, _ = collector.step(collector.action_space.sample())
                if term or trunc:
                    break
        collector.create_dataset(dataset_id="cartpole/flags-v0", algorithm_name="random", author="t",
                                 author_email="t@x", code_permalink="x", description="test")
        collector._tmp_dir.cleanup()  # noqa: SLF001 - see tests/convert/test_convert.py::make_minari
        collector.env.close()
    return str(tmp_path / "minari" / "cartpole" / "flags-v0" / "data" / "main_data.hdf5")


@pytest.mark.slow
def test_minari_every_episode_without_an_end_flag_is_recorded(tmp_path, monkeypatch):
    """More than the 1,024 episodes the record used to stop at: all of them, so the source's
    flags are recovered exactly from the store alone."""
    n = 1080
    src = _collect_minari(tmp_path, monkeypatch, n)
    unflagged = [i for i in range(n) if i % 40]  # 1,053 episodes stop with neither flag
    src_flags: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    with h5py.File(src, "a") as f:
        for i in range(n):
            g = f[f"episode_{i}"]
            term, trunc = g["terminations"][()].astype(bool), g["truncations"][()].astype(bool)
            if i in unflagged:
                term[-1] = trunc[-1] = False
                g["terminations"][...], g["truncations"][...] = term, trunc
            src_flags[i] = term, trunc
    assert len(unflagged) > 1024
    with pytest.warns(ConversionWarning, match="episode 1 ends with neither terminated nor truncated"):
        s = convert("minari", "cartpole/flags-v0", tmp_path / "s", progress=False)
    assert s["forced_truncations"] == len(unflagged) and s["forced_truncation_episodes"] == unflagged
    with mb.open(tmp_path / "s", mode="r") as buf:
        recorded = buf.attrs["convert"]["stats"]["forced_truncation_episodes"]
        starts, lengths = (x.numpy() for x in buf.episodes())
    assert recorded == unflagged
    term, trunc = _store_flags(tmp_path / "s")
    assert len(starts) == n
    for i, (a, t) in enumerate(zip(starts.tolist(), lengths.tolist())):  # store episode i is Minari episode i
        want_term, want_trunc = src_flags[i]
        got_trunc = trunc[a : a + t].copy()
        assert got_trunc[-1] or term[a + t - 1]  # the store's episode ends with a flag
        if i in recorded:  # the record undoes exactly what the converter set
            got_trunc[-1] = False
        np.testing.assert_array_equal(term[a : a + t], want_term)
        np.testing.assert_array_equal(got_trunc, want_trunc)


# -- TorchRL: a real collector's dump ------------------------------------------------------------------
def _collector_dump(path, *, drop_flags: bool = False):
    """Two CartPole envs, batches of [2, 20] flattened into a replay buffer (env 0's 20 rows, then
    env 1's): ``collector/traj_ids`` changes between the blocks with no flag set."""
    with warnings.catch_warnings():  # torchrl's own deprecation warnings, at import and construction
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("torchrl")
        import torch
        from torchrl.collectors import Collector
        from torchrl.data import LazyMemmapStorage, ReplayBuffer
        from torchrl.envs import GymEnv, SerialEnv

        torch.manual_seed(0)
        env = SerialEnv(2, lambda: GymEnv("CartPole-v1"))
        env.set_seed(0)
        collector = Collector(env, policy=None, frames_per_batch=40, total_frames=200, split_trajs=False)
        rb = ReplayBuffer(storage=LazyMemmapStorage(1000))
        rows = []
        for batch in collector:
            flat = batch.reshape(-1)
            if drop_flags:  # what an older or hand-made dump holds: ("next", "done") only
                flat = flat.exclude("terminated", "truncated", ("next", "terminated"), ("next", "truncated"))
            rows.append(flat.clone())
            rb.extend(flat)
        collector.shutdown()
        rb.dumps(path)
    return torch.cat(rows)


def _flag(td, *key) -> np.ndarray:
    return td.get(key).numpy().reshape(-1).astype(bool)


def test_torchrl_trajectory_cuts_are_all_recorded_and_the_flags_recoverable(tmp_path):
    src = _collector_dump(tmp_path / "rb")
    n = src.batch_size[0]
    traj = src.get(("collector", "traj_ids")).numpy().reshape(-1)
    term, trunc = _flag(src, "next", "terminated"), _flag(src, "next", "truncated")
    cuts = np.flatnonzero((traj[1:] != traj[:-1]) & ~(term | trunc)[:-1])
    assert len(cuts) > 8  # more than the warning names: the record holds them all
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = mb.convert.convert("torchrl", tmp_path / "rb", tmp_path / "s", chunk_rows=7, progress=False)
    notes = [str(w.message) for w in caught if w.category is ConversionWarning]
    assert any(re.search(r"traj_ids changes where no flag is set.*"
                         + re.escape(f"({len(cuts)} rows, first {cuts[:8].tolist()}"), m) for m in notes), notes
    assert s["verified"] and s["rows"] == n and s["forced_truncations"] == len(cuts)
    with mb.open(tmp_path / "s", mode="r") as buf:
        recorded = buf.attrs["torchrl"]["forced_truncation_rows"]
        got = buf.get(np.arange(n), keys=["obs", "collector/traj_ids"])
    assert recorded == cuts.tolist()
    np.testing.assert_array_equal(got["obs"].numpy(), src.get("observation").numpy())
    np.testing.assert_array_equal(got["collector/traj_ids"].numpy().reshape(-1), traj)
    got_term, got_trunc = _store_flags(tmp_path / "s")
    assert got_trunc[recorded].all() and not trunc[recorded].any()  # set by the converter, recorded
    got_trunc[recorded] = False  # the record undoes exactly what the converter set
    np.testing.assert_array_equal(got_term, term)
    np.testing.assert_array_equal(got_trunc[:-1], trunc[:-1])  # the last row: the data stops (flat.py)


def test_torchrl_done_alone_is_refused_unless_the_user_says_what_it_means(tmp_path, capsys):
    src = _collector_dump(tmp_path / "rb", drop_flags=True)
    done = _flag(src, "next", "done")
    assert done.any() and ("next", "terminated") not in src.keys(True)
    before = _listing(tmp_path)
    with pytest.raises(ConversionError, match=r"\[next/done\]: expected 'next/terminated' or 'next/truncated' "
                                              r"beside 'next/done', got 'next/done' only.*"
                                              r"done_means='terminated' \(--done-means terminated\)"):
        mb.convert.convert("torchrl", tmp_path / "rb", tmp_path / "s", progress=False)
    assert main(["convert", "torchrl", str(tmp_path / "rb"), str(tmp_path / "s"), "--no-progress"]) == 2
    assert "next/done" in capsys.readouterr().err
    assert _listing(tmp_path) == before  # a refusal leaves nothing on disk
    with pytest.raises(InvalidArgumentError, match="done_means: expected one of"):
        mb.convert.convert("torchrl", tmp_path / "rb", tmp_path / "s", done_means="done", progress=False)
    # a format without the option refuses the flag by name
    assert main(["convert", "npz", str(tmp_path / "rb"), str(tmp_path / "s"), "--done-means", "terminated"]) == 2
    assert "--done-means: not an option of format 'npz'" in capsys.readouterr().err
    assert _listing(tmp_path) == before

    for means, flag in (("terminated", "--done-means=terminated"), ("truncated", "--done-means=truncated")):
        dst = tmp_path / means
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionWarning)
            assert main(["convert", "torchrl", str(tmp_path / "rb"), str(dst), flag, "--no-progress"]) == 0
        with mb.open(dst, mode="r") as buf:
            assert buf.attrs["torchrl"]["done_means"] == means
            forced = buf.attrs["torchrl"]["forced_truncation_rows"]
        got_term, got_trunc = _store_flags(dst)
        got_trunc[forced] = False
        got_trunc[-1] &= bool(done[-1])  # the data stops there: closed as truncated (flat.py)
        np.testing.assert_array_equal(got_term if means == "terminated" else got_trunc, done)
        assert not (got_trunc if means == "terminated" else got_term).any()


# -- Tianshou: a sub-buffer that stops inside an episode ------------------------------------------------
def test_tianshou_forced_truncations_are_recoverable_to_the_source_row(tmp_path):
    from test_formats import rollout, write_tianshou  # what VectorReplayBuffer.save_hdf5 writes

    envs = rollout(3, 70, seed=4)
    for e in envs[0], envs[2]:  # these two environments were mid-episode when the buffer was saved
        e["terminated"][-1] = e["truncated"][-1] = e["done"][-1] = False
    write_tianshou(tmp_path / "buf.hdf5", envs, 50, str(tmp_path / "pwned"))  # rings of 50: two wrapped
    with pytest.warns(ConversionWarning, match=r"sub-buffer\(s\) end inside an episode.*forced_truncation_rows"):
        s = convert("tianshou", tmp_path / "buf.hdf5", tmp_path / "s", drop_unsupported=True, progress=False)
    with mb.open(tmp_path / "s", mode="r") as buf:
        rows = buf.attrs["tianshou"]["forced_truncation_rows"]
        src_rows = buf.attrs["tianshou"]["forced_truncation_source_rows"]
    with h5py.File(tmp_path / "buf.hdf5", "r") as f:
        meta_term, meta_trunc = f["_meta/terminated"][()], f["_meta/truncated"][()]
        last = f["last_index"][()].tolist()
    assert s["forced_truncations"] == len(rows) == len(src_rows) == 2
    assert set(src_rows) <= set(last)  # each one the latest row of its sub-buffer
    got_term, got_trunc = _store_flags(tmp_path / "s")
    for r, q in zip(rows, src_rows):  # the store's row r is _meta row q: unflagged in the source
        assert got_trunc[r] and not meta_trunc[q] and not meta_term[q] and got_term[r] == meta_term[q]
    got_trunc[rows] = False
    kept = [{k: v[len(v) - min(70, 50):] for k, v in e.items()} for e in envs]
    np.testing.assert_array_equal(got_trunc, np.concatenate([e["truncated"] for e in kept]))
    np.testing.assert_array_equal(got_term, np.concatenate([e["terminated"] for e in kept]))
