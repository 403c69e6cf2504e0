"""The SB3 drop-in's targets (issue 24), side by side with SB3's own ``ReplayBuffer``.

Four parts (``--parts``, all by default):

``train``  DQN (``CnnPolicy``) on a real ALE game, SB3's Atari recipe
    (``make_atari_env`` + ``VecFrameStack(4)``, ``--game``), ``--steps`` steps with
    ``learning_starts`` small and ``train_freq=4`` so that sampling and training
    dominate, the same seed: SB3's ``ReplayBuffer`` in RAM against
    ``mmbuffer.sb3.ReplayBuffer`` with ``replay_buffer_kwargs={"path": ...,
    "frame_stack": 4, "codec": "zstd"}``. Runs alternate in one process (ABAB...,
    ``--pairs`` pairs, after one short untimed run of each that loads SB3, torch and
    mmbuffer's compiled kernels); each run reports the ``learn`` wall clock, the
    seconds spent in the buffer's ``add`` and ``sample`` (wrapped timers), and a
    checksum of the trained Q-network (equal: both runs trained the same). Target:
    mmbuffer / SB3 <= 1.05.
``rss``   ``--rows`` transitions (1M) in a fresh process: real frames of the game
    (``--record`` steps recorded from the env, random actions, cut at an episode
    end) tiled to ``--rows`` through ``add`` into the drop-in (``frame_stack=4``,
    zstd, ``n_envs=1``), then ``--samples`` ``sample(32)``; ``RssAnon`` of the process
    (``/proc/self/status``) after filling and after sampling, less its value before
    the buffer existed (the recorded frames already held). Target: <= 0.5 GB.
    SB3's ``ReplayBuffer(rows)`` is constructed in the same process first: its
    ``MemoryError`` (or not) is reported.
``saveload`` the same process, on the filled store: ``DQN(..., replay_buffer_class=
    mmbuffer.sb3.ReplayBuffer)`` reopens it, samples and adds 100 steps (a buffer in
    use: the save commits the held steps and releases the writer lock), then
    ``model.save_replay_buffer`` + ``model.load_replay_buffer`` timed (the first
    ``sample`` after the load, which reopens the store, reported apart). Target:
    <= 1 s.
``sb3``    in another fresh process, SB3's own ``save_replay_buffer`` +
    ``load_replay_buffer`` of an SB3 buffer it can hold (``--sb3-rows`` transitions of
    the same frames, ``optimize_memory_usage=False``; the old buffer dropped before
    the load, as in a new process), and ``sample(32)`` of it against the drop-in
    holding the same transitions (calls alternated, medians).

    python benchmarks/bench_sb3.py                 # 20k steps x 2 pairs, 1M rows (tens of minutes)
    python benchmarks/bench_sb3.py --quick         # 2k steps x 1 pair, 50k rows
    python benchmarks/bench_sb3.py --parts train --steps 30000 --pairs 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, machine, scratch

STACK = 4


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rss_anon() -> int:
    """This process's anonymous resident bytes (``RssAnon``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon: expected a line in /proc/self/status, got none")


def make_env(game: str, seed: int, transpose: bool = False) -> Any:
    """SB3's Atari recipe; ``transpose``: wrapped in ``VecTransposeImage`` as DQN's
    ``CnnPolicy`` wraps it (the channels-first stacks its buffer is given)."""
    import ale_py
    import gymnasium as gym
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack, VecTransposeImage

    gym.register_envs(ale_py)
    kwargs = {"frameskip": 1} if game.startswith("ALE/") else None  # AtariWrapper skips 4 itself
    env = VecFrameStack(make_atari_env(game, n_envs=1, seed=seed, env_kwargs=kwargs), n_stack=STACK)
    return VecTransposeImage(env) if transpose else env


def timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    return wrapper


# -- train ------------------------------------------------------------------------------
def train_once(kind: str, args: argparse.Namespace, steps: int, root: Path) -> dict[str, Any]:
    import torch
    from stable_baselines3 import DQN

    import mmbuffer.sb3

    env = make_env(args.game, args.seed)
    kwargs: dict[str, Any] = {}
    store = root / f"replay-{time.monotonic_ns()}"
    if kind == "mmbuffer":
        kwargs = {"replay_buffer_class": mmbuffer.sb3.ReplayBuffer,
                  "replay_buffer_kwargs": {"path": store, "frame_stack": STACK, "codec": args.codec}}
    model = DQN("CnnPolicy", env, buffer_size=args.buffer_size, learning_starts=args.learning_starts,
                batch_size=32, train_freq=4, gradient_steps=1, target_update_interval=1_000,
                exploration_fraction=0.1, optimize_memory_usage=False, seed=args.seed, verbose=0,
                device="cpu", **kwargs)
    rb: Any = model.replay_buffer
    add, sample = [0.0], [0.0]
    rb.add, rb.sample = timed(rb.add, add), timed(rb.sample, sample)
    t0, c0 = time.perf_counter(), time.process_time()
    model.learn(steps)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.q_net.parameters()))
    size = rb.size()
    if kind == "mmbuffer":
        rb.close()
        shutil.rmtree(store)
    env.close()
    del model, rb
    gc.collect()
    return {"kind": kind, "wall": wall, "cpu": cpu, "threads": threading.active_count(), "add": add[0], "sample": sample[0], "size": size,
            "checksum": checksum}


