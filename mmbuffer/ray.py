"""Writers on many hosts through Ray: one actor owns the store's writer, actors send episodes.

The learner's host owns the store (the single writer, docs/design.md); environment
workers anywhere in the Ray cluster send it steps. :func:`serve` starts (or finds) a
:class:`StoreWriter` actor on the calling node that creates or opens the store and
is its only writer; learners on that host read it with ``mb.open(path, "r")`` as
usual, and send priorities back through the same actor.

:class:`Sender` is the env-worker side: it keeps the steps of the episode being
collected locally and sends whole episodes, batched (``batch_rows``), with at most
``max_in_flight`` sends unanswered (back-pressure: ``extend`` blocks while the
owner is behind). An env worker that dies therefore loses only its open episode;
nothing partial reaches the store (an episode longer than ``max_open_rows`` is sent
in parts, and then its sent part stays the lane's open episode). The owner commits
at least every ``commit_interval`` seconds and on :meth:`StoreWriter.commit`; a
killed owner loses nothing committed (the next ``serve`` recovers the store as after
any crash).

Each stream (lane) must have one sender at a time: the store keeps one open episode
per lane.

>>> import pytest, tempfile, numpy as np, mmbuffer as mb, mmbuffer.ray
>>> ray = pytest.importorskip("ray")
>>> _ = ray.init(num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False)
>>> path = tempfile.mkdtemp() + "/replay"
>>> h = mmbuffer.ray.serve(path, columns={"obs": ((2,), "float32")}, capacity=100, num_streams=2)
>>> s = mmbuffer.ray.Sender(h, stream=1)
>>> s.extend({"obs": np.ones((5, 2)), "terminated": np.arange(5) == 4}, final_obs={"obs": np.zeros((1, 2))})
>>> s.flush(); ray.get(h.commit.remote()) > 0
True
>>> mb.open(path, mode="r").num_episodes
1
>>> ray.shutdown()
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from . import errors
from .buffer import Buffer
from ._read.gather import Batch
from .opening import create
from .opening import open_buffer as open_store
from ._ledger.store import PriorityConfig

# ``ray`` is imported inside the functions: this module imports (and its doctest
# skips) without the "ray" extra

__all__ = ["Sender", "StoreWriter", "serve"]


class StoreWriter:
    """The actor that owns a store's writer (run it with :func:`serve`)."""

    def __init__(self, path: str, columns: Mapping[str, Any] | None, capacity: int | None, num_streams: int,
                 create_options: Mapping[str, Any], commit_interval: float) -> None:
        if os.path.exists(os.path.join(path, "manifest.json")):
            self.buf: Buffer = open_store(path, mode="a")
            if columns is not None and {k: tuple(v[0]) for k, v in columns.items()} != {
                k: tuple(c.shape) for k, c in self.buf.columns.items() if k not in ("terminated", "truncated")
            }:
                self.buf.close()
                raise errors.SchemaError(f"columns: expected those of the existing store {path}, "
                                         f"{dict(self.buf.columns)}, got {dict(columns)}")
        else:
            if columns is None or capacity is None:
                raise errors.InvalidArgumentError(f"columns, capacity: expected both to create {path}, got {columns!r}, {capacity!r}")
            self.buf = create(path, columns, capacity, num_streams=num_streams, **create_options)
        self.commit_interval = commit_interval
        self.last_commit = time.monotonic()
        self.rows = 0

    def extend(self, steps: Mapping[str, Any], stream: int = 0, final_obs: Mapping[str, Any] | None = None) -> int:
        """``Buffer.extend`` on the owner; commits when ``commit_interval`` has passed.
        Returns the generation committed so far (what readers can see)."""
        self.buf.extend(steps, stream=stream, final_obs=final_obs)
        self.rows += len(next(iter(steps.values())))
        if time.monotonic() - self.last_commit >= self.commit_interval:
            return self.commit()
        return int(self.buf.generation)

    def extend_many(self, parts: list[tuple[Mapping[str, Any], int, Mapping[str, Any] | None]]) -> int:
        """Several ``extend`` calls in one message (what :class:`Sender` sends)."""
        gen = int(self.buf.generation)
        for steps, stream, final_obs in parts:
            gen = self.extend(steps, stream, final_obs)
        return gen

    def commit(self) -> int:
        """Commit now; return the generation."""
        self.last_commit = time.monotonic()
        return int(self.buf.commit())

    def update_priorities(self, indices: Any, priorities: Any, written_at: Any = None) -> None:
        """Priorities from a learner: ``(batch.indices, new, batch.written_at)``; rows
        overwritten since that batch was sampled are ignored."""
        target: Any = indices
        if written_at is not None:
            idx = torch.as_tensor(indices)
            target = Batch({}, idx, torch.ones(0), None, np.asarray(written_at, dtype=np.int64))
        self.buf.update_priorities(target, priorities)

    def info(self) -> dict[str, Any]:
        """Rows extended through this actor, rows and episodes live, generation, pid."""
        return {"rows_received": self.rows, "rows": len(self.buf), "episodes": self.buf.num_episodes,
                "generation": int(self.buf.generation), "pid": os.getpid()}

    def close(self) -> int:
        """Commit and release the store (the actor may then be killed)."""
        gen = self.commit()
        self.buf.close()
        return gen


