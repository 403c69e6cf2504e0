"""Conversion tools: D4RL, Minari, npz, TorchRL / TD-MPC2 in; D4RL, Minari, copies out.

Every source is made here (gymnasium rollouts, Minari's own writers, TorchRL's
own ``dumps``); nothing is downloaded.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer.convert import ConversionWarning, convert, convert_d4rl, convert_minari, convert_npz, convert_torchrl, copy, export_d4rl, export_minari
from mmbuffer.errors import ConversionError, InvalidArgumentError, StoreExistsError

gym = pytest.importorskip("gymnasium")


# -- sources -----------------------------------------------------------------------------------
def collect(env_id: str, n_episodes: int, *, max_steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random-policy episodes: obs [T+1], action [T], reward [T], terminated [T], truncated [T]."""
    env = gym.make(env_id, max_episode_steps=max_steps)
    env.action_space.seed(seed)
    out = []
    for i in range(n_episodes):
        obs, _ = env.reset(seed=seed + i)
        o, a, r, te, tr = [obs], [], [], [], []
        while True:
            act = env.action_space.sample()
            obs, rew, term, trunc, _ = env.step(act)
            o.append(obs)
            a.append(act)
            r.append(rew)
            te.append(term)
            tr.append(trunc)
            if term or trunc:
                break
        out.append(_episode(o, a, r, te, tr))
    env.close()
    return out


def _episode(o, a, r, te, tr) -> dict[str, np.ndarray]:
    return {
        "obs": np.asarray(o, dtype=np.float32),
        "action": np.asarray(a),
        "reward": np.asarray(r, dtype=np.float32),
        "terminated": np.asarray(te, bool),
        "truncated": np.asarray(tr, bool),
    }


def write_d4rl(path: Path, episodes, *, next_obs: bool = True, infos: bool = True, open_tail: bool = False) -> None:
    cat = lambda k: np.concatenate([e[k] for e in episodes])  # noqa: E731
    term, trunc = cat("terminated"), cat("truncated")
    if open_tail:
        term[-1] = trunc[-1] = False
    with h5py.File(path, "w") as f:
        f["observations"] = np.concatenate([e["obs"][:-1] for e in episodes])
        f["actions"] = cat("action")
        f["rewards"] = cat("reward")
        f["terminals"] = term
        f["timeouts"] = trunc
        if next_obs:
            f["next_observations"] = np.concatenate([e["obs"][1:] for e in episodes])
        if infos:
            f["infos/step"] = np.concatenate([np.arange(len(e["reward"])) for e in episodes])
        f["metadata/algorithm"] = "random"
        f["metadata/seed"] = 3


@pytest.fixture(scope="module")
def cartpole():
    # max 30 steps: some episodes terminate (pole falls), some are cut by the time limit
    eps = collect("CartPole-v1", 12, max_steps=30)
    assert any(e["terminated"][-1] for e in eps) and any(e["truncated"][-1] for e in eps)
    return eps


def store_episodes(path) -> list[dict[str, np.ndarray]]:
    """Complete episodes of a store, obs with T+1 rows like the sources above."""
    with mb.open(str(path), mode="r") as buf:
        starts, lengths = buf.episodes()
        out = []
        for s, n in zip(starts.tolist(), lengths.tolist()):
            idx = torch.arange(s, s + n)
            d = {k: v.numpy() for k, v in buf.get(idx, keys=["obs", "next_obs", "action", "reward",
                                                             "terminated", "truncated"]).items()}
            out.append({
                "obs": np.concatenate([d["obs"], d["next_obs"][-1:]]),
                "action": d["action"], "reward": d["reward"],
                "terminated": d["terminated"], "truncated": d["truncated"],
            })
        return out


def assert_same_episodes(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for k in ("obs", "action", "reward", "terminated", "truncated"):
            np.testing.assert_array_equal(g[k], np.asarray(w[k]).astype(g[k].dtype), err_msg=k)


def read_all(path) -> dict[str, np.ndarray]:
    """Every written row (open episode included) of a one-lane store, with next values."""
    with mb.open(str(path), mode="r") as buf:
        n = buf.view().written[0]
        keys = [c for c in buf.columns] + [f"next_{k}" for k in buf.next_keys]
        return {k: v.numpy() for k, v in buf.get(torch.arange(int(n)), keys=keys).items()}


# -- D4RL -------------------------------------------------------------------------------------
def test_d4rl_keeps_episodes_flags_and_final_obs(tmp_path, cartpole):
    src = tmp_path / "cartpole.hdf5"
    write_d4rl(src, cartpole)
    summary = convert_d4rl(src, tmp_path / "store", progress=False, chunk_rows=37)
    assert summary["verified"]
    assert summary["rows"] == sum(len(e["reward"]) for e in cartpole)
    assert summary["episodes"] == len(cartpole)
    assert summary["open_episode_rows"] == 0 and summary["nan_rewards"] == 0
    assert summary["next_obs_mismatch_rows"] == 0
    # lossless by default: infos/* are kept as columns, next observations derived (all agree)
    assert set(summary["checksums"]) == {"obs", "action", "reward", "terminated", "truncated", "infos/step"}
    assert_same_episodes(store_episodes(tmp_path / "store"), cartpole)
    with mb.open(str(tmp_path / "store"), mode="r") as buf, h5py.File(src) as f:
        assert buf.next_keys == ("obs",) and "next/obs" not in buf.columns
        assert buf.attrs["next_obs"] == {"source": "derived", "mode": "auto"}
        np.testing.assert_array_equal(buf.read_range("infos/step", 0, len(buf)), f["infos/step"][()])
        assert buf.attrs["source_format"] == "d4rl"
        assert buf.attrs["source_metadata"]["algorithm"] == "random"
        assert buf.attrs["final_obs_source"] == "next"
        assert buf.attrs["convert"]["checksums"] == summary["checksums"]
    assert not (tmp_path / "store.partial").exists()


def test_d4rl_without_next_observations_is_refused_by_name(tmp_path, cartpole):
    """Each episode's final observation is unknown: refused, never zeros in its place;
    nothing is written."""
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole, next_obs=False)
    with pytest.raises(ConversionError, match=r"\[observations\].*no next observations for \['obs'\].*--drop-last-transition"):
        convert_d4rl(src, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()


def test_d4rl_without_next_observations_drops_last_transitions_when_asked(tmp_path, cartpole):
    """``drop_last_transition=True``: each episode keeps its rows but the last, the row
    before ends it (truncated) and the dropped row's observation is its final
    observation, as d4rl.qlearning_dataset pairs them; infos follow their rows."""
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole, next_obs=False)
    s = convert_d4rl(src, tmp_path / "s", progress=False, chunk_rows=7, drop_last_transition=True)
    kept = [e for e in cartpole if len(e["reward"]) > 1]
    assert s["dropped_last_transitions"] == len(cartpole) and s["episodes"] == len(kept)
    assert s["rows"] == sum(len(e["reward"]) - 1 for e in cartpole)
    with mb.open(str(tmp_path / "s"), mode="r") as buf:
        assert buf.attrs["final_obs_source"] == "next_row" and buf.attrs["dropped_last_transitions"] == len(cartpole)
        assert buf.columns["infos/step"].dtype == "int64"
        episodes = list(buf.iter_episodes(["obs", "next_obs", "terminated", "truncated", "infos/step"]))
    assert len(episodes) == len(kept)
    for got, e in zip(episodes, kept):
        t = len(e["reward"]) - 1  # rows kept
        np.testing.assert_array_equal(got["obs"].numpy(), e["obs"][:t])
        np.testing.assert_array_equal(got["next_obs"].numpy(), e["obs"][1 : t + 1])  # the last: the dropped row's obs
        assert got["truncated"].tolist() == [False] * (t - 1) + [True] and not got["terminated"].any()
        assert got["infos/step"].tolist() == list(range(t))


def _with_dropped_frames(src: Path, rows: list[int]) -> np.ndarray:
    """Make next_observations[row] differ from observations[row + 1] (a dropped frame) at ``rows``."""
    with h5py.File(src, "a") as f:
        nxt = f["next_observations"][()]
        nxt[rows] += 0.5
        f["next_observations"][...] = nxt
    return nxt


