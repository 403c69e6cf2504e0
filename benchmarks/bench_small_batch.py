"""Small batches: ``sample(32)`` and ``sample(256)`` against Stable-Baselines3 and TorchRL in RAM.

RL libraries sample small batches many times (SB3's DQN default is 32, SAC's 256),
so the fixed cost of a call matters as much as its copy. The same data, 1e6 rows
of obs 17 float32, action 6 float32, reward float32 (episodes of 1000 steps, each
ended as truncated, its final observation stored), in three buffers:

* mmbuffer: a raw store on disk, dropped from the page cache and read back by
  ``warm(columns=True)`` (``--warm read``: as the writer left it, read once), sampled by the writer
  (``mb.open(path)``, mode "a") and by a reader (``mode="r"``, which re-checks every
  item against the writer's reservation); default keys: obs, action, reward,
  terminated, truncated, next_obs;
* Stable-Baselines3's ``ReplayBuffer`` (numpy in RAM, ``n_envs=1``): obs, actions,
  next_obs, dones, rewards, copied into new tensors (``th.tensor``);
* TorchRL's ``ReplayBuffer(LazyTensorStorage, RandomSampler)`` in RAM: a TensorDict
  of obs, action, reward, done and ("next", "obs").

``torch.set_num_threads(1)``. Every buffer draws from the global generators (numpy's
for SB3, torch's for TorchRL and mmbuffer). The calls are interleaved
(one call of each case per round, in a new random order every round) for ``--reps``
rounds, and the table gives each case's median µs and its ratio to the faster of SB3
and TorchRL at the same batch size (``<= 1``: mmbuffer is as fast).

    python benchmarks/bench_small_batch.py                 # ~0.3 GB scratch, ~1 GB RAM
    python benchmarks/bench_small_batch.py --profile 32    # + cProfile of the writer's sample(32)
    python benchmarks/bench_small_batch.py --live-writer   # + a reader beside a writer process (~0.3 GB copy)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import build_world_model_store, count, drop_file_cache, header, scratch, settle, table  # noqa: E402

import mmbuffer as mb  # noqa: E402
from mmbuffer._read.gather import gather  # noqa: E402

EPISODE = 1000


def build(path: Path, rows: int) -> None:
    if (path / "manifest.json").exists():
        try:
            if len(mb.open(path, mode="r")) == rows:
                return
        except mb.errors.MMBufferError:
            pass
    shutil.rmtree(path, ignore_errors=True)
    build_world_model_store(path, rows, EPISODE)


def columns(path: Path) -> dict[str, np.ndarray]:
    """Every row of the store in RAM (numpy), ``next_obs`` and ``done`` included."""
    ro = mb.open(path, mode="r")
    n = ro.capacity
    out: dict[str, np.ndarray] = {}
    for name in ("obs", "action", "reward", "terminated", "truncated"):
        out[name] = np.asarray(ro.read_range(name, 0, n))
    out["next_obs"] = gather(ro.store, np.arange(n), keys=["next_obs"])["next_obs"].numpy().copy()
    return out


def sb3_buffer(data: dict[str, np.ndarray]) -> Callable[[int], object]:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer

    n = data["obs"].shape[0]
    obs_space = spaces.Box(-np.inf, np.inf, (17,), np.float32)
    act_space = spaces.Box(-1.0, 1.0, (6,), np.float32)
    rb = ReplayBuffer(n, obs_space, act_space, device="cpu", n_envs=1)
    rb.observations[:, 0] = data["obs"]
    rb.next_observations[:, 0] = data["next_obs"]
    rb.actions[:, 0] = data["action"]
    rb.rewards[:, 0] = data["reward"]
    rb.dones[:, 0] = data["terminated"]
    rb.timeouts[:, 0] = data["truncated"]
    rb.pos, rb.full = 0, True
    return rb.sample


def torchrl_buffer(data: dict[str, np.ndarray]) -> Callable[[int], object]:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer

    n = data["obs"].shape[0]
    rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=RandomSampler())
    td = TensorDict(
        {
            "obs": torch.from_numpy(data["obs"]),
            "action": torch.from_numpy(data["action"]),
            "reward": torch.from_numpy(data["reward"]),
            "done": torch.from_numpy(data["terminated"] | data["truncated"]),
            "next": {"obs": torch.from_numpy(data["next_obs"])},
        },
        batch_size=[n],
    )
    rb.extend(td)
    return rb.sample


def interleaved(cases: dict[str, Callable[[], object]], reps: int, warmup: int = 200) -> dict[str, float]:
    """Median µs of each case over ``reps`` rounds, one call of each per round, in a new
    random order each round (a fixed rotation puts some case after the same neighbour
    most of the time, which warms the caches it shares with it: the reader after the
    writer, say)."""
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    order = np.random.default_rng(0)
    for _ in range(reps):
        for name in order.permutation(names).tolist():
            fn = cases[name]
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) / 1e3 for name, ts in times.items()}


def profile(fn: Callable[[], object], calls: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=count, default=1_000_000)
    parser.add_argument("--reps", type=int, default=5000, help="interleaved rounds")
    parser.add_argument("--batch", type=str, default="32,256")
    parser.add_argument("--no-peers", action="store_true", help="mmbuffer only (quick checks)")
    parser.add_argument("--profile", type=int, default=0, metavar="B", help="cProfile the writer's sample(B)")
    parser.add_argument("--live-writer", action="store_true",
                        help="then a reader's sample(256) beside a writer process extending a copy of the store")
    parser.add_argument("--warm", choices=("read", "columns"), default="columns",
                        help="columns: the store dropped from the page cache, then read back by warm(columns=True) "
                        "(a learner opening it from disk); read: as the writer left it, read once")
    args = parser.parse_args()
    torch.set_num_threads(1)

    path = scratch() / f"small_batch_{args.rows}"
    build(path, args.rows)
    gc.collect()  # the builder's maps: the page cache drops only unmapped pages
    if args.warm == "columns":
        drop_file_cache(path)
    writer = mb.open(path)
    reader = mb.open(path, mode="r")
    if args.warm == "columns":  # both map what the first reads in
        reader.warm(columns=True)
        writer.warm(columns=True)
    else:
        for name in writer.store.columns:  # page cache warm, as the writer left it
            writer.read_range(name, 0, args.rows)
    settle(lambda: (writer.sample(256), reader.sample(256)))
    peers: dict[str, Callable[[int], object]] = {}
    if not args.no_peers:
        data = columns(path)
        for name, make in (("SB3 ReplayBuffer", sb3_buffer), ("TorchRL LazyTensorStorage", torchrl_buffer)):
            try:
                peers[name] = make(data)
            except ImportError as exc:  # a machine without one of them (the lent GPU host has no TorchRL)
                print(f"{name}: not installed here ({exc}); the ratio is to the other peer")
        del data

    header(f"Small batches: {args.rows:,} rows (obs 17 + action 6 + reward), one torch thread, {args.reps} rounds")
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        cases: dict[str, Callable[[], object]] = {
            "mmbuffer writer": lambda b=b: writer.sample(b),
            "mmbuffer reader": lambda b=b: reader.sample(b),
        }
        for peer, fn in peers.items():
            cases[peer] = lambda fn=fn, b=b: fn(b)
        med = interleaved(cases, args.reps)
        best = min((med[p] for p in peers), default=float("nan"))
        for name, us in med.items():
            rows.append({"batch": b, "case": name, "median µs": us, "x faster peer": us / best})
    table(rows)

    if args.profile:
        print(f"### cProfile: writer sample({args.profile}), 20000 calls")
        profile(lambda: writer.sample(args.profile), 20000)
    if args.live_writer:
        reader.close()
        writer.close()
        live_writer(path, args.reps)


def _extend_forever(path: str, stop: Any) -> None:
    """A writer process: 1000-step episodes in extends of 100 rows (~50k rows/s at most),
    a commit after each episode, until ``stop`` is set."""
    buf = mb.open(path)
    rng = np.random.default_rng(1)
    obs, action = rng.random((EPISODE, 17), np.float32), rng.random((EPISODE, 6), np.float32)
    truncated = np.arange(EPISODE) == EPISODE - 1
    while not stop.is_set():
        for k in range(0, EPISODE, 100):
            block = slice(k, k + 100)
            ends = bool(truncated[block].any())
            buf.extend({"obs": obs[block], "action": action[block], "reward": obs[block, 0], "truncated": truncated[block]},
                       final_obs={"obs": obs[-1:]} if ends else None)
            time.sleep(0.002)
        buf.commit()
    buf.close()


def live_writer(path: Path, reps: int) -> None:
    """A reader's ``sample(256)`` beside a writer process extending a copy of the store
    (refresh every 200 calls): its median and p90, and in how many calls the reader
    re-checked its items one by one (the writer's reservation had passed what the
    reader's view keeps intact; ``mmbuffer._read.recheck``)."""
    import multiprocessing as mp

    live = path.with_name(path.name + "_live")
    shutil.rmtree(live, ignore_errors=True)
    shutil.copytree(path, live)
    reader = mb.open(live, mode="r")
    reader.warm(columns=True)
    store = reader.store
    checked = [0]
    passed = store.reserved_past

    def counted(bound: np.ndarray) -> bool:
        past = passed(bound)
        checked[0] += past
        return past

    store.reserved_past = counted  # type: ignore[method-assign]
    stop = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=_extend_forever, args=(str(live), stop))
    proc.start()
    try:
        while store.reservation()[0] == reader.view().written[0]:  # until the writer has begun
            time.sleep(0.05)
        times = []
        for i in range(4 * reps):
            if i % 200 == 0:
                reader.refresh()
            t0 = time.perf_counter_ns()
            reader.sample(256)
            times.append(time.perf_counter_ns() - t0)
    finally:
        stop.set()
        proc.join()
    header(f"Reader sample(256) beside a writer process extending the store ({4 * reps} calls, refresh every 200)")
    table([{"median µs": statistics.median(times) / 1e3, "p90 µs": float(np.percentile(times, 90)) / 1e3,
            "calls re-checked item by item": f"{checked[0]} of {len(times)}"}])
    reader.close()
    shutil.rmtree(live, ignore_errors=True)


if __name__ == "__main__":
    main()