def serve(path: str | os.PathLike[str], columns: Mapping[str, Any] | None = None, capacity: int | None = None,
          num_streams: int = 1, *, name: str | None = None, commit_interval: float = 1.0,
          priorities: PriorityConfig | None = None, actor_options: Mapping[str, Any] | None = None,
          **create_options: Any) -> Any:
    """Start the actor owning the store at ``path`` on this node (create-or-open); its handle.

    ``columns``/``capacity``/``num_streams``/``priorities``/``create_options`` create
    the store when it does not exist (as ``mb.create``); an existing store is
    opened, and ``columns``, when given, must match it. ``name`` registers the actor
    (``ray.get_actor(name)`` from other drivers). The actor takes no CPU slot by
    default (``actor_options`` are passed to ``.options()``) and is placed on the
    calling node, where the store's disk is.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ._disk.urls import local_path

    where = str(local_path(path, "path", hint="the owner writes a local store"))
    opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
    node = ray.get_runtime_context().get_node_id()
    opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    if name is not None:
        opts["name"] = name
    opts.update(actor_options or {})
    if priorities is not None:
        create_options["priorities"] = priorities
    actor: Any = ray.remote(StoreWriter).options(**opts).remote(
        where, columns, capacity, num_streams, create_options, commit_interval)
    ray.get(actor.info.remote())  # raise the store's own error here, not at the first extend
    return actor


class Sender:
    """The env-worker side: sends whole episodes to a :class:`StoreWriter`, batched, with back-pressure."""

    def __init__(self, writer: Any, stream: int, *, batch_rows: int = 1024, max_in_flight: int = 2,
                 max_open_rows: int = 1 << 16) -> None:
        for what, value in (("batch_rows", batch_rows), ("max_in_flight", max_in_flight), ("max_open_rows", max_open_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise errors.InvalidArgumentError(f"{what}: expected an integer >= 1, got {value!r}")
        self.writer, self.stream = writer, int(stream)
        self.batch_rows, self.max_in_flight, self.max_open_rows = batch_rows, max_in_flight, max_open_rows
        self.ready: list[tuple[dict[str, np.ndarray], int, dict[str, np.ndarray] | None]] = []
        self.ready_rows = 0
        self.open: dict[str, list[np.ndarray]] = {}
        self.open_rows = 0
        self.in_flight: list[Any] = []
        self.generation = 0

    def extend(self, steps: Mapping[str, Any], final_obs: Mapping[str, Any] | None = None) -> None:
        """Add ``T`` steps of this stream (as ``Buffer.extend``); completed episodes are
        queued, and sent once ``batch_rows`` rows are queued."""
        arrays = {k: np.asarray(v) for k, v in steps.items()}
        n = len(next(iter(arrays.values())))
        done = np.zeros(n, dtype=bool)
        for flag in ("terminated", "truncated"):
            if flag in arrays:
                done |= arrays[flag].astype(bool)
        for k, v in arrays.items():
            self.open.setdefault(k, []).append(v)
        self.open_rows += n
        ends = np.flatnonzero(done)
        if ends.size or self.open_rows >= self.max_open_rows:
            cut = self.open_rows - n + (int(ends[-1]) + 1 if ends.size else n)
            whole = {k: np.concatenate(v) for k, v in self.open.items()}
            finals = {k: np.asarray(v) for k, v in final_obs.items()} if final_obs else None
            self.ready.append(({k: v[:cut] for k, v in whole.items()}, self.stream, finals))
            self.ready_rows += cut
            self.open = {k: [v[cut:]] for k, v in whole.items()} if cut < self.open_rows else {}
            self.open_rows -= cut
        if self.ready_rows >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        """Send the queued episodes now (the open one stays here); wait while
        ``max_in_flight`` sends are unanswered."""
        import ray

        if self.ready:
            while len(self.in_flight) >= self.max_in_flight:
                done, self.in_flight = ray.wait(self.in_flight, num_returns=1)
                self.generation = max(self.generation, *ray.get(done))
            self.in_flight.append(self.writer.extend_many.remote(self.ready))
            self.ready, self.ready_rows = [], 0

    def wait(self) -> int:
        """Flush, wait for every send to be written; return the owner's generation."""
        import ray

        self.flush()
        if self.in_flight:
            self.generation = max(self.generation, *ray.get(self.in_flight))
            self.in_flight = []
        return self.generation
