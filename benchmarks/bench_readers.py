"""Readers against a live writer: torn rows returned, and verify's verdicts, counted.

One writer wraps a small two-lane ring (256 rows a lane) as fast as it can, with
priorities, committing now and then; ``--readers`` processes refresh and sample
uniform, slice, padded-slice and prioritized batches in turn and check every row
against its encoding (``tests/guarantees/racing.py``: each row names its stream,
episode, step and absolute row; a wide second column is a function of that). A
row counts as a violation if it was not in the commit the reader reads, sits at
the wrong ring position, disagrees across columns, or breaks its slice's episode.
Every 50 batches a reader runs ``verify``. Then ``--kills`` times a writer is
SIGKILLed at a random instant and a reader's ``verify`` judges the store.

The soak is a correctness run, not a timing: the counts are the result. Last,
the cost of the re-check: a reader's batch against the writer's own batch of the
same store in the same process (the writer needs no check). Run it
against another checkout to compare (``PYTHONPATH=OTHER python
benchmarks/bench_readers.py``: the harness comes from this tree's tests, the
library from ``PYTHONPATH``).

    python benchmarks/bench_readers.py --laps 200 --batches 2000 --readers 4 --kills 20
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # warm
sys.path.insert(0, str(HERE.parent / "tests" / "guarantees"))  # racing
from _common import count, header, median_time, table  # noqa: E402
from racing import Board, run_race, seed_store, start  # noqa: E402

import mmbuffer as mb  # noqa: E402
from mmbuffer._ledger.verify import verify  # noqa: E402


def kill_runs(path: Path, kills: int) -> dict[str, int]:
    rng = np.random.default_rng(0)
    failed = opened = 0
    for trial in range(kills):
        with mb.open(path, mode="r") as ro:
            streams = ro.num_streams
        board = Board.create(path.parent / f"board-k{trial}", streams)  # the writer's commits, shown to this process
        proc = start("write", path, trial, board.path, 0.02, path.parent / "never")  # a writer until killed
        time.sleep(2.0 + rng.random())
        proc.kill()
        proc.wait()
        reader = mb.open(path, mode="r")
        failed += not verify(reader)["ok"]
        reader.close()
        with mb.open(path):  # recovery by the next writer
            opened += 1
    return {"kills": kills, "reader verify FAILED": failed, "writer reopened": opened}


def recheck_cost(path: Path, rows: int, reps: int) -> list[dict[str, object]]:
    """A reader's batch (with the re-check) against the writer's own batch (no check:
    its writes take the same lock) of the same store, same process, warm."""
    import torch

    buf = mb.create(path, {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32")},
                    capacity=rows)
    done = np.zeros(rows, dtype=bool)
    done[499::500] = True
    rng = np.random.default_rng(0)
    buf.extend({"obs": rng.random((rows, 17), dtype=np.float32), "action": rng.random((rows, 6), dtype=np.float32),
                "reward": rng.random(rows, dtype=np.float32), "terminated": done},
               final_obs={"obs": np.zeros((int(done.sum()), 17), np.float32)})
    buf.commit()
    ro = mb.open(path, mode="r")
    out = []
    for name, call in (("sample(256)", lambda b, g: b.sample(256, g)),
                       ("sample_slices(256, 64)", lambda b, g: b.sample_slices(256, 64, generator=g))):
        g = torch.Generator().manual_seed(0)
        w = median_time(lambda: call(buf, g), reps)
        r = median_time(lambda: call(ro, g), reps)
        out.append({"batch": name, "writer ms": w * 1e3, "reader ms": r * 1e3, "reader / writer": r / w})
    buf.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--laps", type=int, default=200, help="laps of every lane the writer makes in the race (0: skip it)")
    p.add_argument("--batches", type=int, default=2000, help="batches each reader draws in the race")
    p.add_argument("--readers", type=int, default=4, help="reader processes")
    p.add_argument("--kills", type=int, default=20, help="writer kills in the crash run")
    p.add_argument("--rows", type=lambda t: 0 if t == "0" else count(t), default=2_000_000, help="store size for the re-check cost (0: skip; 2e6 notation accepted)")
    args = p.parse_args()
    header(f"Readers against a live writer (mmbuffer from {Path(mb.__file__).parent})")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for priorities in (True, False) if args.laps else ():
            path = Path(tmp) / f"s{int(priorities)}"
            seed_store(path, 256, priorities)
            t0 = time.perf_counter()
            r = run_race(path, args.laps, args.batches, args.readers)
            rows.append({"priorities": priorities, "seconds": round(time.perf_counter() - t0, 1), "readers": args.readers, **r})
        table(rows)
        if args.kills:
            path = Path(tmp) / "k"
            seed_store(path, 256, True)
            table([kill_runs(path, args.kills)])
        if args.rows:
            print("Cost of the re-check (warm, no writer running):\n")
            table(recheck_cost(Path(tmp) / "c", int(args.rows), 200))


if __name__ == "__main__":
    main()