@pytest.mark.parametrize("scan_bytes", [None, 1])
def test_d4rl_next_observations_that_differ_are_kept_by_default(tmp_path, cartpole, monkeypatch, scan_bytes):
    """A file whose next_observations differ from the following row inside an episode keeps
    them: the store holds the file's next observations (an explicit next/obs column), never
    derived ones that differ from the file. (scan_bytes=1: the comparison reads one row at a
    time, so every row is compared across a slice boundary.)"""
    if scan_bytes:
        monkeypatch.setattr("mmbuffer.convert._pipeline.flat.SCAN_BYTES", scan_bytes)
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    # rows inside the first and second episodes (not their last rows)
    rows = [2, 5, len(cartpole[0]["reward"]) + 1]
    nxt = _with_dropped_frames(src, rows)
    with pytest.warns(ConversionWarning, match=r"3 rows have a next observation.*first rows \[2, 5, \d+\].*"
                                                r"kept as the explicit column.*derive_next=True"):
        s = convert_d4rl(src, tmp_path / "s", progress=False, chunk_rows=7)
    assert s["verified"] and s["next_obs_mismatch_rows"] == 3 and "next/obs" in s["checksums"]
    with mb.open(str(tmp_path / "s"), mode="r") as buf:
        assert buf.next_keys == () and "next/obs" in buf.columns
        assert buf.attrs["next_obs"]["source"] == "explicit"
        assert buf.attrs["next_obs"]["mismatch_rows"] == 3 and buf.attrs["next_obs"]["first_rows"] == rows
        with pytest.raises(mb.errors.InvalidArgumentError, match="next_obs"):
            buf.get(torch.arange(3), keys=["next_obs"])  # no derived next_obs that would differ from the file
    got = read_all(tmp_path / "s")
    np.testing.assert_array_equal(got["next/obs"], nxt)  # the file's values, every row
    assert not np.array_equal(got["next/obs"][rows], got["obs"][[r + 1 for r in rows]])


def test_d4rl_next_observations_are_compared_byte_for_byte(tmp_path, cartpole):
    """-0.0 against 0.0 is a difference (deriving would store the following row's 0.0 in
    place of the file's -0.0); a NaN against the same NaN is not."""
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    with h5py.File(src, "a") as f:
        obs, nxt = f["observations"][()], f["next_observations"][()]
        obs[3, 0], nxt[2, 0] = 0.0, -0.0  # row 2's next observation is row 3's, but for its sign
        obs[6, 1] = nxt[5, 1] = np.float32("nan")  # the same bits
        f["observations"][...], f["next_observations"][...] = obs, nxt
    with pytest.warns(ConversionWarning, match=r"1 rows have a next observation.*first rows \[2\]"):
        s = convert_d4rl(src, tmp_path / "s", progress=False)
    assert s["next_obs_mismatch_rows"] == 1
    got = read_all(tmp_path / "s")
    assert got["next/obs"].tobytes() == nxt.tobytes()  # -0.0 and the NaN kept, bit for bit


def test_d4rl_next_observations_of_another_dtype_are_kept(tmp_path):
    """float64 next observations of float32 observations agree inside the episode, but a
    derived column would store the final one as float32 (0.1 became 0.10000000149):
    they are kept as the explicit column, in their own dtype."""
    n = 10
    obs = np.repeat(np.arange(n, dtype=np.float32)[:, None], 2, axis=1)
    nxt = np.vstack([obs[1:], [[0.1, 0.2]]]).astype(np.float64)
    src = tmp_path / "f.hdf5"
    with h5py.File(src, "w") as f:
        f["observations"], f["next_observations"] = obs, nxt
        f["actions"], f["rewards"] = np.zeros((n, 1), np.float32), np.zeros(n, np.float32)
        f["terminals"], f["timeouts"] = np.arange(n) == n - 1, np.zeros(n, bool)
    with pytest.warns(ConversionWarning, match=r"next observations of dtype \{'obs': 'float64'\}.*kept as the explicit"):
        s = convert_d4rl(src, tmp_path / "s", progress=False)
    assert s["next_obs_mismatch_rows"] == 0
    got = read_all(tmp_path / "s")
    assert got["next/obs"].dtype == np.float64 and got["next/obs"].tobytes() == nxt.tobytes()
    # derived as asked: the final observation the float32 column cannot hold is a counted loss
    with pytest.warns(ConversionWarning, match=r"derive_next=True: 1 rows .*dtype cannot hold"):
        s = convert_d4rl(src, tmp_path / "d", derive_next=True, progress=False)
    assert s["next_obs_mismatch_rows"] == 1


@pytest.mark.parametrize("derive", [False, True])
def test_d4rl_dict_observations_count_a_row_once_and_round_trip(tmp_path, derive):
    """observations/<leaf> groups: a row whose leaves both differ counts once; kept, every
    leaf comes back byte for byte from the export."""
    n, rng = 12, np.random.default_rng(0)
    src = tmp_path / "d.hdf5"
    with h5py.File(src, "w") as f:
        for leaf, dim in (("pos", 3), ("vel", 2)):
            states = rng.random((n + 1, dim), dtype=np.float32)
            nxt = states[1:].copy()
            nxt[4] += 1  # both leaves differ at row 4
            f[f"observations/{leaf}"], f[f"next_observations/{leaf}"] = states[:-1], nxt
        f["actions"] = rng.random((n, 1), dtype=np.float32)
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"] = np.arange(n) == n - 1
        f["timeouts"] = np.zeros(n, bool)
    with pytest.warns(ConversionWarning, match="derive_next=True: 1 rows" if derive else "1 rows have a next"):
        s = convert_d4rl(src, tmp_path / "s", derive_next=derive, progress=False)
    assert s["next_obs_mismatch_rows"] == 1
    if derive:
        assert not any(k.startswith("next/") for k in s["checksums"])
        return
    assert {"next/obs/pos", "next/obs/vel"} <= set(s["checksums"])
    export_d4rl(tmp_path / "s", tmp_path / "back.hdf5", progress=False)
    with h5py.File(src) as f, h5py.File(tmp_path / "back.hdf5") as g:
        for key in ("observations/pos", "observations/vel", "next_observations/pos", "next_observations/vel"):
            assert g[key][()].tobytes() == f[key][()].tobytes() and g[key].dtype == f[key].dtype, key


def test_d4rl_derive_next_is_the_explicit_opt_in(tmp_path, cartpole):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    rows = [2, 5]
    _with_dropped_frames(src, rows)
    with pytest.warns(ConversionWarning, match="derive_next=True: 2 rows"):
        s = convert_d4rl(src, tmp_path / "s", derive_next=True, progress=False)
    assert s["next_obs_mismatch_rows"] == 2 and "next/obs" not in s["checksums"]
    got = read_all(tmp_path / "s")
    assert "next/obs" not in got
    np.testing.assert_array_equal(got["next_obs"][rows], got["obs"][[r + 1 for r in rows]])  # derived, as asked
    with pytest.raises(ConversionError, match="derive_next=True and keep_next_obs=True"):
        convert_d4rl(src, tmp_path / "t", derive_next=True, keep_next_obs=True, progress=False)
    assert not (tmp_path / "t").exists()
    # keep_next_obs keeps the column even when nothing differs
    write_d4rl(tmp_path / "ok.hdf5", cartpole)
    s = convert_d4rl(tmp_path / "ok.hdf5", tmp_path / "k", keep_next_obs=True, progress=False)
    assert s["next_obs_mismatch_rows"] == 0 and "next/obs" in s["checksums"]


def test_d4rl_drop_infos_and_the_deprecated_keep_infos(tmp_path, cartpole):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    s = convert_d4rl(src, tmp_path / "d", drop_infos=True, progress=False)
    assert "infos/step" not in s["checksums"] and s["dropped_keys"] == ["infos/step"]
    s = convert_d4rl(src, tmp_path / "f", keep_infos=False, progress=False)  # the old default, asked for
    assert "infos/step" not in s["checksums"] and s["dropped_keys"] == ["infos/step"]
    s = convert_d4rl(src, tmp_path / "k", keep_infos=True, progress=False)  # the default now
    assert "infos/step" in s["checksums"] and "dropped_keys" not in s
    with pytest.raises(ConversionError, match="keep_infos=True and drop_infos=True"):
        convert_d4rl(src, tmp_path / "x", keep_infos=True, drop_infos=True, progress=False)


def test_d4rl_non_numeric_dataset_is_refused_by_name_unless_dropped(tmp_path, cartpole):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    n = sum(len(e["reward"]) for e in cartpole)
    with h5py.File(src, "a") as f:
        f["infos/label"] = np.array([b"x"] * n, dtype="S1")
    with pytest.raises(ConversionError, match=rf"\[infos/label\]: expected a numeric array .* of {n} rows, got "
                                              r"dtype \|S1.*drop_unsupported=True.*drop_infos=True"):
        convert_d4rl(src, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    s = convert_d4rl(src, tmp_path / "s", drop_unsupported=True, progress=False)
    assert s["dropped_keys"] == ["infos/label"] and "infos/step" in s["checksums"]


def test_d4rl_unflagged_final_episode_is_kept_as_truncated(tmp_path, cartpole):
    """A file that stops inside an episode (no flag on its last row, as in real D4RL files)
    keeps every row: the episode is closed as truncated, its final observation is the
    last next_observations row."""
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole, open_tail=True)
    n = sum(len(e["reward"]) for e in cartpole)
    with pytest.warns(ConversionWarning, match="kept as a truncated episode"):
        s = convert_d4rl(src, tmp_path / "s", progress=False)
    assert s["episodes"] == len(cartpole) and s["open_episode_rows"] == 0 and s["tail_truncated_row"] == n - 1
    with mb.open(str(tmp_path / "s"), mode="r") as buf:
        assert buf.num_episodes == len(cartpole) and len(buf) == n
        assert buf.attrs["tail_truncated_row"] == n - 1
    rows = read_all(tmp_path / "s")
    assert rows["truncated"][-1] and not rows["terminated"][-1]
    np.testing.assert_array_equal(rows["next_obs"][-1], cartpole[-1]["obs"][-1])
    np.testing.assert_array_equal(rows["obs"][-len(cartpole[-1]["reward"]):], cartpole[-1]["obs"][:-1])


