"""Does a GPU training step wait on mmbuffer? A TD-MPC2-sized world model fed by each loader.

The step: an MLP world model ``23 -> 1024 -> 1024 -> 1024 -> 17`` (each hidden layer
Linear + LayerNorm + Mish, as TD-MPC2's), bf16 autocast, AdamW, predicting
``next_obs`` from ``obs`` and ``action`` on ``--slices`` x ``--slice-len`` (256 x 64)
slices of a store of ``--rows`` rows (obs 17 float32, action 6 float32, reward;
every column and ``next_obs`` read: 2.8 MB a batch). Small layers make the step
launch-bound (the CPU issuing kernels is the limit), so any CPU the loader takes
from the training thread shows. ``--wide 4`` repeats the headline modes with a 4x
wider model (a GPU-bound step) for contrast.

Reported, steps per second and as a fraction of ``compute only``:

* ``compute only``: the step on batches already on the GPU (the ceiling),
* ``sync``: ``buf.sample_slices`` + ``.to("cuda")`` then the step, in the loop,
* ``mb.stream(device="cuda", workers=k)``: the ring of pinned blocks, one copy a batch,
* ``mb.stream(device="cuda", processes=k)`` (modes ``stream-procK``): producers in k
  processes writing into a shared page-locked ring, only slot numbers crossing,
* ``DataLoader(BufferDataset, num_workers=k, pin_memory=True)``, then ``.to("cuda")``,
* ``paired-stream-procK``: ``processes=K`` and compute only in one pass, alternating
  blocks of ``--block`` steps, so that the host's drift (compute only itself moves by
  up to 10% between passes on the lent machines) cancels in the ratio (the default
  run starts with three such passes: the headline figure of RESULTS),

and the loaders alone (no step): batches/s and GB/s delivered to the GPU.

Run on a CUDA machine: ``python benchmarks/bench_gpu.py``. Without CUDA it prints
a skip and exits 0. ``--modes`` picks modes (``--modes compute,stream2``);
``--label`` names the run in the table (to compare two checkouts side by side,
run the script once with each on ``PYTHONPATH``, on the same ``--path``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_world_model_store  # noqa: E402

import mmbuffer as mb  # noqa: E402
from mmbuffer.data import BufferDataset  # noqa: E402

DEFAULT_MODES = "paired-stream-proc4,paired-stream-proc4,paired-stream-proc4,compute,sync,stream1,stream2,stream4,loader2,loader8,loaderfs8,alone_stream1,alone_stream2,alone_stream4,alone_loader2,alone_loader8,alone_loaderfs8,wide_compute,wide_sync,wide_stream2,stream-proc2,stream-proc4,alone_stream-proc2,alone_stream-proc4"


def build(path: Path, rows: int, episode: int) -> None:
    build_world_model_store(path, rows, episode)


def warm(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


class WorldModel(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        width = 23
        for _ in range(3):
            layers += [torch.nn.Linear(width, hidden), torch.nn.LayerNorm(hidden), torch.nn.Mish()]
            width = hidden
        layers.append(torch.nn.Linear(width, 17))
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def make_step(hidden: int, dev: torch.device) -> Callable[[Any], None]:
    model = WorldModel(hidden).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(b: Any) -> None:
        x = torch.cat([b["obs"], b["action"]], -1)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            pred = model(x)
        loss = torch.nn.functional.mse_loss(pred.float(), b["next_obs"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


DEVICE = torch.device("cpu")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


TRACE: list[str] = []  # with --trace: one line per mode, printed after the table


def timed(batches: Iterator[Any], step: Callable[[Any], None] | None, warmup: int, n: int) -> float:
    """Items per second over ``n`` items after ``warmup`` (the GPU drained at both ends).

    With ``--trace`` it also records, for the training thread, the time spent in
    ``next()`` per step, its CPU time against the wall clock, its involuntary context
    switches, the rate in each quarter of the window and the GPU's clocks."""
    run(batches, step, warmup)
    sync()
    if TRACE_ON:
        return _traced(batches, step, n)
    t0 = time.perf_counter()
    run(batches, step, n)
    sync()
    return n / (time.perf_counter() - t0)


