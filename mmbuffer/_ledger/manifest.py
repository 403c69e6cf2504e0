"""Parse and check ``manifest.json`` (fields in ``_disk/format.py``) into a frozen ``Manifest``.

A store is untrusted input: every field is checked for its type and range, and
the counters of each lane against each other and the capacity, before any file
is opened from what the manifest says. Every refusal is a ``CorruptStoreError``
that names the file, the field, the expected and the received value (format and
version: ``_format.read_manifest``). Checks that need the episode index are in
``_ledger/counters.py``.

>>> m = parse({"format": "mmbuffer", "format_version": 4, "generation": 0, "capacity": 8,
...            "num_streams": 1, "lane_size": 8, "compression": None, "next_keys": [],
...            "columns": {"terminated": {"shape": [], "dtype": "bool"},
...                        "truncated": {"shape": [], "dtype": "bool"}},
...            "priorities": None, "lanes": [{"written": 3, "ep_head": 0, "ep_tail": 0,
...            "first_start": 0}], "attrs": {}}, "manifest.json")
>>> m.lanes[0].written, m.lane_size
(3, 8)
>>> parse({**m.to_json(), "capacity": "8"}, "manifest.json")
Traceback (most recent call last):
    ...
mmbuffer.errors.CorruptStoreError: manifest.json: capacity: expected an integer in [1, 281474976710656], got '8'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._disk import format as fmt
from .. import errors
from .index import Lane

MAX_COUNTER = 1 << 62  # row and episode counters stay far from int64 overflow


@dataclass(frozen=True, slots=True)
class Manifest:
    """The checked content of ``manifest.json``."""

    generation: int
    capacity: int
    num_streams: int
    lane_size: int
    compression: str | None
    columns: dict[str, tuple[tuple[int, ...], np.dtype]]
    next_keys: tuple[str, ...]
    priorities: dict[str, float] | None
    lanes: tuple[Lane, ...]
    attrs: dict[str, Any]
    codecs: dict[str, str] = field(default_factory=dict)  # columns with a codec (columns/sharding.py)
    #: the store's format version: kept by every commit (a version 3 store stays one)
    format_version: int = fmt.FORMAT_VERSION
    #: the priority log the commit counts (version 5, ``_disk/prilog.py``): its
    #: checkpoint id and committed bytes; (0, 0) when none
    priority_log: tuple[int, int] = (0, 0)
    #: 32 hex digits drawn at creation ("" for a store made before 2026-11-26): which store
    #: this is, whatever its path (a publish appends to its last copy only of the same store)
    store_id: str = ""

    @property
    def finals_by_episode(self) -> bool:
        """Whether ``final/<col>`` is addressed by episode (version 4) or by row (3)."""
        return self.format_version >= fmt.FINALS_BY_EPISODE

    @property
    def next_version(self) -> int:
        """The version a writer's next commit gives the store: a version 4 store becomes
        version 5 (it may log priorities, ``_disk/prilog.py``); a version 3 one stays 3."""
        return max(self.format_version, fmt.PRIORITY_LOG) if self.finals_by_episode else self.format_version

    def to_json(self) -> dict[str, Any]:
        return {
            "format": fmt.FORMAT_NAME,
            "format_version": self.format_version,
            "generation": self.generation,
            "capacity": self.capacity,
            "num_streams": self.num_streams,
            "lane_size": self.lane_size,
            "compression": self.compression,
            "columns": {
                n: {"shape": list(s), "dtype": d.name, **({"codec": self.codecs[n]} if n in self.codecs else {})}
                for n, (s, d) in self.columns.items()
            },
            "next_keys": list(self.next_keys),
            "priorities": self.priorities,
            "lanes": [st.to_json() for st in self.lanes],
            "attrs": self.attrs,
            **({"priority_log": {"checkpoint": self.priority_log[0], "bytes": self.priority_log[1]}}
               if self.format_version >= fmt.PRIORITY_LOG and self.priorities is not None else {}),
            **({"store_id": self.store_id} if self.store_id else {}),
        }

    def schema(self) -> tuple[Any, ...]:
        """What never changes after creation (a reader's refresh checks it)."""
        cols = tuple((n, s, d.name) for n, (s, d) in sorted(self.columns.items()))
        pri = None if self.priorities is None else tuple(sorted(self.priorities.items()))
        codecs = tuple(sorted(self.codecs.items()))
        return (self.capacity, self.num_streams, self.lane_size, self.compression, cols, self.next_keys, pri, codecs)


def load_manifest(path: Path) -> Manifest:
    """Read and check the manifest of the store at ``path``."""
    return parse(fmt.read_manifest(path), str(path / fmt.MANIFEST))


def parse(obj: object, file: str) -> Manifest:
    """Check a decoded ``manifest.json`` and return it as a ``Manifest``."""

    def bad(field: str, want: str, got: object) -> errors.CorruptStoreError:
        return errors.CorruptStoreError(f"{file}: {field}: expected {want}, got {got!r}")

    def integer(field: str, value: object, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise bad(field, f"an integer in [{low}, {high}]", value)
        return value

    if not isinstance(obj, dict):
        raise bad("manifest", "a JSON object", type(obj).__name__)
    missing = {"generation", "capacity", "num_streams", "lane_size", "columns", "next_keys", "lanes"} - set(obj)
    if missing:
        raise bad("fields", "generation, capacity, num_streams, lane_size, columns, next_keys, lanes", f"{sorted(missing)} missing")
    generation = integer("generation", obj["generation"], 0, MAX_COUNTER)
    capacity = integer("capacity", obj["capacity"], 1, fmt.MAX_ROWS)
    num_streams = integer("num_streams", obj["num_streams"], 1, capacity)
    lane_size = integer("lane_size", obj["lane_size"], 1, capacity)
    if lane_size * num_streams != capacity:
        raise bad("lane_size", f"capacity // num_streams = {capacity} // {num_streams} (and no remainder)", lane_size)
    compression = obj.get("compression")
    if compression not in fmt.COMPRESSIONS:
        raise bad("compression", f"one of {fmt.COMPRESSIONS}", compression)

    columns, codecs = _columns(obj["columns"], capacity, bad)
    next_keys = obj["next_keys"]
    if not isinstance(next_keys, list) or len(set(map(str, next_keys))) != len(next_keys) or not all(
        isinstance(k, str) and k in columns and k not in fmt.RESERVED_NAMES for k in next_keys
    ):
        raise bad("next_keys", f"a list of distinct names among {sorted(set(columns) - fmt.RESERVED_NAMES)}", next_keys)

    priorities = obj.get("priorities")
    if priorities is not None:
        if not isinstance(priorities, dict) or set(priorities) != {"alpha", "eps", "max_priority"}:
            raise bad("priorities", "null or {alpha, eps, max_priority}", priorities)
        for key, value in priorities.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise bad(f"priorities.{key}", "a finite number >= 0", value)
        if priorities["max_priority"] <= 0:
            raise bad("priorities.max_priority", "a number > 0", priorities["max_priority"])
        priorities = {k: float(v) for k, v in priorities.items()}

    lanes = obj["lanes"]
    if not isinstance(lanes, list) or len(lanes) != num_streams:
        raise bad("lanes", f"a list of {num_streams} lane states", lanes if not isinstance(lanes, list) else f"{len(lanes)} lanes")
    states = tuple(_lane(f"lanes[{i}]", x, lane_size, integer, bad) for i, x in enumerate(lanes))

    attrs = obj.get("attrs", {})
    if not isinstance(attrs, dict):
        raise bad("attrs", "a JSON object", type(attrs).__name__)
    version = obj.get("format_version", fmt.FORMAT_VERSION)
    if version not in fmt.READABLE_VERSIONS or isinstance(version, bool):
        raise errors.FormatVersionError(
            f"{file}: expected format_version {' or '.join(map(str, fmt.READABLE_VERSIONS))}, got {version!r}; "
            "this mmbuffer cannot read it"
        )
    log = (0, 0)
    if version >= fmt.PRIORITY_LOG and priorities is not None and "priority_log" in obj:
        spec = obj["priority_log"]
        if not isinstance(spec, dict) or set(spec) != {"checkpoint", "bytes"}:
            raise bad("priority_log", "an object with checkpoint, bytes", spec)
        log = (integer("priority_log.checkpoint", spec["checkpoint"], 0, MAX_COUNTER),
               integer("priority_log.bytes", spec["bytes"], 0, MAX_COUNTER))
    store_id = obj.get("store_id", "")
    if not isinstance(store_id, str) or not (store_id == "" or re.fullmatch(r"[0-9a-f]{32}", store_id)):
        raise bad("store_id", "32 hex digits", store_id)
    return Manifest(generation, capacity, num_streams, lane_size, compression, columns, tuple(next_keys), priorities,
                    states, attrs, codecs, int(version), log, store_id)


def _columns(cols: object, capacity: int, bad: Any) -> tuple[dict[str, tuple[tuple[int, ...], np.dtype]], dict[str, str]]:
    if not isinstance(cols, dict) or not fmt.RESERVED_NAMES <= set(cols):
        raise bad("columns", f"an object name -> {{shape, dtype}} with {sorted(fmt.RESERVED_NAMES)}", cols)
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    codecs: dict[str, str] = {}
    for name, spec in cols.items():
        try:
            if name not in fmt.RESERVED_NAMES:
                fmt.check_column_name(name)
        except errors.SchemaError:
            raise bad("columns", "path-safe names (letters, digits, '_', '.', '-', '/' between parts)", name) from None
        if not isinstance(spec, dict) or set(spec) - {"codec"} != {"shape", "dtype"}:
            raise bad(f"columns[{name!r}]", "{shape, dtype} (and codec for a column with one)", spec)
        if "codec" in spec:
            try:
                if name in fmt.RESERVED_NAMES:
                    raise errors.SchemaError(name)
                fmt.parse_codec(name, spec["codec"])
            except errors.SchemaError:
                raise bad(f"columns[{name!r}].codec", "'zstd', 'zstd:<level 1-22>', 'lz4', 'jpeg' or 'jpeg:<quality 1-100>' (never on a flag)", spec["codec"]) from None
            codecs[name] = spec["codec"]
        shape, dtype = spec["shape"], spec["dtype"]
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= fmt.MAX_ROWS for s in shape
        ):
            raise bad(f"columns[{name!r}].shape", "a list of positive integers", shape)
        try:
            if not isinstance(dtype, str) or np.dtype(dtype).name != dtype:
                raise TypeError(dtype)
            dt = fmt.check_dtype(name, dtype)
        except (TypeError, errors.SchemaError):
            raise bad(f"columns[{name!r}].dtype", "one of bool, int8-64, uint8-64, float16-64", dtype) from None
        if capacity * math.prod(shape) * dt.itemsize > MAX_COUNTER:
            raise bad(f"columns[{name!r}].shape", f"at most {MAX_COUNTER} bytes per column", shape)
        out[name] = (tuple(shape), dt)
    for flag in fmt.RESERVED_NAMES:
        if out[flag] != ((), np.dtype(bool)):
            raise bad(f"columns[{flag!r}]", "{shape: [], dtype: bool}", cols[flag])
    names = sorted(out)
    for a, b in zip(names, names[1:]):
        if b.startswith(a + "/"):
            raise bad("columns", "no column nested under another", [a, b])
    return out, codecs


def _lane(field: str, obj: object, lane_size: int, integer: Any, bad: Any) -> Lane:
    keys = ("written", "ep_head", "ep_tail", "first_start")
    if not isinstance(obj, dict) or set(obj) != set(keys):
        raise bad(field, f"an object with {', '.join(keys)}", obj)
    written, head, tail, first = (integer(f"{field}.{k}", obj[k], 0, MAX_COUNTER) for k in keys)
    if not written - lane_size <= first <= written:
        raise bad(f"{field}.first_start", f"in [written - lane_size, written] = [{written - lane_size}, {written}]", first)
    if not head <= tail <= head + min(lane_size, written - first):
        raise bad(
            f"{field}.ep_tail",
            f"in [ep_head, ep_head + min(lane_size, written - first_start)] = [{head}, {head + min(lane_size, written - first)}]",
            tail,
        )
    return Lane(written, head, tail, first)
