"""Pixels on real ALE frames (issue 23 item 7): mmbuffer against SB3 and TorchRL, side by side.

Frames: ``ALE/MsPacman-v5`` (``--games MsPacman,Breakout`` for more) under
``gymnasium.wrappers.AtariPreprocessing`` (84x84 grayscale, ``frame_skip=4`` and
``noop_max=30`` as SB3's ``AtariWrapper``; a life loss does not end the episode),
a random policy, ``--collect`` steps (the last episode cut as truncated). The
collected episodes are tiled, whole, to ``--rows`` transitions (the last one
truncated), so every contender stores the same transitions.

Contenders, each in its own process (its anonymous RSS is its own), in groups
(``GROUPS``): a group's processes are sampled in interleaved rounds (every round
asks each in turn for ``--reps`` calls of each batch size; medians over rounds),
then its peers exit before the next group is built. ``mmbuffer raw`` is built
once and takes part in every group: each "x raw" ratio is the median over rounds
of a peer's time over raw's in the same round. "warm resident %" is the lowest
share of the store's allocated bytes in the page cache (``fincore``) seen after
a warm block: below 100, the host evicted pages meanwhile and "warm" was not.

* ``mmbuffer raw``: one 84x84 frame a row (``next_keys=("pixels",)``, the final
  frame of each episode stored), stacks built at sampling:
  ``sample(B, stack={"pixels": 4}, stack_pad="zero")`` -> ``pixels`` and
  ``next_pixels`` ``[B, 4, 84, 84]``;
* ``mmbuffer zstd``: the same with ``mb.Column((84, 84), "uint8", codec="zstd")``
  (capacity ``--rows``: a lane that is a multiple of 8 rows, so 8-frame chunks);
* ``SB3 ReplayBuffer`` with ``optimize_memory_usage`` False and True, fed the
  ``[4, 84, 84]`` stacks ``VecFrameStack`` + ``VecTransposeImage`` give DQN's
  ``CnnPolicy`` (zeros before an episode's first frame; the final stack as SB3's
  ``terminal_observation``); a ``MemoryError`` at construction is the result, and
  a buffer larger than 60% of ``MemAvailable`` is not run (the host is shared);
* ``mmbuffer.sb3.ReplayBuffer(frame_stack=4)`` (the SB3 drop-in, same feed), and
  with ``codec="zstd"``;
* TorchRL ``TensorDictReplayBuffer(storage=LazyMemmapStorage)`` as TorchRL users
  fill it from a collector with ``CatFrames``: ``pixels`` and ``("next",
  "pixels")`` stacked ``[4, 84, 84]``, plus action, reward, done flags (not run
  when its files would take more than half the free disk).

Measured: bytes per transition on disk (allocated blocks, ``st_blocks``, of every
file of the store) and in RAM (SB3's arrays); ``RssAnon`` of the contender's
process after filling and sampling, less its ``RssAnon`` after imports; add
throughput one transition a call (as SB3's ``add`` and a hand-written collector
loop add; ``--per-step`` calls) and in blocks of 1,000 (the rest of the fill;
SB3 has no block add; an mmbuffer contender's process first loads the compiled
kernels it will use from numba's cache, off the clock: ``warm_kernels``);
``sample(32)`` / ``sample(256)`` of 4-stacks, page cache
warm (every file of the store read, and every page of the process's maps of
them touched, beforehand), and cold: the store's pages dropped
(``madvise(MADV_DONTNEED)`` on the process's maps of the store's files, then
``posix_fadvise(DONTNEED)``) before every call. SB3 keeps everything in RAM: no
cold figure.

    python benchmarks/bench_pixels_ale.py                 # 100k transitions
    python benchmarks/bench_pixels_ale.py --rows 1e6 --contenders "SB3 ReplayBuffer,SB3 optimize_memory_usage"
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import count, header, scratch, table

FRAME = (84, 84)
K = 4
BLOCK = 1000


# -- frames ------------------------------------------------------------------------------
def collect(game: str, steps: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``steps`` random-policy transitions of ``ALE/<game>-v5``: ``frames`` [T] (each
    transition's observation), ``finals`` [E] (the observation after each episode's
    last step), ``end`` / ``terminated`` [T], ``action`` [T], ``reward`` [T]."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing

    gym.register_envs(ale_py)
    env = AtariPreprocessing(gym.make(f"ALE/{game}-v5", frameskip=1), frame_skip=4, screen_size=84,
                             grayscale_obs=True, noop_max=30)
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    frames, finals, end, term, action, reward = [], [], [], [], [], []
    for t in range(steps):
        a = int(env.action_space.sample())
        nxt, r, te, tr, _ = env.step(a)
        frames.append(obs)
        action.append(a)
        reward.append(r)
        stop = te or tr or t == steps - 1
        end.append(stop)
        term.append(te)
        if stop:
            finals.append(nxt)
            obs, _ = env.reset()
        else:
            obs = nxt
    env.close()
    return {"frames": np.stack(frames), "finals": np.stack(finals), "end": np.array(end), "terminated": np.array(term),
            "action": np.array(action, np.int64), "reward": np.array(reward, np.float32)}


class Feed:
    """The collected transitions tiled to ``rows``: block ``[a, b)`` as single frames
    (mmbuffer) or as ``VecFrameStack`` stacks (SB3, TorchRL)."""

    def __init__(self, npz: Path, rows: int) -> None:
        src = dict(np.load(npz))
        t = len(src["frames"])
        # the frame bank: transitions' frames, each episode's final frame, a zero frame
        self.bank = np.concatenate([src["frames"], src["finals"], np.zeros((1, *FRAME), np.uint8)])
        self.zero = len(self.bank) - 1
        end = src["end"]
        episode = np.concatenate([[0], np.cumsum(end)[:-1]])  # episode id of each transition
        start = np.flatnonzero(np.concatenate([[True], end[:-1]]))
        self.depth = np.arange(t) - start[episode]  # steps since the episode's first
        self.next = np.where(end, t + episode, np.arange(t) + 1)
        self.src = np.arange(rows) % t  # whole episodes repeated; the last row is cut below
        self.end = end[self.src].copy()
        self.end[-1] = True
        self.terminated = src["terminated"][self.src] & end[self.src]
        self.action, self.reward = src["action"][self.src], src["reward"][self.src]
        self.rows = rows

    def frames(self, a: int, b: int) -> np.ndarray:
        return self.bank[self.src[a:b]]

    def finals(self, a: int, b: int) -> np.ndarray:
        s = self.src[a:b][self.end[a:b]]
        return self.bank[self.next[s]]

    def stacks(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """``obs`` and ``next_obs`` ``[b - a, 4, 84, 84]`` as ``VecFrameStack`` builds them."""
        s = self.src[a:b]
        back = np.arange(1 - K, 1)  # oldest first
        idx = s[:, None] + back
        idx = np.where(-back[None, :] <= self.depth[s][:, None], idx, self.zero)
        nidx = np.concatenate([idx[:, 1:], self.next[s][:, None]], axis=1)
        return self.bank[idx], self.bank[nidx]

    def steps(self, a: int, b: int) -> dict[str, np.ndarray]:
        end = self.end[a:b]
        return {"action": self.action[a:b], "reward": self.reward[a:b], "terminated": self.terminated[a:b],
                "truncated": end & ~self.terminated[a:b]}


# -- contenders (each in its own process) ------------------------------------------------------
def warm_kernels(root: Path, codec: str | None) -> None:
    """Load the compiled kernels an mmbuffer contender uses (numba's cache; compiled when
    the sources changed) in a throwaway store, before any clock starts: a one-time
    0.3-0.7 s a process on the dev VM, seconds when it compiles, that otherwise lands in
    the first shard's encode, inside the one-transition-a-call adds."""
    import mmbuffer as mb

    col: Any = (FRAME, "uint8") if codec is None else mb.Column(FRAME, "uint8", codec=codec)
    path = root / f"warm_{codec}_{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    n, z = 1024, np.zeros(1, bool)
    frames = np.zeros((n, *FRAME), np.uint8)
    with mb.create(path, {"pixels": col, "action": ((), "int64"), "reward": ((), "float32")},
                   capacity=n, next_keys=("pixels",)) as buf:
        steps = {"action": np.zeros(1, np.int64), "reward": np.zeros(1, np.float32), "terminated": z, "truncated": z}
        buf.extend({"pixels": frames[:1], **steps})
        end = {**steps, "truncated": ~z}
        buf.extend({"pixels": frames[1:2], **end}, final_obs={"pixels": frames[:1]})
        rest = {k: np.repeat(v, n - 2) for k, v in steps.items()}
        rest["truncated"][-1] = True
        buf.extend({"pixels": frames[2:], **rest}, final_obs={"pixels": frames[:1]})
        buf.commit()
        buf.sample(32, stack={"pixels": K}, stack_pad="zero")
    shutil.rmtree(path, ignore_errors=True)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def resident(path: Path) -> int:
    """Bytes of the files under ``path`` in the page cache (util-linux ``fincore``)."""
    files = [str(f) for f in path.rglob("*") if f.is_file()]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *files],
                         capture_output=True, text=True, check=False).stdout
    return sum(int(x) for x in out.split())