def run(batches: Iterator[Any], step: Callable[[Any], None] | None, n: int) -> None:
    """``n`` batches of ``batches``, each through ``step`` (none: the loader alone)."""
    for _ in range(n):
        b = next(batches)
        if step is not None:
            step(b)


def paired(streamed: Iterator[Any], on_gpu: Iterator[Any], step: Callable[[Any], None] | None, warmup: int, n: int, block: int) -> tuple[float, float]:
    """Steps/s fed by ``streamed`` and by ``on_gpu`` (batches already on the GPU), timed in
    alternating blocks of ``block`` steps (order ABBA, so neither side always goes first)
    over ``n`` steps each: a drift of the host's speed during the pass slows both sides
    alike, so their ratio measures the loader and not the minute it ran in."""
    sides = (streamed, on_gpu)
    for it in sides:
        run(it, step, warmup)
    spent = [0.0, 0.0]
    block = min(block, n)
    rounds = n // block
    for r in range(rounds):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            sync()
            t0 = time.perf_counter()
            run(sides[k], step, block)
            sync()
            spent[k] += time.perf_counter() - t0
    done = rounds * block
    return done / spent[0], done / spent[1]


TRACE_ON = False
CURRENT = [""]  # the mode being timed, for the trace lines


def topology() -> list[frozenset[int]]:
    """This process's CPUs grouped by physical core (SMT siblings together)."""
    cores: dict[frozenset[int], None] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            text = str(cpu)
        sib: set[int] = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            sib.update(range(int(lo), int(hi or lo) + 1))
        cores[frozenset(sib & os.sched_getaffinity(0))] = None
    return list(cores)


def pin_apart() -> tuple[set[int], set[int]]:
    """Put the training process's threads on the first half of the physical cores and
    every child process (the stream's workers, the forkserver) on the others."""
    import psutil

    cores = topology()
    half = max(1, len(cores) // 2)
    train = set().union(*cores[:half])
    rest = set().union(*cores[half:]) or train
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), train)
    for child in psutil.Process().children(recursive=True):
        try:
            for t in child.threads():
                os.sched_setaffinity(t.id, rest)
        except (psutil.Error, OSError):
            pass
    return train, rest


