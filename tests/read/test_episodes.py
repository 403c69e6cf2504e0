"""``buf.episode(i)`` and ``buf.iter_episodes()``: whole episodes, steps in order, wrap undone."""

import numpy as np
import pytest
import torch

import mmbuffer as mb


def _store(path, streams=3, lane=37, rounds=9, seed=0):
    """Rows encode (stream, absolute row): x = 1000 * stream + absolute; obs = [absolute, stream].
    Returns the buffer and, per stream, the final observation of each episode by its end."""
    buf = mb.create(path, {"x": ((), "int64"), "obs": ((2,), "float32")}, capacity=streams * lane, num_streams=streams)
    rng = np.random.default_rng(seed)
    written = [0] * streams
    finals = {}
    for _ in range(rounds):
        for s in range(streams):
            n = int(rng.integers(5, 15))
            absolute = written[s] + np.arange(n)
            done = rng.random(n) < 0.3
            final = np.stack([-absolute[done] - 1.0, np.full(int(done.sum()), s)], 1)
            for a, f in zip(absolute[done], final):
                finals[(s, int(a) + 1)] = f
            buf.extend({"x": 1000 * s + absolute, "obs": np.stack([absolute, np.full(n, s)], 1),
                        "truncated": done}, stream=s, final_obs={"obs": final})
            written[s] += n
    return buf, finals


def test_episodes_are_whole_in_order_and_unwrapped(tmp_path):
    buf, finals = _store(tmp_path / "s")
    starts, lengths = buf.episodes()
    assert buf.num_episodes == len(starts) > 10
    eps = list(buf.iter_episodes())
    assert len(eps) == buf.num_episodes
    wrapped = 0
    for i, (ep, start, length) in enumerate(zip(eps, starts.tolist(), lengths.tolist())):
        one = buf.episode(i)
        assert set(ep) == {"x", "obs", "terminated", "truncated", "next_obs"}
        for k in ep:
            torch.testing.assert_close(ep[k], one[k])
        x = ep["x"].numpy()
        lane = start // buf.lane_size
        assert len(x) == length and (x // 1000 == lane).all() and (np.diff(x) == 1).all()  # steps in order
        assert ep["truncated"].tolist() == [False] * (length - 1) + [True]
        # next_obs: the following step's obs inside the episode, the stored final observation at its end
        torch.testing.assert_close(ep["next_obs"][:-1], ep["obs"][1:])
        end = int(x[-1] % 1000) + 1
        np.testing.assert_array_equal(ep["next_obs"][-1].numpy(), finals[(lane, end)])
        # the rows are those of buf.get at start + arange(length), wrapping inside the lane
        base = lane * buf.lane_size
        rows = base + (start - base + np.arange(length)) % buf.lane_size
        torch.testing.assert_close(ep["obs"], buf.get(rows)["obs"])
        wrapped += bool((np.diff(rows) < 0).any())
    assert wrapped > 0  # the ring's seam runs through at least one episode
    assert [int(e["x"][0]) // 1000 for e in eps] == sorted(int(e["x"][0]) // 1000 for e in eps)  # lane by lane
    buf.close()


def test_episode_index_keys_and_refusals(tmp_path):
    buf, _ = _store(tmp_path / "s", streams=2)
    n = buf.num_episodes
    torch.testing.assert_close(buf.episode(-1)["x"], buf.episode(n - 1)["x"])
    torch.testing.assert_close(buf.episode(-n)["x"], buf.episode(0)["x"])
    assert set(buf.episode(0, keys=["x"])) == {"x"}
    assert [set(e) for e in buf.iter_episodes(keys=("obs", "next_obs"))][0] == {"obs", "next_obs"}
    for bad in (n, -n - 1):
        with pytest.raises(mb.errors.InvalidArgumentError, match=rf"i: expected an episode number in \[-{n}, {n}\), got {bad}"):
            buf.episode(bad)
    with pytest.raises(mb.errors.InvalidArgumentError, match="i: expected an integer"):
        buf.episode(1.5)
    with pytest.raises(mb.errors.InvalidArgumentError, match="keys"):
        buf.episode(0, keys=["nope"])
    buf.close()


def test_an_empty_store_has_no_episodes(tmp_path):
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=8, next_keys=())
    buf.extend({"x": np.arange(3)})  # an open episode is not an episode yet
    assert list(buf.iter_episodes()) == []
    with pytest.raises(mb.errors.InvalidArgumentError, match=r"in \[0, 0\)"):
        buf.episode(0)


def test_a_reader_skips_episodes_the_writer_rewrites(tmp_path):
    """A reader's episodes are checked against the writer's reservation: once the
    writer (uncommitted) laps part of the ring, the reader no longer returns the
    episodes there, and what it returns holds the committed rows."""
    buf, _ = _store(tmp_path / "s", streams=1, lane=64, rounds=12)
    buf.commit()
    ro = mb.open(tmp_path / "s", mode="r")
    before = [int(e["x"][0]) for e in ro.iter_episodes()]
    w = int(buf.view().written[0])
    absolute = w + np.arange(40)
    buf.extend({"x": 777_000 + absolute, "obs": np.zeros((40, 2)), "truncated": absolute % 8 == 7},
               stream=0, final_obs={"obs": np.zeros((5, 2))})
    after = [e for e in ro.iter_episodes()]
    assert 0 < len(after) < len(before)
    for ep in after:
        x = ep["x"].numpy()
        assert (x < 777_000).all() and (np.diff(x) == 1).all()
    first = ro.episode(0)["x"].numpy()
    assert (first < 777_000).all() and int(first[0]) > before[0]
    buf.close()