def drop_cache(path: Path) -> None:
    """Unmap this process's pages of the files under ``path`` (the data stays in the
    files) and evict them from the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for lo, hi, _, _ in store_maps(path):
        libc.madvise(lo, hi - lo, 4)  # MADV_DONTNEED: shared file pages go back to the cache
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def store_maps(path: Path) -> list[tuple[int, int, int, str]]:
    """This process's readable maps of files under ``path``: (start, end, offset, file)."""
    root, out = str(path.resolve()), []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(root) and parts[1].startswith("r"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16), parts[5].strip()))
    return out


def warm(path: Path) -> None:
    """Read every file under ``path`` (the page cache), then touch every page of this
    process's maps of them (their page-table entries, as in a learner that has been
    sampling a while: a read pass alone leaves a minor fault per page)."""
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    for lo, hi, offset, name in store_maps(path):
        size = min(hi - lo, os.stat(name).st_size - offset)  # never past the file's end (SIGBUS)
        if size > 0:
            pages = np.frombuffer((ctypes.c_char * size).from_address(lo), np.uint8)
            int(pages[::4096].sum())


class Contender:
    per_step_rate = block_rate = float("nan")
    path: Path | None = None
    ram_bytes = 0

    def sample(self, b: int) -> Any:
        raise NotImplementedError


