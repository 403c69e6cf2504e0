"""Issue 13 §3: offline -> online in one step (capacity, streams, priorities), and the
formats people have: Diffusion Policy / UMI Zarr, Tianshou save_hdf5, LeRobot v3, Minari ids.

Every source is written here: Zarr groups with zarr-python in Diffusion Policy's layout,
HDF5 files in the layout Tianshou's ``to_hdf5`` writes (``tianshou/data/utils/converter.py``
applied to a buffer's ``__dict__``), LeRobot v3 datasets with pyarrow in the layout of
LeRobot's ``LeRobotDataset`` v3.0, Minari datasets with ``minari.DataCollector``.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer.convert import ConversionWarning, convert, copy, export
from mmbuffer.errors import ConversionError, InvalidArgumentError

zarr = pytest.importorskip("zarr")


# -- a small D4RL-style source ------------------------------------------------------------------
def npz_source(path: Path, lengths: list[int], *, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    obs = rng.random((n, 3)).astype("float32")
    nxt = rng.random((n, 3)).astype("float32")
    ends = np.cumsum(lengths) - 1
    nxt[:-1] = obs[1:]
    term = np.zeros(n, bool)
    term[ends] = True
    arrays = dict(observations=obs, next_observations=nxt, actions=rng.random((n, 2)).astype("float32"),
                  rewards=rng.random(n).astype("float32"), terminals=term, timeouts=np.zeros(n, bool))
    np.savez(path, **arrays)
    return arrays


def steps(n: int, value: float = 7.0) -> dict[str, np.ndarray]:
    return {"obs": np.full((n, 3), value, "float32"), "action": np.zeros((n, 2), "float32"),
            "reward": np.zeros(n, "float32")}


# -- 1. offline -> online ---------------------------------------------------------------------
def test_convert_with_capacity_extends_without_eviction(tmp_path):
    lengths = [10, 20, 5, 15, 30, 20]
    src = npz_source(tmp_path / "d.npz", lengths)
    convert("npz", tmp_path / "d.npz", tmp_path / "s", capacity=1000, progress=False)
    with mb.open(tmp_path / "s") as buf:
        assert buf.capacity == 1000 and buf.num_episodes == len(lengths)
        buf.extend(steps(100), final_obs={"obs": np.zeros((0, 3), "float32")})
        buf.extend({**steps(1), "terminated": np.ones(1, bool)}, final_obs={"obs": np.zeros((1, 3), "float32")})
        assert buf.num_episodes == len(lengths) + 1  # nothing evicted
        starts, got = buf.episodes()
        assert got.tolist() == [*lengths, 101]
        assert np.array_equal(buf.get(np.arange(100))["obs"].numpy(), src["observations"])


def test_default_capacity_is_the_source_rows_and_evicts(tmp_path):
    npz_source(tmp_path / "d.npz", [10, 20, 5])
    convert("npz", tmp_path / "d.npz", tmp_path / "s", progress=False)
    with mb.open(tmp_path / "s") as buf:
        assert buf.capacity == 35
        buf.extend(steps(12), final_obs={"obs": np.zeros((0, 3), "float32")})
        assert buf.num_episodes < 3  # why capacity= exists


def test_priorities_usable_right_after_conversion(tmp_path):
    npz_source(tmp_path / "d.npz", [10, 20, 5, 15])
    convert("npz", tmp_path / "d.npz", tmp_path / "s", capacity=100, progress=False,
            priorities=mb.PriorityConfig(alpha=1.0, eps=0.0))
    with mb.open(tmp_path / "s") as buf:
        g = torch_generator(0)
        b = buf.sample(64, prioritized=True, beta=1.0, generator=g)
        assert b.weights.shape == (64,)
        prio = np.zeros(50)
        prio[7] = 1.0  # every other row gets priority 0
        buf.update_priorities(np.arange(50), prio)
        b = buf.sample(32, prioritized=True, generator=g)
        assert set(b.indices.tolist()) == {7}


def torch_generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("chunk_rows", [7, 1000])
def test_num_streams_deals_episodes_in_contiguous_runs(tmp_path, chunk_rows):
    lengths = [10, 20, 5, 15, 30, 20]  # 100 rows, starts 0, 10, 30, 35, 50, 80
    src = npz_source(tmp_path / "d.npz", lengths)
    s = convert("npz", tmp_path / "d.npz", tmp_path / "s", capacity=200, num_streams=2,
                chunk_rows=chunk_rows, progress=False)
    assert s["verified"]
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert buf.num_streams == 2 and buf.lane_size == 100
        starts, got = (t.tolist() for t in buf.episodes())
        # stream = min(S - 1, first_row * S // N): rows 0..49 start in stream 0, 50.. in stream 1
        assert sorted(zip(starts, got)) == [(0, 10), (10, 20), (30, 5), (35, 15), (100, 30), (130, 20)]
        rows = np.r_[0:50, 100:150]
        assert np.array_equal(buf.get(rows)["obs"].numpy(), src["observations"])
        last = np.array([9, 29, 34, 49, 129, 149])
        assert np.array_equal(buf.get(last, keys=["next_obs"])["next_obs"].numpy(),
                              src["next_observations"][np.cumsum(lengths) - 1])
    with mb.open(tmp_path / "s") as buf:  # each stream has room to grow
        buf.extend(steps(50), stream=1, final_obs={"obs": np.zeros((0, 3), "float32")})
        buf.extend(steps(50), stream=0, final_obs={"obs": np.zeros((0, 3), "float32")})
        assert buf.num_episodes == 6


def test_capacity_smaller_than_the_source_is_refused_before_writing(tmp_path):
    npz_source(tmp_path / "d.npz", [10, 20, 5])
    with pytest.raises(InvalidArgumentError, match=r"capacity: expected at least the source's 35 rows.*got 20"):
        convert("npz", tmp_path / "d.npz", tmp_path / "s", capacity=20, progress=False)
    with pytest.raises(InvalidArgumentError, match="capacity: expected a multiple of num_streams=3"):
        convert("npz", tmp_path / "d.npz", tmp_path / "s", capacity=40, num_streams=3, progress=False)
    with pytest.raises(InvalidArgumentError, match="priorities: expected mb.PriorityConfig"):
        convert("npz", tmp_path / "d.npz", tmp_path / "s", priorities=0.6, progress=False)
    # streams whose share does not fit a lane: refused, nothing left behind
    with pytest.raises(InvalidArgumentError, match="capacity: stream 0 of 2"):
        convert("npz", tmp_path / "d.npz", tmp_path / "s", capacity=36, num_streams=2, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["d.npz"]


def test_copy_resizes_restreams_and_changes_priorities(tmp_path):
    buf = mb.create(tmp_path / "src", {"obs": ((2,), "float32")}, capacity=60, num_streams=3,
                    priorities=mb.PriorityConfig(alpha=0.5))
    rng = np.random.default_rng(0)
    data = {}
    for lane in range(3):
        n = 15 + lane
        term = np.zeros(n, bool)
        term[[4, 9]] = True
        data[lane] = rng.random((n, 2)).astype("float32")
        buf.extend({"obs": data[lane], "terminated": term}, stream=lane, final_obs={"obs": rng.random((2, 2))})
    buf.update_priorities(np.arange(5), np.arange(5) + 1.0)
    buf.close()
    s = copy(tmp_path / "src", tmp_path / "big", capacity=300, progress=False)
    with mb.open(tmp_path / "big", mode="r") as big, mb.open(tmp_path / "src", mode="r") as src:
        assert (big.capacity, big.num_streams, big.priorities) == (300, 3, src.priorities)
        assert np.array_equal(big.get(np.r_[100:116])["obs"].numpy(), data[1][:16])
        assert np.array_equal(big.leaf_priorities(np.arange(5)), src.leaf_priorities(np.arange(5)))
    assert s["verified"]
    copy(tmp_path / "src", tmp_path / "four", num_streams=4, capacity=200, priorities=None, progress=False)
    with mb.open(tmp_path / "four", mode="r") as four:
        assert four.num_streams == 4 and four.priorities is None
        assert four.num_episodes == 6 and len(four) == 45
    with pytest.raises(InvalidArgumentError, match=r"num_streams: .*open episodes \(3 needed"):
        copy(tmp_path / "src", tmp_path / "two", num_streams=2, progress=False)
    with pytest.raises(InvalidArgumentError, match="capacity: stream 2 needs 17 rows"):
        copy(tmp_path / "src", tmp_path / "small", capacity=48, progress=False)
    assert not (tmp_path / "two").exists() and not (tmp_path / "small").exists()


def test_cli_capacity_streams_priorities(tmp_path, capsys):
    from mmbuffer._cli.main import main

    npz_source(tmp_path / "d.npz", [10, 20, 5, 15])
    assert main(["convert", "npz", str(tmp_path / "d.npz"), str(tmp_path / "s"), "--capacity", "1e3",
                 "--streams", "2", "--priorities", "alpha=0.7,eps=0.01", "--no-progress", "--json"]) == 0
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert (buf.capacity, buf.num_streams) == (1000, 2)
        assert buf.priorities == mb.PriorityConfig(alpha=0.7, eps=0.01)
    capsys.readouterr()
    assert main(["copy", str(tmp_path / "s"), str(tmp_path / "c"), "--streams", "4", "--priorities", "none",
                 "--no-progress"]) == 0
    with mb.open(tmp_path / "c", mode="r") as buf:
        assert (buf.capacity, buf.num_streams, buf.priorities) == (1000, 4, None)
    with pytest.raises(SystemExit):
        main(["convert", "npz", str(tmp_path / "d.npz"), str(tmp_path / "x"), "--capacity", "1.5"])
    assert "expected a positive integer" in capsys.readouterr().err


def test_convert_help_documents_every_option_and_the_npz_layout(capsys):
    from mmbuffer._cli.main import main

    for cmd in ("convert", "copy", "export"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "--overwrite" in out
        if cmd != "export":
            assert "--capacity" in out and "--streams" in out and "--priorities" in out
    main_help = _help("convert")
    for key in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "infos/"):
        assert key in main_help
    assert "diffusion_policy" in main_help and "tianshou" in main_help and "lerobot" in main_help


def _help(cmd: str) -> str:
    import argparse

    from mmbuffer._cli.convert import add_subcommands

    p = argparse.ArgumentParser()
    add_subcommands(p.add_subparsers())
    for action in p._actions:  # noqa: SLF001 - argparse keeps subparsers here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            sub = action.choices[cmd]
            for a in sub._actions:  # noqa: SLF001
                assert a.help, f"{cmd} {a.option_strings or a.dest}: no help"
            return sub.format_help()
    raise AssertionError("no subcommands")


# -- 3a. Diffusion Policy / UMI -----------------------------------------------------------------
def dp_group(path: Path, *, zarr_format: int = 2, lengths=(10, 15, 25), store=None) -> dict[str, np.ndarray]:
    """A replay buffer as Diffusion Policy's ``ReplayBuffer.create_from_path`` + ``add_episode`` leave it."""
    rng = np.random.default_rng(1)
    n = sum(lengths)
    data = {"action": rng.random((n, 2)).astype("float32"),
            "state": rng.random((n, 5)).astype("float32"),
            "img": rng.integers(0, 255, (n, 12, 12, 3)).astype("uint8"),
            "robot0_eef_pos": rng.random((n, 3)).astype("float64")}
    root = zarr.open_group(store if store is not None else str(path), mode="w", zarr_format=zarr_format)
    for k, v in data.items():
        root.create_array(f"data/{k}", data=v, chunks=(8, *v.shape[1:]))
    root.create_array("meta/episode_ends", data=np.cumsum(lengths).astype("int64"))
    return data


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_diffusion_policy_convert_and_round_trip(tmp_path, zarr_format):
    data = dp_group(tmp_path / "pusht.zarr", zarr_format=zarr_format)
    src = zarr.open_group(str(tmp_path / "pusht.zarr"), mode="a")
    src.attrs["robot"] = "ur5"
    src.create_array("meta/episode_seed", data=np.array([3, 1, 4], "int32"))  # a per-episode value
    s = convert("diffusion_policy", tmp_path / "pusht.zarr", tmp_path / "s", chunk_rows=9, progress=False)
    assert (s["rows"], s["episodes"], s["verified"]) == (50, 3, True)
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert buf.episodes()[1].tolist() == [10, 15, 25]
        got = buf.get(np.arange(50))
        for k, v in data.items():
            assert np.array_equal(got[k].numpy(), v), k
        assert got["truncated"].numpy().nonzero()[0].tolist() == [9, 24, 49]
        assert not got["terminated"].any()
    e = export("diffusion_policy", tmp_path / "s", tmp_path / "back.zarr", zarr_format=zarr_format, progress=False)
    assert e["verified"] and e["rows"] == 50
    back = zarr.open_group(str(tmp_path / "back.zarr"), mode="r")
    assert back.metadata.zarr_format == zarr_format
    # byte for byte, everything the source held (the flags the export adds are the store's)
    assert sorted(back["data"].keys()) == sorted([*data, "terminated", "truncated"])
    assert sorted(back["meta"].keys()) == sorted(src["meta"].keys()) and back.attrs["robot"] == "ur5"
    for key in [*(f"data/{k}" for k in data), "meta/episode_ends", "meta/episode_seed"]:
        a, b = src[key][...], back[key][...]
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), key
    s2 = convert("diffusion_policy", tmp_path / "back.zarr", tmp_path / "s2", progress=False)
    assert s2["checksums"] == s["checksums"]


