"""TorchRL replay buffers saved with ``dumps()``, and TD-MPC2 ``.pt`` dataset files.

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
flags (``("next", "done")`` alone -> ``terminated``, with a warning); every root
key that also exists under ``next`` is next-derived and its final observation
is ``("next", key)`` at the episode's last row; other keys are kept as columns
named by their path (``collector/traj_ids``, ``next/<key>`` for next-only keys);
``index`` is dropped. Trailing ``[.., 1]`` dims of reward and flags are squeezed.
Where ``("collector", "traj_ids")`` changes with no flag set, the row before is
marked truncated (counted as ``forced_truncations``); a last episode with no
flag is closed as truncated with ``("next", key)`` as final observation (see
:mod:`._flat`).

**TD-MPC2 files**: a TensorDict (or a dict of tensors) shaped ``[episodes, L]``
with ``obs``, ``action``, ``reward`` and ``episode`` keys, where row 0 of each
episode holds the reset observation with NaN action/reward and row ``t`` holds
``obs_t`` and the action/reward that led to it. Each episode becomes ``L - 1``
store rows ``(obs[t], action[t+1], reward[t+1])`` with final observation
``obs[L-1]``, truncated at the end (terminated where a ``terminated`` key says
so). Loaded only with ``torch.load(weights_only=True, mmap=True)`` and an
allow-list of tensordict's own container classes; anything else in the pickle
is refused. Episodes are converted a chunk at a time from the memory map.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import MMBufferError
from ...schema import PriorityConfig
from .._pipeline.flat import FileArray, FlatReader, RolledArray
from .._pipeline.reader import Chunk, Reader, Schema, as_flag, reader_error
from .._pipeline.sniff import PICKLE, ZIP, expect
from .._pipeline.write import write_store

__all__ = ["TorchRLReader", "TDMPC2Reader", "convert_torchrl", "open_torchrl"]

_TORCH_DTYPES = {
    "torch.float16": "<f2", "torch.float32": "<f4", "torch.float64": "<f8",
    "torch.bfloat16": None,
    "torch.uint8": "|u1", "torch.int8": "|i1", "torch.int16": "<i2", "torch.int32": "<i4",
    "torch.int64": "<i8", "torch.uint16": "<u2", "torch.uint32": "<u4", "torch.uint64": "<u8",
    "torch.bool": "|b1",
}
_FLAG_NAMES = ("terminated", "truncated", "done")


def _read_json(reader: Reader, path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise reader_error(reader, f"expected a JSON object, found unreadable JSON ({exc})", path.name) from None
    if not isinstance(value, dict):
        raise reader_error(reader, f"expected a JSON object, got {type(value).__name__}", path.name)
    return value


def _np_dtype(reader: Reader, s: str, key: str) -> np.dtype:
    dt = _TORCH_DTYPES.get(s)
    if dt is None:
        raise reader_error(reader, f"unsupported dtype {s}", key)
    return np.dtype(dt)


class TorchRLReader(FlatReader):
    """Read a TorchRL replay buffer directory written by ``ReplayBuffer.dumps``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        Reader.__init__(self, path)
        try:
            self._open()
        except MMBufferError:
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
        args = self._map_keys(arrays)
        attrs = {
            "source_format": "torchrl",
            "torchrl": {"len": length, "capacity": cap, "write_count": write_count, "cursor": cursor,
                        "keys": ["/".join(k) for k in leaves]},
        }
        notes = self.notes
        traj = args.pop("traj_ids", None)
        super().__init__(self.path, fmt="torchrl", attrs=attrs, squeeze=("reward",), **args)
        self.notes = notes + self.notes
        self._traj = traj
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
            if "type" in md and "shape" not in md:
                sub = d / key
                if sub.is_dir():
                    self._walk_td(sub, (*prefix, key), out)
                continue
            if md.get("is_nested"):
                raise self._error("nested (jagged) tensors are not supported", "/".join((*prefix, key)))
            file = d / f"{key}.memmap"
            if not file.is_file():
                self._pending.append(f"{'/'.join((*prefix, key))}: no {file.name}, left out")
                continue
            out[(*prefix, key)] = (file, tuple(md["shape"]), _np_dtype(self, md["dtype"], "/".join((*prefix, key))))

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
            if key in (("index",),) or (len(key) == 1 and key[0] in _FLAG_NAMES):
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
        if term is None and trunc is None:
            if done is None:
                raise self._error(
                    "missing key 'next/terminated' (nor 'next/truncated' nor 'next/done'): "
                    "episode ends are unknown"
                )
            self._pending.append("no next/terminated or next/truncated: next/done is used as terminated")
            term = done
        zeros = None
        if term is None or trunc is None:
            n = len(term if term is not None else trunc)  # type: ignore[arg-type]  # one is set
            zeros = np.zeros(n, bool)
        keys["terminated"], keys["truncated"] = "next/terminated", "next/truncated"
        return dict(
            columns=columns,
            terminated=term if term is not None else zeros,
            truncated=trunc if trunc is not None else zeros,
            next_arrays=next_arrays,
            next_keys=tuple(next_keys),
            keys=keys,
            traj_ids=root.get(("collector", "traj_ids")),
        )

    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        traj = self._traj
        total = self.schema.num_rows
        a = 0
        forced = 0
        for chunk in super().chunks(chunk_rows):
            n = len(chunk.steps["terminated"])
            if traj is not None and n:
                # one row of look-ahead: row i ends a trajectory when ids[i] != ids[i + 1]
                ids = np.asarray(traj[a : min(total, a + n + 1)]).reshape(-1)
                change = np.flatnonzero(ids[1:] != ids[:-1])
                steps = chunk.steps
                done = steps["terminated"] | steps["truncated"]
                cut = change[~done[change]]
                if len(cut):
                    forced += len(cut)
                    self._warn_once_traj()
                    steps["truncated"] = steps["truncated"].copy()
                    steps["truncated"][cut] = True
                    chunk = self._refinal(chunk, a)
            a += n
            yield chunk
        if forced:
            self.stats["forced_truncations"] = forced

    def _warn_once_traj(self) -> None:
        if not getattr(self, "_traj_warned", False):
            self._traj_warned = True
            self._warn("collector/traj_ids changes where no flag is set: the row before is marked truncated")

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