def unpin(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def _traced(batches: Iterator[Any], step: Callable[[Any], None] | None, n: int) -> float:
    import resource

    import numpy as np

    clocks0 = gpu_clocks()
    waits = np.empty(n)
    ends = np.empty(n)
    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    c0 = time.thread_time()
    t0 = time.perf_counter()
    for i in range(n):
        a = time.perf_counter()
        b = next(batches)
        waits[i] = time.perf_counter() - a
        if step is not None:
            step(b)
        ends[i] = time.perf_counter()
    sync()
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    q = np.array_split(np.diff(np.concatenate([[t0], ends])), 4)
    quarters = "/".join(f"{len(x) / x.sum():.0f}" for x in q)
    TRACE.append(
        f"{CURRENT[0]}: next() p50 {np.median(waits) * 1e3:.3f} ms, p99 {np.percentile(waits, 99) * 1e3:.2f} ms, max {waits.max() * 1e3:.1f} ms, "
        f"{waits.sum() / wall:.1%} of the wall; training thread CPU {cpu / wall:.0%} of the wall, "
        f"{r1.ru_nivcsw - r0.ru_nivcsw} involuntary / {r1.ru_nvcsw - r0.ru_nvcsw} voluntary switches, "
        f"{r1.ru_minflt - r0.ru_minflt} minor faults; steps/s by quarter {quarters}; GPU clocks {clocks0} -> {gpu_clocks()}"
    )
    return n / wall


def gpu_clocks() -> str:
    """SM / memory clock (MHz) and temperature, from nvidia-smi (outside any timed window)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.replace(", ", "/")


def batch_bytes(b: Any) -> int:
    tensors = [*b.data.values(), b.indices, b.weights] + ([] if b.mask is None else [b.mask])
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=float, default=2e6)
    p.add_argument("--episode", type=int, default=500)
    p.add_argument("--slices", type=int, default=256)
    p.add_argument("--slice-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--wide", type=int, default=4, help="the wide model's hidden size is this times --hidden")
    p.add_argument("--modes", default=DEFAULT_MODES)
    p.add_argument("--block", type=int, default=100, help="paired-* modes: steps per alternating block")
    p.add_argument("--label", default="this checkout")
    p.add_argument("--path", type=Path, default=None, help="a store built earlier by this script (else a temporary one)")
    p.add_argument("--trace", action="store_true", help="also record where the training thread's time goes (printed after the table)")
    p.add_argument("--cpu-dry-run", action="store_true", help="run every mode on the CPU, tiny: checks the script, measures nothing")
    args = p.parse_args()
    if args.cpu_dry_run:
        dev = torch.device("cpu")
        args.rows, args.steps, args.warmup, args.hidden, args.slices = 2e4, 3, 2, 32, 8
    elif not torch.cuda.is_available():
        print("bench_gpu: skipped, CUDA is not available (this benchmark needs a GPU)")
        return 0
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    global DEVICE, TRACE_ON
    DEVICE = dev
    TRACE_ON = args.trace
    modes = [m for m in args.modes.split(",") if m]
    tmp = None
    path = args.path
    if path is None:
        tmp = tempfile.mkdtemp(prefix="bench_gpu_")
        path = Path(tmp) / "store"
    if not (path / "manifest.json").exists():
        t0 = time.perf_counter()
        build(path, int(args.rows), args.episode)
        print(f"built {int(args.rows):,} rows in {time.perf_counter() - t0:.1f} s")
    warm(path)
    buf = mb.open(path, mode="r")
    B, L = args.slices, args.slice_len
    g = torch.Generator().manual_seed(0)
    sample = buf.sample_slices(B, L, generator=g)
    nbytes = batch_bytes(sample)
    t0 = time.perf_counter()
    for _ in range(50):
        buf.sample_slices(B, L, generator=g)
    sample_ms = (time.perf_counter() - t0) / 50 * 1e3
    print(f"## bench_gpu ({args.label}) {datetime.date.today().isoformat()}")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU dry run (measures nothing)"
    print(f"{gpu}; {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}")
    print(f"store {int(args.rows):,} rows, batch {B}x{L} slices, {nbytes / 1e6:.2f} MB a batch; "
          f"buf.sample_slices alone {sample_ms:.2f} ms on one thread")
    print()
    print("| mode | steps/s (or batches/s) | of compute only | GB/s |")
    print("|---|---|---|---|")
    ceilings: dict[int, float] = {}
    on_gpu = [buf.sample_slices(B, L, generator=g).to(dev) for _ in range(16)]

    def gpu_cycle() -> Iterator[Any]:
        while True:
            yield from on_gpu

    def report(name: str, rate: float, hidden: int | None) -> None:
        ratio = "" if hidden is None or hidden not in ceilings else f"{rate / ceilings[hidden]:.0%}"
        gbs = f"{rate * nbytes / 1e9:.2f}" if hidden is None else ""
        print(f"| {name} | {rate:.0f} | {ratio} | {gbs} |", flush=True)

    def run_mode(mode: str) -> None:
        wide = mode.startswith("wide_")
        base = mode[5:] if wide else mode
        hidden = args.hidden * (args.wide if wide else 1)
        alone = base.startswith("alone_")
        kind = base[6:] if alone else base
        step = None if alone else make_step(hidden, dev)
        tag = f"{'wide ' if wide else ''}{'loader alone: ' if alone else ''}"
        if kind == "compute":
            rate = timed(gpu_cycle(), step, args.warmup, args.steps)
            ceilings[hidden] = rate
            report(f"{tag}compute only (h={hidden})", rate, hidden)
        elif kind == "sync":
            def sync_batches() -> Iterator[Any]:
                while True:
                    yield buf.sample_slices(B, L, generator=g).to(dev, non_blocking=True)
            report(f"{tag}sync: sample_slices + .to(cuda)", timed(sync_batches(), step, args.warmup, args.steps), None if alone else hidden)
        elif kind.startswith("paired-stream-proc"):
            procs = int(kind[18:])
            with mb.stream(buf, B, L, device=dev, generator=g, processes=procs) as s:
                streamed, ceiling = paired(iter(s), gpu_cycle(), step, args.warmup, args.steps, args.block)
            ratio = streamed / ceiling
            ceilings[hidden] = ceiling
            if TRACE_ON:
                TRACE.append(f"{mode}: {args.steps // min(args.block, args.steps)} rounds of {min(args.block, args.steps)} steps each way, "
                             f"compute only {ceiling:.0f} steps/s, streamed {streamed:.0f} steps/s")
            print(f"| {tag}paired: mb.stream(device=cuda, processes={procs}) against compute only, "
                  f"alternating blocks of {min(args.block, args.steps)} steps | {streamed:.0f} (compute only {ceiling:.0f}) | {ratio:.1%} | |", flush=True)
        elif kind.startswith("stream-proc"):
            pin = kind.endswith("pin")
            procs = int(kind[11:].removesuffix("pin"))
            t_open = time.perf_counter()
            with mb.stream(buf, B, L, device=dev, generator=g, processes=procs) as s:
                first = next(iter(s))
                started = time.perf_counter() - t_open
                del first
                where = ""
                if pin:
                    train, rest = pin_apart()
                    where = f", training on CPUs {sorted(train)}, workers on {sorted(rest)}"
                try:
                    rate = timed(iter(s), step, args.warmup, args.steps)
                finally:
                    if pin:
                        unpin(all_cpus)
            if TRACE_ON:
                TRACE[-1] += f"; first batch {started * 1e3:.0f} ms after mb.stream(){where}"
            report(f"{tag}mb.stream(device=cuda, processes={procs}{', pinned apart' if pin else ''})", rate, None if alone else hidden)
        elif kind.startswith("stream"):
            workers = int(kind[6:] or 0) or None
            extra = {} if workers is None else {"workers": workers}
            try:
                s = mb.stream(buf, B, L, device=dev, pin_memory=dev.type == "cuda", generator=g, **extra)
            except TypeError:  # a checkout without workers=
                s = mb.stream(buf, B, L, device=dev, pin_memory=dev.type == "cuda", generator=g)
            with s:
                rate = timed(iter(s), step, args.warmup, args.steps)
            report(f"{tag}mb.stream(device=cuda, workers={workers or 'default'})", rate, None if alone else hidden)
        elif kind.startswith("loader"):
            # loaderfs: torch's "file_system" sharing strategy (no file descriptor
            # passed per shared tensor; the default is "file_descriptor")
            fs = kind.startswith("loaderfs")
            nw = int(kind[8:] if fs else kind[6:])
            strategy = torch.multiprocessing.get_sharing_strategy()
            if fs:
                torch.multiprocessing.set_sharing_strategy("file_system")
            ds = BufferDataset(path, B, L)
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw, pin_memory=dev.type == "cuda", prefetch_factor=4)

            def moved() -> Iterator[Any]:
                for b in loader:
                    yield b.to(dev, non_blocking=True)

            it = moved()
            rate = timed(it, step, args.warmup, args.steps)
            it.close()
            del loader
            torch.multiprocessing.set_sharing_strategy(strategy)
            fsname = ", file_system sharing" if fs else ""
            report(f"{tag}DataLoader(BufferDataset, {nw} workers, pin_memory{fsname})", rate, None if alone else hidden)
        else:
            print(f"| unknown mode {mode!r} | | | |")

    all_cpus = set(os.sched_getaffinity(0))
    if TRACE_ON:
        cores = topology()
        print(f"CPUs {len(all_cpus)} in {len(cores)} physical cores; GPU clocks (SM/mem MHz, °C) {gpu_clocks()}")
    for mode in modes:
        CURRENT[0] = mode
        try:
            run_mode(mode)
        except Exception as exc:  # one failing mode must not hide the others' figures
            print(f"| {mode} | failed: {type(exc).__name__}: {exc} | | |", flush=True)
    if TRACE:
        print()
        print("Where the training thread's time went (--trace):")
        for line in TRACE:
            print(f"- {line}")
    buf.close()
    if tmp is not None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
