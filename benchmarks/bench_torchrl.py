"""The TorchRL drop-in (``mmbuffer.torchrl.ReplayBuffer``) against TorchRL's own
``TensorDictReplayBuffer`` on ``LazyMemmapStorage``, same data, same run.

Both buffers receive the same synthetic collector batches (``[E, T]`` with
``observation``, ``action``, ``("next", observation / reward / done / terminated /
truncated)``, ``("collector", "traj_ids")``; TorchRL gets them flattened, as its
examples do). Timed, median over ``--reps`` calls, warm page cache:

* ``extend``: one ``[E, T]`` batch (the two buffers alternate batch by batch over
  the whole fill; median and mean of the fill, the first batch, which creates the
  files, left out);
* ``sample``: ``batch_size`` uniform transitions, as a TensorDict;
* ``slices``: ``batch_size`` rows as ``batch_size // L`` windows of ``L``
  (``Slices(L)`` against ``SliceSampler(slice_len=L, traj_key=...)``);
* the same two reads straight from ``mb.Buffer`` (``Batch`` of tensors, no
  TensorDict): what the drop-in layer costs on top.

TorchRL's ``PrioritizedSampler`` needs its C++ extension, which does not load with
the torch this project pins, so prioritized sampling is not compared here
(``bench_priority.py`` does, through a separate interpreter).

    python benchmarks/bench_torchrl.py --rows 1e6
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from _common import header, median_time, table


def _batch(e: int, t: int, obs_dim: int, step: int, ep_len: int, g: torch.Generator):
    from tensordict import TensorDict

    obs = torch.randn(e, t + 1, obs_dim, generator=g)
    pos = (step + torch.arange(t)) % ep_len
    end = (pos == ep_len - 1).expand(e, t)[..., None]
    traj = ((step + torch.arange(t)) // ep_len)[None, :] * e + torch.arange(e)[:, None]
    return TensorDict(
        {
            "observation": obs[:, :-1],
            "action": torch.randn(e, t, 6, generator=g),
            "done": torch.zeros(e, t, 1, dtype=torch.bool),
            "terminated": torch.zeros(e, t, 1, dtype=torch.bool),
            "truncated": torch.zeros(e, t, 1, dtype=torch.bool),
            "collector": {"traj_ids": traj},
            "next": {
                "observation": obs[:, 1:],
                "reward": torch.randn(e, t, 1, generator=g),
                "done": end.clone(),
                "terminated": end.clone(),
                "truncated": torch.zeros(e, t, 1, dtype=torch.bool),
            },
        },
        [e, t],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=float, default=1e6, help="rows stored before timing (1e6 notation accepted)")
    p.add_argument("--envs", type=int, default=8, help="environments per collector batch (E)")
    p.add_argument("--steps", type=int, default=128, help="steps per environment per batch (T)")
    p.add_argument("--obs-dim", type=int, default=17)
    p.add_argument("--episode-len", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--slice-len", type=int, default=16)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads, 0: torch's default (1: on a loaded 2-core machine, waking a "
                        "second thread made TorchRL's 256-row index take 1.4 ms instead of 4 us)")
    p.add_argument("--extend-only", action="store_true", help="time the fill's extends only")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    args = p.parse_args()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    from mmbuffer.torchrl import ReplayBuffer

    if args.threads:
        torch.set_num_threads(args.threads)
    rows, e, t, bs, L = int(args.rows), args.envs, args.steps, args.batch_size, args.slice_len
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_torchrl_"))
    g = torch.Generator().manual_seed(0)
    rb = ReplayBuffer(root / "mmbuffer", capacity=rows, batch_size=bs, generator=torch.Generator().manual_seed(0))
    ref = TensorDictReplayBuffer(storage=LazyMemmapStorage(rows, scratch_dir=root / "torchrl"), batch_size=bs)
    n_batches = rows // (e * t)
    fill_mb: list[float] = []
    fill_ref: list[float] = []
    for i in range(n_batches):
        td = _batch(e, t, args.obs_dim, i * t, args.episode_len, g)
        flat = td.reshape(-1)
        t0 = time.perf_counter()
        rb.extend(td)
        t1 = time.perf_counter()
        ref.extend(flat)
        if i:  # the first extend creates the files on both sides: not timed
            fill_ref.append(time.perf_counter() - t1)
            fill_mb.append(t1 - t0)
    rb.commit()
    buf = rb.buffer

    results = []

    def row(name: str, theirs: float, ours: float, raw: float | None) -> None:
        results.append({
            "operation": name,
            "TorchRL ms": theirs * 1e3,
            "drop-in ms": ours * 1e3,
            "drop-in / TorchRL": ours / theirs,
            "mb.Buffer ms": float("nan") if raw is None else raw * 1e3,
        })

    row(f"extend [{e}, {t}], median of the fill", statistics.median(fill_ref), statistics.median(fill_mb), None)
    row(f"extend [{e}, {t}], mean of the fill", statistics.mean(fill_ref), statistics.mean(fill_mb), None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not args.extend_only:
            _reads(row, ref, rb, buf, bs, L, args.reps)

    header(f"TorchRL drop-in against TensorDictReplayBuffer(LazyMemmapStorage), {rows:,} rows")
    print(f"obs {args.obs_dim} float32, action 6 float32, episodes of {args.episode_len} steps, "
          f"extend: {n_batches - 1} batches alternated; reads: median of {args.reps} calls; warm; "
          f"torch threads {torch.get_num_threads()}")
    table(results)
    rb.close()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


def _reads(row, ref, rb, buf, bs: int, L: int, reps: int) -> None:  # noqa: ANN001
    """The sample and slice rows, each read alternating buffers' medians."""
    from torchrl.data import SliceSampler, TensorDictReplayBuffer

    import mmbuffer as mb

    row(
        f"sample({bs}) transitions",
        median_time(ref.sample, reps),
        median_time(rb.sample, reps),
        median_time(lambda: buf.sample(bs, rb.generator), reps),
    )
    ref_slices = TensorDictReplayBuffer(
        storage=ref.storage, batch_size=bs * L,
        sampler=SliceSampler(slice_len=L, traj_key=("collector", "traj_ids")),
    )
    rb_slices_spec = mb.samplers.Slices(L)
    rb.set_sampler(rb_slices_spec)
    row(
        f"slices: {bs} x {L} rows",
        median_time(ref_slices.sample, reps),
        median_time(lambda: rb.sample(bs * L), reps),
        median_time(lambda: buf.sample(bs, rb.generator, sampler=rb_slices_spec), reps),
    )


if __name__ == "__main__":
    main()