def test_d4rl_unflagged_final_episode_without_next_observations_stays_open(tmp_path, cartpole):
    """With the last transitions dropped (no next observations), the unflagged last
    episode keeps every row and stays open: its last row is not sampled."""
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole, open_tail=True, next_obs=False)
    n = sum(len(e["reward"]) for e in cartpole)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = convert_d4rl(src, tmp_path / "s", progress=False, drop_last_transition=True)
    assert any("no next observation, so it is stored but not sampled" in str(w.message) for w in caught)
    assert s["episodes"] == len(cartpole) - 1 and s["open_episode_rows"] == len(cartpole[-1]["reward"])
    assert s["dropped_last_transitions"] == len(cartpole) - 1
    with mb.open(str(tmp_path / "s"), mode="r") as buf:
        assert "tail_truncated_row" not in buf.attrs
        assert len(buf) == n - (len(cartpole) - 1) - 1
    rows = read_all(tmp_path / "s")
    assert not rows["truncated"][-1] and not rows["terminated"][-1]
    np.testing.assert_array_equal(rows["obs"][-len(cartpole[-1]["reward"]):], cartpole[-1]["obs"][:-1])


def test_d4rl_nan_rewards_are_kept_and_counted(tmp_path, cartpole):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    with h5py.File(src, "a") as f:
        r = f["rewards"][:]
        r[[3, 7]] = np.nan
        f["rewards"][:] = r
    s = convert_d4rl(src, tmp_path / "s", progress=False)
    assert s["nan_rewards"] == 2
    assert np.isnan(read_all(tmp_path / "s")["reward"][[3, 7]]).all()


@pytest.mark.parametrize("drop", ["timeouts", "observations"])
def test_d4rl_missing_key_names_file_and_key(tmp_path, cartpole, drop):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    with h5py.File(src, "a") as f:
        del f[drop]
    with pytest.raises(ConversionError, match=rf"c\.hdf5.*missing key '{drop}'"):
        convert_d4rl(src, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()


def test_d4rl_mismatched_lengths_and_wrong_format(tmp_path, cartpole):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    with h5py.File(src, "a") as f:
        a = f["actions"][:-1]
        del f["actions"]
        f["actions"] = a
    with pytest.raises(ConversionError, match=r"\[actions\].*mismatched lengths"):
        convert_d4rl(src, tmp_path / "s", progress=False)
    (tmp_path / "text.hdf5").write_text("not hdf5")
    with pytest.raises(ConversionError, match="expected a D4RL HDF5 file, found a text file"):
        convert_d4rl(tmp_path / "text.hdf5", tmp_path / "s", progress=False)
    with pytest.raises(InvalidArgumentError, match="format"):
        convert("parquet-of-doom", src, tmp_path / "s")


def test_existing_output_is_refused_unless_overwrite(tmp_path, cartpole):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    (tmp_path / "s").mkdir()
    with pytest.raises(StoreExistsError, match="overwrite"):
        convert_d4rl(src, tmp_path / "s", progress=False)
    s = convert("d4rl", src, tmp_path / "s", overwrite=True, progress=False)
    assert s["verified"] and mb.open(str(tmp_path / "s"), mode="r").num_episodes == len(cartpole)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("s")] == ["s"]


