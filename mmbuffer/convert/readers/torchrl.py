"""TorchRL replay buffers saved with ``dumps()``.

**TorchRL dumps** (read without torchrl or tensordict installed)::

    DIR/storage/storage_metadata.json   {"len": n, "is_pytree": bool, "metadata": {...}}
    DIR/storage/meta.json               tensordict memmap: per leaf {shape, dtype}; per
    DIR/storage/<key>.memmap            sub-tensordict {"type": "TensorDict"} and a directory
    DIR/storage/next/meta.json, next/<key>.memmap, ...
    DIR/writer/metadata.json            {"cursor": c, "write_count": w}
    DIR/prefetch.pkl, sampler/...       never read (pickles)

Rows ``0..len-1`` are read in write order (a full ring that wrapped starts at the
writer's cursor). Keys map as ``observation -> obs``, ``action``,
``("next", "reward") -> reward``, ``("next", "terminated"/"truncated")`` -> the
flags (``("next", "done")`` alone: refused, see below); every root
key that also exists under ``next`` is next-derived and its final observation
is ``("next", key)`` at the episode's last row; other keys are kept as columns
named by their path (``collector/traj_ids``, ``next/<key>`` for next-only keys;
``index`` too, unless it is each row's storage slot, as ``TensorDictReplayBuffer``
writes it: derived from the row's position then, and not stored). Trailing ``[.., 1]`` dims of reward and flags are squeezed.
Where ``("collector", "traj_ids")`` changes with no flag set (a collector's batch
of several environments, flattened), the row before is marked truncated: the
trajectories were interleaved, a store's episode is contiguous. Every such row,
none left out, is listed in ``attrs["torchrl"]["forced_truncation_rows"]`` (rows
in read order: the store's rows in the same order, stream after stream), and
counted as ``forced_truncations``: the source's flags are recoverable exactly
(``truncated`` was ``False`` at those rows, nothing else changed; the transition
itself, ``("next", key)`` included, is kept); a last episode with no
flag is closed as truncated with ``("next", key)`` as final observation (see
:mod:`._flat`).

**Lossless by default.** What a dump holds that the store cannot derive:
``("next", key)`` values that differ from the following row's ``key`` inside
an episode (a trajectory boundary of ``collector/traj_ids`` counts as an end):
kept as an explicit ``next/<col>`` column, as for D4RL
(:mod:`~mmbuffer.convert.readers.d4rl`; ``derive_next=True`` derives anyway,
``keep_next_obs=True`` always keeps the column); every other leaf: kept as a
column. Not stored, because the store derives them: ``("next", "done")``
beside ``terminated``/``truncated`` (their ``or``) and the root-level flags
(a collector's copy of the previous row's ``next`` flags). A dump with only
``("next", "done")`` does not say which ends were truncations (time limits) and
which terminations: refused with :class:`~mmbuffer.errors.ConversionError`
naming ``next/done``, unless ``done_means="terminated"`` or ``"truncated"``
(``--done-means``) says which (recorded in ``attrs["torchrl"]["done_means"]``).
An entry with no array a store could hold (a
non-tensor entry, a leaf listed in ``meta.json`` with no ``.memmap`` file) is
refused by name unless ``drop_unsupported=True`` (``--drop-unsupported``).
``prefetch.pkl`` and the sampler's state are pickles and never read.

TD-MPC2 ``.pt`` files: ``tdmpc2.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import MMBufferError
from ...schema import PriorityConfig
from .._pipeline.flat import FileArray, FlatReader, RolledArray, next_mode
from .._pipeline.reader import Chunk, Reader, as_flag, reader_error
from .._pipeline.write import write_store
from .tdmpc2 import TORCH_DTYPES, TDMPC2Reader

__all__ = ["TorchRLReader", "convert_torchrl", "open_torchrl"]

_FLAG_NAMES = ("terminated", "truncated", "done")
#: The values of ``done_means``: what a dump's ``("next", "done")`` is, when it has no other flag.
DONE_MEANS = ("terminated", "truncated")
#: Rows of ``collector/traj_ids`` and flags scanned at a time for the trajectory cuts.
_SCAN_ROWS = 1 << 20


def _read_json(reader: Reader, path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise reader_error(reader, f"expected a JSON object, found unreadable JSON ({exc})", path.name) from None
    if not isinstance(value, dict):
        raise reader_error(reader, f"expected a JSON object, got {type(value).__name__}", path.name)
    return value


def _np_dtype(reader: Reader, s: str, key: str) -> np.dtype:
    dt = TORCH_DTYPES.get(s)
    if dt is None:
        raise reader_error(reader, f"unsupported dtype {s}", key)
    return np.dtype(dt)


class TorchRLReader(FlatReader):
    """Read a TorchRL replay buffer directory written by ``ReplayBuffer.dumps`` (see the module docstring).

    ``done_means`` (``"terminated"`` or ``"truncated"``) says what ``("next", "done")``
    is in a dump with neither ``("next", "terminated")`` nor ``("next", "truncated")``;
    without it such a dump is refused. ``derive_next``, ``keep_next_obs``: as for
    :class:`~mmbuffer.convert.D4RLReader`; ``drop_unsupported``: leave out entries
    with no array instead of refusing them.
    """

    def __init__(self, path: str | os.PathLike[str], *, derive_next: bool = False,
                 keep_next_obs: bool = False, drop_unsupported: bool = False,
                 done_means: str | None = None) -> None:
        Reader.__init__(self, path)
        if done_means is not None and done_means not in DONE_MEANS:
            from ...errors import InvalidArgumentError

            raise InvalidArgumentError(f"done_means: expected one of {DONE_MEANS} or None, got {done_means!r}")
        self._mode = next_mode(derive_next, keep_next_obs, str(self.path))
        self._drop_unsupported, self._dropped = drop_unsupported, list[str]()
        self._done_means = done_means
        try:
            self._open()
        except MMBufferError:
            self.close()
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            self.close()
            raise self._error(f"malformed TorchRL dump metadata ({type(exc).__name__}: {exc})") from None

    def _open(self) -> None:
        root = self.path
        storage = root / "storage" if (root / "storage" / "storage_metadata.json").is_file() else root
        smeta_path = storage / "storage_metadata.json"
        if not smeta_path.is_file():
            raise self._error("not a TorchRL dump: no storage/storage_metadata.json")
        smeta = _read_json(self, smeta_path)
        length = int(smeta.get("len", 0))
        writer_meta = {}
        for wpath in (root / "writer" / "metadata.json",):
            if wpath.is_file():
                writer_meta = _read_json(self, wpath)
        leaves: dict[tuple[str, ...], tuple[Path, tuple[int, ...], np.dtype]] = {}
        self._pending: list[str] = []
        if smeta.get("is_pytree"):
            for key, md in smeta.get("metadata", {}).items():
                parts = tuple(p.replace("_<dot>_", ".") for p in key.split("."))
                file = storage / (key.replace(".", "/") + ".memmap")
                leaves[parts] = (file, tuple(md["shape"]), _np_dtype(self, md["dtype"], key))
        else:
            self._walk_td(storage, (), leaves)
        if not leaves:
            raise self._error("the storage holds no tensors")
        capacity = {shape[0] for _, shape, _ in leaves.values() if shape}
        if len(capacity) != 1:
            raise self._error(f"leaves disagree on the storage size: {sorted(capacity)}")
        cap = capacity.pop()
        if length > cap:
            raise self._error(f"storage_metadata.json says len={length} but arrays hold {cap} rows")
        write_count = int(writer_meta.get("write_count", length))
        cursor = int(writer_meta.get("cursor", length % cap if cap else 0))
        shift = cursor % cap if (length == cap and write_count > cap) else 0
        if shift:
            self._pending.append("the ring buffer wrapped: rows are read from the writer cursor on, and "
                                 "the first episode may have lost its beginning")

        arrays: dict[tuple[str, ...], Any] = {}
        for key, (file, shape, dtype) in leaves.items():
            arr = FileArray(file, 0, shape, dtype)
            arrays[key] = RolledArray(arr, shift, length)
        self._files = arrays
        slot_index = ("index",) in arrays and _is_slot_index(arrays[("index",)], shift, cap)
        args = self._map_keys({k: v for k, v in arrays.items() if not (slot_index and k == ("index",))})
        attrs: dict[str, Any] = {
            "source_format": "torchrl",
            "torchrl": {"len": length, "capacity": cap, "write_count": write_count, "cursor": cursor,
                        "keys": ["/".join(k) for k in leaves]},
        }
        if slot_index:
            attrs["torchrl"]["index"] = "the storage slot of each row: derived, not stored"
        if self._done_used:
            attrs["torchrl"]["done_means"] = self._done_means
        notes = self.notes
        self._traj = args.pop("traj_ids", None)
        self._cuts = _trajectory_cuts(self._traj, args["terminated"], args["truncated"], length)
        attrs["torchrl"]["forced_truncation_rows"] = [int(r) for r in self._cuts]
        super().__init__(self.path, fmt="torchrl", attrs=attrs, squeeze=("reward",), next_mode=self._mode, **args)
        self.notes = notes + self.notes
        if self._dropped:  # only as asked (drop_unsupported): listed in the summary
            self.stats["dropped_keys"] = self._dropped
        for msg in self._pending:
            self._warn(msg)

    def _walk_td(self, d: Path, prefix: tuple[str, ...], out: dict[tuple[str, ...], Any]) -> None:
        meta_path = d / "meta.json"
        if not meta_path.is_file():
            raise self._error("missing meta.json (not a tensordict memmap directory)", str(d))
        meta = _read_json(self, meta_path)
        batch = meta.get("shape", meta.get("batch_size"))
        if isinstance(batch, list) and len(batch) > 1:
            raise self._error(
                f"a storage with batch shape {batch} (ndim > 1) is not supported: "
                "convert a buffer whose storage is one-dimensional", str(d)
            )
        for key, md in meta.items():
            if key.startswith("_") or key in ("shape", "device", "batch_size"):
                continue
            if not isinstance(md, dict):
                continue
            name = "/".join((*prefix, key))
            if "type" in md and "shape" not in md:
                sub = d / key
                if sub.is_dir():
                    self._walk_td(sub, (*prefix, key), out)
                else:  # a non-tensor entry (NonTensorData...): no array a store could hold
                    self._unsupported(name, f"a {md['type']} entry with no tensors")
                continue
            if md.get("is_nested"):
                raise self._error("nested (jagged) tensors are not supported", name)
            file = d / f"{key}.memmap"
            if not file.is_file():
                self._unsupported(name, f"listed in meta.json with no {file.name}")
                continue
            out[(*prefix, key)] = (file, tuple(md["shape"]), _np_dtype(self, md["dtype"], "/".join((*prefix, key))))

    def _unsupported(self, name: str, why: str) -> None:
        """A leaf a store cannot hold: refused by name, unless ``drop_unsupported`` (then listed)."""
        if not self._drop_unsupported:
            raise self._error(f"{why}: a store cannot hold it; drop_unsupported=True (--drop-unsupported) "
                              "converts without it", name)
        self._dropped.append(name)

    def _map_keys(self, arrays: dict[tuple[str, ...], Any]) -> dict[str, Any]:
        def name_of(key: tuple[str, ...]) -> str:
            if key == ("observation",):
                return "obs"
            return "/".join(key)

        root = {k: v for k, v in arrays.items() if k[0] != "next"}
        nxt = {k[1:]: v for k, v in arrays.items() if k[0] == "next" and len(k) > 1}
        columns: dict[str, Any] = {}
        keys: dict[str, str] = {}
        next_arrays: dict[str, Any] = {}
        next_keys: list[str] = []
        for key, arr in root.items():
            if len(key) == 1 and key[0] in _FLAG_NAMES:
                continue
            name = name_of(key)
            columns[name] = arr
            keys[name] = "/".join(key)
            if key in nxt:
                next_keys.append(name)
                next_arrays[name] = nxt[key]
                keys[f"next_{name}"] = "next/" + "/".join(key)
        if ("reward",) in nxt:
            columns["reward"] = nxt[("reward",)]
            keys["reward"] = "next/reward"
        for key, arr in nxt.items():
            if key in root or key == ("reward",) or (len(key) == 1 and key[0] in _FLAG_NAMES):
                continue
            columns["next/" + "/".join(key)] = arr
            keys["next/" + "/".join(key)] = "next/" + "/".join(key)
        term = nxt.get(("terminated",))
        trunc = nxt.get(("truncated",))
        done = nxt.get(("done",))
        self._done_used = False
        if term is None and trunc is None:
            if done is None:
                raise self._error(
                    "missing key 'next/terminated' (nor 'next/truncated' nor 'next/done'): "
                    "episode ends are unknown"
                )
            if self._done_means is None:
                raise self._error(
                    "expected 'next/terminated' or 'next/truncated' beside 'next/done', got 'next/done' "
                    "only: it does not say which episode ends are terminations and which truncations "
                    "(time limits); done_means='terminated' (--done-means terminated) or "
                    "done_means='truncated' (--done-means truncated) says which", "next/done")
            self._done_used = True
            if self._done_means == "terminated":
                term = done
            else:
                trunc = done
        zeros = None
        if term is None or trunc is None:
            n = len(term if term is not None else trunc)  # type: ignore[arg-type]  # one is set
            zeros = np.zeros(n, bool)
        keys["terminated"], keys["truncated"] = "next/terminated", "next/truncated"
        if self._done_used:
            keys[str(self._done_means)] = "next/done"
        return dict(
            columns=columns,
            terminated=term if term is not None else zeros,
            truncated=trunc if trunc is not None else zeros,
            next_arrays=next_arrays,
            next_keys=tuple(next_keys),
            keys=keys,
            traj_ids=root.get(("collector", "traj_ids")),
        )

    def _extra_ends(self, a: int, b: int) -> np.ndarray | None:
        """Rows ``a..b`` after which ``collector/traj_ids`` changes (where no flag is set: the rows
        :meth:`chunks` truncates)."""
        if self._traj is None or b <= a:
            return None
        ids = np.asarray(self._traj[a : min(self._n, b + 1)]).reshape(-1)
        out = np.zeros(b - a, bool)
        out[: len(ids) - 1] = ids[1:] != ids[:-1]
        return out

    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        cuts = self._cuts
        if len(cuts):
            self._warn(f"collector/traj_ids changes where no flag is set: the row before is marked truncated "
                       f"({len(cuts)} rows, first {cuts[:8].tolist()}; all of them in "
                       "attrs['torchrl']['forced_truncation_rows'])")
        a = 0
        for chunk in super().chunks(chunk_rows):
            n = len(chunk.steps["terminated"])
            lo, hi = np.searchsorted(cuts, [a, a + n])
            if hi > lo:
                steps = chunk.steps
                steps["truncated"] = steps["truncated"].copy()
                steps["truncated"][cuts[lo:hi] - a] = True
                chunk = self._refinal(chunk, a)
            a += n
            yield chunk
        if len(cuts):
            self.stats["forced_truncations"] = len(cuts)

    def _refinal(self, chunk: Chunk, a: int) -> Chunk:
        steps = chunk.steps
        done = steps["terminated"] | steps["truncated"]
        ends = np.flatnonzero(done)
        n = len(done)
        final = {}
        for k in self.schema.next_keys:
            if k in self._next:
                final[k] = np.asarray(self._next[k][a : a + n])[ends]
            else:
                shape, dtype = self.schema.columns[k]
                final[k] = np.zeros((len(ends), *shape), dtype)
        return Chunk(steps, final)

    def close(self) -> None:
        for arr in getattr(self, "_files", {}).values():
            arr.base.close()


def _trajectory_cuts(traj: Any, term: Any, trunc: Any, n: int) -> np.ndarray:
    """The rows ``i`` (sorted, int64) with ``traj[i] != traj[i + 1]`` and neither flag set.

    Read in slices of :data:`_SCAN_ROWS` rows with one row of look-ahead.
    """
    if traj is None or n < 2:
        return np.zeros(0, np.int64)
    out = []
    for a in range(0, n - 1, _SCAN_ROWS):
        b = min(n - 1, a + _SCAN_ROWS)  # rows a..b-1, each compared with the row after it
        ids = np.asarray(traj[a : b + 1]).reshape(b + 1 - a, -1)
        change = (ids[1:] != ids[:-1]).any(axis=1)
        done = as_flag(np.asarray(term[a:b])) | as_flag(np.asarray(trunc[a:b]))
        out.append(np.flatnonzero(change & ~done) + a)
    return np.concatenate(out).astype(np.int64)


def _is_slot_index(arr: RolledArray, shift: int, cap: int) -> bool:
    """Whether ``arr`` (the dump's ``index`` leaf, rows in write order) holds each row's storage
    slot, as ``TensorDictReplayBuffer`` writes it: then the row's position says it, nothing is lost."""
    if arr.shape[1:] not in ((), (1,)) or np.dtype(arr.dtype).kind not in "iu":
        return False
    step = 1 << 20
    for a in range(0, arr.shape[0], step):
        b = min(arr.shape[0], a + step)
        if not np.array_equal(np.asarray(arr[a:b]).reshape(b - a), (shift + np.arange(a, b)) % cap):
            return False
    return True


# -- TD-MPC2 ------------------------------------------------------------------------------------


def open_torchrl(path: str | os.PathLike[str], *, derive_next: bool = False, keep_next_obs: bool = False,
                 drop_reset_values: bool = False, drop_unsupported: bool = False,
                 done_means: str | None = None) -> Reader:
    """A reader for ``path``: a ``dumps()`` directory, or a TD-MPC2 ``.pt`` file.

    ``derive_next`` and ``keep_next_obs`` are :class:`TorchRLReader`'s; a TD-MPC2
    file has no separate next observations (each episode's ``L`` observations
    are its rows and its final observation), so they change nothing there.
    ``drop_reset_values`` is :class:`TDMPC2Reader`'s (a dump has no reset row);
    ``done_means`` :class:`TorchRLReader`'s (a TD-MPC2 file has no flags);
    ``drop_unsupported`` both readers'.
    """
    p = Path(path)
    if p.is_dir():
        return TorchRLReader(p, derive_next=derive_next, keep_next_obs=keep_next_obs,
                             drop_unsupported=drop_unsupported, done_means=done_means)
    if p.is_file():
        return TDMPC2Reader(p, drop_reset_values=drop_reset_values, drop_unsupported=drop_unsupported)
    from ...errors import ConversionError

    raise ConversionError(f"{p}: no such file or directory (expected a TorchRL dumps() directory or a .pt file)")


def convert_torchrl(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    derive_next: bool = False,
    keep_next_obs: bool = False,
    drop_reset_values: bool = False,
    drop_unsupported: bool = False,
    done_means: str | None = None,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
) -> dict[str, Any]:
    """Convert a TorchRL ``dumps()`` directory or a TD-MPC2 ``.pt`` file into a store.

    The directory is read from its JSON metadata and raw ``.memmap`` files (no
    torchrl needed, no pickle read); ``.pt`` files are loaded memory-mapped with
    ``weights_only=True`` and only tensordict's container classes allowed.
    Lossless by default (see :mod:`mmbuffer.convert.readers.torchrl`):
    ``derive_next=True`` accepts deriving next values that differ from the dump's;
    ``drop_reset_values=True`` leaving out values in a TD-MPC2 file's reset rows
    (see :mod:`mmbuffer.convert.readers.tdmpc2`); ``done_means="terminated"`` or
    ``"truncated"`` says what ``("next", "done")`` is in a dump with no other flag
    (refused without it).

    Raises
    ------
    ConversionError
        Not a TorchRL dump / TD-MPC2 file, a missing key, ``("next", "done")`` as
        the only flag without ``done_means``, a pickle needing anything beyond
        tensors and tensordict containers.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    reader = open_torchrl(src, derive_next=derive_next, keep_next_obs=keep_next_obs,
                          drop_reset_values=drop_reset_values, drop_unsupported=drop_unsupported,
                          done_means=done_means)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )

