"""The memory floor of the two "flat in store size" targets that stay missed: the
loads a prioritized step and a slice index must make, alone, big store against small.

Issue 26 item 2 asks PER at 6e8 rows within 1.3x of 1e6, and item 7 the slice index at
1e9 stored rows within 1.2x of 1e6. Both missed (1.6-1.7x and 1.75x when it was written). It asks
whether any code over the same arrays could meet them: for each, a compiled kernel makes
only the loads the real call makes (the same cache lines, in the same level-by-level
order over the batch, so their misses overlap as far as the core allows) and nothing
else, and the bench times it beside the real call, at both sizes, interleaved in one
process. If the loads alone grow by more than the target allows, the target is out of
reach for this layout whatever the code around them does.

- ``tree``: ``tree.sample(256)`` then ``tree.update`` of the drawn rows, on a full tree
  (every leaf live) in anonymous memory; the floor loads, per draw, the two cache lines
  of slot sums of each level's row on the path and the leaf block's four lines, and per
  updated row the block's four lines and each level's whole row (four lines), bottom up;
  also each timed between two real steps (``in context``, as the ``context`` part does).
- ``index``: the guided searches (``kernels.sampling._search_guided``) of 256 ranks in the
  cumulative counts of ``rows / 1000`` episodes, laid out as ``slice_indices(256, 4)``
  reads them (``(cum, end)`` rows, buckets about one episode wide); the floor ``loads``
  is each item's bucket then the counts row it names, and ``one row`` a counts row per
  item at random, the least any index must read (the found episode's ends).
- ``context``: the same loads in context, on ``bench_flat.py``'s stores (1e6 and 1e9 stored
  rows, their live counts and mapped ``obs``): each floor kernel is timed between two real
  calls, so it finds the caches and TLBs as the real call's kernels find them (a tight
  loop keeps its own lines and page walks warm). ``index loads``: each rank's bucket, then
  the counts row it names, between ``slice_indices(256, 4)`` calls; ``sample loads``: those,
  then an ``obs`` line of a row in the found episode, between ``sample_slices(256, 4)``
  calls; beside the real calls timed in the same loop. ``small call after index loads``:
  the small store's ``slice_indices(256, 4)`` timed right after a real call and the index
  loads on each store: the same code at both sizes, so its growth is what the big store's
  misses cost the code that runs after them (caches and TLB entries they evicted).

    python benchmarks/bench_floor.py                        # tree 1e6 / 6e8, index and context 1e6 / 1e9
    python benchmarks/bench_floor.py --tree 1e6,1e8 --index 1e6,1e8 --rounds 3 --skip context
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import counts, drop_file_cache, header, median_time, scratch, settle, table
from bench_sampling import build

import mmbuffer as mb
from mmbuffer import tree
from mmbuffer.kernels import load

BATCH = 256


@numba.njit(nogil=True, cache=False)
def _tree_loads(leaf, ns, offs, salt):
    """The loads of 256 descents then of an update of the rows found, and nothing else.

    As in a descent, each level's row depends on what was read at the level above (here
    the child slot is a hash of the loaded sum and ``salt``: random on a tree of random
    priorities), and the batch goes level by level, so the misses of one level overlap
    each other but not those of the next. Per draw: the row's two lines of sums at each
    level, then the leaf block's four lines; the update then reads each block again and
    each level's whole row (four lines), bottom up, as ``kernels.tree._refresh``."""
    depth = offs.shape[0] - 1
    n = salt.shape[0]
    cap = leaf.shape[0]
    node = np.zeros(n, np.int64)
    rows = np.empty((depth + 1, n), np.int64)
    sink = 0.0
    for d in range(depth):
        for k in range(n):
            g = offs[d] + node[k]
            rows[d, k] = g
            s = ns[g, 0] + ns[g, 8]
            sink += s
            below = offs[d + 2] - offs[d + 1] if d + 1 < depth else (cap + 63) >> 6  # rows (blocks) of the next level
            node[k] = (node[k] * 16 + ((np.int64(s * 1e9) ^ (salt[k] >> (4 * d))) & 15)) % below
    for k in range(n):
        lo = node[k] << 6
        rows[depth, k] = lo
        sink += leaf[lo] + leaf[min(lo + 16, cap - 1)] + leaf[min(lo + 32, cap - 1)] + leaf[min(lo + 48, cap - 1)]
    for k in range(n):
        lo = rows[depth, k]
        sink += leaf[lo] + leaf[min(lo + 16, cap - 1)] + leaf[min(lo + 32, cap - 1)] + leaf[min(lo + 48, cap - 1)]
    for d in range(depth - 1, -1, -1):
        for k in range(n):
            g = rows[d, k]
            sink += ns[g, 0] + ns[g, 8] + ns[g, 16] + ns[g, 24]
    return sink


