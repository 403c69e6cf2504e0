"""A reader's read of a batch, re-checked against the writer after the copy (seqlock-style).

In a reader (``mode="r"``) a writer in another process may overwrite rows while
they are copied. So after the copy every item is checked against the writer's
reservation as it stands *then* (:func:`overwritten`; nothing is checked item by
item while the reservation has not passed what the view the batch was drawn from
keeps intact, ``View.intact_up_to``: it moves once per ``reserve_fraction`` of a lane
written); the items that fail are
drawn again from a fresh view and copied again, until none fails. What a reader
returns was therefore never being rewritten while it was read. The writer needs
no check: its writes take the store's lock.

>>> from mmbuffer._ledger.layout import Layout
>>> overwritten(Layout(8), np.array([[2, 3], [6, 7]]), np.array([8, 8]), np.array([11]))
array([ True, False])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from .. import errors
from .._ledger.layout import Layout
from .._ledger.snapshot import Draw, View
from .._ledger.store import Store
from ..kernels import load
from .frames import Stacks
from .gather import gather

MAX_REREADS = 64


def read_checked(
    store: Store,
    draw: Callable[[np.ndarray], Draw],
    size: int,
    names: list[str],
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    recheck: bool | None = None,
    stack: Stacks | None = None,
) -> tuple[dict[str, torch.Tensor], Draw]:
    """Gather the rows that ``draw`` picks for batch positions ``arange(size)``; return
    the data and the draw (with the redrawn items in place).

    ``draw(positions)`` returns ``(rows, weights, mask or None, lane cursors)`` for
    those positions, from the store's current ``view()``. A reader's items are
    re-checked as the module docstring says (``recheck=True``: a writer's too, for
    callers that gather without the store's lock); ``out``: caller tensors the
    columns are gathered into; ``EmptyBufferError`` when the writer
    laps a lane faster than ``MAX_REREADS`` draws in a row can be read. ``stack``:
    frame stacks (``frames.py``); an item is then checked at its earliest frame.
    """
    check = store.mode == "r" if recheck is None else recheck
    first = None
    if stack is None:
        drawn = draw(np.arange(size))
        data = gather(store, drawn[0], names, out)
    else:
        drawn, data, first = stack.read(store, draw, np.arange(size), names, out)
    return rechecked(store, draw, drawn, data, names, first=first, stack=stack) if check else (data, drawn)


def rechecked(
    store: Store,
    draw: Callable[[np.ndarray], Draw],
    drawn: Draw,
    data: dict[str, torch.Tensor],
    names: list[str],
    *,
    first: np.ndarray | None = None,
    stack: Stacks | None = None,
    view: View | None = None,
) -> tuple[dict[str, torch.Tensor], Draw]:
    """``data``, gathered for ``drawn``, re-checked as the module docstring says: the
    items the writer may have begun rewriting meanwhile are drawn again by ``draw``
    and read again, in place, until none is. ``first``: the row each item is checked
    at (default its first row; with ``stack``, its earliest frame). ``view``: the view
    ``drawn`` was drawn from, whose rows are its live rows (a sampler's, unstacked)."""
    rows, weights, mask, written = drawn
    if not store.reserved_past(written if view is None else view.intact_up_to):
        return data, drawn  # no item's rows can be being rewritten
    if first is None:
        first = first_rows(rows, len(rows)).copy()
    kernels = load("gather")  # ``overwritten`` in one compiled pass
    layout = store.layout
    cursors = None  # per item, once an item is redrawn from a later view
    for _ in range(MAX_REREADS):
        first_view = cursors is None  # every item still from the first view: its lanes' cursors
        bad = kernels.overwritten(first, written if first_view else cursors, store.reservation(), layout.lane_size,
                                  by_lane=first_view)
        if bad.size == 0:
            break
        if cursors is None:
            cursors = written[layout.lane(first)]
        (r, w, m, wr), fresh, f = _read(store, draw, bad, names, None, stack)
        rows[bad], weights[bad], first[bad], cursors[bad] = r, w, f, wr[layout.lane(f)]
        if mask is not None and m is not None:
            mask[bad] = m
        for name, value in data.items():
            value[torch.from_numpy(bad)] = fresh[name]
    else:
        raise errors.EmptyBufferError(
            f"sample: expected rows that stay put while they are read, got rows overwritten by the writer "
            f"in {MAX_REREADS} draws in a row (the writer laps this lane faster than a batch is read)"
        )
    return data, Draw(rows, weights, mask, written)


def _read(
    store: Store, draw: Callable[[np.ndarray], Draw], positions: np.ndarray, names: list[str],
    out: Mapping[str, torch.Tensor] | None, stack: Stacks | None,
) -> tuple[Draw, dict[str, torch.Tensor], np.ndarray]:
    """The items at batch ``positions``: their draw, data and the row each is checked at
    (its first row; with ``stack``, the earliest frame it reads)."""
    if stack is not None:
        return stack.read(store, draw, positions, names, out)
    drawn = draw(positions)
    return drawn, gather(store, drawn[0], names, out), first_rows(drawn[0], len(positions)).copy()


def first_rows(rows: np.ndarray, items: int) -> np.ndarray:
    """The first row of each of ``items`` items (``rows`` is ``[B]`` or ``[B, L]``)."""
    first: np.ndarray = rows.reshape(items, -1)[:, 0]
    return first


def overwritten(layout: Layout, rows: np.ndarray, cursors: np.ndarray, reserved: np.ndarray) -> np.ndarray:
    """Which items (first axis of ``rows``) the writer may have begun rewriting.

    ``cursors[i]`` is the ``written`` counter of item ``i``'s lane in the view it
    was drawn from, which fixes the absolute row its first row held. Absolute row
    ``a`` is rewritten when the writer writes ``a + lane_size``, and the writer
    raises ``reserved`` past a row before it writes it: ``a >= reserved -
    lane_size`` holds exactly while ``a`` is intact. An item's later rows (the
    window, the next row read for ``next_*``) are younger than its first.
    """
    first = first_rows(rows, len(cursors))
    bad: np.ndarray = layout.absolute_at(first, cursors) < reserved[layout.lane(first)] - layout.lane_size
    return bad