class Core(Contender):
    def __init__(self, feed: Feed, path: Path, codec: str | None, per_step: int) -> None:
        import mmbuffer as mb

        col: Any = ((FRAME), "uint8") if codec is None else mb.Column(FRAME, "uint8", codec=codec)  # type: ignore[call-arg]
        shutil.rmtree(path, ignore_errors=True)
        self.path = path
        self.buf = buf = mb.create(path, {"pixels": col, "action": ((), "int64"), "reward": ((), "float32")},
                                   capacity=feed.rows, next_keys=("pixels",))
        n = feed.rows
        p = min(per_step, n)
        spent = 0.0
        for a in range(0, p, BLOCK):  # one transition a call
            b = min(a + BLOCK, p)
            frames, finals, steps = feed.frames(a, b), feed.finals(a, b), feed.steps(a, b)
            e = 0
            t0 = time.perf_counter()
            for i in range(b - a):
                row = {"pixels": frames[i : i + 1], **{k: v[i : i + 1] for k, v in steps.items()}}
                ends = bool(steps["terminated"][i] or steps["truncated"][i])
                buf.extend(row, final_obs={"pixels": finals[e : e + 1]} if ends else None)
                e += ends
            spent += time.perf_counter() - t0
        self.per_step_rate = p / spent if p else float("nan")
        spent = 0.0
        for a in range(p, n, BLOCK):
            b = min(a + BLOCK, n)
            frames, finals, steps = feed.frames(a, b), feed.finals(a, b), feed.steps(a, b)
            t0 = time.perf_counter()
            buf.extend({"pixels": frames, **steps}, final_obs={"pixels": finals})
            spent += time.perf_counter() - t0
        t0 = time.perf_counter()
        buf.commit()
        spent += time.perf_counter() - t0
        self.block_rate = (n - p) / spent if n > p else float("nan")

    def sample(self, b: int) -> Any:
        return self.buf.sample(b, stack={"pixels": K}, stack_pad="zero")


class SB3(Contender):
    def __init__(self, feed: Feed, optimize: bool) -> None:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer

        obs_space = spaces.Box(0, 255, (K, *FRAME), np.uint8)
        need = feed.rows * K * FRAME[0] * FRAME[1] * (1 if optimize else 2)
        avail = _mem_available()
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total >= need > 0.6 * avail:  # numpy would allocate lazily, then the host would swap or kill
            raise MemoryError(f"not run: needs {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available on this shared host")
        self.rb = rb = ReplayBuffer(feed.rows, obs_space, spaces.Discrete(9), device="cpu",
                                    optimize_memory_usage=optimize, handle_timeout_termination=not optimize)
        self.ram_bytes = sum(getattr(rb, k).nbytes for k in ("observations", "next_observations", "actions", "rewards",
                                                            "dones", "timeouts") if getattr(rb, k, None) is not None)
        self.per_step_rate = _add_per_step(rb, feed)

    def sample(self, b: int) -> Any:
        return self.rb.sample(b)


def _add_per_step(rb: Any, feed: Feed) -> float:
    spent = 0.0
    for a in range(0, feed.rows, BLOCK):
        b = min(a + BLOCK, feed.rows)
        obs, nxt = feed.stacks(a, b)
        steps = feed.steps(a, b)
        act, rew = steps["action"].reshape(-1, 1, 1), steps["reward"].reshape(-1, 1)
        done = steps["terminated"] | steps["truncated"]
        infos = [[{"TimeLimit.truncated": bool(x)}] for x in steps["truncated"]]
        t0 = time.perf_counter()
        for i in range(b - a):
            rb.add(obs[i : i + 1], nxt[i : i + 1], act[i], rew[i], done[i : i + 1], infos[i])
        spent += time.perf_counter() - t0
    return feed.rows / spent


class DropIn(Contender):
    def __init__(self, feed: Feed, path: Path, codec: str | None) -> None:
        from gymnasium import spaces

        import mmbuffer.sb3

        shutil.rmtree(path, ignore_errors=True)
        self.path = path
        kw: dict[str, Any] = {"path": path, "frame_stack": K}
        if codec is not None:
            kw["codec"] = codec
        self.rb = rb = mmbuffer.sb3.ReplayBuffer(feed.rows, spaces.Box(0, 255, (K, *FRAME), np.uint8), spaces.Discrete(9),
                                                 device="cpu", **kw)
        self.per_step_rate = _add_per_step(rb, feed)
        rb.commit()

    def sample(self, b: int) -> Any:
        return self.rb.sample(b)