def test_diffusion_policy_zip_store_and_exported_flags(tmp_path):
    zs = zarr.storage.ZipStore(tmp_path / "umi.zarr.zip", mode="w")
    data = dp_group(tmp_path, store=zs)
    zs.close()
    s = convert("diffusion_policy", tmp_path / "umi.zarr.zip", tmp_path / "s", progress=False)
    assert s["rows"] == 50
    # a store with terminated episodes and an open one: flags come back exactly, the open one is left out
    with mb.create(tmp_path / "t", {"x": ((), "int32")}, capacity=20, next_keys=()) as buf:
        buf.extend({"x": np.arange(12), "terminated": np.isin(np.arange(12), [2, 6]),
                    "truncated": np.arange(12) == 9})
    with pytest.raises(ConversionError, match="2 rows of open .*drop_open_episodes=True"):
        export("diffusion_policy", tmp_path / "t", tmp_path / "t.zarr", progress=False)
    with pytest.warns(ConversionWarning, match=r"left out \(drop_open_episodes\): 2 rows of open"):
        e = export("diffusion_policy", tmp_path / "t", tmp_path / "t.zarr", drop_open_episodes=True, progress=False)
    assert e["skipped_open_rows"] == 2
    convert("diffusion_policy", tmp_path / "t.zarr", tmp_path / "t2", progress=False)
    with mb.open(tmp_path / "t2", mode="r") as buf:
        got = buf.get(np.arange(10))
        assert got["terminated"].nonzero().flatten().tolist() == [2, 6]
        assert got["truncated"].nonzero().flatten().tolist() == [9]
    del data