def test_interrupted_conversion_leaves_nothing_that_looks_complete(tmp_path, cartpole, monkeypatch):
    from mmbuffer.convert._pipeline import flat as _flat

    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    real = _flat.FlatReader.chunks

    def chunks(self, n):
        for i, c in enumerate(real(self, n)):
            if i == 2:
                raise KeyboardInterrupt
            yield c

    monkeypatch.setattr(_flat.FlatReader, "chunks", chunks)
    with pytest.raises(KeyboardInterrupt):
        convert_d4rl(src, tmp_path / "s", chunk_rows=16, progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()


def test_verification_catches_a_bad_write(tmp_path, cartpole, monkeypatch):
    from mmbuffer._disk import rawio as _format  # the raw-array I/O moved out of _format

    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    real = _format.write_rows

    def corrupting_write(fd, mm, start, rows):
        if mm.dtype == np.float32 and mm.ndim == 1 and start <= 40 < start + len(rows):  # the reward column
            rows = rows.copy()
            rows[40 - start] += 1.0
        return real(fd, mm, start, rows)

    monkeypatch.setattr(_format, "write_rows", corrupting_write)
    with pytest.raises(ConversionError, match="column 'reward' at row 40"):
        convert_d4rl(src, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    assert (tmp_path / "s.partial").exists()  # left for inspection


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_copy_keeps_stored_priorities(tmp_path, compression):
    path = tmp_path / "src"
    rng = np.random.default_rng(3)
    buf = mb.create(str(path), {"x": ((), "float32")}, capacity=400, num_streams=2, next_keys=(),
                    priorities=mb.PriorityConfig(alpha=0.7, eps=1e-3))
    for lane, n in ((0, 180), (1, 150), (0, 90)):  # lane 0 (200 rows) wraps and evicts
        buf.extend({"x": rng.random(n, dtype=np.float32), "truncated": rng.random(n) < 0.05}, stream=lane)
        live = np.concatenate([s + np.arange(k) for s, k in zip(*(t.numpy() for t in buf.episodes()))])
        buf.update_priorities(live, rng.exponential(size=len(live)) * 10.0 ** rng.integers(-4, 4, len(live)))
    buf.close()
    src = mb.open(str(path), mode="r")
    copy(path, tmp_path / "c", compression=compression, progress=False)
    dst = mb.open(str(tmp_path / "c"), mode="r")
    (s0, n0), (s1, n1) = ((t.numpy() for t in b.episodes()) for b in (src, dst))
    rows_src = np.concatenate([s + np.arange(k) for s, k in zip(s0, n0)])
    rows_dst = np.concatenate([s + np.arange(k) for s, k in zip(s1, n1)])
    np.testing.assert_array_equal(dst.get(rows_dst)["x"].numpy(), src.get(rows_src)["x"].numpy())
    np.testing.assert_array_equal(dst.leaf_priorities(rows_dst), src.leaf_priorities(rows_src))
    assert len(np.unique(src.leaf_priorities(rows_src))) > 100  # not the default for every row
    # the copy's rows sit elsewhere, so the same generator draws other rows; the
    # weights it returns must be those the source's priorities give those rows
    # (open episodes included): find each drawn row in the source by its unique x
    leaf_all = src.leaf_priorities(np.arange(400)).astype(np.float64)  # 0 where not live
    live = leaf_all > 0
    leaf_of_x = dict(zip(src.read_range("x", 0, 400)[live].tolist(), leaf_all[live].tolist()))
    b = dst.sample(256, torch.Generator().manual_seed(0), prioritized=True, beta=0.4)
    want = np.array([leaf_of_x[x] for x in b.data["x"].tolist()])
    np.testing.assert_allclose(b.weights.numpy(), (want / leaf_all[live].min()) ** -0.4, rtol=1e-6)


def test_copy_verification_catches_a_bad_write(tmp_path, monkeypatch):
    from mmbuffer._disk import rawio as _format  # the raw-array I/O moved out of _format

    with mb.create(str(tmp_path / "src"), {"obs": ((4,), "float32")}, capacity=20_000, next_keys=()) as buf:
        buf.extend({"obs": np.ones((20_000, 4), np.float32), "truncated": np.arange(20_000) % 1000 == 999})
    real = _format.write_rows

    def corrupting_write(fd, mm, start, rows):
        if mm.ndim == 2 and start <= 12_345 < start + len(rows):
            rows = rows.copy()
            rows[12_345 - start, 2] = -1.0
        return real(fd, mm, start, rows)

    monkeypatch.setattr(_format, "write_rows", corrupting_write)
    with pytest.raises(ConversionError, match="column 'obs' at row 12345"):
        copy(tmp_path / "src", tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists() and (tmp_path / "c.partial").exists()


def test_verification_compares_episodes_after_reopening(tmp_path, cartpole, monkeypatch):
    from mmbuffer.convert._pipeline import write as _write

    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    real = _write.verify_store

    def one_more_episode(path, tally, schema):
        tally.episodes += 1
        return real(path, tally, schema)

    monkeypatch.setattr(_write, "verify_store", one_more_episode)
    with pytest.raises(ConversionError, match="episodes: expected"):
        convert_d4rl(src, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


# -- npz ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dropped_frames", [False, True])
def test_npz_and_npy_directory_match_d4rl(tmp_path, cartpole, dropped_frames):
    """The same arrays as .npz (stored and compressed members) or .npy files give the D4RL
    store; with next observations that differ, every reader keeps them (next/obs)."""
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    if dropped_frames:
        _with_dropped_frames(src, [2, 40])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)  # asserted on below
        ref = convert_d4rl(src, tmp_path / "ref", progress=False)
    assert ("next/obs" in ref["checksums"]) == dropped_frames and "infos/step" in ref["checksums"]
    with h5py.File(src, "r") as f:
        arrays = {k: f[k][()] for k in ("observations", "actions", "rewards", "terminals", "timeouts",
                                        "next_observations")}
        arrays["infos/step"] = f["infos/step"][()]
    np.savez(tmp_path / "plain.npz", **arrays)
    np.savez_compressed(tmp_path / "small.npz", **arrays)
    d = tmp_path / "npy"
    (d / "infos").mkdir(parents=True)
    for k, v in arrays.items():
        np.save(d / f"{k}.npy", v)
    for i, path in enumerate([tmp_path / "plain.npz", tmp_path / "small.npz", d]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = convert_npz(path, tmp_path / f"s{i}", chunk_rows=50, progress=False)
        assert any("kept as the explicit column" in str(w.message) for w in caught) == dropped_frames
        assert s["next_obs_mismatch_rows"] == (2 if dropped_frames else 0)
        assert s["checksums"] == ref["checksums"], path
        assert s["final_obs_checksums"] == ref["final_obs_checksums"]
        assert s["episodes"] == ref["episodes"]


def test_npz_refuses_pickles_and_non_archives(tmp_path, cartpole):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with zipfile.ZipFile(tmp_path / "evil.npz", "w") as z:
        z.write(tmp_path / "obj.npy", "observations.npy")
    with pytest.raises(ConversionError, match="pickle"):
        convert_npz(tmp_path / "evil.npz", tmp_path / "s", progress=False)
    (tmp_path / "x.npz").write_bytes(b"hello")
    with pytest.raises(ConversionError, match="expected an .npz archive.*found a text file"):
        convert_npz(tmp_path / "x.npz", tmp_path / "s", progress=False)
    np.savez(tmp_path / "partial.npz", observations=np.zeros((3, 2)), actions=np.zeros((3, 1)))
    with pytest.raises(ConversionError, match="missing keys 'rewards', 'terminals', 'timeouts'"):
        convert_npz(tmp_path / "partial.npz", tmp_path / "s", progress=False)


def test_command_line_convert_export_copy(tmp_path, cartpole, capsys):
    from mmbuffer._cli.main import main
    from mmbuffer._cli.convert import tool_main

    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    assert main(["convert", "d4rl", str(src), str(tmp_path / "s"), "--keep-infos", "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verified"] and "infos/step" in summary["checksums"]
    assert main(["convert", "d4rl", str(src), str(tmp_path / "s"), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert tool_main("d4rl", [str(src), str(tmp_path / "s"), "--overwrite", "--no-progress"]) == 0
    assert main(["export", "d4rl", str(tmp_path / "s"), str(tmp_path / "o.hdf5"), "--no-progress"]) == 0
    assert main(["copy", str(tmp_path / "s"), str(tmp_path / "z"), "--compression", "zstd", "--no-progress"]) == 0
    assert "verified" in capsys.readouterr().out
    with mb.open(str(tmp_path / "z"), mode="r") as buf:
        assert buf.compression == "zstd" and buf.num_episodes == len(cartpole)


def test_command_line_is_lossless_by_default_and_names_the_opt_ins(tmp_path, cartpole, capsys):
    from mmbuffer._cli.main import main

    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole)
    nxt = _with_dropped_frames(src, [3])
    assert main(["convert", "d4rl", str(src), str(tmp_path / "a"), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {"next/obs", "infos/step"} <= set(summary["checksums"]) and summary["next_obs_mismatch_rows"] == 1
    assert any("kept as the explicit column" in w and "--derive-next" in w for w in summary["warnings"])
    np.testing.assert_array_equal(read_all(tmp_path / "a")["next/obs"], nxt)
    assert main(["convert", "d4rl", str(src), str(tmp_path / "b"), "--derive-next", "--drop-infos",
                 "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert not {"next/obs", "infos/step"} & set(summary["checksums"]) and summary["dropped_keys"] == ["infos/step"]
    assert main(["convert", "lerobot", str(src), str(tmp_path / "c"), "--derive-next"]) == 2
    assert "--derive-next: not an option of format 'lerobot' (only d4rl, npz, torchrl, tianshou)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = capsys.readouterr().out
    for flag in ("--drop-infos", "--drop-unsupported", "--derive-next", "--keep-next-obs"):
        assert flag in text


# -- exports and copies ------------------------------------------------------------------------
def test_store_export_d4rl_convert_gives_identical_data(tmp_path, cartpole):
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole, open_tail=True)
    with pytest.warns(ConversionWarning):
        first = convert_d4rl(src, tmp_path / "a", keep_infos=True, progress=False)
    out = export_d4rl(tmp_path / "a", tmp_path / "back.hdf5", progress=False)
    assert out["verified"] and out["rows"] == first["rows"] and out["tail_unflagged_row"] == first["rows"] - 1
    with h5py.File(src) as f, h5py.File(tmp_path / "back.hdf5") as g:  # the file as it was
        for key in ("observations", "next_observations", "actions", "rewards", "terminals", "timeouts",
                    "infos/step"):
            np.testing.assert_array_equal(g[key][()], f[key][()], err_msg=key)
    with pytest.warns(ConversionWarning, match="kept as a truncated episode"):
        second = convert_d4rl(tmp_path / "back.hdf5", tmp_path / "b", keep_infos=True, progress=False)
    assert second["checksums"] == first["checksums"]
    assert second["final_obs_checksums"] == first["final_obs_checksums"]
    a, b = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    with h5py.File(tmp_path / "back.hdf5") as f:
        assert json.loads(f["metadata/mmbuffer_attrs"][()])["source_format"] == "d4rl"


@pytest.mark.parametrize("open_tail", [False, True])
def test_d4rl_with_differing_next_observations_round_trips_byte_for_byte(tmp_path, cartpole, open_tail):
    """convert -> export gives the file back, byte for byte, for every dataset it holds:
    the file's own next_observations (which differ from the following row at 3 rows),
    infos, flags (an unflagged last row included)."""
    src = tmp_path / "c.hdf5"
    write_d4rl(src, cartpole, open_tail=open_tail)
    _with_dropped_frames(src, [1, 4, 9])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = convert_d4rl(src, tmp_path / "a", progress=False)
    assert any("kept as the explicit column" in str(w.message) for w in caught)
    out = export_d4rl(tmp_path / "a", tmp_path / "back.hdf5", progress=False)
    assert out["verified"] and out["rows"] == first["rows"]
    with h5py.File(src) as f, h5py.File(tmp_path / "back.hdf5") as g:
        data = ["observations", "next_observations", "actions", "rewards", "terminals", "timeouts", "infos/step"]
        assert set(g) == set(f) and set(g["infos"]) == set(f["infos"]) == {"step"}  # nothing left out
        for key in data:
            assert g[key].dtype == f[key].dtype and g[key].shape == f[key].shape, key
            assert g[key][()].tobytes() == f[key][()].tobytes(), key
        for key in ("algorithm", "seed"):
            assert g[f"metadata/{key}"][()] == f[f"metadata/{key}"][()]


@pytest.mark.parametrize("compression", ["zstd", None])
def test_copy_reencodes_and_keeps_lanes_and_open_episodes(tmp_path, compression):
    path = tmp_path / "src"
    buf = mb.create(str(path), {"obs": ((3,), "float32"), "reward": ((), "float32")}, capacity=60,
                    num_streams=2, attrs={"note": "x"})
    rng = np.random.default_rng(1)
    for lane, n in ((0, 25), (1, 18)):
        term = np.zeros(n, bool)
        term[[4, 11]] = True  # two episodes, then an open one
        buf.extend({"obs": rng.random((n, 3), dtype=np.float32), "reward": rng.random(n, dtype=np.float32),
                    "terminated": term}, stream=lane, final_obs={"obs": rng.random((2, 3), dtype=np.float32)})
    # wrap lane 0 (30 rows): its oldest episode is evicted
    term = np.zeros(12, bool)
    term[5] = True
    buf.extend({"obs": rng.random((12, 3), dtype=np.float32), "reward": np.ones(12, np.float32),
                "terminated": term}, stream=0, final_obs={"obs": np.ones((1, 3), np.float32)})
    buf.commit()
    buf.close()
    s = copy(path, tmp_path / "c1", compression=compression or "lz4", chunk_rows=7, progress=False)
    s2 = copy(tmp_path / "c1", tmp_path / "c2", compression=compression, progress=False)
    assert s["verified"] and s2["verified"] and s["checksums"] == s2["checksums"]
    with mb.open(str(path), mode="r") as a, mb.open(str(tmp_path / "c2"), mode="r") as b:
        assert (b.capacity, b.num_streams, b.attrs["note"]) == (60, 2, "x")
        assert a.num_episodes == b.num_episodes and len(a) == len(b)
        la, lb = a.episodes()[1], b.episodes()[1]
        assert la.tolist() == lb.tolist()
        ga = a.get(a.episodes()[0], keys=["obs", "next_obs"])
        gb = b.get(b.episodes()[0], keys=["obs", "next_obs"])
        for k in ga:
            assert torch.equal(ga[k], gb[k])


# -- Minari -----------------------------------------------------------------------------------
minari = pytest.importorskip("minari")


class PixelsAndState(gym.ObservationWrapper):
    """Pendulum with a Dict observation: a state vector and a 32x32 image."""

    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({
            "state": env.observation_space,
            "pixels": gym.spaces.Box(0, 255, (32, 32, 3), np.uint8),
        })

    def observation(self, obs):
        img = np.zeros((32, 32, 3), np.uint8)
        img[..., 0] = np.uint8((obs[0] + 1) * 100)
        return {"state": obs, "pixels": img}


def make_minari(tmp_path, monkeypatch, dataset_id, env, n_episodes, *, data_format="hdf5", steps=None):
    """A dataset written by Minari itself (DataCollector when jax is there, else from buffers)."""
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import jax  # noqa: F401 - DataCollector needs it

            collector = minari.DataCollector(env, data_format=data_format)
            collector.action_space.seed(0)
            for i in range(n_episodes):
                collector.reset(seed=i)
                while True:
                    *_, term, trunc, _ = collector.step(collector.action_space.sample())
                    if term or trunc:
                        break
            ds = collector.create_dataset(dataset_id=dataset_id, algorithm_name="random",
                                          author="t", author_email="t@x", code_permalink="x",
                                          description="test")
            # DataCollector.close() removes its temporary directory behind the back of
            # the TemporaryDirectory object (a ResourceWarning at exit): clean it properly
            collector._tmp_dir.cleanup()
            collector.env.close()
        except ImportError:
            from minari.data_collector import EpisodeBuffer

            buffers = []
            env.action_space.seed(0)
            for i in range(n_episodes):
                obs, _ = env.reset(seed=i)
                o, a, r, te, tr = [obs], [], [], [], []
                while True:
                    act = env.action_space.sample()
                    obs, rew, term, trunc, _ = env.step(act)
                    o.append(obs), a.append(act), r.append(rew), te.append(term), tr.append(trunc)
                    if term or trunc:
                        break
                if isinstance(o[0], dict):
                    o = {k: [x[k] for x in o] for k in o[0]}
                buffers.append(EpisodeBuffer(observations=o, actions=a, rewards=r, terminations=te,
                                             truncations=tr, infos={}))
            ds = minari.create_dataset_from_buffers(dataset_id, buffers, env=env, algorithm_name="random",
                                                    author="t", author_email="t@x", code_permalink="x",
                                                    description="test", data_format=data_format)
    return ds, tmp_path / "minari" / dataset_id


def compare_with_minari(store, dataset, obs_keys=None) -> None:
    with mb.open(str(store), mode="r") as buf:
        starts, lengths = buf.episodes()
        episodes = list(dataset.iterate_episodes())
        assert len(episodes) == len(starts) == buf.num_episodes
        for ep, s, n in zip(episodes, starts.tolist(), lengths.tolist()):
            idx = torch.arange(s, s + n)
            got = {k: v.numpy() for k, v in buf.get(idx).items()}
            assert n == len(ep.rewards)
            if obs_keys is None:
                nxt = buf.get(idx[-1:], keys=["next_obs"])["next_obs"].numpy()
                np.testing.assert_array_equal(np.concatenate([got["obs"], nxt]), ep.observations)
            else:
                for k in obs_keys:
                    nxt = buf.get(idx[-1:], keys=[f"next_obs/{k}"])[f"next_obs/{k}"].numpy()
                    np.testing.assert_array_equal(np.concatenate([got[f"obs/{k}"], nxt]), ep.observations[k])
            np.testing.assert_array_equal(got["action"], ep.actions)
            np.testing.assert_array_equal(got["reward"], ep.rewards)
            np.testing.assert_array_equal(got["terminated"], ep.terminations)
            np.testing.assert_array_equal(got["truncated"], ep.truncations)


def test_minari_hdf5_cartpole_episode_by_episode(tmp_path, monkeypatch):
    _, path = make_minari(tmp_path, monkeypatch, "test/cartpole-v0",
                          gym.make("CartPole-v1", max_episode_steps=40), 10)
    s = convert_minari(path, tmp_path / "store", chunk_rows=25, progress=False)
    assert s["verified"] and s["episodes"] == 10
    compare_with_minari(tmp_path / "store", minari.load_dataset("test/cartpole-v0"))
    with mb.open(str(tmp_path / "store"), mode="r") as buf:
        meta = buf.attrs["minari"]
        assert meta["dataset_id"] == "test/cartpole-v0"
        assert json.loads(meta["action_space"])["type"] == "Discrete"
        assert "CartPole-v1" in meta["env_spec"]


def test_minari_arrow_pendulum(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    _, path = make_minari(tmp_path, monkeypatch, "test/pendulum-v0",
                          gym.make("Pendulum-v1", max_episode_steps=50), 4, data_format="arrow")
    s = convert_minari(path / "data", tmp_path / "store", progress=False)
    assert s["verified"] and s["rows"] == 200
    compare_with_minari(tmp_path / "store", minari.load_dataset("test/pendulum-v0"))


def test_minari_dict_observations_become_leaf_columns(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    env = PixelsAndState(gym.make("Pendulum-v1", max_episode_steps=20))
    _, path = make_minari(tmp_path, monkeypatch, "test/pixels-v0", env, 3)
    s = convert_minari(path, tmp_path / "store", progress=False)
    assert s["verified"]
    with mb.open(str(tmp_path / "store"), mode="r") as buf:
        assert buf.columns["obs/pixels"] == mb.Column((32, 32, 3), "uint8")
        assert set(buf.next_keys) == {"obs/pixels", "obs/state"}
    compare_with_minari(tmp_path / "store", minari.load_dataset("test/pixels-v0"), obs_keys=["pixels", "state"])


def test_store_export_minari_load_dataset_convert_roundtrip(tmp_path, monkeypatch):
    _, path = make_minari(tmp_path, monkeypatch, "test/cart-v0", gym.make("CartPole-v1", max_episode_steps=40), 6)
    first = convert_minari(path, tmp_path / "a", progress=False)
    out = tmp_path / "minari" / "test" / "exported-v0"
    e = export_minari(tmp_path / "a", out, dataset_id="test/exported-v0", progress=False)
    assert e["verified"] and e["episodes"] == 6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = minari.load_dataset("test/exported-v0")
    assert ds.total_episodes == 6 and ds.total_steps == first["rows"]
    compare_with_minari(tmp_path / "a", ds)
    second = convert_minari(out, tmp_path / "b", progress=False)
    assert second["checksums"] == first["checksums"]
    assert second["final_obs_checksums"] == first["final_obs_checksums"]


def test_minari_bad_input(tmp_path, monkeypatch):
    with pytest.raises(ConversionError, match="not a Minari dataset"):
        convert_minari(tmp_path, tmp_path / "s", progress=False)
    _, path = make_minari(tmp_path, monkeypatch, "test/bad-v0", gym.make("CartPole-v1", max_episode_steps=20), 2)
    with h5py.File(path / "data" / "main_data.hdf5", "a") as f:
        obs = f["episode_1/observations"][:-1]
        del f["episode_1/observations"]
        f["episode_1/observations"] = obs
    with pytest.raises(ConversionError, match=r"episode_1/observations.*mismatched lengths"):
        convert_minari(path, tmp_path / "s", progress=False)


# -- TorchRL / TD-MPC2 --------------------------------------------------------------------------
def _memmap_dump(root: Path, leaves: dict[str, np.ndarray], length: int, cursor: int, write_count: int) -> None:
    """TorchRL's dumps() layout written by hand (tensordict memmap + JSON)."""
    tdtype = {np.dtype("float32"): "torch.float32", np.dtype("bool"): "torch.bool", np.dtype("int64"): "torch.int64"}
    metas: dict[Path, dict] = {}
    for key, arr in leaves.items():
        parts = key.split("/")
        d = root / "storage" / Path(*parts[:-1]) if len(parts) > 1 else root / "storage"
        d.mkdir(parents=True, exist_ok=True)
        arr.tofile(d / f"{parts[-1]}.memmap")
        metas.setdefault(d, {})[parts[-1]] = {"device": "cpu", "shape": list(arr.shape),
                                              "dtype": tdtype[arr.dtype], "is_nested": False}
        for i in range(1, len(parts)):
            parent = root / "storage" / Path(*parts[: i - 1]) if i > 1 else root / "storage"
            metas.setdefault(parent, {})[parts[i - 1]] = {"type": "TensorDict"}
    for d, m in metas.items():
        m.update(shape=[len(next(iter(leaves.values())))], device="cpu", _type="<class 'TensorDict'>")
        (d / "meta.json").write_text(json.dumps(m))
    (root / "storage" / "storage_metadata.json").write_text(json.dumps({"metadata": {}, "is_pytree": False,
                                                                       "len": length}))
    (root / "writer").mkdir()
    (root / "writer" / "metadata.json").write_text(json.dumps({"cursor": cursor, "write_count": write_count}))


def test_torchrl_layout_read_without_torchrl_including_a_wrapped_ring(tmp_path):
    cap, rng = 12, np.random.default_rng(0)
    obs = rng.random((cap, 2), dtype=np.float32)
    nxt = rng.random((cap, 2), dtype=np.float32)
    term = np.zeros((cap, 1), bool)
    trunc = np.zeros((cap, 1), bool)
    term[[1, 6]] = True
    trunc[9] = True
    # wrote 17 rows into 12 slots: the oldest row is at the cursor, 5
    leaves = {"observation": obs, "action": rng.random((cap, 1), dtype=np.float32),
              "next/observation": nxt, "next/reward": rng.random((cap, 1), dtype=np.float32),
              "next/terminated": term, "next/truncated": trunc, "next/done": term | trunc,
              "index": np.arange(cap, dtype=np.int64)}
    _memmap_dump(tmp_path / "rb", leaves, cap, cursor=5, write_count=17)
    order = np.r_[5:12, 0:5]
    ends = np.flatnonzero((term | trunc)[order, 0])
    # next/observation is random: it differs from the following row inside episodes
    inner = [r for r in range(cap - 1) if r not in ends]
    for derive in (False, True):
        dst = tmp_path / f"s{derive}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = convert_torchrl(tmp_path / "rb", dst, chunk_rows=5, derive_next=derive, progress=False)
        messages = " ".join(str(w.message) for w in caught if w.category is ConversionWarning)
        assert "wrapped" in messages and "next observation that differs" in messages
        assert s["next_obs_mismatch_rows"] == len(inner)
        rows = read_all(dst)
        np.testing.assert_array_equal(rows["obs"], obs[order])
        np.testing.assert_array_equal(rows["reward"], leaves["next/reward"][order, 0])
        np.testing.assert_array_equal(rows["terminated"], term[order, 0])
        assert "index" not in rows  # each row's storage slot (as TorchRL writes it): derived from its position
        if not derive:  # lossless: the dump's next observations, every row; the ring's last episode stays open
            assert set(rows) == {"obs", "action", "reward", "terminated", "truncated", "next/obs"}
            np.testing.assert_array_equal(rows["next/obs"], nxt[order])
            assert s["episodes"] == 3 and s["open_episode_rows"] == cap - 1 - ends[-1] and not rows["truncated"][-1]
            continue
        assert set(rows) == {"obs", "action", "reward", "terminated", "truncated", "next_obs"}
        np.testing.assert_array_equal(rows["next_obs"][ends], nxt[order][ends])
        np.testing.assert_array_equal(rows["next_obs"][inner], obs[order][[r + 1 for r in inner]])  # derived, as asked
        # the ring stops inside an episode: closed as truncated, final observation next/observation
        assert s["episodes"] == 4 and s["open_episode_rows"] == 0 and rows["truncated"][-1]
        np.testing.assert_array_equal(rows["next_obs"][-1], nxt[order][-1])
    # an index that is not the storage slot is data of its own: kept
    other = np.arange(cap, dtype=np.int64)[::-1].copy()
    other.tofile(tmp_path / "rb" / "storage" / "index.memmap")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        convert_torchrl(tmp_path / "rb", tmp_path / "idx", progress=False)
    np.testing.assert_array_equal(read_all(tmp_path / "idx")["index"], other[order])


def test_torchrl_trajectory_changes_end_episodes_in_the_next_observation_check(tmp_path):
    """Where collector/traj_ids changes with no flag, the next observation is the trajectory's
    last, not the following row's: not a difference (nothing to keep), the store derives."""
    n, cut = 10, 4  # trajectory 0 is rows 0..4 (cut with no flag), trajectory 1 rows 5..9
    rng = np.random.default_rng(1)
    states = rng.random((n + 2, 3), dtype=np.float32)
    obs = np.concatenate([states[:5], states[6:11]])
    nxt = np.concatenate([states[1:6], states[7:12]])  # row 4: trajectory 0's final state
    term = np.zeros((n, 1), bool)
    term[-1] = True
    leaves = {"observation": obs, "action": rng.random((n, 1), dtype=np.float32),
              "collector/traj_ids": np.repeat(np.arange(2, dtype=np.int64), 5),
              "next/observation": nxt, "next/reward": rng.random((n, 1), dtype=np.float32),
              "next/terminated": term, "next/truncated": np.zeros((n, 1), bool)}
    _memmap_dump(tmp_path / "rb", leaves, n, cursor=0, write_count=n)
    with pytest.warns(ConversionWarning, match="traj_ids changes where no flag is set"):
        s = convert_torchrl(tmp_path / "rb", tmp_path / "s", progress=False)
    assert s["next_obs_mismatch_rows"] == 0 and s["forced_truncations"] == 1 and s["episodes"] == 2
    rows = read_all(tmp_path / "s")
    assert "next/obs" not in rows and rows["truncated"][cut]
    np.testing.assert_array_equal(rows["next_obs"], nxt)  # the dump's next observations, every row
    np.testing.assert_array_equal(rows["collector/traj_ids"], leaves["collector/traj_ids"])


def test_torchrl_and_tdmpc2_entries_a_store_cannot_hold_are_refused_by_name(tmp_path):
    n = 6
    leaves = {"observation": np.zeros((n, 2), np.float32), "action": np.zeros((n, 1), np.float32),
              "next/observation": np.zeros((n, 2), np.float32), "next/reward": np.zeros((n, 1), np.float32),
              "next/terminated": np.arange(n)[:, None] == n - 1, "next/truncated": np.zeros((n, 1), bool)}
    _memmap_dump(tmp_path / "rb", leaves, n, cursor=0, write_count=n)
    meta = json.loads((tmp_path / "rb" / "storage" / "meta.json").read_text())
    meta["label"] = {"type": "NonTensorData"}  # an entry with no tensors
    (tmp_path / "rb" / "storage" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConversionError, match=r"\[label\]: a NonTensorData entry with no tensors.*drop_unsupported=True"):
        convert_torchrl(tmp_path / "rb", tmp_path / "s", progress=False)
    s = convert("torchrl", tmp_path / "rb", tmp_path / "s", drop_unsupported=True, progress=False)
    assert s["dropped_keys"] == ["label"] and s["rows"] == n
    d = {**_tdmpc2(E=2, L=3), "note": "collected by hand"}
    torch.save(d, tmp_path / "n.pt")
    with pytest.raises(ConversionError, match=r"\[note\]: expected tensors, got other values at \['note'\]"):
        convert_torchrl(tmp_path / "n.pt", tmp_path / "t", progress=False)
    s = convert("tdmpc2", tmp_path / "n.pt", tmp_path / "t", drop_unsupported=True, progress=False)
    assert s["dropped_keys"] == ["note"]


def test_torchrl_dumps_written_by_torchrl(tmp_path):
    pytest.importorskip("torchrl")
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    eps = collect("CartPole-v1", 5, max_steps=25, seed=3)
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000))
    for i, e in enumerate(eps):
        t = len(e["reward"])
        obs = torch.from_numpy(e["obs"])
        flag = lambda x: torch.from_numpy(x)[:, None]  # noqa: E731
        rb.extend(TensorDict({
            "observation": obs[:-1], "action": torch.from_numpy(e["action"]),
            "collector": {"traj_ids": torch.full((t,), i)},
            "next": {"observation": obs[1:], "reward": torch.from_numpy(e["reward"])[:, None],
                     "terminated": flag(e["terminated"]), "truncated": flag(e["truncated"]),
                     "done": flag(e["terminated"] | e["truncated"])},
        }, [t]))
    rb.dumps(tmp_path / "rb")
    s = convert_torchrl(tmp_path / "rb", tmp_path / "s", progress=False)
    assert s["verified"] and s["episodes"] == 5 and s["next_obs_mismatch_rows"] == 0
    assert_same_episodes(store_episodes(tmp_path / "s"), eps)


def _tdmpc2(E=5, L=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(E, L, 4, generator=g)
    action = torch.randn(E, L, 2, generator=g)
    reward = torch.randn(E, L, generator=g)
    action[:, 0] = float("nan")
    reward[:, 0] = float("nan")
    episode = torch.arange(E)[:, None].expand(E, L).clone()
    return {"obs": obs, "action": action, "reward": reward, "episode": episode}


def check_tdmpc2(store, d) -> None:
    E, L = d["reward"].shape
    rows = read_all(store)
    np.testing.assert_array_equal(rows["obs"], d["obs"][:, :-1].reshape(-1, 4).numpy())
    np.testing.assert_array_equal(rows["action"], d["action"][:, 1:].reshape(-1, 2).numpy())
    np.testing.assert_array_equal(rows["reward"], d["reward"][:, 1:].reshape(-1).numpy())
    np.testing.assert_array_equal(rows["next_obs"], d["obs"][:, 1:].reshape(-1, 4).numpy())
    trunc = rows["truncated"].reshape(E, L - 1)
    assert trunc[:, -1].all() and not trunc[:, :-1].any() and not rows["terminated"].any()


def test_tdmpc2_tensordict_file(tmp_path):
    td_mod = pytest.importorskip("tensordict")
    d = _tdmpc2()
    torch.save(td_mod.TensorDict(d, batch_size=[5, 7]), tmp_path / "chunk_0.pt")
    s = convert_torchrl(tmp_path / "chunk_0.pt", tmp_path / "s", chunk_rows=12, progress=False)
    assert s["format"] == "tdmpc2" and s["episodes"] == 5 and s["rows"] == 30 and s["verified"]
    check_tdmpc2(tmp_path / "s", d)


def test_tdmpc2_plain_dict_file_and_refused_pickles(tmp_path):
    d = _tdmpc2(E=3, L=4)
    torch.save(d, tmp_path / "plain.pt")
    convert_torchrl(tmp_path / "plain.pt", tmp_path / "s", progress=False)
    check_tdmpc2(tmp_path / "s", d)
    marker = tmp_path / "exploited"
    torch.save({**d, "callback": Exploit(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ConversionError, match="refused.*exec"):
        convert_torchrl(tmp_path / "evil.pt", tmp_path / "s2", progress=False)
    assert not marker.exists()
    torch.save({"obs": d["obs"]}, tmp_path / "noep.pt")
    with pytest.raises(ConversionError, match="missing key 'action'"):
        convert_torchrl(tmp_path / "noep.pt", tmp_path / "s3", progress=False)


def test_tdmpc2_values_the_store_has_no_place_for_are_refused_by_name(tmp_path):
    d = _tdmpc2(E=4, L=5)
    d["action"][2, 0] = 0.5  # a reset-row action: TD-MPC2 writes NaN there
    torch.save(d, tmp_path / "a.pt")
    with pytest.raises(ConversionError, match=r"\[action\]: expected the reset row \(row 0\) of every episode to "
                                              r"hold NaN.*episodes \[2\].*drop_reset_values=True"):
        convert_torchrl(tmp_path / "a.pt", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    s = convert("tdmpc2", tmp_path / "a.pt", tmp_path / "s", drop_reset_values=True, progress=False)
    assert s["reset_values_dropped"] == 1
    check_tdmpc2(tmp_path / "s", d)
    # a task that changes inside an episode, a truncated flag the store would not derive
    d = _tdmpc2(E=3, L=4)
    d["task"] = torch.zeros(3, 4, dtype=torch.int64)
    d["task"][1, 3] = 7
    torch.save(d, tmp_path / "t.pt")
    with pytest.raises(ConversionError, match=r"\[task\]: expected one value per episode.*episodes \[1\]"):
        convert_torchrl(tmp_path / "t.pt", tmp_path / "t", progress=False)
    d = _tdmpc2(E=3, L=4)
    d["truncated"] = torch.zeros(3, 4, dtype=torch.bool)
    d["truncated"][:, -1] = True
    torch.save(d, tmp_path / "ok.pt")
    convert_torchrl(tmp_path / "ok.pt", tmp_path / "ok", progress=False)  # the flags the store derives
    d["truncated"][0, 2] = True
    torch.save(d, tmp_path / "tr.pt")
    with pytest.raises(ConversionError, match=r"\[truncated\]: expected truncated set exactly at each "
                                              r"episode's last step.*episodes \[0\]"):
        convert_torchrl(tmp_path / "tr.pt", tmp_path / "tr", progress=False)


class Exploit:
    """Unpickling this would run code (creating ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_export_d4rl_refuses_a_store_without_d4rl_columns(tmp_path):
    buf = mb.create(tmp_path / "s", {"obs": ((2,), "float32"), "act": ((), "int64")}, capacity=20)
    buf.extend({"obs": np.zeros((4, 2)), "act": np.arange(4), "terminated": np.arange(4) == 3},
               final_obs={"obs": np.zeros((1, 2))})
    buf.close()
    from mmbuffer.convert import export_d4rl

    with pytest.raises(mb.errors.ConversionError, match="missing \\['action', 'reward'\\]"):
        export_d4rl(tmp_path / "s", tmp_path / "out.hdf5", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


# -- copies of columns with a codec --------------------------------------------------------------
def _codec_store(path, monkeypatch):
    """Small shards (4-row chunks, 16-row shards) so that ~100 rows per lane fill several
    shard files and leave rows staged; lanes wrapped, open episodes, final observations."""
    from mmbuffer._disk.columns import sharding

    monkeypatch.setattr(sharding, "INNER_BYTES", 4 * 48)
    monkeypatch.setattr(sharding, "SHARD_CHUNKS", 4)
    rng = np.random.default_rng(5)
    cols = {"px": mb.Column((6, 8), "uint8", codec="zstd:5"), "vel": mb.Column((2,), "float32", codec="lz4"),
            "a": ((), "int64")}
    with mb.create(str(path), cols, capacity=128, num_streams=2, next_keys=("px",)) as buf:
        for step in range(30):
            n = int(rng.integers(3, 9))
            done = np.zeros(n, bool)
            done[-1] = step % 3 == 2  # the last episode of each lane stays open
            buf.extend({"px": (rng.integers(0, 3, (n, 6, 8)) * 80).astype(np.uint8),
                        "vel": rng.random((n, 2), dtype=np.float32), "a": np.arange(n) + 100 * step,
                        "terminated": done}, stream=step % 2,
                       final_obs={"px": np.full((int(done.sum()), 6, 8), step, np.uint8)})
    return path


def _same_rows(a, b):
    """Every live row of ``a`` and ``b`` (episode by episode, next_px included) is the same."""
    (sa, na), (sb, nb) = ((t.numpy() for t in s.episodes()) for s in (a, b))
    assert na.tolist() == nb.tolist() and len(a) == len(b) > 100
    lane = a.lane_size

    def rows(starts, lengths):  # an episode may wrap round its lane's ring
        return np.concatenate([s - s % lane + (s % lane + np.arange(k)) % lane for s, k in zip(starts, lengths)])

    rows_a, rows_b = rows(sa, na), rows(sb, nb)
    keys = ["px", "next_px", "vel", "a", "terminated", "truncated"]
    ga, gb = a.get(rows_a, keys=keys), b.get(rows_b, keys=keys)
    for k in keys:
        assert ga[k].numpy().tobytes() == gb[k].numpy().tobytes(), k


def test_copy_keeps_each_columns_codec_and_reads_the_same(tmp_path, monkeypatch):
    src = _codec_store(tmp_path / "src", monkeypatch)
    s = copy(src, tmp_path / "c", progress=False)
    s_z = copy(src, tmp_path / "cz", compression="zstd", progress=False)  # store-wide: the raw column only
    assert s["codecs"] == s_z["codecs"] == {"px": "zstd:5", "vel": "lz4"}
    with mb.open(str(src), mode="r") as a, mb.open(str(tmp_path / "c"), mode="r") as b, \
            mb.open(str(tmp_path / "cz"), mode="r") as z:
        for c in (b, z):
            assert {k: col.codec for k, col in c.columns.items()} == {k: col.codec for k, col in a.columns.items()}
            assert c.columns["px"].codec == "zstd:5"
            _same_rows(a, c)
        assert (b.compression, z.compression) == (None, "zstd")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["columns"]["px"]["codec"] == "zstd:5" and "codec" not in manifest["columns"]["a"]
    shards = [p for p in (tmp_path / "c" / "columns" / "px" / "c").rglob("*") if p.is_file()]
    assert len(shards) >= 4  # complete shards were encoded in the copy, not only staged rows


def test_copy_changes_codecs_only_when_asked(tmp_path, monkeypatch):
    src = _codec_store(tmp_path / "src", monkeypatch)
    s = copy(src, tmp_path / "c", codec={"px": None, "a": "zstd"}, progress=False)
    s_raw = copy(src, tmp_path / "raw", codec=None, progress=False)
    assert s["codecs"] == {"vel": "lz4", "a": "zstd"} and s_raw["codecs"] == {}
    with mb.open(str(src), mode="r") as a, mb.open(str(tmp_path / "c"), mode="r") as b, \
            mb.open(str(tmp_path / "raw"), mode="r") as r:
        assert {k: b.columns[k].codec for k in ("px", "vel", "a")} == {"px": None, "vel": "lz4", "a": "zstd"}
        assert all(col.codec is None for col in r.columns.values())
        _same_rows(a, b)
        _same_rows(a, r)
    assert not (tmp_path / "raw" / "staging").exists() or not any((tmp_path / "raw" / "staging").iterdir())


@pytest.mark.parametrize("codec, error, match", [
    ({"nope": "zstd"}, InvalidArgumentError, r"codec: expected column names among \['a', 'px', 'vel'\], got 'nope'"),
    ({"terminated": "zstd"}, InvalidArgumentError, r"got 'terminated'"),
    ({"px": "gzip"}, mb.errors.SchemaError, r"column 'px': codec: expected None \(raw\) or one of .*got 'gzip'"),
    ({"px": "zstd:99"}, mb.errors.SchemaError, r"column 'px'"),
    ("zstd", InvalidArgumentError, r"codec: expected 'keep', None or a mapping column -> codec, got 'zstd'"),
])
def test_copy_refuses_a_bad_codec_by_name_and_writes_nothing(tmp_path, monkeypatch, codec, error, match):
    src = _codec_store(tmp_path / "src", monkeypatch)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error, match=match):
        copy(src, tmp_path / "c", codec=codec, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # neither c nor c.partial


def test_a_copy_that_keeps_rows_holds_a_wrapped_ring_where_the_source_does(tmp_path, monkeypatch):
    """``copy_local(keep_rows=True)`` (what a publish does): every lane of the copy begins at
    the source's oldest live episode, so a wrapped two-stream ring with priorities, final
    observations, an open episode and a codec column has the same counters, rows, episode
    slots and priorities; after more rows, a second copy differs only in the chunks written."""
    import dataclasses

    from mmbuffer._disk import format as fmt
    from mmbuffer.convert._pipeline.copy import copy_local

    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=4 << 10))  # 256 obs rows a chunk
    rng = np.random.default_rng(3)
    cols = {"obs": ((4,), "float32"), "px": mb.Column((8, 8), "uint8", codec="zstd")}
    with mb.create(tmp_path / "src", cols, capacity=2 * 4096, num_streams=2, priorities=mb.PriorityConfig()) as buf:
        for n in (3000, 2000, 1500):  # wraps both lanes (4096 rows each), a cut inside episodes
            for lane in (0, 1):
                done = rng.random(n) < 0.02
                buf.extend({"obs": rng.standard_normal((n, 4), dtype=np.float32), "px": rng.integers(0, 255, (n, 8, 8), np.uint8),
                            "terminated": done}, stream=lane,
                           final_obs={"obs": rng.standard_normal((int(done.sum()), 4), dtype=np.float32)})
            buf.update_priorities(buf.sample(256).indices, rng.random(256) + 0.1)
    copy_local(tmp_path / "src", tmp_path / "a", compression="zstd", progress=False, keep_rows=True)
    with mb.open(tmp_path / "src", mode="r") as src, mb.open(tmp_path / "a", mode="r") as a:
        assert src.view().first_starts.min() > 0 and a.store.committed == src.store.committed
        (s0, n0), (s1, n1) = src.episodes(), a.episodes()
        assert torch.equal(s0, s1) and torch.equal(n0, n1)
        rows = np.concatenate([lane * 4096 + np.arange(lv.first_start, lv.visible_end) % 4096
                               for lane, lv in enumerate(a.view().lanes)])  # the sampleable rows
        want, got = src.get(rows), a.get(rows)
        for k in ("obs", "next_obs", "px", "terminated", "truncated"):
            assert torch.equal(want[k], got[k]), k
        np.testing.assert_array_equal(a.leaf_priorities(rows), src.leaf_priorities(rows))
    with mb.open(tmp_path / "src") as buf:
        buf.extend({"obs": np.zeros((40, 4), np.float32), "px": np.zeros((40, 8, 8), np.uint8),
                    "terminated": np.arange(40) == 39}, stream=1, final_obs={"obs": np.ones((1, 4), np.float32)})
    copy_local(tmp_path / "src", tmp_path / "b", compression="zstd", progress=False, keep_rows=True)

    def chunks(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / "columns" / "obs" / "c").rglob("*") if p.is_file()}

    before, after = chunks(tmp_path / "a"), chunks(tmp_path / "b")
    changed = [k for k in after if before.get(k) != after[k]]
    assert len(after) >= 8 and 1 <= len(changed) <= 2  # the chunk(s) of lane 1's 40 new rows


def _counted(n: int, start: int) -> dict:
    """``n`` rows whose ``x`` counts on from ``start``; an episode ends every 10."""
    x = np.arange(start, start + n)
    return {"x": x, "terminated": x % 10 == 9}


def _ring_of_4000_counted_rows(path):
    """A writer of a one-lane ring of 4,096 rows holding 4,000 committed rows."""
    writer = mb.create(path, {"x": ((), "int64")}, capacity=4096, next_keys=())
    writer.extend(_counted(4000, 0))
    writer.commit()
    return writer


def _lapped_once(walk, writer):
    """``walk`` whose first call lets ``writer`` lap the rows still to be read once its
    first piece is out; and the list of calls."""
    calls: list[int] = []

    def lapped(*args, **kwargs):
        calls.append(1)
        for i, piece in enumerate(walk(*args, **kwargs)):
            yield piece
            if i == 0 and len(calls) == 1:
                writer.extend(_counted(3000, 4000))
                writer.commit()

    return lapped, calls


def test_a_copy_of_rows_that_the_stores_writer_laps_meanwhile_is_refused(tmp_path, monkeypatch):
    """A copy from a read-only handle checks, after reading each piece, that the writer has
    not reserved those rows meanwhile (it may have rewritten them); a lapped copy is a
    typed refusal naming the stream, and nothing is left at the destination."""
    from mmbuffer.convert._pipeline import copy as copy_module
    from mmbuffer.errors import RowNotLiveError

    path = tmp_path / "s"
    writer = _ring_of_4000_counted_rows(path)
    reader = mb.open(path, mode="r")
    walk = copy_module.walk
    monkeypatch.setattr(copy_module, "walk", _lapped_once(walk, writer)[0])
    with pytest.raises(RowNotLiveError, match="stream 0: expected the rows from"):
        copy(reader, tmp_path / "c", chunk_rows=1024, progress=False)
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()
    monkeypatch.setattr(copy_module, "walk", walk)
    reader.refresh()
    copy(reader, tmp_path / "c", chunk_rows=1024, progress=False)  # nothing moves now: copied
    with mb.open(tmp_path / "c", mode="r") as c:
        assert torch.equal(c.episodes()[1], reader.episodes()[1])
    reader.close()
    writer.close()


def test_a_copy_of_a_store_path_whose_writer_laps_it_once_is_made_again_from_the_newer_state(tmp_path, monkeypatch):
    """From a store path (opened read-only by the copy itself), a lapped copy is discarded
    and made again from the store's newer state: the copy then holds what it holds."""
    from mmbuffer.convert._pipeline import copy as copy_module

    path = tmp_path / "s"
    writer = _ring_of_4000_counted_rows(path)
    lapped_once, calls = _lapped_once(copy_module.walk, writer)  # the first copy's rows lapped
    monkeypatch.setattr(copy_module, "walk", lapped_once)
    summary = copy(path, tmp_path / "c", chunk_rows=1024, progress=False)
    assert len(calls) == 2 and summary["verified"]
    with mb.open(path, mode="r") as src, mb.open(tmp_path / "c", mode="r") as c:
        assert torch.equal(c.episodes()[1], src.episodes()[1])
        x = c.get(np.arange(len(c)))["x"].numpy()
        assert x[0] == src.view().first_starts[0] and np.array_equal(np.diff(x), np.ones(len(x) - 1))
    writer.close()
