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

**Lossless by default.** What the file holds that the store cannot derive,
and what happens to it: the observations (all ``L``: ``L - 1`` rows and the
final observation), every step's action, reward and other values (rows ``1..L-1``)
and ``episode``/``task`` (one value per episode) are kept. Row 0 of the step
columns is the reset row, which TD-MPC2 fills with NaN: it has no place in the
store, so a row-0 value that is not NaN (not 0/False for an integer or bool
column; ``terminated``: not False) is refused with
:class:`~mmbuffer.errors.ConversionError` naming the key and the episodes,
unless ``drop_reset_values=True`` (``--drop-reset-values``)
accepts leaving them out (counted as ``reset_values_dropped``). ``episode`` or
``task`` changing inside an episode is refused likewise (one value per
episode is kept: that of the episode's rows). A ``truncated`` or ``done`` key
is compared with the flags the store derives (truncated at each episode's last
step unless terminated) and refused where they disagree. A value that is not a
tensor (a string, a number in a plain dict) is refused by name unless
``drop_unsupported=True``.
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


def _td_leaves(td: Any, prefix: str, out: dict[str, Any], other: list[str]) -> None:
    """The tensors of ``td`` into ``out`` by path; the names of anything else into ``other``."""
    import torch

    keys = list(td.keys())
    for k in keys:
        v = td[k]
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif hasattr(v, "keys"):
            _td_leaves(v, name, out, other)
        else:
            other.append(name)


class TDMPC2Reader(Reader):
    """Read a TD-MPC2 ``.pt`` dataset file (see the module docstring)."""

    format = "tdmpc2"

    def __init__(self, path: str | os.PathLike[str], *, drop_reset_values: bool = False,
                 drop_unsupported: bool = False) -> None:
        import torch

        super().__init__(path)
        self._drop_reset = drop_reset_values
        expected = "a TD-MPC2 .pt file (torch.save) or a TorchRL dumps() directory"
        if expect(self.path, (ZIP, PICKLE), expected) == ZIP and not is_torch_zip(self.path):
            raise self._error(f"expected {expected}, found a zip archive that torch.save did not write "
                              "(no <name>/data.pkl member; an .npz? use the npz format)")
        td = _safe_load(self.path)
        if not hasattr(td, "keys"):
            raise self._error(f"not a TD-MPC2 dataset: expected a TensorDict or dict, got {type(td).__name__}")
        leaves: dict[str, torch.Tensor] = {}
        other: list[str] = []
        _td_leaves(td, "", leaves, other)
        if other and not drop_unsupported:
            raise self._error(f"expected tensors, got other values at {other[:8]}: a store cannot hold them; "
                              "drop_unsupported=True (--drop-unsupported) converts without them", other[0])
        if other:
            self.stats["dropped_keys"] = other
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
        dropped = 0
        for e0 in range(0, self._E, eps_per):
            e1 = min(self._E, e0 + eps_per)
            k = e1 - e0
            block = {name: t[e0:e1].numpy() for name, t in self._leaves.items()}
            for name in ("episode", "task"):
                if name in block:
                    arr = block[name].reshape(k, self._L, -1)
                    bad = np.flatnonzero((arr != arr[:, :1]).any(axis=(1, 2)))
                    if len(bad):
                        raise self._error(f"expected one value per episode, got values that change inside "
                                          f"episodes {(bad + e0)[:8].tolist()} (one value per episode is kept)",
                                          name)
            steps: dict[str, np.ndarray] = {}
            for name in self._schema.columns:
                arr = block[name]
                if name == "obs" or name.startswith("obs/") or name in ("episode", "task"):
                    rows = arr[:, :-1]
                else:
                    rows = arr[:, 1:]
                    dropped += self._reset_values(name, arr[:, 0], e0)
                rows = rows.reshape(k * steps_per, *self._schema.columns[name][0])
                steps[name] = rows
            if self._term_key:
                dropped += self._reset_values(self._term_key, block[self._term_key][:, 0], e0)
                term = as_flag(block[self._term_key][:, 1:].reshape(k * steps_per, -1))
            else:
                term = np.zeros(k * steps_per, bool)
            term2 = term.reshape(k, steps_per)
            if term2[:, :-1].any():
                raise self._error("a terminated flag before the last step of an episode", "terminated")
            trunc = np.zeros((k, steps_per), bool)
            trunc[:, -1] = ~term2[:, -1]
            for key, want in (("truncated", trunc), ("done", term2 | trunc)):
                if key in block and key != self._term_key:
                    dropped += self._reset_values(key, block[key][:, 0], e0)
                    got = as_flag(block[key][:, 1:].reshape(k * steps_per, -1)).reshape(k, steps_per)
                    bad = np.flatnonzero((got != want).any(axis=1))
                    if len(bad):
                        raise self._error(
                            f"expected {key} set exactly at each episode's last step ({'unless terminated' if key == 'truncated' else 'terminated or truncated'}: "
                            f"the flags the store derives), got other values in episodes {(bad + e0)[:8].tolist()}",
                            key)
            steps["terminated"] = term
            steps["truncated"] = trunc.reshape(-1)
            final = {c: block[c][:, -1] for c in obs_cols}
            yield Chunk(steps, final)
        if dropped:
            self.stats["reset_values_dropped"] = dropped

    def _reset_values(self, name: str, first: np.ndarray, e0: int) -> int:
        """Row 0 (the reset row) of a step column: refused unless it holds nothing (NaN, 0, False).

        Returns the number of episodes whose reset value is left out (``drop_reset_values``).
        """
        first = first.reshape(len(first), -1)
        held = ~np.isnan(first) if first.dtype.kind == "f" else first != 0
        bad = np.flatnonzero(held.any(axis=1))
        if not len(bad):
            return 0
        if not self._drop_reset:
            what = "NaN" if first.dtype.kind == "f" else "0/False"
            raise self._error(
                f"expected the reset row (row 0) of every episode to hold {what} (TD-MPC2 fills it so), got "
                f"values in episodes {(bad + e0)[:8].tolist()} ({len(bad)} in these {len(first)}): the store "
                "has no place for them; drop_reset_values=True (--drop-reset-values) converts "
                "without them", name)
        return len(bad)