def test_diffusion_policy_rows_past_the_last_end_are_refused_by_name(tmp_path):
    data = dp_group(tmp_path / "g.zarr", lengths=(10, 15))
    root = zarr.open_group(str(tmp_path / "g.zarr"), mode="a")
    root["meta/episode_ends"][...] = np.array([10, 20])  # rows 20..24: an episode never closed
    with pytest.raises(ConversionError, match=r"\[data/action\]: expected 20 rows \(meta/episode_ends\[-1\]\), got "
                                              r"25: rows \[20, 25\) belong to no episode.*drop_past_ends=True"):
        convert("diffusion_policy", tmp_path / "g.zarr", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    s = convert("diffusion_policy", tmp_path / "g.zarr", tmp_path / "s", drop_past_ends=True, progress=False)
    assert s["rows"] == 20 and s["dropped_rows_past_ends"]["data/action"] == 5
    root.create_array("meta/big", data=np.zeros(5000))
    with pytest.raises(ConversionError, match=r"\[meta/big\]: cannot be kept.*drop_unsupported=True"):
        convert("diffusion_policy", tmp_path / "g.zarr", tmp_path / "t", drop_past_ends=True, progress=False)
    s = convert("diffusion_policy", tmp_path / "g.zarr", tmp_path / "t", drop_past_ends=True, drop_unsupported=True,
                progress=False)
    assert s["dropped_keys"] == ["meta/big"]
    del data


def test_diffusion_policy_bad_input(tmp_path):
    with pytest.raises(ConversionError, match="expected a Diffusion Policy Zarr group"):
        convert("diffusion_policy", tmp_path / "missing.zarr", tmp_path / "s", progress=False)
    root = zarr.open_group(str(tmp_path / "a.zarr"), mode="w", zarr_format=2)
    root.create_array("data/action", data=np.zeros((5, 2), "float32"))
    with pytest.raises(ConversionError, match=r"expected a group 'meta'"):
        convert("diffusion_policy", tmp_path / "a.zarr", tmp_path / "s", progress=False)
    root.create_array("meta/episode_ends", data=np.array([3, 3, 5]))
    with pytest.raises(ConversionError, match=r"meta/episode_ends.*strictly increasing"):
        convert("diffusion_policy", tmp_path / "a.zarr", tmp_path / "s", progress=False)
    root = zarr.open_group(str(tmp_path / "b.zarr"), mode="w", zarr_format=2)
    root.create_array("data/action", data=np.zeros((5, 2), "float32"))
    root.create_array("meta/episode_ends", data=np.array([3, 8]))
    with pytest.raises(ConversionError, match=r"data/action.*expected at least 8 rows"):
        convert("diffusion_policy", tmp_path / "b.zarr", tmp_path / "s", progress=False)
    # a pickle codec would run code when a chunk is decoded: refused from the metadata
    root = zarr.open_group(str(tmp_path / "c.zarr"), mode="w", zarr_format=2)
    root.create_array("data/action", data=np.zeros((5, 2), "float32"))
    root.create_array("meta/episode_ends", data=np.array([5]))
    meta_file = tmp_path / "c.zarr" / "data" / "action" / ".zarray"
    meta = json.loads(meta_file.read_text())
    meta["filters"] = [{"id": "pickle", "protocol": 5}]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ConversionError, match=r"data/.*pickle"):
        convert("diffusion_policy", tmp_path / "c.zarr", tmp_path / "s", progress=False)
    # a symbolic link could point outside the dataset
    root = zarr.open_group(str(tmp_path / "d.zarr"), mode="w", zarr_format=2)
    root.create_array("meta/episode_ends", data=np.array([5]))
    (tmp_path / "d.zarr" / "data").symlink_to(tmp_path / "a.zarr" / "data")
    with pytest.raises(ConversionError, match="symbolic link"):
        convert("diffusion_policy", tmp_path / "d.zarr", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


# -- 3c. Tianshou -------------------------------------------------------------------------------
class _Evil:
    """Unpickling this creates a file: the reader must never unpickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def rollout(n_envs: int, steps_per_env: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Per env, transitions in insertion order (CartPole-like episodes of random length)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_envs):
        t = steps_per_env
        obs = rng.random((t, 4)).astype("float32")
        obs_next = np.empty_like(obs)
        obs_next[:-1] = obs[1:]
        obs_next[-1] = rng.random(4)
        term = rng.random(t) < 0.08
        trunc = np.zeros(t, bool)
        trunc[::23] = True
        trunc &= ~term
        for e in np.flatnonzero(term | trunc):  # a new episode starts after an end
            obs_next[e] = rng.random(4)
        out.append(dict(obs=obs, act=rng.integers(0, 2, t), rew=np.ones(t, "float64"),
                        terminated=term, truncated=trunc, done=term | trunc, obs_next=obs_next,
                        info_env=np.full(t, len(out), "int64")))
    return out


def write_tianshou(path: Path, envs: list[dict[str, np.ndarray]], size: int, evil: str) -> list[tuple[int, int]]:
    """What ``VectorReplayBuffer(size * len(envs), len(envs)).save_hdf5`` writes after adding ``envs``
    (``ReplayBuffer(size)`` for one env); returns, per sub-buffer, (rows kept, ring shift)."""
    n = len(envs)
    maxsize = size * n
    keys = ("obs", "act", "rew", "terminated", "truncated", "done", "obs_next")
    store = {k: np.zeros((maxsize, *envs[0][k].shape[1:]), envs[0][k].dtype) for k in keys}
    info = np.zeros(maxsize, "int64")
    lengths, last, layout = [], [], []
    for j, env in enumerate(envs):
        t = len(env["rew"])
        idx = j * size + np.arange(t) % size  # ReplayBuffer._update_state_pre_add: a ring per env
        for k in keys:
            store[k][idx] = env[k]
        info[idx] = env["info_env"]
        lengths.append(min(t, size))
        last.append(j * size + (t - 1) % size)
        layout.append((min(t, size), t % size if t >= size else 0))
    with h5py.File(path, "w") as f:
        meta = f.create_group("_meta")
        meta.attrs["__data_type__"] = "Batch"
        for k in keys:
            meta.create_dataset(k, data=store[k])
            meta[k].attrs["__data_type__"] = "ndarray"
        g = meta.create_group("info")
        g.attrs["__data_type__"] = "Batch"
        g.create_dataset("env_id", data=info)
        g["env_id"].attrs["__data_type__"] = "ndarray"
        g.create_dataset("note", data=np.frombuffer(pickle.dumps(_Evil(evil)), np.byte))
        g["note"].attrs["__data_type__"] = "pickled_ndarray"
        opts = f.create_group("options")
        for k, v in {"stack_num": 1, "ignore_obs_next": False, "save_only_last_obs": False,
                     "sample_avail": False}.items():
            opts.attrs[k] = v
        for k, v in {"maxsize": maxsize, "stack_num": 1, "_save_obs_next": True, "_save_only_last_obs": False,
                     "_sample_avail": False, "_insertion_idx": 0, "_size": 0, "_ep_return": 0.0,
                     "_ep_len": 0, "_ep_start_idx": 0}.items():
            f.attrs[k] = v
        f.create_dataset("_indices", data=np.arange(maxsize))
        f["_indices"].attrs["__data_type__"] = "ndarray"
        f.create_dataset("_random_state", data=np.frombuffer(pickle.dumps(_Evil(evil)), np.byte))
        f["_random_state"].attrs["__data_type__"] = "RandomState"
        f.create_dataset("last_index", data=np.array(last))
        f["last_index"].attrs["__data_type__"] = "ndarray"
        if n == 1:
            f.attrs["_size"], f.attrs["_insertion_idx"] = lengths[0], (last[0] + 1) % size
        else:
            f.attrs["buffer_num"] = n
            for k, v in {"_offset": np.arange(n) * size, "_extend_offset": np.arange(n + 1) * size,
                         "_lengths": np.array(lengths)}.items():
                f.create_dataset(k, data=v)
                f[k].attrs["__data_type__"] = "ndarray"
            f.create_dataset("buffers", data=np.frombuffer(pickle.dumps(_Evil(evil)), np.byte))
            f["buffers"].attrs["__data_type__"] = "pickled_ndarray"
    return layout


def _kept(env: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    return {k: v[len(v) - rows:] for k, v in env.items()}


@pytest.mark.parametrize("n_envs,steps_per_env,size", [(1, 80, 100), (1, 130, 100), (3, 70, 50), (3, 40, 50)])
def test_tianshou_buffers_in_age_order(tmp_path, n_envs, steps_per_env, size):
    envs = rollout(n_envs, steps_per_env)
    evil = tmp_path / "pwned"
    write_tianshou(tmp_path / "buf.hdf5", envs, size, str(evil))
    # lossless by default: the pickled info/note cannot be stored, so it is refused by name...
    with pytest.raises(ConversionError, match=r"\[_meta/info/note\]: expected a numeric array.*pickled data is "
                                              r"never loaded.*drop_unsupported=True"):
        convert("tianshou", tmp_path / "buf.hdf5", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    # ... and left out when asked; the numeric infos are kept by default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        s = convert("tianshou", tmp_path / "buf.hdf5", tmp_path / "s", drop_unsupported=True, chunk_rows=33,
                    progress=False)
    assert s["verified"] and not evil.exists() and s["dropped_keys"] == ["_meta/info/note"]
    assert s["next_obs_mismatch_rows"] == 0
    kept = [_kept(e, min(steps_per_env, size)) for e in envs]
    want = {k: np.concatenate([e[k] for e in kept]) for k in kept[0]}
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert s["rows"] == len(want["rew"])
        got = buf.get(np.arange(s["rows"]), keys=["obs", "action", "reward", "terminated", "truncated",
                                                   "infos/env_id"])
        assert np.array_equal(got["obs"].numpy(), want["obs"])
        assert np.array_equal(got["action"].numpy(), want["act"])
        assert np.array_equal(got["reward"].numpy(), want["rew"])
        assert np.array_equal(got["terminated"].numpy(), want["terminated"])
        assert np.array_equal(got["infos/env_id"].numpy(), want["info_env"])
        # each sub-buffer's latest row ends an episode (forced truncated when the env was mid-episode)
        ends = np.cumsum([len(e["rew"]) for e in kept]) - 1
        assert got["truncated"].numpy()[ends].astype(bool).__or__(got["terminated"].numpy()[ends]).all()
        inner = np.setdiff1d(np.arange(s["rows"]), ends)
        assert np.array_equal(got["truncated"].numpy()[inner], want["truncated"][inner])
        # the forced flags are recorded: the source's flags can be told apart from the store's
        forced = [int(e) for e in ends if not (want["terminated"][e] or want["truncated"][e])]
        assert buf.attrs["tianshou"]["forced_truncation_rows"] == forced and len(forced) == s.get("forced_truncations", 0)
        # final observations are the obs_next of each episode's last row
        done = np.flatnonzero(got["terminated"].numpy() | got["truncated"].numpy())
        starts, lengths = buf.episodes()
        last = (starts + lengths - 1).numpy()
        assert np.array_equal(np.sort(last), done)
        nxt = buf.get(done, keys=["next_obs"])["next_obs"].numpy()
        assert np.array_equal(nxt, want["obs_next"][done])
    assert "infos/note" not in s["columns"]


def test_tianshou_obs_next_that_differs_is_kept(tmp_path):
    envs = rollout(1, 60)
    env = envs[0]
    inner = int(np.flatnonzero(~(env["terminated"] | env["truncated"]))[3])
    env["obs_next"][inner] += 1.0  # not the following row's obs (a reset inside an episode, a dropped frame)
    write_tianshou(tmp_path / "b.hdf5", envs, 100, str(tmp_path / "pwned"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = convert("tianshou", tmp_path / "b.hdf5", tmp_path / "s", drop_unsupported=True, progress=False)
    assert any("1 rows have a next observation" in str(w.message) and f"first rows [{inner}]" in str(w.message)
               for w in caught)
    assert s["next_obs_mismatch_rows"] == 1
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert buf.next_keys == () and buf.attrs["next_obs"]["first_rows"] == [inner]
        assert np.array_equal(buf.read_range("next/obs", 0, 60), env["obs_next"])  # every row, as the buffer holds it


def test_tianshou_bad_input(tmp_path):
    envs = rollout(2, 30)
    write_tianshou(tmp_path / "v.hdf5", envs, 50, str(tmp_path / "pwned"))
    with h5py.File(tmp_path / "v.hdf5", "a") as f:
        del f["_lengths"]
        f["_lengths"] = np.array([30, 60])
    with pytest.raises(ConversionError, match=r"sub-buffer 1: expected 0 <= _lengths <= 50"):
        convert("tianshou", tmp_path / "v.hdf5", tmp_path / "s", progress=False)
    write_tianshou(tmp_path / "p.hdf5", envs[:1], 50, str(tmp_path / "pwned"))
    with h5py.File(tmp_path / "p.hdf5", "a") as f:
        obs = f["_meta/obs"][()]
        del f["_meta/obs"]
        f["_meta/obs"] = np.frombuffer(pickle.dumps(obs), np.byte)
        f["_meta/obs"].attrs["__data_type__"] = "pickled_ndarray"
    with pytest.raises(ConversionError, match=r"_meta/obs.*pickled data is never loaded"):
        convert("tianshou", tmp_path / "p.hdf5", tmp_path / "s", progress=False)
    with h5py.File(tmp_path / "q.hdf5", "w") as f:
        f["observations"] = np.zeros(3)
    with pytest.raises(ConversionError, match="expected a group _meta"):
        convert("tianshou", tmp_path / "q.hdf5", tmp_path / "s", progress=False)
    with pytest.raises(ConversionError, match="found a directory"):
        convert("tianshou", tmp_path, tmp_path / "s", progress=False)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "s").exists()


# -- 3b. LeRobot v3 -----------------------------------------------------------------------------
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_lerobot(root: Path, lengths: list[int], *, files: int = 2, video: bool = False,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """A dataset as ``LeRobotDataset`` v3.0 writes it (lerobot/datasets/utils.py: DEFAULT_DATA_PATH,
    DEFAULT_EPISODES_PATH, create_empty_dataset_info, DEFAULT_FEATURES; 1-d features as fixed-size
    lists, (1,)-shaped ones as scalars, 2-d as nested lists)."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    ep = np.repeat(np.arange(len(lengths)), lengths)
    frame = np.concatenate([np.arange(k) for k in lengths])
    done = np.zeros(n, bool)
    ends = np.cumsum(lengths) - 1
    done[ends[::2]] = True  # every other episode ends in success (next.done)
    cols = {
        "observation.state": rng.random((n, 6)).astype("float32"),
        "observation.environment_state": rng.random((n, 3, 2)).astype("float32"),
        "action": rng.random((n, 2)).astype("float32"),
        "next.reward": rng.random(n).astype("float32"),
        "next.done": done,
        "timestamp": (frame / 10).astype("float32"),
        "frame_index": frame.astype("int64"),
        "episode_index": ep.astype("int64"),
        "index": np.arange(n, dtype="int64"),
        "task_index": np.zeros(n, "int64"),
    }
    features = {
        "observation.state": {"dtype": "float32", "shape": [6], "names": [f"j{i}" for i in range(6)]},
        "observation.environment_state": {"dtype": "float32", "shape": [3, 2], "names": None},
        "action": {"dtype": "float32", "shape": [2], "names": ["x", "y"]},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    if video:
        features["observation.images.top"] = {"dtype": "video", "shape": [96, 96, 3],
                                              "names": ["height", "width", "channels"]}

    def arrow(key: str, v: np.ndarray) -> pa.Array:
        if v.ndim == 1:
            return pa.array(v)
        if v.ndim == 2:
            return pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
        return pa.array(v.tolist())  # Array2D: nested lists

    # episodes are never split across files: cut at an episode boundary
    cut = int(np.cumsum(lengths)[len(lengths) // 2 - 1]) if files == 2 else n
    bounds = [(0, cut), (cut, n)] if files == 2 else [(0, n)]
    for i, (a, b) in enumerate(bounds):
        path = root / "data" / "chunk-000" / f"file-{i:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({k: arrow(k, v[a:b]) for k, v in cols.items()}), path, row_group_size=16)
    starts = np.cumsum(lengths) - np.array(lengths)
    episodes = pa.table({
        "episode_index": pa.array(np.arange(len(lengths), dtype="int64")),
        "tasks": pa.array([["push the block"]] * len(lengths)),
        "length": pa.array(np.array(lengths, "int64")),
        "dataset_from_index": pa.array(starts.astype("int64")),
        "dataset_to_index": pa.array((starts + lengths).astype("int64")),
        "data/chunk_index": pa.array(np.zeros(len(lengths), "int64")),
        "data/file_index": pa.array((starts >= cut).astype("int64")),
        "meta/episodes/chunk_index": pa.array(np.zeros(len(lengths), "int64")),
        "meta/episodes/file_index": pa.array(np.zeros(len(lengths), "int64")),
    })
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    pq.write_table(episodes, root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    pq.write_table(pa.table({"task_index": pa.array([0]), "__index_level_0__": pa.array(["push the block"])}),
                   root / "meta" / "tasks.parquet")
    info = {
        "codebase_version": "v3.0", "robot_type": "pusht", "total_episodes": len(lengths), "total_frames": n,
        "total_tasks": 1, "chunks_size": 1000, "data_files_size_in_mb": 100, "video_files_size_in_mb": 500,
        "fps": 10, "splits": {"train": f"0:{len(lengths)}"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4" if video else None,
        "features": features,
    }
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    return cols


@pytest.mark.parametrize("chunk_rows", [7, 1000])
def test_lerobot_v3_tabular_features(tmp_path, chunk_rows):
    lengths = [12, 30, 7, 21]
    cols = write_lerobot(tmp_path / "pusht", lengths)
    s = convert("lerobot", tmp_path / "pusht", tmp_path / "s", chunk_rows=chunk_rows, progress=False)
    assert (s["rows"], s["episodes"], s["verified"]) == (70, 4, True)
    with mb.open(tmp_path / "s", mode="r") as buf:
        assert buf.episodes()[1].tolist() == lengths
        got = buf.get(np.arange(70))
        assert np.array_equal(got["obs/state"].numpy(), cols["observation.state"])
        assert np.array_equal(got["obs/environment_state"].numpy(), cols["observation.environment_state"])
        assert np.array_equal(got["action"].numpy(), cols["action"])
        assert np.array_equal(got["reward"].numpy(), cols["next.reward"])
        assert np.array_equal(got["episode_index"].numpy(), cols["episode_index"])
        ends = np.cumsum(lengths) - 1
        assert got["terminated"].nonzero().flatten().tolist() == ends[::2].tolist()
        assert got["truncated"].nonzero().flatten().tolist() == ends[1::2].tolist()
        assert buf.attrs["lerobot"]["fps"] == 10
        assert buf.attrs["lerobot"]["tasks"] == {"0": "push the block"}  # meta/tasks.parquet, kept


@pytest.mark.parametrize(("chunk_rows", "sizes"), [(7, [7, 7, 2] * 4 + [6]), (40, [32, 32, 6]), (1000, [70])])
def test_lerobot_frames_are_read_a_row_group_at_a_time(tmp_path, chunk_rows, sizes):
    """Row groups of 16 frames (70 in all): a group of at least half a chunk is cut into
    chunks on its own; smaller ones are joined until they hold half a chunk, or the file
    ends. (Joining up to a whole chunk held two groups and their copy per chunk.)"""
    from mmbuffer.convert import LeRobotReader

    cols = write_lerobot(tmp_path / "d", [12, 30, 7, 21], files=1)
    chunks = list(LeRobotReader(tmp_path / "d").chunks(chunk_rows))
    assert [len(c.steps["action"]) for c in chunks] == sizes
    assert np.array_equal(np.concatenate([c.steps["action"] for c in chunks]), cols["action"])


def test_lerobot_text_features_and_inner_done_are_refused_by_name(tmp_path):
    write_lerobot(tmp_path / "t", [5, 6], files=1)
    info_path = tmp_path / "t" / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["language_instruction"] = {"dtype": "string", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info))
    with pytest.raises(ConversionError, match=r"\[language_instruction\]: string features \['language_instruction'\] "
                                              r"cannot be stored.*drop_unsupported=True"):
        convert("lerobot", tmp_path / "t", tmp_path / "s", progress=False)
    s = convert("lerobot", tmp_path / "t", tmp_path / "s", drop_unsupported=True, progress=False)
    assert s["dropped_keys"] == ["language_instruction"] and s["rows"] == 11
    cols = write_lerobot(tmp_path / "d", [5, 6], files=1)
    done = cols["next.done"].copy()
    done[2] = True  # inside episode 0: the store's flags could not say it
    path = tmp_path / "d" / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index("next.done"), "next.done", pa.array(done)), path)
    with pytest.raises(ConversionError, match=r"\[next.done\]: expected next.done only on an episode's last frame.*"
                                              r"frames \[2\]"):
        convert("lerobot", tmp_path / "d", tmp_path / "s2", progress=False)


def test_lerobot_video_without_its_episode_metadata_refused_unless_skipped(tmp_path):
    # a video feature whose meta/episodes has no videos/<key>/... columns (decoding: test_lerobot_video.py)
    write_lerobot(tmp_path / "aloha", [5, 6], video=True, files=1)
    with pytest.raises(ConversionError, match=r"\[meta/episodes/chunk-000/file-000.parquet\]: expected columns "
                                              r"episode_index and videos/observation.images.top/chunk_index.*missing "
                                              r"\['videos/observation.images.top/chunk_index'"):
        convert("lerobot", tmp_path / "aloha", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    with pytest.warns(ConversionWarning, match="video/image features left out"):
        s = convert("lerobot", tmp_path / "aloha", tmp_path / "s", skip_visual=True, progress=False)
    assert s["rows"] == 11 and "observation.images.top" not in s["columns"]


def test_lerobot_bad_input(tmp_path):
    write_lerobot(tmp_path / "a", [5, 6, 4])
    info = json.loads((tmp_path / "a" / "meta" / "info.json").read_text())
    info["codebase_version"] = "v2.1"
    (tmp_path / "a" / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ConversionError, match="expected codebase_version v3.x"):
        convert("lerobot", tmp_path / "a", tmp_path / "s", progress=False)
    info["codebase_version"], info["total_frames"] = "v3.0", 99
    (tmp_path / "a" / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ConversionError, match=r"total_frames: expected 15 \(meta/episodes\), got 99"):
        convert("lerobot", tmp_path / "a", tmp_path / "s", progress=False)
    # episode lengths in meta/ that disagree with the frames' episode_index
    write_lerobot(tmp_path / "b", [5, 6, 4])
    ep_file = tmp_path / "b" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(ep_file)
    t = t.set_column(t.schema.get_field_index("length"), "length", pa.array(np.array([6, 5, 4], "int64")))
    pq.write_table(t, ep_file)
    with pytest.raises(ConversionError, match=r"frame 5: expected episode_index 0"):
        convert("lerobot", tmp_path / "b", tmp_path / "s", progress=False)
    with pytest.raises(ConversionError, match="no meta/info.json"):
        convert("lerobot", tmp_path, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


# -- 2. Minari: dataset ids and the reset info ------------------------------------------------------
gym = pytest.importorskip("gymnasium")
minari = pytest.importorskip("minari")


class CountingInfo(gym.Wrapper):
    """CartPole whose reset and step infos carry numbers (the reset info differs from every step's)."""

    def reset(self, **kwargs):
        obs, _ = self.env.reset(**kwargs)
        self.t = 0
        return obs, {"t": np.int64(-1), "x": np.float32(obs[0])}

    def step(self, action):
        obs, r, term, trunc, _ = self.env.step(action)
        self.t += 1
        return obs, r, term, trunc, {"t": np.int64(self.t), "x": np.float32(obs[0])}


def collect_minari(tmp_path, monkeypatch, dataset_id: str, n_episodes: int, data_format: str = "hdf5"):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    env = CountingInfo(gym.make("CartPole-v1", max_episode_steps=30))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collector = minari.DataCollector(env, data_format=data_format, record_infos=True)
        collector.action_space.seed(0)
        for i in range(n_episodes):
            collector.reset(seed=i)
            while True:
                *_, term, trunc, _ = collector.step(collector.action_space.sample())
                if term or trunc:
                    break
        collector.create_dataset(dataset_id=dataset_id, algorithm_name="random", author="t",
                                 author_email="t@x", code_permalink="x", description="test")
        collector._tmp_dir.cleanup()  # noqa: SLF001 - see tests/convert/test_convert.py::make_minari
        collector.env.close()


@pytest.mark.parametrize("data_format", ["hdf5", "arrow"])
def test_minari_dataset_id_and_reset_info(tmp_path, monkeypatch, data_format):
    if data_format == "arrow":
        pytest.importorskip("pyarrow")
    collect_minari(tmp_path, monkeypatch, "cartpole/random-v0", 4, data_format)
    from mmbuffer._cli.main import main

    # the id, resolved in MINARI_DATASETS_PATH (no download), on the command line
    assert main(["convert", "minari", "cartpole/random-v0", str(tmp_path / "s"), "--keep-infos",
                 "--no-progress", "--json"]) == 0
    assert main(["convert", "minari", "cartpole/random", str(tmp_path / "s2"), "--no-progress"]) == 0  # latest
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        episodes = list(minari.load_dataset("cartpole/random-v0").iterate_episodes())
    with mb.open(tmp_path / "s", mode="r") as buf:
        starts, lengths = buf.episodes()
        for ep, s, n in zip(episodes, starts.tolist(), lengths.tolist()):
            rows = np.arange(s, s + n)
            got = buf.get(rows, keys=["infos/t", "next_infos/t", "infos/x"])
            final = buf.get(rows[-1:], keys=["next_infos/t"])["next_infos/t"].numpy()
            # every info Minari recorded, the reset info (t = -1) first, none made up
            assert np.array_equal(np.concatenate([got["infos/t"].numpy(), final]), ep.infos["t"])
            assert got["infos/t"][0] == -1 and np.array_equal(got["next_infos/t"].numpy(), np.arange(1, n + 1))
            assert np.array_equal(got["infos/x"].numpy(), ep.infos["x"][:-1])
    with pytest.raises(ConversionError, match=r"cartpole/missing-v3: expected a Minari dataset .* nothing is downloaded"):
        convert("minari", "cartpole/missing-v3", tmp_path / "s3", progress=False)


def _h5_datasets(group, prefix=""):
    out = {}
    for k, v in group.items():
        out.update(_h5_datasets(v, f"{prefix}{k}/") if isinstance(v, h5py.Group) else {f"{prefix}{k}": v[()]})
    return out


def test_minari_convert_export_is_byte_equal_by_default(tmp_path, monkeypatch):
    """convert -> export gives every episode's datasets back byte for byte (observations,
    actions, rewards, flags and the infos, kept by default, reset info included)."""
    collect_minari(tmp_path, monkeypatch, "cartpole/random-v0", 4)
    s = convert("minari", "cartpole/random-v0", tmp_path / "s", progress=False)
    assert "infos/t" in s["checksums"] and "dropped_keys" not in s
    out = tmp_path / "minari" / "cartpole" / "back-v0"
    export("minari", tmp_path / "s", out, dataset_id="cartpole/back-v0", progress=False)
    src = tmp_path / "minari" / "cartpole" / "random-v0" / "data" / "main_data.hdf5"
    with h5py.File(src) as f, h5py.File(out / "data" / "main_data.hdf5") as g:
        assert sorted(f) == sorted(g) and len(f) == 4
        for ep in f:
            a, b = _h5_datasets(f[ep]), _h5_datasets(g[ep])
            assert sorted(a) == sorted(b) and {"infos/t", "infos/x", "observations"} <= set(a), ep
            for key in a:
                assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, (ep, key)
                assert a[key].tobytes() == b[key].tobytes(), (ep, key)


def test_minari_info_leaf_a_store_cannot_hold_is_refused_by_name(tmp_path, monkeypatch):
    collect_minari(tmp_path, monkeypatch, "cartpole/random-v0", 3)
    src = tmp_path / "minari" / "cartpole" / "random-v0" / "data" / "main_data.hdf5"
    with h5py.File(src, "a") as f:
        t = f["episode_1/rewards"].shape[0]
        f["episode_1/infos/label"] = np.array([b"abc"] * (t + 1))  # text, in one episode only
    with pytest.raises(ConversionError, match=r"\[infos/label\]: info leaf 'infos/label' cannot be stored as a "
                                              r"column: episode_1: dtype \|S3, not numeric.*drop_unsupported=True"):
        convert("minari", "cartpole/random-v0", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    s = convert("minari", "cartpole/random-v0", tmp_path / "s", drop_unsupported=True, progress=False)
    assert s["dropped_keys"] == ["infos/label"] and {"infos/t", "infos/x"} <= set(s["checksums"])
    s = convert("minari", "cartpole/random-v0", tmp_path / "d", drop_infos=True, progress=False)
    assert not any(k.startswith("infos/") for k in s["checksums"])


def test_minari_arrow_missing_values_are_refused_not_filled(tmp_path, monkeypatch):
    pa_ipc = pytest.importorskip("pyarrow.ipc")
    collect_minari(tmp_path, monkeypatch, "cartpole/random-v0", 2, "arrow")
    part = tmp_path / "minari" / "cartpole" / "random-v0" / "data" / "1" / "part-0.arrow"
    with pa_ipc.open_file(part) as f:
        table = f.read_all()
    infos = table.column("infos").combine_chunks()
    t = infos.field("t").to_numpy(zero_copy_only=False).astype("int64")
    mask = np.zeros(len(t), bool)
    mask[0] = True  # the reset info lacks "t": Arrow stores a null there
    fields = [pa.array(t, mask=mask) if name == "t" else infos.field(i) for i, name in enumerate(infos.type.names)]
    table = table.set_column(table.column_names.index("infos"), "infos",
                             pa.StructArray.from_arrays(fields, names=infos.type.names))
    with pa_ipc.new_file(part, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ConversionError, match=r"\[infos/t\]: info leaf 'infos/t' cannot be stored as a column: 1: "
                                              r"missing \(null\) values at rows \[0\].*drop_unsupported=True"):
        convert("minari", "cartpole/random-v0", tmp_path / "s", progress=False)
    s = convert("minari", "cartpole/random-v0", tmp_path / "s", drop_unsupported=True, progress=False)
    assert s["dropped_keys"] == ["infos/t"] and "infos/x" in s["checksums"]


def test_minari_episode_without_an_end_flag_is_recorded(tmp_path, monkeypatch):
    collect_minari(tmp_path, monkeypatch, "cartpole/random-v0", 3)
    src = tmp_path / "minari" / "cartpole" / "random-v0" / "data" / "main_data.hdf5"
    with h5py.File(src, "a") as f:  # episode 1 stops with neither flag
        for key in ("terminations", "truncations"):
            flags = f[f"episode_1/{key}"][()]
            flags[-1] = False
            f[f"episode_1/{key}"][...] = flags
    with pytest.warns(ConversionWarning, match="episode 1 ends with neither terminated nor truncated"):
        s = convert("minari", "cartpole/random-v0", tmp_path / "s", progress=False)
    assert s["forced_truncations"] == 1 and s["forced_truncation_episodes"] == [1]
    with mb.open(tmp_path / "s", mode="r") as buf:  # the source's flags stay recoverable
        assert buf.attrs["convert"]["stats"]["forced_truncation_episodes"] == [1]


def test_minari_infos_survive_export(tmp_path, monkeypatch):
    collect_minari(tmp_path, monkeypatch, "cartpole/random-v0", 3)
    convert("minari", "cartpole/random-v0", tmp_path / "s", keep_infos=True, progress=False)
    out = tmp_path / "minari" / "cartpole" / "back-v0"
    export("minari", tmp_path / "s", out, dataset_id="cartpole/back-v0", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = list(minari.load_dataset("cartpole/random-v0").iterate_episodes())
        b = list(minari.load_dataset("cartpole/back-v0").iterate_episodes())
    for x, y in zip(a, b):
        assert np.array_equal(x.infos["t"], y.infos["t"]) and np.array_equal(x.infos["x"], y.infos["x"])
        assert np.array_equal(x.observations, y.observations)
    export("d4rl", tmp_path / "s", tmp_path / "d.hdf5", progress=False)  # infos stay row for row there
    with h5py.File(tmp_path / "d.hdf5") as f:
        assert f["infos/t"].shape[0] == f["observations"].shape[0]


def test_cli_summaries_are_readable(tmp_path, capsys):
    from mmbuffer._cli.main import main

    long = "observation_with_a_very_long_column_name_indeed"
    with mb.create(tmp_path / "s", {long: ((2,), "float32")}, capacity=10, next_keys=()) as buf:
        buf.extend({long: np.zeros((4, 2)), "terminated": np.arange(4) == 3})
    assert main(["copy", str(tmp_path / "s"), str(tmp_path / "c"), "--compression", "none", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "compression" in out and "none" in out.split("compression")[1].splitlines()[0]
    assert "crc32 of 3 lane:column pairs" in out and len(out.splitlines()) < 20
    assert main(["export", "diffusion_policy", str(tmp_path / "s"), str(tmp_path / "o.zarr"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if long in x)
    assert line.split()[0] == long and len(line.split()) == 2  # the name and its checksum, apart


def test_diffusion_policy_zip_export_round_trip(tmp_path):
    data = dp_group(tmp_path / "src.zarr")
    convert("diffusion_policy", tmp_path / "src.zarr", tmp_path / "s", progress=False)
    e = export("diffusion_policy", tmp_path / "s", tmp_path / "out.zarr.zip", progress=False)
    assert e["verified"] and (tmp_path / "out.zarr.zip").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out.zarr.zip", "s", "src.zarr"]  # no temporary left
    zs = zarr.storage.ZipStore(tmp_path / "out.zarr.zip", mode="r")
    back = zarr.open_group(zs, mode="r")
    assert back["meta/episode_ends"][:].tolist() == [10, 25, 50]
    assert np.array_equal(back["data/img"][:], data["img"])
    zs.close()
    export("diffusion_policy", tmp_path / "s", tmp_path / "out.zarr.zip", overwrite=True, progress=False)
    (tmp_path / "notes.zip").write_bytes((tmp_path / "out.zarr.zip").read_bytes()[:0] + b"PK\x05\x06" + bytes(18))
    with pytest.raises(mb.errors.StoreExistsError, match="without meta/episode_ends"):
        export("diffusion_policy", tmp_path / "s", tmp_path / "notes.zip", overwrite=True, progress=False)