class TorchRL(Contender):
    def __init__(self, feed: Feed, path: Path, per_step: int) -> None:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

        shutil.rmtree(path, ignore_errors=True)
        need, free = 2 * feed.rows * K * FRAME[0] * FRAME[1], shutil.disk_usage(path.parent).free
        if need > 0.5 * free:  # the disk is shared too
            raise MemoryError(f"not run: needs {need / 2**30:.1f} GiB of disk, {free / 2**30:.1f} GiB free on this shared host")
        self.path = path
        self.rb = rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(feed.rows, scratch_dir=str(path)))
        n, p = feed.rows, min(per_step, feed.rows)
        spent = [0.0, 0.0]
        for a in range(0, n, BLOCK):
            b = min(a + BLOCK, n)
            obs, nxt = feed.stacks(a, b)
            s = feed.steps(a, b)
            td = TensorDict({
                "pixels": torch.from_numpy(obs), "action": torch.from_numpy(s["action"]),
                "next": {"pixels": torch.from_numpy(nxt), "reward": torch.from_numpy(s["reward"])[:, None],
                         "done": torch.from_numpy(s["terminated"] | s["truncated"])[:, None],
                         "terminated": torch.from_numpy(s["terminated"])[:, None],
                         "truncated": torch.from_numpy(s["truncated"])[:, None]},
            }, batch_size=[b - a])
            t0 = time.perf_counter()
            if a < p:
                for i in range(b - a):
                    rb.add(td[i])
            else:
                rb.extend(td)
            spent[a >= p] += time.perf_counter() - t0
        self.per_step_rate = p / spent[0] if p else float("nan")
        self.block_rate = (n - p) / spent[1] if n > p else float("nan")

    def sample(self, b: int) -> Any:
        return self.rb.sample(b)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(name: str, npz: Path, rows: int, root: Path, per_step: int) -> None:
    """One contender: build it, report, then answer ``sample``/``cold`` requests on stdin."""
    import torch

    torch.set_num_threads(1)
    feed = Feed(npz, rows)
    reply = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not reach the protocol
    import mmbuffer  # noqa: F401  (imports before the RSS baseline)
    import stable_baselines3  # noqa: F401
    import torchrl  # noqa: F401

    if name.startswith(("mmbuffer", "SB3 drop-in")):
        warm_kernels(root, "zstd" if "zstd" in name else None)
    base = rss_anon()
    t0 = time.perf_counter()
    try:
        c: Contender = {
            "mmbuffer raw": lambda: Core(feed, root / "raw", None, per_step),
            "mmbuffer zstd": lambda: Core(feed, root / "zstd", "zstd", per_step),
            "SB3 ReplayBuffer": lambda: SB3(feed, False),
            "SB3 optimize_memory_usage": lambda: SB3(feed, True),
            "SB3 drop-in frame_stack=4": lambda: DropIn(feed, root / "dropin", None),
            "SB3 drop-in zstd": lambda: DropIn(feed, root / "dropin_zstd", "zstd"),
            "TorchRL LazyMemmapStorage": lambda: TorchRL(feed, root / "torchrl", per_step),
        }[name]()
    except MemoryError as exc:
        print(json.dumps({"error": f"MemoryError: {exc}"}), file=reply, flush=True)
        return
    built = time.perf_counter() - t0
    del feed
    disk = du(c.path) if c.path is not None else 0
    for b in (32, 256):  # maps made, code paths warmed
        for _ in range(5):
            c.sample(b)
    if c.path is not None:
        warm(c.path)
    print(json.dumps({"built_s": built, "disk": disk, "ram": c.ram_bytes, "per_step": c.per_step_rate,
                      "block": c.block_rate}), file=reply, flush=True)
    for line in sys.stdin:
        cmd, b, reps = line.split()
        if cmd == "warm":  # the cold rounds of an earlier group evicted the store
            if c.path is not None:
                warm(c.path)
            print("{}", file=reply, flush=True)
            continue
        times, cpu = [], []
        for _ in range(int(reps)):
            if cmd == "cold":
                assert c.path is not None
                drop_cache(c.path)
            t, u = time.perf_counter(), time.thread_time()
            c.sample(int(b))
            times.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - u)
        out: dict[str, Any] = {"times": times, "cpu": cpu, "rss_anon": rss_anon() - base}
        if cmd == "sample" and c.path is not None and disk:
            out["resident"] = resident(c.path) / disk
        print(json.dumps(out), file=reply, flush=True)


