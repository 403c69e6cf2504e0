"""Writers on many hosts through Ray, on a local Ray cluster started by the test.

Several env actors (worker processes) send episodes into distinct streams of one
store through the actor that owns its writer, while the learner (this process)
samples it with ``mb.open(path, "r")``; a killed env actor loses only its open
episode; a killed owner loses nothing committed; priorities flow back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import mmbuffer as mb

ray = pytest.importorskip("ray")
import mmbuffer.ray as mbray  # noqa: E402

COLUMNS = {"obs": ((3,), "float32"), "x": ((), "int64")}
LEN = 40


@pytest.fixture(scope="module")
def cluster():
    # workers import this file's actors and the mmbuffer under test, not another install
    here = Path(__file__).resolve().parent  # test_ray (the actors), and tests/ above it: conftest, s3server
    paths = [str(here), str(here.parent), str(Path(mb.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
    # in the environment the cluster's processes start with, not a runtime_env: Ray then
    # starts a new worker for each actor (2-3 s here) instead of leasing an idle one (0.4-1 s)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def episode(stream: int, ep: int, length: int = LEN, *, end: bool = True) -> dict:
    """Steps that say where they come from: obs = (stream, episode, t), x = t."""
    t = np.arange(length)
    obs = np.stack([np.full(length, stream), np.full(length, ep), t], axis=1).astype("float32")
    return {"obs": obs, "x": t, "terminated": (t == length - 1) & end}


@ray.remote(num_cpus=0)
class Env:
    def __init__(self, writer, stream: int) -> None:
        self.sender = mbray.Sender(writer, stream, batch_rows=3 * LEN, max_in_flight=2)
        self.stream = stream

    def run(self, episodes: int, *, then_open: int = 0) -> int:
        for ep in range(episodes):
            self.sender.extend(episode(self.stream, ep), final_obs={"obs": np.full((1, 3), -1.0)})
        gen = self.sender.wait()
        if then_open:  # an episode being collected, never finished: lost when the actor dies
            self.sender.extend(episode(self.stream, episodes, then_open, end=False))
            self.sender.flush()
        return gen


def check_rows(batch: mb.Batch, lane_size: int) -> None:
    obs, x = batch.data["obs"].numpy(), batch.data["x"].numpy()
    assert (obs[..., 0] == batch.indices.numpy() // lane_size).all()  # each stream writes its own lane
    assert (obs[..., 2] == x).all()


@pytest.mark.slow
def test_actors_write_streams_concurrently_while_the_learner_samples(tmp_path, cluster):
    path = str(tmp_path / "replay")
    h = mbray.serve(path, columns=COLUMNS, capacity=3 * 4096, num_streams=3, commit_interval=0.05)
    envs = [Env.remote(h, s) for s in range(3)]
    runs = [e.run.remote(15) for e in envs]
    ro = mb.open(path, mode="r")
    samples = 0
    while True:
        ready, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        ro.refresh()
        if len(ro) > 0:
            b = ro.sample_slices(8, 8, strict=True) if ro.num_episodes else ro.sample(16)
            check_rows(b, ro.lane_size)
            samples += 1
        if len(ready) == len(runs):
            break
        time.sleep(0.02)
    ray.get(runs)
    ray.get(h.commit.remote())
    ro.refresh()
    assert samples > 0 and ro.num_episodes == 45 and len(ro) == 45 * LEN
    starts, lengths = ro.episodes()
    assert np.bincount(starts.numpy() // ro.lane_size, minlength=3).tolist() == [15, 15, 15]
    info = ray.get(h.info.remote())
    assert info["rows_received"] == 45 * LEN and info["episodes"] == 45
    ray.get(h.close.remote())
    ray.kill(h)


@pytest.mark.slow
def test_a_killed_env_actor_loses_only_its_open_episode(tmp_path, cluster):
    path = str(tmp_path / "replay")
    h = mbray.serve(path, columns=COLUMNS, capacity=2 * 4096, num_streams=2, commit_interval=0.0)
    doomed, fine = Env.remote(h, 0), Env.remote(h, 1)
    ray.get(doomed.run.remote(3, then_open=25))
    ray.kill(doomed)
    ray.get(fine.run.remote(4))
    ray.get(h.commit.remote())
    with mb.open(path, mode="r") as ro:
        starts, lengths = ro.episodes()
        lanes = starts.numpy() // ro.lane_size
        assert np.bincount(lanes, minlength=2).tolist() == [3, 4]
        assert len(ro) == 7 * LEN  # no row of the unfinished episode reached the store
    ray.get(h.close.remote())
    ray.kill(h)


@pytest.mark.slow
def test_a_killed_owner_loses_nothing_committed_and_priorities_flow_back(tmp_path, cluster):
    path = str(tmp_path / "replay")
    h = mbray.serve(path, columns=COLUMNS, capacity=2 * 4096, num_streams=2, commit_interval=1e9,
                    priorities=mb.PriorityConfig(alpha=1.0, eps=0.0), name="owner-test")
    assert ray.get_actor("owner-test") is not None
    env = Env.remote(h, 1)
    ray.get(env.run.remote(5))
    committed = ray.get(h.commit.remote())
    ro = mb.open(path, mode="r")
    b = ro.sample(32)
    new = np.arange(32, dtype=np.float64) + 1.0
    ray.get(h.update_priorities.remote(b.indices, new, b.written_at))
    ray.get(h.commit.remote())
    ro.refresh()
    last = {int(i): p for i, p in zip(b.indices.tolist(), new)}  # duplicates: the last value wins
    np.testing.assert_allclose(ro.leaf_priorities(list(last)), list(last.values()))
    ray.get(env.run.remote(3))  # extended, never committed
    ray.kill(h)  # the owner dies without a commit or close
    ray.kill(env)
    h2 = mbray.serve(path)  # create-or-open: recovers the store as after any crash
    info = ray.get(h2.info.remote())
    assert info["episodes"] >= 5 and info["generation"] >= committed
    with mb.open(path, mode="r") as again:
        assert again.num_episodes >= 5
        np.testing.assert_allclose(again.leaf_priorities(list(last)), list(last.values()))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(h.info.remote())
    ray.get(h2.close.remote())
    ray.kill(h2)
    ro.close()


def test_serve_refuses_a_url_and_missing_schema(tmp_path, cluster):
    with pytest.raises(mb.errors.InvalidArgumentError, match="expected a local path"):
        mbray.serve("s3://bucket/replay", columns=COLUMNS, capacity=100)
    with pytest.raises(Exception, match="columns, capacity: expected both"):
        mbray.serve(str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()
