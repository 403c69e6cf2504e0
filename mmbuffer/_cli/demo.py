"""``mmbuffer demo``: the main job end to end on generated trajectories.

Builds a store from a vectorized point-mass task (4 streams, episodes that end by
termination or by truncation), samples transitions, slices and priorities from
it, reopens it read-only as another run would, verifies it, and prints a summary.

>>> import tempfile
>>> summary = run_demo(tempfile.mkdtemp() + "/demo", episodes=8, quiet=True)
>>> summary["episodes"] == summary["reopened_episodes"] and summary["verify_ok"]
True
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

OBS, ACT = 4, 2


def rollout(rng: np.random.Generator, max_len: int = 200) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One episode of a 2-D point mass pushed by random forces.

    It terminates when the mass leaves the unit box, or is truncated at
    ``max_len`` steps. Returns the steps and the final observation.
    """
    force = rng.normal(0.0, 0.05, size=(max_len, ACT)).astype(np.float32)
    vel = np.cumsum(force, axis=0) * 0.9
    pos = np.cumsum(vel, axis=0) * 0.1 + rng.uniform(-0.5, 0.5, size=ACT)
    states = np.concatenate([pos, vel], axis=1).astype(np.float32)  # state after each step
    outside = np.flatnonzero(np.abs(pos).max(axis=1) > 1.0)
    length = int(outside[0]) + 1 if outside.size else max_len
    first = np.concatenate([rng.uniform(-0.5, 0.5, size=ACT), np.zeros(ACT)]).astype(np.float32)
    obs = np.concatenate([first[None], states[: length - 1]])
    steps = {
        "obs": obs,
        "action": force[:length],
        "reward": -np.linalg.norm(states[:length, :ACT], axis=1).astype(np.float32),
        "terminated": np.arange(length) == (length - 1 if outside.size else -1),
        "truncated": np.arange(length) == (length - 1 if not outside.size else -1),
    }
    return steps, states[length - 1]


def run_demo(directory: str | Path | None = None, episodes: int = 400, quiet: bool = False,
             interrupted: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Run the demo in ``directory`` (a fresh temporary one by default): ``episodes``
    (>= 1, else ``InvalidArgumentError`` before anything is created) over 4 streams.
    ``interrupted``: asked before each episode; True raises ``KeyboardInterrupt``."""
    import mmbuffer as mb
    from mmbuffer._ledger.verify import verify

    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:  # before anything is created
        raise mb.errors.InvalidArgumentError(f"episodes: expected an integer >= 1, got {episodes!r}")
    say = (lambda *a: None) if quiet else print
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="mmbuffer-demo-"))
    path = root / "replay"  # mb.create refuses an existing store: pick a fresh DIR to rerun
    streams = 4
    rng = np.random.default_rng(0)
    with mb.create(
        path,
        columns={"obs": ((OBS,), "float32"), "action": ((ACT,), "float32"), "reward": ((), "float32")},
        capacity=streams * 16_384,
        num_streams=streams,
        priorities=mb.PriorityConfig(alpha=0.6),
    ) as buf:  # closed on Ctrl-C too: what was extended is committed, with no message at exit
        t0 = time.perf_counter()
        rows = 0
        for ep in range(episodes):
            if interrupted():
                raise KeyboardInterrupt
            steps, final = rollout(rng)
            buf.extend(steps, stream=ep % streams, final_obs={"obs": final[None]})
            rows += len(steps["reward"])
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        generation = buf.commit()
        t_commit = time.perf_counter() - t0
        say(f"wrote {rows:,} rows in {episodes} episodes over {streams} streams to {path}")
        say(f"  extend {rows / t_write:,.0f} rows/s, commit {t_commit * 1e3:.1f} ms (generation {generation})")

        g = torch.Generator().manual_seed(0)
        batch = buf.sample(256, generator=g)
        say(f"uniform sample: obs {tuple(batch['obs'].shape)}, next_obs {tuple(batch['next_obs'].shape)}")
        sl = buf.sample_slices(64, 16, generator=g)
        lane_of = sl.indices // buf.lane_size
        assert bool((lane_of == lane_of[:, :1]).all())
        say(f"slices: obs {tuple(sl['obs'].shape)} (64 windows of 16 steps inside one episode each)")
        pb = buf.sample(256, prioritized=True, beta=0.4, generator=g)
        buf.update_priorities(pb.indices, pb["reward"].abs() + 0.01)
        pb2 = buf.sample(256, prioritized=True, beta=0.4, generator=g)
        say(f"prioritized: weights in [{float(pb2.weights.min()):.3f}, {float(pb2.weights.max()):.3f}] after an update")

    t0 = time.perf_counter()
    ro = mb.open(path, mode="r")
    t_open = time.perf_counter() - t0
    again = ro.sample_slices(8, 16, generator=torch.Generator().manual_seed(1))
    report = verify(ro)
    say(f"reopened read-only in {t_open * 1e3:.1f} ms: {len(ro):,} rows, {ro.num_episodes} episodes; "
        f"slices {tuple(again['obs'].shape)}; verify: {'ok' if report['ok'] else report['problems']}")
    say(f"inspect it with: mmbuffer info {path}")
    return {
        "path": str(path),
        "rows": rows,
        "episodes": episodes,
        "reopened_episodes": ro.num_episodes,
        "verify_ok": report["ok"],
    }
