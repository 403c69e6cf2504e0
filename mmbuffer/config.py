"""Library-wide defaults, overridable through ``MMBUFFER_*`` environment variables.

Explicit arguments always win over this configuration.

>>> from mmbuffer.config import config
>>> config.chunk_bytes >= 4096
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Config:
    """Tunables read once at import.

    Attributes
    ----------
    chunk_bytes:
        Target size of a Zarr inner chunk (the unit a non-mmbuffer reader fetches).
    madvise_random:
        Advise the kernel that column maps are read at random (no read-ahead).
    reserve_fraction:
        Part of a lane the writer reserves ahead of its cursor at a time (see
        ``store.py``: readers never sample rows the writer may be overwriting).
    decode_cache_bytes:
        Bytes of decoded chunks each column with a codec keeps per process
        (``_disk/columns/sharded.py``), shared by every batch.
    private_tree_bytes:
        Bytes of private (anonymous) copies of priority-tree pages a writer keeps
        after a commit (``_ledger/touched.py``): kept, a later store into the page
        takes no page fault; above this bound a commit drops them all
        (``MMBUFFER_PRIVATE_TREE_BYTES``). The pages changed since the last commit
        are private until it, whatever the bound. It also bounds the pages a writer
        changes between two checkpoints (``priority_log_bytes``).
    priority_log_bytes:
        Bytes of the priority log (``_disk/prilog.py``) past which a commit is a
        checkpoint, writing the tree's changed pages and starting a new log
        (``MMBUFFER_PRIORITY_LOG_BYTES``): a commit that is not one appends 12 bytes
        per changed priority; an open replays up to this many bytes.
    """

    chunk_bytes: int = 1 << 20
    madvise_random: bool = True
    reserve_fraction: float = 1 / 16
    decode_cache_bytes: int = 256 << 20
    private_tree_bytes: int = 512 << 20
    priority_log_bytes: int = 32 << 20


def _from_env() -> Config:
    values: dict[str, object] = {}
    for f in fields(Config):
        raw = os.environ.get(f"MMBUFFER_{f.name.upper()}")
        if raw is None:
            continue
        default: object = f.default
        if isinstance(default, bool):
            values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(default, (int, float)):
            values[f.name] = type(default)(raw)
    return Config(**values)  # type: ignore[arg-type]


config = _from_env()