@numba.njit(nogil=True, cache=False)
def _index_loads(counts, guide, shift, xs, out):
    """The guided search's loads: every item's bucket, then the counts row it names (the
    found episode's count and ends are in that row, or the next), and nothing else."""
    m = xs.shape[0]
    for i in range(m):
        out[i] = guide[xs[i] >> shift]
    sink = 0
    for i in range(m):
        k = out[i]
        sink += counts[k, 0] + counts[k, 1]
    return sink


@numba.njit(nogil=True, cache=False)
def _one_row(counts, ks):
    """One counts row per item, at random: what any index must read (the episode's ends)."""
    sink = 0
    for i in range(ks.shape[0]):
        sink += counts[ks[i], 0] + counts[ks[i], 1]
    return sink


@numba.njit(nogil=True, cache=False)
def _sample_loads(counts, guide, shift, obs, ranks, ks):
    """``_index_loads``, then per item an ``obs`` line of a row of the episode found (as a
    window's gather reads it), each level over the whole batch."""
    _index_loads(counts, guide, shift, ranks, ks)
    sink = 0
    n = obs.shape[0]
    for i in range(ranks.shape[0]):
        k = ks[i]
        sink += obs[(counts[k, 1] + ranks[i] - counts[k, 0]) % n]
    return sink


def _live_counts(buf: mb.Buffer) -> tuple[np.ndarray, np.ndarray, int]:
    """The counts, guide and shift that ``slice_indices(256, 4)`` searches (one lane), as
    the sampling kernel receives them."""
    sampling = load("sampling")
    seen = []
    real = sampling.slice_rows
    sampling.slice_rows = lambda *a: seen.append(a) or real(*a)
    try:
        buf.slice_indices(BATCH, 4)
    finally:
        sampling.slice_rows = real
    _, _, _, live, (guide, shift), *_ = seen[0]
    return live, guide, shift


def context_part(sizes: list[int], rounds: int, reps: int) -> list[dict[str, object]]:
    bufs = {}
    for n in sizes:
        path = scratch() / "flat" / f"s{n}"
        build(path, n, int(n * 1.2), 1000)
        drop_file_cache(path)
        bufs[n] = mb.open(path)
        bufs[n].warm(columns=True)
    rng = np.random.default_rng(3)
    g = torch.Generator().manual_seed(3)
    settle(lambda: [buf.sample_slices(BATCH, 4, generator=g) for buf in bufs.values()])  # as bench_flat.py
    ks = np.empty(BATCH, np.int64)
    per: dict[tuple[int, str], list[float]] = {}
    for r in range(rounds):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            buf = bufs[n]
            live, guide, shift = _live_counts(buf)
            obs = buf.column("obs").mapped()
            total = int(live[-1, 0] - live[0, 0])
            for _ in range(300):  # settled, as in bench_flat.py
                buf.sample_slices(BATCH, 4, generator=g)
            t: dict[str, list[int]] = {}
            pairs = ((buf.slice_indices, "slice_indices(256, 4)", "index loads", _index_loads, (live, guide, shift)),
                     (buf.sample_slices, "sample_slices(256, 4)", "sample loads", _sample_loads,
                      (live, guide, shift, obs)))
            small = bufs[sizes[0]]
            for _ in range(reps):
                ranks = rng.integers(0, total, BATCH)
                for real, name, loads, floor, inputs in pairs:
                    real(BATCH, 4, generator=g)
                    t0 = time.perf_counter_ns()
                    floor(*inputs, ranks, ks)
                    t1 = time.perf_counter_ns()
                    real(BATCH, 4, generator=g)
                    t2 = time.perf_counter_ns()
                    t.setdefault(loads, []).append(t1 - t0)
                    t.setdefault(name, []).append(t2 - t1)
                buf.slice_indices(BATCH, 4, generator=g)
                _index_loads(live, guide, shift, ranks, ks)
                t0 = time.perf_counter_ns()
                small.slice_indices(BATCH, 4, generator=g)
                t.setdefault("small call after index loads", []).append(time.perf_counter_ns() - t0)
            for k, v in t.items():
                per.setdefault((n, k), []).append(statistics.median(v) / 1e9)
    for buf in bufs.values():
        buf.close()
    return _rows("in context", sizes, per)


def full_tree(capacity: int, seed: int) -> tree.PriorityTree:
    """A tree of ``capacity`` live rows (priorities uniform in (0, 1]), anonymous memory."""
    tr = tree.init(capacity)
    rng = np.random.default_rng(seed)
    for at in range(0, capacity, 1 << 26):  # in pieces: no second copy of a 2.4 GB array
        stop = min(capacity, at + (1 << 26))
        tr.leaves[at:stop] = 1.0 - rng.random(stop - at, dtype=np.float32)
    tree.rebuild(tr)
    return tr


