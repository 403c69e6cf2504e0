"""TD-MPC2 ``.pt`` dataset files.

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

import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._pipeline.reader import Chunk, Reader, Schema, as_flag
from .._pipeline.sniff import PICKLE, ZIP, expect

__all__ = ["TDMPC2Reader", "TORCH_DTYPES", "is_torch_zip"]

TORCH_DTYPES = {
    "torch.float16": "<f2", "torch.float32": "<f4", "torch.float64": "<f8",
    "torch.bfloat16": None,
    "torch.uint8": "|u1", "torch.int8": "|i1", "torch.int16": "<i2", "torch.int32": "<i4",
    "torch.int64": "<i8", "torch.uint16": "<u2", "torch.uint32": "<u4", "torch.uint64": "<u8",
    "torch.bool": "|b1",
}


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


def is_torch_zip(path: Path) -> bool:
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
        if expect(self.path, (ZIP, PICKLE), expected) == ZIP and not is_torch_zip(self.path):
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
            np_dt = TORCH_DTYPES.get(dt)
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