def part_train(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="sb3train-", dir=scratch()))
    try:
        for kind in ("sb3", "mmbuffer"):  # untimed: imports, kernels, the ROM
            train_once(kind, args, min(args.learning_starts + 200, args.steps), root)
        runs = []
        for p in range(args.pairs):
            order = ("sb3", "mmbuffer") if p % 2 == 0 else ("mmbuffer", "sb3")
            for kind in order:
                r = train_once(kind, args, args.steps, root)
                r["load"] = loadavg().split()[0]
                runs.append(r)
                print(f"  run {len(runs)}: {kind:8s} learn {r['wall']:7.1f} s (cpu {r['cpu']:6.1f} s, {r['threads']} threads; add {r['add']:5.1f} s, "
                      f"sample {r['sample']:5.1f} s)  size {r['size']}  q-net checksum {r['checksum']:.6f}  "
                      f"load {r['load']}", flush=True)
        return runs
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- rss + saveload (a fresh process) --------------------------------------------------
def record(args: argparse.Namespace) -> dict[str, Any]:
    """``--record`` steps of the game with random actions, as SB3's ``_store_transition``
    hands them to ``add``, cut after the last episode end (so that the recording tiles:
    the step after it starts an episode, its older frames zeros)."""
    env = make_env(args.game, args.seed, transpose=True)
    rng = np.random.default_rng(args.seed)
    obs = env.reset()
    rec: dict[str, list[Any]] = {"obs": [], "next": [], "action": [], "reward": [], "done": [], "infos": []}
    for _ in range(args.record):
        action = rng.integers(0, env.action_space.n, size=1)
        new_obs, reward, done, infos = env.step(action)
        nxt = new_obs.copy()
        if done[0]:
            nxt[0] = infos[0]["terminal_observation"]
        rec["obs"].append(obs)
        rec["next"].append(nxt)
        rec["action"].append(action.reshape(1, 1))
        rec["reward"].append(reward)
        rec["done"].append(done)
        rec["infos"].append([{"TimeLimit.truncated": bool(infos[0].get("TimeLimit.truncated", False))}])
        obs = new_obs
    last = max(i for i, d in enumerate(rec["done"]) if d[0]) + 1
    out: dict[str, Any] = {k: v[:last] for k, v in rec.items()}
    out["space"], out["action_space"] = env.observation_space, env.action_space
    env.close()
    return out


def fill(rb: Any, rec: dict[str, Any], rows: int) -> None:
    t = len(rec["obs"])
    obs, nxt, act, rew, done, infos = (rec[k] for k in ("obs", "next", "action", "reward", "done", "infos"))
    for i in range(rows):
        j = i % t
        rb.add(obs[j], nxt[j], act[j], rew[j], done[j], infos[j])


