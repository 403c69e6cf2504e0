"""Checkpoints, pickling and read-only reopening of a :class:`~mmbuffer.torchrl.ReplayBuffer`.

The store is the data: a state dict names it (path, generation, the lanes'
cursors) and carries what is not in it (batch size, generator state). Loading
restores exactly the state it describes, or refuses: a store at another commit
holds other data (rows written or evicted since, other priorities), and loading
that as the state would silently give the current data instead. To keep a state
whose data the training goes on changing, ``dumps`` copies the store.

Pickling carries the path and the settings, never the data or the writer's lock:
the unpickled buffer opens the store read-only (``mode="r"``), a learner or a
worker process's view that follows the writer's commits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import errors
from ..opening import open as open_buffer

if TYPE_CHECKING:
    from .replay import ReplayBuffer


def state_dict(rb: ReplayBuffer) -> dict[str, Any]:
    """Commit what changed, then the state (see the module docstring)."""
    buf = rb.buffer
    generation = rb._commit_changes()
    return {
        "path": str(rb.path),
        "generation": generation,
        "written": buf.view().written.tolist(),
        "batch_size": rb.batch_size,
        "generator": None if rb.generator is None else rb.generator.get_state(),
    }


def load_state_dict(rb: ReplayBuffer, state: dict[str, Any]) -> None:
    """Open the store ``state`` names and take the state's settings; refused with
    ``CorruptStoreError`` when the store is older than the state, and with
    ``InvalidArgumentError`` when it is at another commit (the data described is gone)."""
    try:
        path, generation = Path(state["path"]), int(state["generation"])
        written = state.get("written")
    except (KeyError, TypeError, ValueError):
        raise errors.InvalidArgumentError(f"state: expected a dict from state_dict(), got {state!r}") from None
    if not path.exists():
        raise errors.StoreNotFoundError(f"state['path']: expected a store at {path}, found nothing")
    if rb._buf is None or Path(rb.path).resolve() != path.resolve():
        reopen(rb, path)
    buf = rb.buffer
    if buf.mode == "r":
        buf.refresh()
    if buf.generation < generation:
        raise errors.CorruptStoreError(
            f"{path}: expected a store at commit {generation} or later (the state's), got commit {buf.generation}"
        )
    if buf.generation != generation or (written is not None and buf.view().written.tolist() != list(written)):
        raise errors.InvalidArgumentError(
            f"state: expected the store at {path} at commit {generation} (the state's), got commit {buf.generation}: "
            "rows or priorities changed since, so the data the state describes is gone "
            "(keep a state's data with dumps(path), or go on from the store as it is without load_state_dict)"
        )
    rb._batch_size = state.get("batch_size", rb.batch_size)
    if state.get("generator") is not None:
        rb.generator = rb.generator or torch.Generator()
        rb.generator.set_state(state["generator"])


def dumps(rb: ReplayBuffer, path: str | os.PathLike[str]) -> None:
    """Commit what changed; copy the store to ``path`` unless it is the store itself."""
    rb._commit_changes()
    if Path(path).resolve() != Path(rb.path).resolve():
        from ..convert import copy

        copy(rb.buffer, path, progress=False)


def reopen(rb: ReplayBuffer, path: Path) -> None:
    """Close the current store and make the one at ``path`` the buffer's (same mode)."""
    if not path.exists():
        raise errors.StoreNotFoundError(f"path: expected a store at {path}, found nothing")
    rb.close()
    rb.path = path
    rb._held.clear()
    rb._attach(open_buffer(path, mode=rb.mode))


def getstate(rb: ReplayBuffer) -> dict[str, Any]:
    """What pickling keeps: the path and the settings (see the module docstring)."""
    return {
        "path": str(rb.path),
        "batch_size": rb.batch_size,
        "sampler": rb.sampler,
        "priority_key": rb.priority_key,
        "flatten_slices": rb.flatten_slices,
        "generator": None if rb.generator is None else rb.generator.get_state(),
        "transform": rb._transform,
        "prefetch": None if rb._prefetch is None else rb._prefetch.depth,
    }


def setstate(rb: ReplayBuffer, state: dict[str, Any]) -> None:
    """Reopen read-only from what :func:`getstate` kept."""
    generator = None
    if state["generator"] is not None:
        generator = torch.Generator()
        generator.set_state(state["generator"])
    type(rb).__init__(
        rb, state["path"], mode="r", batch_size=state["batch_size"], sampler=state["sampler"],
        priority_key=state["priority_key"], flatten_slices=state["flatten_slices"], generator=generator,
        transform=state["transform"], prefetch=state["prefetch"],
    )


__all__ = ["dumps", "getstate", "load_state_dict", "reopen", "setstate", "state_dict"]