# -- TD-MPC2 ------------------------------------------------------------------------------------
def _safe_load(path: Path) -> Any:
    """``torch.load(weights_only=True, mmap=True)`` allowing only tensordict's containers."""
    import torch

    from ...errors import ConversionError

    allowed: list[Any] = []
    try:
        from tensordict import LazyStackedTensorDict, TensorDict
        from tensordict._reductions import (
            _make_td,
            _rebuild_tensordict_files_consolidated,
        )

        allowed = [TensorDict, LazyStackedTensorDict, _make_td, _rebuild_tensordict_files_consolidated]
    except ImportError:
        allowed = []

    def load(mmap: bool) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            return load(True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zipfile" not in str(exc):
                raise
            return load(False)  # a legacy (non-zip) file cannot be memory-mapped
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        needs = ""
        for line in msg.splitlines():
            if "Unsupported global" in line or "GLOBAL" in line:
                needs = line.strip()
                break
        if "tensordict" in msg and not allowed:
            raise ConversionError(
                f"{path}: the file holds a TensorDict; install tensordict to read it "
                f"(pip install tensordict). {needs}"
            ) from None
        raise ConversionError(
            f"{path}: refused: the file needs more than tensors and tensordict containers "
            f"unpickled ({needs or 'weights_only load failed'}); untrusted pickles are never loaded"
        ) from None
    except (RuntimeError, EOFError, OSError, KeyError, IndexError, ValueError, TypeError) as exc:
        raise ConversionError(f"{path}: expected a torch.save file, found one torch cannot read "
                              f"({type(exc).__name__}: {exc})") from None


def _is_torch_zip(path: Path) -> bool:
    """Whether a zip archive has torch.save's layout (``<name>/data.pkl``)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.count("/") == 1 and n.endswith("/data.pkl") for n in zf.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _td_leaves(td: Any, prefix: str, out: dict[str, Any]) -> None:
    import torch

    keys = list(td.keys())
    for k in keys:
        v = td[k]
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif hasattr(v, "keys"):
            _td_leaves(v, name, out)


class TDMPC2Reader(Reader):
    """Read a TD-MPC2 ``.pt`` dataset file (see the module docstring)."""

    format = "tdmpc2"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import torch

        super().__init__(path)
        expected = "a TD-MPC2 .pt file (torch.save) or a TorchRL dumps() directory"
        if expect(self.path, (ZIP, PICKLE), expected) == ZIP and not _is_torch_zip(self.path):
            raise self._error(f"expected {expected}, found a zip archive that torch.save did not write "
                              "(no <name>/data.pkl member; an .npz? use the npz format)")
        td = _safe_load(self.path)
        if not hasattr(td, "keys"):
            raise self._error(f"not a TD-MPC2 dataset: expected a TensorDict or dict, got {type(td).__name__}")
        leaves: dict[str, torch.Tensor] = {}
        _td_leaves(td, "", leaves)
        for key in ("obs", "action", "reward", "episode"):
            if not any(k == key or k.startswith(key + "/") for k in leaves):
                raise self._error(
                    f"missing key {key!r} (a TD-MPC2 file has obs, action, reward, episode; found "
                    f"{', '.join(sorted(leaves))})",
                    key,
                )
        shapes = {tuple(v.shape[:2]) for v in leaves.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise self._error(f"expected every tensor shaped [episodes, L, ...], got leading dims {sorted(shapes)}")
        self._E, self._L = next(iter(shapes))
        if self._L < 2:
            raise self._error(f"episodes of length {self._L}: need at least the reset row and one step")
        self._leaves = leaves
        columns: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, t in leaves.items():
            if name in ("terminated", "done", "truncated"):
                continue
            shape = tuple(t.shape[2:])
            if name == "reward" and shape == (1,):
                shape = ()
            dt = str(t.dtype)
            np_dt = _TORCH_DTYPES.get(dt)
            if np_dt is None:
                raise self._error(f"unsupported dtype {dt}", name)
            columns[name] = (shape, np.dtype(np_dt).str)
        self._term_key = "terminated" if "terminated" in leaves else None
        obs_cols = tuple(c for c in columns if c == "obs" or c.startswith("obs/"))
        attrs = {"source_format": "tdmpc2", "tdmpc2": {"episodes": self._E, "episode_length": self._L}}
        self._schema = Schema(columns, obs_cols, self._E * (self._L - 1), attrs, self._E)

    @property
    def schema(self) -> Schema:
        return self._schema

    def chunks(self, chunk_rows: int) -> Iterator[Chunk]:
        steps_per = self._L - 1
        eps_per = max(1, chunk_rows // steps_per)
        obs_cols = self._schema.next_keys
        nan_first = 0
        for e0 in range(0, self._E, eps_per):
            e1 = min(self._E, e0 + eps_per)
            k = e1 - e0
            block = {name: t[e0:e1].numpy() for name, t in self._leaves.items()}
            ep = block["episode"]
            if (ep != ep[:, :1]).any():
                raise self._error("the 'episode' key changes inside an episode row", "episode")
            steps: dict[str, np.ndarray] = {}
            for name in self._schema.columns:
                arr = block[name]
                if name == "obs" or name.startswith("obs/") or name in ("episode", "task"):
                    rows = arr[:, :-1]
                else:
                    rows = arr[:, 1:]
                    if name == "action" and arr.dtype.kind == "f":
                        nan_first += int(np.isnan(arr[:, 0]).reshape(k, -1).all(axis=1).sum())
                rows = rows.reshape(k * steps_per, *self._schema.columns[name][0])
                steps[name] = rows
            if self._term_key:
                term = as_flag(block[self._term_key][:, 1:].reshape(k * steps_per, -1))
            else:
                term = np.zeros(k * steps_per, bool)
            term2 = term.reshape(k, steps_per)
            if term2[:, :-1].any():
                raise self._error("a terminated flag before the last step of an episode", "terminated")
            trunc = np.zeros((k, steps_per), bool)
            trunc[:, -1] = ~term2[:, -1]
            steps["terminated"] = term
            steps["truncated"] = trunc.reshape(-1)
            final = {c: block[c][:, -1] for c in obs_cols}
            yield Chunk(steps, final)
        if nan_first != self._E:
            self._warn(
                f"{self._E - nan_first} of {self._E} episodes do not start with a NaN action: "
                "is this really TD-MPC2's layout (row t = obs_t and the action that led to it)?"
            )


def open_torchrl(path: str | os.PathLike[str]) -> Reader:
    """A reader for ``path``: a ``dumps()`` directory, or a TD-MPC2 ``.pt`` file."""
    p = Path(path)
    if p.is_dir():
        return TorchRLReader(p)
    if p.is_file():
        return TDMPC2Reader(p)
    from ...errors import ConversionError

    raise ConversionError(f"{p}: no such file or directory (expected a TorchRL dumps() directory or a .pt file)")


def convert_torchrl(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
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

    Raises
    ------
    ConversionError
        Not a TorchRL dump / TD-MPC2 file, a missing key, a pickle needing anything
        beyond tensors and tensordict containers.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    reader = open_torchrl(src)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )

