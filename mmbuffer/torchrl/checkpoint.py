"""Checkpoints of a :class:`~mmbuffer.torchrl.ReplayBuffer`: what a state dict holds
and when it may be loaded.

The store is the data: a state dict names it (path, generation, the lanes'
cursors) and carries what is not in it (batch size, generator state). Loading
restores exactly the state it describes, or refuses: a store at another commit
holds other data (rows written or evicted since, other priorities), and loading
that as the state would silently give the current data instead. To keep a state
whose data the training goes on changing, ``dumps`` copies the store.

Pickling (``ReplayBuffer.__getstate__``) carries the path and the settings, never
the data or the writer's lock: the unpickled buffer opens the store read-only
(``mode="r"``), a learner or a worker process's view that follows the writer's commits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import errors
from ..buffer import Buffer


@dataclass(frozen=True, slots=True)
class State:
    """A state dict, checked: the store it names and the settings it carries."""

    path: Path
    generation: int
    written: list[int] | None
    batch_size: int | None
    generator: torch.Tensor | None


def state_dict(buf: Buffer, batch_size: int | None, generator: torch.Generator | None) -> dict[str, Any]:
    """The state of a buffer over ``buf`` at its last commit (see the module docstring)."""
    return {
        "path": str(buf.path),
        "generation": buf.generation,
        "written": buf.view().written.tolist(),
        "batch_size": batch_size,
        "generator": None if generator is None else generator.get_state(),
    }


def parse(state: Any) -> State:
    """``state`` as :func:`state_dict` made it, or ``InvalidArgumentError``."""
    try:
        written = state.get("written")
        return State(Path(state["path"]), int(state["generation"]), None if written is None else [int(w) for w in written],
                     state.get("batch_size"), state.get("generator"))
    except (AttributeError, KeyError, TypeError, ValueError):
        raise errors.InvalidArgumentError(f"state: expected a dict from state_dict(), got {state!r}") from None


def check(buf: Buffer, want: State) -> None:
    """Refuse a store that does not hold the state ``want`` describes: older than it
    (``CorruptStoreError``), or at another commit (``InvalidArgumentError``: the data
    the state describes is gone)."""
    if buf.mode == "r":
        buf.refresh()
    if buf.generation < want.generation:
        raise errors.CorruptStoreError(
            f"{want.path}: expected a store at commit {want.generation} or later (the state's), got commit {buf.generation}"
        )
    if buf.generation != want.generation or (want.written is not None and buf.view().written.tolist() != want.written):
        raise errors.InvalidArgumentError(
            f"state: expected the store at {want.path} at commit {want.generation} (the state's), got commit "
            f"{buf.generation}: rows or priorities changed since, so the data the state describes is gone "
            "(keep a state's data with dumps(path), or go on from the store as it is without load_state_dict)"
        )


def copy_store(buf: Buffer, path: str | os.PathLike[str]) -> None:
    """Copy the store to ``path`` unless ``path`` is the store itself."""
    if Path(path).resolve() != Path(buf.path).resolve():
        from ..convert import copy

        copy(buf, path, progress=False)


def unpickled(state: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that reopen a pickled buffer (``ReplayBuffer.__getstate__``)."""
    state = dict(state)
    rng = state.pop("generator", None)
    if rng is not None:
        state["generator"] = torch.Generator()
        state["generator"].set_state(rng)
    return state