def tree_part(sizes: list[int], rounds: int, reps: int) -> list[dict[str, object]]:
    trees = {n: full_tree(n, i) for i, n in enumerate(sizes)}
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    per: dict[tuple[int, str], list[float]] = {}
    for r in range(rounds):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            tr = trees[n]
            v = tr.views

            def step(tr: tree.PriorityTree = tr) -> None:
                idx, _ = tree.sample(tr, BATCH, g)
                tree.update(tr, idx, 1.0 - rng.random(BATCH, dtype=np.float32))

            pool = rng.integers(0, 1 << 62, (reps + 8, BATCH))  # fresh paths every call, as draws are
            at = iter(range(10**9))

            def loads(v: object = v, pool: np.ndarray = pool, at: object = at) -> None:
                _tree_loads(v.leaf, v.nodes, v.offs, pool[next(at) % len(pool)])

            per.setdefault((n, "step"), []).append(median_time(step, reps))
            per.setdefault((n, "sample"), []).append(median_time(lambda tr=tr: tree.sample(tr, BATCH, g), reps))
            per.setdefault((n, "loads"), []).append(median_time(loads, reps))
            between: dict[str, list[int]] = {"loads in context": [], "step in context": []}
            for _ in range(reps):  # each timed between two real steps (see ``context_part``)
                step()
                t0 = time.perf_counter_ns()
                loads()
                t1 = time.perf_counter_ns()
                step()
                between["loads in context"].append(t1 - t0)
                between["step in context"].append(time.perf_counter_ns() - t1)
            for k, ts in between.items():
                per.setdefault((n, k), []).append(statistics.median(ts) / 1e9)
    return _rows("tree: sample 256 + update 256", sizes, per)


def index_part(sizes: list[int], rounds: int, reps: int) -> list[dict[str, object]]:
    sampling = load("sampling")
    arrays = {}
    for n in sizes:
        episodes = max(n // 1000, 1)
        counts = np.empty((episodes + 1, 2), np.int64)  # as ``LaneCounts``: (cum, end) per episode
        counts[:, 0] = np.arange(episodes + 1) * 997  # strict windows of 4 rows
        counts[:, 1] = np.arange(episodes + 1) * 1000
        shift = 10  # buckets about one episode wide, as ``LaneCounts`` cuts them
        guide = np.empty(((int(counts[-1, 0]) - 1) >> shift) + 1, np.int32)
        sampling.fill_buckets(counts[:, 0], shift, guide, 0, len(guide))
        arrays[n] = (counts, guide, shift)
    rng = np.random.default_rng(2)
    per: dict[tuple[int, str], list[float]] = {}
    for r in range(rounds):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            counts, guide, shift = arrays[n]
            pool = rng.integers(0, int(counts[-1, 0]), (reps + 8, BATCH))  # fresh ranks every call
            rows = rng.integers(0, len(counts), (reps + 8, BATCH))
            out = np.empty(BATCH, np.int64)
            at = iter(range(10**9))

            def search(counts: np.ndarray = counts, guide: np.ndarray = guide, shift: int = shift,
                       pool: np.ndarray = pool, out: np.ndarray = out, at: object = at) -> None:
                sampling._search_guided(counts[:, 0], guide, shift, pool[next(at) % len(pool)], out)  # as slice_indices

            def loads(counts: np.ndarray = counts, guide: np.ndarray = guide, shift: int = shift,
                      pool: np.ndarray = pool, out: np.ndarray = out, at: object = at) -> None:
                _index_loads(counts, guide, shift, pool[next(at) % len(pool)], out)

            def one_row(counts: np.ndarray = counts, rows: np.ndarray = rows, at: object = at) -> None:
                _one_row(counts, rows[next(at) % len(rows)])

            per.setdefault((n, "search"), []).append(median_time(search, reps))
            per.setdefault((n, "loads"), []).append(median_time(loads, reps))
            per.setdefault((n, "one row"), []).append(median_time(one_row, reps))
    return _rows("index: 256 searches and the found episodes' rows", sizes, per)


def _rows(what: str, sizes: list[int], per: dict[tuple[int, str], list[float]]) -> list[dict[str, object]]:
    small, big = sizes[0], sizes[-1]
    kinds = sorted({k for _, k in per}, key=lambda k: k != "loads")
    out = []
    for k in kinds:
        a, b = statistics.median(per[(small, k)]), statistics.median(per[(big, k)])
        out.append({"measure": f"{what}: {k}", f"{small:.0e} us": a * 1e6, f"{big:.0e} us": b * 1e6,
                    "big - small us": (b - a) * 1e6, "big / small": b / a})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=counts, default=[1_000_000, 600_000_000], help="small,big capacities (0: skip)")
    p.add_argument("--index", type=counts, default=[1_000_000, 1_000_000_000], help="small,big stored rows")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--context", type=counts, default=[1_000_000, 1_000_000_000],
                   help="small,big stored rows of bench_flat.py's stores")
    p.add_argument("--skip", choices=("tree", "index", "context"), action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(1)
    header("memory floor: the loads alone, big against small, interleaved")
    t0 = time.perf_counter()
    if "index" not in args.skip:
        table(index_part(args.index, args.rounds, args.reps))
    if "context" not in args.skip:
        table(context_part(args.context, args.rounds, args.reps))
    if "tree" not in args.skip:
        table(tree_part(args.tree, args.rounds, args.reps))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
