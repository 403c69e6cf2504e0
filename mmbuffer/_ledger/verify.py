"""Check that a store's derived state (episode index, priority tree) agrees with its data.

The index is recomputed from the ``terminated``/``truncated`` columns of the live
rows of each lane, the tree from its leaves. ``repair=True`` (needs the writer
lock) writes the recomputed state back and commits.

A reader (``mode="r"``) judges what a reader may read: the episodes of its view,
which leaves out the rows a writer (running, or killed and not yet reopened) may
have rewritten, re-read if the writer's reservation moved past them meanwhile.
A priority tree that a writer is changing (the ``priority/DIRTY`` marker, or a
commit during the check) cannot be checked from outside: that is a note, not a
problem; the writer's next commit or open settles it.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/v", {"x": ((), "float32")}, capacity=16, next_keys=())
>>> buf.extend({"x": np.arange(6), "terminated": np.arange(6) % 3 == 2})
>>> verify(buf)["ok"]
True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import errors, tree
from .._disk import format as fmt
from . import index
from .index import Lane
from .layout import Layout
from .snapshot import View


class Checked(Protocol):
    """What verify reads of a store: a ``Store`` in a reader (no torch: ``mmbuffer verify``),
    a ``Buffer`` (``mb.open``) when it may repair: ``rewrite_derived`` needs the writer."""

    path: Path
    mode: str
    lane_size: int
    layout: Layout

    def view(self) -> View: ...
    def read_range(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray: ...
    def reservation(self) -> np.ndarray: ...
    def tree_spans(self) -> list[tuple[int, int]]: ...
    def rewrite_derived(self, ends: np.ndarray, lanes: list[Lane]) -> int: ...

_CHUNK_ROWS = 1 << 22
REPAIR_HINT = "repair needs the writer: stop it, then run `mmbuffer verify PATH --repair` (or open the store with mode='a')"


def _live_done(store: Checked, lane: int, st: Lane) -> np.ndarray:
    parts = []
    for a, b in store.layout.segments(lane, st.first_start, st.written):
        for lo in range(a, b, _CHUNK_ROWS):
            hi = min(b, lo + _CHUNK_ROWS)
            parts.append(store.read_range("terminated", lo, hi) | store.read_range("truncated", lo, hi))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _readable_lanes(store: Checked, view: View) -> tuple[list[Lane], list[np.ndarray]]:
    """The lanes of the store's ``view`` and their end flags. In a reader, the episodes
    that the writer's reservation reached while the flags were read are left out:
    what is compared was intact for the whole read."""
    lanes = [Lane(int(view.written[l]), lv.ep_head, lv.ep_tail, lv.first_start) for l, lv in enumerate(view.lanes)]
    done = [_live_done(store, lane, st) for lane, st in enumerate(lanes)]
    if store.mode == "r":
        threshold = store.reservation() - store.lane_size
        for lane, st in enumerate(lanes):
            kept = index.drop_below(view.ends, lane, store.lane_size, st, int(threshold[lane]))
            done[lane] = done[lane][kept.first_start - st.first_start :]
            lanes[lane] = kept
    return lanes, done


def _tree_settled(store: Checked) -> tuple[bool, int]:
    """Whether no writer change is pending on the tree, and the committed generation."""
    generation = int(fmt.read_manifest(store.path)["generation"])
    return not (store.path / "priority" / "DIRTY").exists(), generation


def verify(store: Checked, repair: bool = False) -> dict[str, Any]:
    """Recompute derived state; return ``{"ok", "problems", "notes", "repaired", "tree_drift"}``."""
    problems: list[str] = []
    notes: list[str] = []
    snapshot = store.view()
    lanes, done = _readable_lanes(store, snapshot)
    ends, fresh = index.rebuild(done, lanes, store.lane_size)
    for lane, (old, new) in enumerate(zip(lanes, fresh)):
        if (old.ep_tail, old.written) != (new.ep_tail, new.written):
            problems.append(
                f"stream {lane}: index has {old.num_episodes} episodes up to row {old.written}, "
                f"data says {new.num_episodes} up to row {new.written}"
            )
            continue
        seqs = np.arange(old.ep_head, old.ep_tail, dtype=np.int64)
        have = index.ends_at(snapshot.ends, lane, store.lane_size, seqs)
        want = index.ends_at(ends, lane, store.lane_size, seqs)
        if not np.array_equal(have, want):
            bad = int(np.flatnonzero(have != want)[0])
            problems.append(f"stream {lane}: episode {seqs[bad]} ends at {have[bad]} in the index, {want[bad]} in the data")
    drift = 0.0
    try:
        ptree = snapshot.tree  # a reader applies the committed priority log here (store.py)
    except errors.CorruptStoreError as exc:
        problems.append(f"priority log: {exc}")
        ptree = None
    if ptree is not None:
        settled, generation = _tree_settled(store) if store.mode == "r" else (True, 0)
        drift = float(tree.check(ptree, spans=store.tree_spans()))
        if store.mode == "r" and settled:
            settled = _tree_settled(store) == (True, generation)
        if drift > 1e-9 and settled:
            problems.append(f"priority tree: sums disagree with the leaves by {drift:.3g} (relative)")
        elif drift > 1e-9:
            notes.append(
                "priority tree: a writer has uncommitted priority changes (running, or stopped without "
                "committing); not checkable from a reader; its next commit or open settles them"
            )
    if problems and not repair:
        notes.append(REPAIR_HINT)
    repaired = bool(repair and problems)
    if repaired:
        store.rewrite_derived(ends, fresh)
    return {"ok": not problems, "problems": problems, "notes": notes, "repaired": repaired, "tree_drift": drift}
