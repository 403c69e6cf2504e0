"""What ``mb.stream(processes=N)`` costs the training thread per batch, this tree against another.

With producer processes the training thread still runs the hand-over of every
batch: ``next()`` polls and receives the slot number, copies the block out (on a
GPU: issues its copy and records an event), gives the slot back, and the step then
makes the tensors it uses. On a launch-bound GPU step that time comes straight off
the step rate (``bench_gpu.py``: 8–11% of a TD-MPC2-sized step). This measures it on
the CPU, where the same code runs except the CUDA calls: per batch, the time of
``next()`` and of ``next()`` plus the first use of the three columns a world-model
step reads (``obs``, ``action``, ``next_obs``), between steps of ``--step-ms`` of tiny
torch ops (a launch-bound step's stand-in, which leaves the caches as a real step
does). ``--slices 8 --slice-len 4`` makes the copy negligible, leaving the hand-over
itself; a copy of the batch's bytes as one block, timed the same way, is reported
beside it.

Each side runs in a fresh interpreter with its checkout on ``PYTHONPATH``; the sides
alternate ``--rounds`` times (ABBA), on one store built by this tree.

    git worktree add /tmp/base <commit>
    python benchmarks/bench_handover.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import build_world_model_store, count, header, run_in_checkout, table

WORKER = r"""
import json, sys, time
import numpy as np, torch, mmbuffer as mb
torch.set_num_threads(1)
path, B, L, P, n, step_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
x = torch.zeros(16)
def step():  # tiny in-place ops for step_s: the thread lives in Python and torch's dispatch
    t = time.perf_counter()
    while time.perf_counter() - t < step_s:
        x.add_(1.0)
def main():
    buf = mb.open(path, "r")
    wait, hand = np.empty(n), np.empty(n)
    with mb.stream(buf, B, L, processes=P, generator=torch.Generator().manual_seed(0)) as s:
        it = iter(s)
        for _ in range(50):
            first = next(it)
        nbytes = sum(t.numel() * t.element_size() for t in (*first.data.values(), first.indices, first.weights, first.mask))
        del first
        for i in range(n):
            t0 = time.perf_counter()
            b = next(it)
            t1 = time.perf_counter()
            used = (b["obs"], b["action"], b["next_obs"])
            t2 = time.perf_counter()
            wait[i], hand[i] = t1 - t0, t2 - t0
            del used, b
            step()
    block = torch.empty(nbytes, dtype=torch.uint8)
    copy = np.empty(200)
    for i in range(200):
        t0 = time.perf_counter()
        block.clone()
        copy[i] = time.perf_counter() - t0
        step()
    print(json.dumps({"next": float(np.median(wait)), "handover": float(np.median(hand)),
                      "handover_p90": float(np.percentile(hand, 90)), "copy": float(np.median(copy))}))
if __name__ == "__main__":
    main()
"""


def run(tree: Path, args: argparse.Namespace, path: Path) -> dict[str, float]:
    argv = [str(path), str(args.slices), str(args.slice_len), str(args.processes), str(args.batches), str(args.step_ms / 1e3)]
    return run_in_checkout(tree, WORKER, *argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, required=True, help="root of another mmbuffer checkout")
    p.add_argument("--rows", type=count, default=200_000, help="rows of the store (1e6 notation accepted)")
    p.add_argument("--slices", type=int, default=256, help="slices per batch")
    p.add_argument("--slice-len", type=int, default=64, help="steps per slice")
    p.add_argument("--processes", type=int, default=4, help="producer processes (bench_gpu.py's headline uses 4)")
    p.add_argument("--batches", type=int, default=1500, help="batches timed per run")
    p.add_argument("--step-ms", type=float, default=1.5, help="the stand-in step between batches, ms")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each side once per round")
    args = p.parse_args()
    this = HERE.parent
    header(f"Hand-over of mb.stream(processes={args.processes}): this tree ({this}) against {args.baseline}, "
           f"{args.slices}x{args.slice_len} slices, {args.step_ms:g} ms stand-in step, {args.rounds} rounds")
    results: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="bench_handover_") as tmp:
        path = Path(tmp) / "store"
        build_world_model_store(path, int(args.rows), 500)
        for r in range(args.rounds):
            sides = (("base", args.baseline), ("this", this))
            for side, tree in sides if r % 2 == 0 else sides[::-1]:
                results[side].append(run(tree, args, path))
    rows = []
    for k, label in (("next", "next() p50"), ("handover", "next() + first use of 3 columns, p50"),
                     ("handover_p90", "next() + first use of 3 columns, p90"), ("copy", "copy of the batch's bytes alone, p50")):
        b = [x[k] * 1e6 for x in results["base"]]
        t = [x[k] * 1e6 for x in results["this"]]
        rows.append({"per batch": label, "baseline µs (rounds)": " / ".join(f"{v:.0f}" for v in b),
                     "this µs (rounds)": " / ".join(f"{v:.0f}" for v in t),
                     "this / baseline (medians)": statistics.median(t) / statistics.median(b)})
    table(rows)


if __name__ == "__main__":
    main()
