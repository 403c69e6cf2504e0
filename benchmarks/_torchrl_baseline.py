"""TorchRL side-by-side baselines for the mmbuffer benchmarks.

Only TorchRL's public API is used (``ReplayBuffer``, ``LazyTensorStorage``,
``LazyMemmapStorage``, ``SliceSampler``, ``PrioritizedSampler``); no TorchRL code
is copied here.  Both entry points return ``None`` when TorchRL (or, for the
prioritized sampler, an interpreter able to load TorchRL's C++ extension) is not
available, and the caller then prints ``"torchrl not installed"``::

    from _torchrl_baseline import slice_sampler_times, prioritized_sampler_times

    t = slice_sampler_times(done, None, num_slices=256, slice_len=4, reps=20)
    if t is None:
        print("torchrl not installed")

* :func:`slice_sampler_times` runs in the calling process (TorchRL 0.14.1's
  ``SliceSampler`` is pure Python and works with the main environment's torch).
* :func:`prioritized_sampler_times` always runs in a fresh subprocess (so that
  the RSS it reports is that of TorchRL alone).  TorchRL 0.14.1's
  ``PrioritizedSampler`` needs ``torchrl._torchrl`` (C++ segment trees), which
  only loads with torch 2.14.1; when the current interpreter cannot load it,
  the interpreter named by ``$MMBUFFER_TORCHRL_PYTHON`` or
  ``/work/venvs/torchrl214/bin/python`` (torch 2.14.1 + torchrl 0.14.1) is used.

This file is also the worker script of that subprocess
(``python _torchrl_baseline.py _prio_worker '<json>'``): the worker imports only
numpy, torch and torchrl, never mmbuffer.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

__all__ = [
    "torchrl_available",
    "prioritized_python",
    "slice_sampler_times",
    "prioritized_sampler_times",
]

DEFAULT_VENV_PYTHON = "/work/venvs/torchrl214/bin/python"
_CHUNK = 8_000_000  # rows per extend() while filling (bounds TorchRL's int64 index temporaries)

os.environ.setdefault("RL_LOGGING_LEVEL", "WARNING")  # silence TorchRL's INFO lines


# --------------------------------------------------------------------------- helpers
def _import_torchrl():
    try:
        import logging

        import torch  # noqa: F401
        import torchrl  # noqa: F401
        from tensordict import TensorDict
        from torchrl.data import (
            LazyMemmapStorage,
            LazyTensorStorage,
            ReplayBuffer,
            SliceSampler,
        )

        logging.getLogger("torchrl").setLevel(logging.WARNING)
    except Exception:  # ImportError, or a broken binary dependency
        return None
    return torch, torchrl, TensorDict, ReplayBuffer, LazyTensorStorage, LazyMemmapStorage, SliceSampler


def torchrl_available() -> bool:
    """True when ``torchrl`` (and ``tensordict``) import in this process."""
    return _import_torchrl() is not None


def _rss_bytes() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return {"rss_bytes": out.get("VmRSS"), "peak_rss_bytes": out.get("VmHWM")}


def _median(xs) -> float:
    return float(statistics.median(xs))


def _put(out: dict, name: str, ts: list) -> None:
    """``name_s`` = median, ``name_min_s`` = min (robust to other load on the host)."""
    out[f"{name}_s"] = _median(ts)
    out[f"{name}_min_s"] = float(min(ts))


def _timed(fn, reps: int) -> list:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


# --------------------------------------------------------------------------- slices
def slice_sampler_times(
    done: np.ndarray,
    traj_or_none: np.ndarray | None,
    num_slices: int,
    slice_len: int,
    reps: int = 10,
    cache_values: bool = True,
    *,
    capacity: int | None = None,
    storage: str = "tensor",
    scratch_dir: str | None = None,
    online_episode_len: int = 1000,
    online_reps: int | None = None,
    seed: int = 0,
) -> dict | None:
    """Time TorchRL's ``SliceSampler`` on the given episode layout, in this process.

    Args:
        done: bool ``[stored]``, True on the last row of each episode (terminated
            or truncated), in storage order.  Only this column (as
            ``("next", "done")``, 1 byte/row) and a 1-byte ``obs`` are stored:
            the index cost does not depend on the other columns.
        traj_or_none: optional integer episode id per row ``[stored]``.  When
            given it is stored as ``"episode"`` (int32 when it fits) and the
            sampler uses ``traj_key="episode"`` instead of ``end_key`` (TorchRL's
            slower path); ``done`` is then ignored except for the online episodes.
        num_slices, slice_len: batch = ``num_slices * slice_len`` rows.
        reps: timed samples per mode (medians are returned).
        cache_values: also time ``SliceSampler(cache_values=True)`` (static
            "cached" mode) and the online mode (extend one episode of
            ``online_episode_len`` rows, then sample: the write drops TorchRL's
            cache).  With False only the uncached mode is timed.
        capacity: storage capacity (default ``len(done)``); e.g. 600M capacity
            with 346M stored reproduces pytorch/rl#2669.
        storage: ``"tensor"`` (``LazyTensorStorage``, RAM) or ``"memmap"``
            (``LazyMemmapStorage`` in ``scratch_dir``).
        online_reps: number of online extend+sample rounds (default ``reps``).

    Returns ``None`` when torchrl is not importable, else a dict of seconds
    (medians): ``uncached_index_s`` / ``uncached_total_s`` (sampler only /
    ``rb.sample()`` including the gather), ``cached_index_s`` /
    ``cached_total_s``, ``online_sample_s`` (sample right after a write),
    ``online_extend_s``, plus ``fill_s``, sizes, versions and RSS.  Every
    timing ``X_s`` also comes as ``X_min_s`` (the fastest rep), which is the
    steadier figure on a shared, loaded host.
    """
    mods = _import_torchrl()
    if mods is None:
        return None
    torch, torchrl, TensorDict, ReplayBuffer, LazyTensorStorage, LazyMemmapStorage, SliceSampler = mods

    done = np.asarray(done)
    if done.dtype != np.bool_:
        done = done.astype(np.bool_)
    stored = int(done.shape[0])
    capacity = int(capacity or stored)
    if capacity < stored:
        raise ValueError("capacity < len(done)")
    batch = int(num_slices) * int(slice_len)
    online_reps = reps if online_reps is None else online_reps
    torch.manual_seed(seed)

    traj = None
    if traj_or_none is not None:
        traj = np.asarray(traj_or_none)
        if traj.shape[0] != stored:
            raise ValueError("traj_or_none must have len(done) rows")
        lo, hi = int(traj.min()), int(traj.max()) + online_reps + 1
        tdtype = np.int32 if (lo >= np.iinfo(np.int32).min and hi <= np.iinfo(np.int32).max) else np.int64
        traj = traj.astype(tdtype, copy=False)
        next_ep = hi - online_reps

    if storage not in ("tensor", "memmap"):
        raise ValueError(f"unknown storage {storage!r}")
    tmpdirs: list = []

    def make_storage():
        if storage == "tensor":
            return LazyTensorStorage(capacity)
        # a fresh directory per buffer: TorchRL refuses to reuse existing files
        d = tempfile.mkdtemp(prefix="torchrl_slice_", dir=scratch_dir)
        tmpdirs.append(d)
        return LazyMemmapStorage(capacity, scratch_dir=d)

    def make_sampler(cache: bool):
        if traj is not None:
            return SliceSampler(num_slices=num_slices, traj_key="episode", cache_values=cache)
        return SliceSampler(num_slices=num_slices, end_key=("next", "done"), cache_values=cache)

    def chunk_td(lo, hi, d, t):
        n = hi - lo
        fields: dict[str, Any] = {
            "obs": torch.zeros(n, dtype=torch.uint8),
            "next": TensorDict({"done": torch.from_numpy(d)}, batch_size=[n]),
        }
        if t is not None:
            fields["episode"] = torch.from_numpy(t)
        return TensorDict(fields, batch_size=[n])

    # One storage, two buffers sharing it would make TorchRL's writer/cache
    # bookkeeping ambiguous, so each mode gets its own buffer; the uncached one
    # is freed before the cached one is built to keep the peak memory at one copy.
    def build(cache: bool):
        rb = ReplayBuffer(storage=make_storage(), sampler=make_sampler(cache), batch_size=batch)
        t0 = time.perf_counter()
        for lo in range(0, stored, _CHUNK):
            hi = min(stored, lo + _CHUNK)
            rb.extend(chunk_td(lo, hi, done[lo:hi], None if traj is None else traj[lo:hi]))
        return rb, time.perf_counter() - t0

    out: dict[str, Any] = {
        "stored": stored,
        "capacity": capacity,
        "num_slices": int(num_slices),
        "slice_len": int(slice_len),
        "key": "episode" if traj is not None else "next.done",
        "storage": storage,
        "reps": int(reps),
        "torchrl_version": torchrl.__version__,
        "torch_version": torch.__version__,
    }

    def index_once(rb):
        rb.sampler.sample(rb.storage, batch)

    def run_modes():
        # ---- uncached
        rb, fill_s = build(False)
        out["fill_s"] = fill_s
        rb.sample()  # warm-up (lazy init, first allocation)
        _put(out, "uncached_index", _timed(lambda: index_once(rb), reps))
        _put(out, "uncached_total", _timed(lambda: rb.sample(), reps))
        out.update({f"uncached_{k}": v for k, v in _rss_bytes().items()})
        del rb

        if cache_values:
            rb, _ = build(True)
            t0 = time.perf_counter()
            rb.sample()  # fills the cache
            out["cached_first_sample_s"] = time.perf_counter() - t0
            _put(out, "cached_index", _timed(lambda: index_once(rb), reps))
            _put(out, "cached_total", _timed(lambda: rb.sample(), reps))

            # ---- online: extend one episode, then sample (the write drops the cache)
            L = int(online_episode_len)
            ext_t, smp_t = [], []
            for i in range(online_reps):
                d = np.zeros(L, dtype=np.bool_)
                d[-1] = True
                t = None if traj is None else np.full(L, next_ep + i, dtype=traj.dtype)
                td = chunk_td(0, L, d, t)
                t0 = time.perf_counter()
                rb.extend(td)
                t1 = time.perf_counter()
                rb.sample()
                t2 = time.perf_counter()
                ext_t.append(t1 - t0)
                smp_t.append(t2 - t1)
            _put(out, "online_extend", ext_t)
            _put(out, "online_sample", smp_t)
            out["online_episode_len"] = L
            out.update(_rss_bytes())
            del rb
        else:
            out.update(_rss_bytes())

    try:
        run_modes()
    finally:
        for d in tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- priorities
def _ext_loads_here() -> bool:
    """True when this interpreter has TorchRL with its C++ segment trees."""
    if _import_torchrl() is None:
        return False
    import logging

    lg = logging.getLogger("torchrl")
    level = lg.level
    lg.setLevel(logging.ERROR)  # TorchRL warns when its extension is missing
    try:
        from torchrl.data import PrioritizedSampler

        PrioritizedSampler(2, 0.6, 0.4)
        return True
    except Exception:
        return False
    finally:
        lg.setLevel(level)


def prioritized_python() -> str | None:
    """The interpreter used for :func:`prioritized_sampler_times`, or None."""
    env = os.environ.get("MMBUFFER_TORCHRL_PYTHON")
    if env:
        return env if os.path.exists(env) else None
    if _ext_loads_here():
        return sys.executable
    if os.path.exists(DEFAULT_VENV_PYTHON):
        return DEFAULT_VENV_PYTHON
    return None


def prioritized_sampler_times(
    capacity: int,
    batch: int = 256,
    reps: int = 50,
    *,
    max_priority_within_buffer: bool = True,
    alpha: float = 0.6,
    beta: float = 0.4,
    python: str | None = None,
    timeout: float = 1800.0,
) -> dict | None:
    """Time TorchRL's ``PrioritizedSampler`` at ``capacity`` rows (buffer full).

    Runs in a fresh subprocess (``python`` or :func:`prioritized_python`).  The
    buffer is a ``ReplayBuffer(LazyTensorStorage(capacity), PrioritizedSampler)``
    holding a 1-byte ``obs`` column, filled to capacity (new rows get TorchRL's
    default priority), then given random priorities in [0, 1).

    Returned medians (seconds; each also as ``X_min_s``, the fastest rep): ``sample_index_s`` (``sampler.sample`` only),
    ``sample_total_s`` (``rb.sample`` with the gather), ``update_s``
    (``rb.update_priority`` of ``batch`` sampled indices); and, when
    ``max_priority_within_buffer=True`` (a TorchRL >= 0.7 option, present in
    0.14.1), ``update_touching_max_s``: an update of ``batch`` indices one of
    which holds the current max (TorchRL then rescans the leaves for the new
    max).  Also ``rss_bytes`` / ``peak_rss_bytes`` of that process at the end,
    ``rss_after_import_bytes`` (torch + torchrl imported, no buffer yet: the
    difference is the buffer's own cost), ``fill_s``, versions.  Returns ``None`` when no interpreter with a
    working ``PrioritizedSampler`` is found.
    """
    py = python or prioritized_python()
    if py is None:
        return None
    args = {
        "capacity": int(capacity),
        "batch": int(batch),
        "reps": int(reps),
        "max_priority_within_buffer": bool(max_priority_within_buffer),
        "alpha": alpha,
        "beta": beta,
    }
    env = dict(os.environ, RL_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [py, os.path.abspath(__file__), "_prio_worker", json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-2000:]
        if "No module named" in tail or "is not available" in tail:
            return None
        raise RuntimeError(f"TorchRL prioritized worker failed ({py}):\n{tail}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(line)
    res["python"] = py
    return res


def _prio_worker(args: dict) -> dict:
    import torch
    import torchrl
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

    torch.manual_seed(0)
    rss_import = _rss_bytes()["rss_bytes"]  # torch (+ its CUDA libs) and torchrl, before any buffer
    cap, batch, reps = args["capacity"], args["batch"], args["reps"]
    mpwb = args["max_priority_within_buffer"]
    kw = {"max_priority_within_buffer": True} if mpwb else {}
    sampler = PrioritizedSampler(cap, args["alpha"], args["beta"], **kw)
    rb = ReplayBuffer(storage=LazyTensorStorage(cap), sampler=sampler, batch_size=batch)

    t0 = time.perf_counter()
    chunk = 1_000_000
    for lo in range(0, cap, chunk):
        n = min(chunk, cap - lo)
        rb.extend(TensorDict({"obs": torch.zeros(n, dtype=torch.uint8)}, batch_size=[n]))
    fill_s = time.perf_counter() - t0
    # random priorities in [0, 1) on every row (kept below 2.0 so that the
    # "max" row set later is the unique maximum)
    # (large chunks: with max_priority_within_buffer=True each chunk that
    # contains the running max triggers a full rescan in TorchRL)
    for lo in range(0, cap, 10 * chunk):
        n = min(10 * chunk, cap - lo)
        rb.update_priority(torch.arange(lo, lo + n), torch.rand(n))
    fill_s_prio = time.perf_counter() - t0 - fill_s

    out = {
        "capacity": cap,
        "batch": batch,
        "reps": reps,
        "max_priority_within_buffer": mpwb,
        "torchrl_version": torchrl.__version__,
        "torch_version": torch.__version__,
        "fill_s": fill_s,
        "set_priorities_s": fill_s_prio,
        "rss_after_import_bytes": rss_import,
    }
    for _ in range(3):  # warm-up
        rb.sample()
    _put(out, "sample_index", _timed(lambda: rb.sampler.sample(rb.storage, batch), reps))

    st, ut = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        _, info = rb.sample(return_info=True)
        t1 = time.perf_counter()
        idx = info["index"]
        rb.update_priority(idx, torch.rand(idx.shape[0]))
        t2 = time.perf_counter()
        st.append(t1 - t0)
        ut.append(t2 - t1)
    _put(out, "sample_total", st)
    _put(out, "update", ut)

    if mpwb:
        # The row holding the max is lowered: TorchRL recomputes the max over
        # all leaves.  Setting the max (untimed) also rescans, by design.
        tm = []
        g = torch.Generator().manual_seed(1)
        for i in range(max(3, min(reps, 20))):
            j = int(torch.randint(cap, (1,), generator=g))
            rb.update_priority(torch.tensor([j]), torch.tensor([2.0 + i]))
            idx = torch.randint(cap, (batch,), generator=g)
            idx[0] = j
            pr = torch.rand(batch, generator=g)
            t0 = time.perf_counter()
            rb.update_priority(idx, pr)
            tm.append(time.perf_counter() - t0)
        _put(out, "update_touching_max", tm)
    out.update(_rss_bytes())
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "_prio_worker":
        print(json.dumps(_prio_worker(json.loads(sys.argv[2]))), flush=True)
    else:
        print(__doc__)