# -- the run ------------------------------------------------------------------------------
NAMES = ["mmbuffer raw", "mmbuffer zstd", "SB3 ReplayBuffer", "SB3 optimize_memory_usage",
         "SB3 drop-in frame_stack=4", "SB3 drop-in zstd", "TorchRL LazyMemmapStorage"]
#: contenders alive together, sampled in interleaved rounds; "mmbuffer raw" (built once,
#: kept alive) is in every group, so each ratio is against raw in the same rounds, and a
#: group's peers exit before the next starts (the in-RAM and stacked peers take GBs)
GROUPS = [["mmbuffer raw", "mmbuffer zstd", "SB3 drop-in frame_stack=4", "SB3 drop-in zstd"],
          ["mmbuffer raw", "SB3 ReplayBuffer"], ["mmbuffer raw", "SB3 optimize_memory_usage"],
          ["mmbuffer raw", "TorchRL LazyMemmapStorage"]]


class Worker:
    def __init__(self, name: str, npz: Path, args: argparse.Namespace) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", name, "--npz", str(npz), "--rows",
                                      str(args.rows), "--per-step", str(args.per_step)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.built = self._read() or {"error": "worker died (see stderr)"}
        if "error" in self.built:
            self.close()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return dict(json.loads(line)) if line else {}

    def ask(self, cmd: str, b: int, reps: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{cmd} {b} {reps}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait()


def run_game(game: str, args: argparse.Namespace, root: Path) -> list[tuple[dict[str, object], dict[str, object]]]:
    t0 = time.perf_counter()
    data = collect(game, args.collect)
    npz = root / f"{game}.npz"
    np.savez(npz, **data)
    eps = len(data["finals"])
    print(f"{game}: {len(data['frames']):,} transitions collected in {time.perf_counter() - t0:.1f} s, {eps} episodes "
          f"(mean {len(data['frames']) / eps:.0f} steps), tiled to {args.rows:,}")
    chosen = NAMES if args.contenders == "all" else ["mmbuffer raw", *(n.strip() for n in args.contenders.split(","))]
    rows: dict[str, dict[str, object]] = {n: {"game": game, "contender": n} for n in NAMES
                                          if n in chosen and (args.codec == "zstd" or "zstd" not in n)}
    live: dict[str, Worker] = {}
    times: dict[tuple[str, str, int], list[float]] = {}  # (name, regime, batch) -> medians per round
    ratios: dict[tuple[str, str, int], list[float]] = {}  # the same against raw's in the same round
    for group in GROUPS:
        members = []
        for name in (n for n in group if n in rows):
            r = rows[name]
            if name not in live and "result" not in r:
                w = Worker(name, npz, args)
                got = w.built
                if "error" in got:
                    r["result"] = got["error"]
                    print(f"  {name}: {got['error']}", flush=True)
                    continue
                live[name] = w
                r.update({"result": "ok", "built s": got["built_s"], "disk B/tr": got["disk"] / args.rows,
                          "RAM B/tr": got["ram"] / args.rows, "add 1/call tr/s": got["per_step"],
                          "add 1000/call tr/s": got["block"]})
                print(f"  {name}: built in {got['built_s']:.1f} s", flush=True)
            if name in live:
                members.append(name)
        if "mmbuffer raw" not in live:
            break
        if members == ["mmbuffer raw"] and any(k[0] == "mmbuffer raw" for k in times):
            continue  # no peer left in this group: raw alone was sampled already
        for name in members:
            live[name].ask("warm", 0, 0)
        for regime, rounds, reps in (("warm", args.rounds, args.reps), ("cold", args.cold_rounds, args.cold_reps)):
            for _ in range(rounds):
                for b in (32, 256):
                    got_round = {}
                    for name in members:
                        if regime == "cold" and live[name].built["disk"] == 0:
                            continue  # in RAM: no cold regime
                        got = live[name].ask("sample" if regime == "warm" else "cold", b, reps)
                        got_round[name] = statistics.median(got["times"])
                        times.setdefault((name, regime + " cpu", b), []).append(statistics.median(got["cpu"]))
                        rows[name]["RssAnon MiB"] = got["rss_anon"] / 2**20
                        if regime == "warm" and "resident" in got:
                            rows[name]["warm resident %"] = min(float(rows[name].get("warm resident %", 100.0)),
                                                                 100 * got["resident"])
                    for name, t in got_round.items():
                        times.setdefault((name, regime, b), []).append(t)
                        if name != "mmbuffer raw" and "mmbuffer raw" in got_round:
                            ratios.setdefault((name, regime, b), []).append(t / got_round["mmbuffer raw"])
        for name in members:
            if name != "mmbuffer raw":
                live.pop(name).close()
    for w in live.values():
        w.close()
    out = []
    for name, r in rows.items():
        sampled: dict[str, object] = {"game": game, "contender": name}
        for regime in ("warm", "cold"):
            for b in (32, 256):
                ts = times.get((name, regime, b))
                sampled[f"s({b}) {regime} ms"] = statistics.median(ts) * 1e3 if ts else float("nan")
                if regime == "warm":
                    cs = times.get((name, "warm cpu", b))
                    sampled[f"s({b}) warm cpu ms"] = statistics.median(cs) * 1e3 if cs else float("nan")
                rs = ratios.get((name, regime, b))
                sampled[f"s({b}) {regime} x raw"] = (statistics.median(rs) if rs else
                                                     1.0 if ts and name == "mmbuffer raw" else float("nan"))
        out.append((r, sampled))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=count, default=100_000, help="transitions each contender stores (tiled)")
    ap.add_argument("--games", default="MsPacman", help="comma-separated ALE games (MsPacman,Breakout)")
    ap.add_argument("--collect", type=count, default=5000, help="random-policy steps collected per game")
    ap.add_argument("--codec", default="zstd", help="'zstd' (the zstd contenders run) or 'none' (they do not)")
    ap.add_argument("--contenders", default="all",
                    help="'all' or comma-separated names besides 'mmbuffer raw' (always run), e.g. 'SB3 ReplayBuffer'")
    ap.add_argument("--per-step", type=count, default=2000, help="transitions added one a call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="calls per contender per round, page cache warm")
    ap.add_argument("--cold-rounds", type=int, default=2)
    ap.add_argument("--cold-reps", type=int, default=4)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--npz", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [] if args.contenders == "all" else [n for n in args.contenders.split(",") if n.strip() not in NAMES]
    if unknown:
        ap.error(f"--contenders: expected names among {NAMES}, got {unknown}")
    root = scratch() / "pixels_ale"
    if args.worker:
        worker(args.worker, Path(args.npz), args.rows, root, args.per_step)
        return
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    header(f"bench_pixels_ale: real ALE frames, 4-stacks of 84x84, {args.rows:,} transitions")
    print(f"one process per contender, torch threads 1; sample medians of {args.rounds} interleaved rounds x {args.reps} "
          f"calls (page cache warm: store files read and their maps touched first) and {args.cold_rounds} x {args.cold_reps} cold "
          f"(store pages unmapped and evicted before every call); mmbuffer's compiled kernels loaded before the clocks\n")
    rows = []
    try:
        for game in args.games.split(","):
            rows += run_game(game.strip(), args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nstorage, memory and adds (B/tr: bytes per transition; RssAnon: the process's, less its own after imports)")
    table([r for r, _ in rows])
    print("sample(B) of 4-stacks (obs and next obs): medians over rounds of each round's median; "
          "'x raw': against mmbuffer raw in the same rounds; 'cpu': the calling thread's CPU time")
    table([s for _, s in rows])


if __name__ == "__main__":
    main()