def part_memory(args: argparse.Namespace) -> dict[str, Any]:
    """``rss`` and/or ``saveload`` in this (fresh) process."""
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common import buffers as sb3_buffers

    import mmbuffer.sb3

    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"rows": args.rows}
    rec = record(args)
    out["recorded"] = len(rec["obs"])
    out["episode_ends"] = int(sum(d[0] for d in rec["done"]))
    try:  # SB3's own buffer at the same size
        sb3 = sb3_buffers.ReplayBuffer(args.rows, rec["space"], rec["action_space"], device="cpu")
        out["sb3_alloc"] = f"allocated {(sb3.observations.nbytes + sb3.next_observations.nbytes) / 2**30:.1f} GiB (lazily)"
        del sb3
    except MemoryError as exc:
        out["sb3_alloc"] = f"MemoryError: {exc}"
    gc.collect()
    root = Path(tempfile.mkdtemp(prefix="sb3mem-", dir=scratch()))
    store = root / "replay"
    kwargs = {"path": store, "frame_stack": STACK, "codec": args.codec}
    try:
        before = rss_anon()
        rb = mmbuffer.sb3.ReplayBuffer(args.rows, rec["space"], rec["action_space"], device="cpu", **kwargs)
        t0 = time.perf_counter()
        fill(rb, rec, args.rows)
        out["fill_s"] = time.perf_counter() - t0
        out["anon_filled"] = rss_anon() - before
        np.random.seed(0)
        t0 = time.perf_counter()
        for _ in range(args.samples):
            rb.sample(32)
        out["sample32_ms"] = (time.perf_counter() - t0) / args.samples * 1e3  # mean: the cache fills meanwhile
        out["anon_sampled"] = rss_anon() - before
        out["size"] = rb.size()
        rb.close()
        del rb
        gc.collect()
        if "saveload" in args.parts:
            env = make_env(args.game, args.seed)
            model = DQN("CnnPolicy", env, buffer_size=args.rows, learning_starts=0, optimize_memory_usage=False,
                        seed=args.seed, verbose=0, device="cpu",
                        replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs=kwargs)
            assert model.replay_buffer is not None and model.replay_buffer.size() == args.rows
            model.replay_buffer.sample(32)  # opened and read, as a buffer in use is
            fill(model.replay_buffer, rec, 100)  # and written: the save commits held steps, releases the lock
            pkl = root / "replay.pkl"
            t0 = time.perf_counter()
            model.save_replay_buffer(pkl)
            t1 = time.perf_counter()
            model.load_replay_buffer(pkl)
            t2 = time.perf_counter()
            got = model.replay_buffer.sample(32)
            t3 = time.perf_counter()
            assert model.replay_buffer.size() == args.rows and got.observations.shape == (32, STACK, 84, 84)
            out.update(save_s=t1 - t0, load_s=t2 - t1, first_sample_s=t3 - t2, pickle_bytes=pkl.stat().st_size)
            model.replay_buffer.close()  # type: ignore[attr-defined]
            env.close()
        out["disk_bytes"] = sum(f.stat().st_blocks * 512 for f in store.rglob("*") if f.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def part_sb3_save(args: argparse.Namespace) -> dict[str, Any]:
    """SB3's own ``save_replay_buffer`` + ``load_replay_buffer`` of ``--sb3-rows``
    transitions; ``sample(32)`` of it and of the drop-in holding the same
    transitions, calls alternated."""
    import torch
    from stable_baselines3 import DQN

    import mmbuffer.sb3

    torch.set_num_threads(args.threads)
    rec = record(args)
    env = make_env(args.game, args.seed)
    model = DQN("CnnPolicy", env, buffer_size=args.sb3_rows, learning_starts=0, optimize_memory_usage=False,
                seed=args.seed, verbose=0, device="cpu")
    assert model.replay_buffer is not None
    fill(model.replay_buffer, rec, args.sb3_rows)
    root = Path(tempfile.mkdtemp(prefix="sb3save-", dir=scratch()))
    try:
        mine = mmbuffer.sb3.ReplayBuffer(args.sb3_rows, rec["space"], rec["action_space"], device="cpu",
                                         path=root / "replay", frame_stack=STACK, codec=args.codec)
        fill(mine, rec, args.sb3_rows)
        spent = {"sb3": [], "mmbuffer": []}
        for i in range(args.samples):
            pair = (("sb3", model.replay_buffer), ("mmbuffer", mine))
            for name, buf in pair if i % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                buf.sample(32)
                spent[name].append(time.perf_counter() - t0)
        mine.close()
        out: dict[str, Any] = {f"{k}_sample32_ms": float(np.median(v)) * 1e3 for k, v in spent.items()}
        pkl = root / "replay.pkl"
        t0 = time.perf_counter()
        model.save_replay_buffer(pkl)
        t1 = time.perf_counter()
        model.replay_buffer = None  # as a new process loading it: one buffer in RAM at a time
        gc.collect()
        t2 = time.perf_counter()
        model.load_replay_buffer(pkl)
        t3 = time.perf_counter()
        assert model.replay_buffer.size() == args.sb3_rows
        out.update(sb3_rows=args.sb3_rows, sb3_save_s=t1 - t0, sb3_load_s=t3 - t2, sb3_pickle_bytes=pkl.stat().st_size)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
        env.close()


def child(part: str, argv: list[str]) -> dict[str, Any]:
    """Run ``part`` in a fresh interpreter; return its JSON result."""
    cmd = [sys.executable, __file__, "--child", part, *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        raise RuntimeError(f"{part}: expected the child to succeed, got rc {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="train,rss,saveload,sb3", help="comma-separated: train, rss, saveload, sb3")
    ap.add_argument("--quick", action="store_true", help="2k steps x 1 pair, 50k rows, SB3 save of 10k")
    ap.add_argument("--game", default="BreakoutNoFrameskip-v4")
    ap.add_argument("--steps", type=count, default=20_000)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--learning-starts", type=count, default=1_000)
    ap.add_argument("--buffer-size", type=count, default=100_000)
    ap.add_argument("--rows", type=count, default=1_000_000)
    ap.add_argument("--sb3-rows", type=count, default=100_000)
    ap.add_argument("--record", type=count, default=2_000)
    ap.add_argument("--samples", type=count, default=1_000)
    ap.add_argument("--codec", default="zstd", help="the drop-in's frame codec (replay_buffer_kwargs codec)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    if ap.parse_known_args()[0].quick:  # smaller defaults; explicit options still win
        ap.set_defaults(steps=2_000, pairs=1, learning_starts=500, rows=50_000, sb3_rows=10_000,
                        buffer_size=10_000, record=1_000, samples=200)
    args = ap.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if args.child:
        result = part_memory(args) if args.child == "memory" else part_sb3_save(args)
        print(json.dumps(result))
        return
    argv = [a for a in sys.argv[1:]]
    print(f"# bench_sb3 {' '.join(argv)}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}; load {loadavg()}")
    print(f"game {args.game}, codec {args.codec}, frame_stack {STACK}, torch threads {args.threads}, seed {args.seed}")
    if "train" in args.parts:
        print(f"\ntrain: DQN CnnPolicy, {args.steps} steps, learning_starts {args.learning_starts}, train_freq 4, "
              f"batch 32, buffer_size {args.buffer_size}; runs alternated")
        runs = part_train(args)
        walls = {k: [r["wall"] for r in runs if r["kind"] == k] for k in ("sb3", "mmbuffer")}
        ratios = [m / s for m, s in zip(walls["mmbuffer"], walls["sb3"])]
        cpus = {k: [r["cpu"] for r in runs if r["kind"] == k] for k in ("sb3", "mmbuffer")}
        same = len({round(r["checksum"], 6) for r in runs}) == 1
        print(f"  mmbuffer / SB3 learn CPU time (the process's) per pair: "
              f"{', '.join(f'{m / c:.3f}' for m, c in zip(cpus['mmbuffer'], cpus['sb3']))}")
        print(f"  mmbuffer / SB3 learn wall clock per pair: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"sums {sum(walls['mmbuffer']) / sum(walls['sb3']):.3f} (target <= 1.05); same q-net in every run: {same}")
    if "rss" in args.parts or "saveload" in args.parts:
        print(f"\nmemory: {args.rows:,} transitions in a fresh process")
        m = child("memory", sys.argv[1:])
        print(f"  recorded {m['recorded']} real steps ({m['episode_ends']} episode ends), tiled to {m['rows']:,}; "
              f"SB3 ReplayBuffer({m['rows']:,}): {m['sb3_alloc']}")
        print(f"  fill {m['fill_s']:.0f} s ({m['fill_s'] / m['rows'] * 1e6:.0f} us/add); store on disk "
              f"{m['disk_bytes'] / 2**20:,.0f} MiB ({m['disk_bytes'] / m['rows']:,.0f} B/transition)")
        print(f"  RssAnon of the buffer: {m['anon_filled'] / 2**20:,.0f} MiB filled, {m['anon_sampled'] / 2**20:,.0f} MiB "
              f"after {args.samples} sample(32) ({m['sample32_ms']:.2f} ms each) (target <= 512 MiB)")
        if "save_s" in m:
            print(f"  save_replay_buffer {m['save_s'] * 1e3:.0f} ms + load_replay_buffer {m['load_s'] * 1e3:.0f} ms = "
                  f"{(m['save_s'] + m['load_s']) * 1e3:.0f} ms (target <= 1 s); pickle {m['pickle_bytes']:,} B; "
                  f"first sample(32) after the load (reopens the store) {m['first_sample_s'] * 1e3:.0f} ms")
    if "sb3" in args.parts:
        print(f"\nSB3's own buffer: {args.sb3_rows:,} transitions in a fresh process")
        s = child("sb3save", sys.argv[1:])
        print(f"  save_replay_buffer {s['sb3_save_s']:.1f} s + "
              f"load_replay_buffer {s['sb3_load_s']:.1f} s; pickle {s['sb3_pickle_bytes'] / 2**30:.2f} GiB")
        print(f"  sample(32) at {s['sb3_rows']:,} transitions, calls alternated (medians): SB3 {s['sb3_sample32_ms']:.2f} ms, "
              f"mmbuffer {s['mmbuffer_sample32_ms']:.2f} ms")
    print(f"\nload at the end {loadavg()}")


if __name__ == "__main__":
    main()
