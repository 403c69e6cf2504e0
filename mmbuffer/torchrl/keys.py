"""TensorDict keys <-> store columns for :mod:`mmbuffer.torchrl` (rules in its docstring).

``KeyMap`` is the mapping a store keeps in ``attrs["torchrl_layout"]``; ``infer``
builds it from a first batch, ``read_batch`` turns a batch into column arrays and
``to_tensordict`` turns a sampled ``mb.Batch`` back into TorchRL's layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import errors, samplers
from ..buffer import Buffer
from .._read.gather import Batch
from ..opening import create as create_buffer
from ..schema import PriorityConfig

WEIGHT_KEY = "priority_weight"  # TorchRL's PrioritizedSampler info key, read by its losses
FLAGS = ("done", "terminated", "truncated")
ATTR = "torchrl_layout"
OPEN_ATTR = "torchrl_open"  # streams whose open episode's final observation is stored: written
PRIORITY = "__priority__"  # the priority values carried with a batch's rows (never a column)

Key = tuple[str, ...]
Columns = dict[str, tuple[tuple[int, ...], str]]


def as_key(key: str | Iterable[str]) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


@dataclass(slots=True)
class KeyMap:
    """Which TensorDict key each column holds (``derived``: next-derived columns,
    whose ``("next", *key)`` is rebuilt), and the flags to give back."""

    columns: dict[str, Key]
    derived: tuple[str, ...]
    next_flags: tuple[str, ...] = FLAGS
    root_flags: tuple[str, ...] = FLAGS
    flag_shape: tuple[int, ...] = (1,)
    squeezed: tuple[str, ...] = ()  # columns stored without TorchRL's trailing [..., 1]

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": {k: list(v) for k, v in self.columns.items()},
            "derived": list(self.derived),
            "next_flags": list(self.next_flags),
            "root_flags": list(self.root_flags),
            "flag_shape": list(self.flag_shape),
            "squeezed": list(self.squeezed),
        }

    def name_of(self, key: Key) -> str | None:
        """The column holding ``key``, if any."""
        for name, k in self.columns.items():
            if k == key:
                return name
        return None

    @classmethod
    def from_store(cls, buf: Buffer) -> KeyMap:
        """The map saved by :mod:`mmbuffer.torchrl`, or the converter's naming rules
        for a store converted from a TorchRL dump (or any store: columns by path)."""
        saved = buf.attrs.get(ATTR)
        if isinstance(saved, dict):
            try:
                return cls(
                    {str(k): tuple(map(str, v)) for k, v in saved["columns"].items()},
                    tuple(saved["derived"]),
                    tuple(saved["next_flags"]),
                    tuple(saved["root_flags"]),
                    tuple(int(x) for x in saved["flag_shape"]),
                    tuple(saved.get("squeezed", ())),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise errors.CorruptStoreError(
                    f"{buf.path}: attrs[{ATTR!r}]: expected the layout mmbuffer.torchrl writes, got {saved!r} ({exc})"
                ) from None
        source = buf.attrs.get("torchrl", {})
        paths = set(source.get("keys", [])) if isinstance(source, dict) else set()
        columns: dict[str, Key] = {}
        for name in buf.columns:
            if name in ("terminated", "truncated"):
                continue
            if name == "obs" and ("observation" in paths or "obs" not in paths):
                columns[name] = ("observation",)
            elif name == "reward":
                columns[name] = ("next", "reward")
            else:
                columns[name] = tuple(name.split("/"))
        # the converter stores reward as a scalar; TorchRL's layout has [..., 1]
        squeezed = ("reward",) if "reward" in buf.columns and buf.columns["reward"].shape == () else ()
        return cls(columns, tuple(buf.next_keys), squeezed=squeezed)


def infer(td: Any, priority_key: Key, *, derive: bool = True) -> tuple[KeyMap, Columns]:
    """The key map and the store columns of a first batch (``derive=False``: every
    ``("next", key)`` in its own column, none derived: n-step data, ``nstep.py``).

    >>> import pytest; td = pytest.importorskip("tensordict")
    >>> batch = td.TensorDict({"observation": torch.zeros(5, 3), "next": {"observation": torch.zeros(5, 3),
    ...     "reward": torch.zeros(5, 1), "done": torch.zeros(5, 1, dtype=torch.bool)}}, [5])
    >>> keymap, columns = infer(batch, ("td_error",))
    >>> columns, keymap.derived
    ({'obs': ((3,), 'float32'), 'reward': ((1,), 'float32')}, ('obs',))
    """
    lead = td.batch_dims
    found = leaves(td)
    for key, value in found.items():
        if not isinstance(value, torch.Tensor):
            raise errors.SchemaError(f"data[{key}]: expected a tensor, got {type(value).__name__}")
    root = {k: v for k, v in found.items() if k[0] != "next"}
    nxt = {k[1:]: v for k, v in found.items() if k[0] == "next" and len(k) > 1}
    skip = {("index",), (WEIGHT_KEY,), priority_key}
    columns: dict[str, Key] = {}
    derived: list[str] = []
    for key in root:
        if key in skip or (len(key) == 1 and key[0] in FLAGS):
            continue
        name = "obs" if key == ("observation",) and ("obs",) not in root else "/".join(key)
        columns[name] = key
        if key in nxt and derive:
            derived.append(name)
    for key in nxt:
        if (key in root and derive) or (len(key) == 1 and key[0] in FLAGS) or ("next", *key) in skip:
            continue
        name = "reward" if key == ("reward",) and "reward" not in columns else "next/" + "/".join(key)
        columns[name] = ("next", *key)
    next_flags = tuple(f for f in FLAGS if (f,) in nxt)
    flags = [nxt[(f,)] for f in ("terminated", "done", "truncated") if f in next_flags]
    fshape = tuple(flags[0].shape[lead:]) if flags else (1,)
    keymap = KeyMap(columns, tuple(derived), next_flags, tuple(f for f in FLAGS if (f,) in root), fshape)
    spec = {name: (tuple(found[k].shape[lead:]), str(found[k].dtype).removeprefix("torch.")) for name, k in columns.items()}
    return keymap, spec


def leaves(td: Any) -> dict[Key, Any]:
    """Every leaf of ``td`` by its key path, in one walk (``td.items(include_nested=True,
    leaves_only=True)`` takes several times as long on a collector's batch).

    >>> import pytest; td = pytest.importorskip("tensordict")
    >>> sorted(leaves(td.TensorDict({"a": torch.zeros(2), "next": {"a": torch.ones(2)}}, [2])))
    [('a',), ('next', 'a')]
    """
    from tensordict import TensorDictBase, is_non_tensor

    out: dict[Key, Any] = {}

    def walk(t: Any, prefix: Key) -> None:
        for k, v in t.items():
            key = (*prefix, k)
            if isinstance(v, TensorDictBase) and not is_non_tensor(v):  # a nested TensorDict
                walk(v, key)
            else:
                out[key] = v

    walk(td, ())
    return out


def read_batch(
    td: Any, keymap: KeyMap, buf: Buffer, priority_key: Key, traj_key: Key = ("collector", "traj_ids"),
    found: dict[Key, Any] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray | None]:
    """Columns (and ``next_<col>``, priorities) of a ``[*E, T]`` batch as ``[E, T, ...]``
    arrays (views where the tensors allow), episode ends and truncations ``[E, T]``,
    trajectory ids ``[E, T]`` (``traj_key``) or None. Every key, shape and dtype is
    checked here. Data with no ``("next", "done" | "terminated")`` ends an episode
    where its trajectory id changes, else at every row (truncated). ``found``: the
    batch's :func:`leaves`, when the caller has them."""
    lead = tuple(td.batch_size)
    n_lead = len(lead)
    shape = (int(np.prod(lead[:-1])), lead[-1])
    found = leaves(td) if found is None else found
    wanted = {*keymap.columns.values(), *(("next", *keymap.columns[c]) for c in keymap.derived)}
    wanted |= {("next", f) for f in keymap.next_flags} | {(f,) for f in keymap.root_flags}
    given = set(found) - {("index",), (WEIGHT_KEY,), priority_key}
    if given != wanted:
        raise errors.SchemaError(
            f"data: expected the keys of the store at {buf.path}, {sorted(wanted)}, got {sorted(given)} "
            f"(missing {sorted(wanted - given)}, unknown {sorted(given - wanted)})"
        )

    def get(key: Key) -> np.ndarray:
        value = found[key]
        if not isinstance(value, torch.Tensor):
            raise errors.SchemaError(f"data[{key}]: expected a tensor, got {type(value).__name__}")
        if value.requires_grad or value.device.type != "cpu":
            value = value.detach().cpu()
        out: np.ndarray = value.numpy()
        return out.reshape(shape + out.shape[n_lead:])

    values = {name: get(key) for name, key in keymap.columns.items()}
    for name in keymap.squeezed:
        if values[name].shape[2:] == (1,):
            values[name] = values[name][..., 0]
    for name in keymap.derived:
        values[f"next_{name}"] = get(("next", *keymap.columns[name]))
    for name, value in values.items():
        base = name if name in keymap.columns else name[5:]
        col = buf.columns[base]
        if value.shape[2:] != col.shape or value.dtype != np.dtype(col.dtype):
            key = keymap.columns[base] if name == base else ("next", *keymap.columns[base])
            raise errors.SchemaError(
                f"data[{key}] (column {name!r}): expected rows of shape {col.shape} and dtype {col.dtype}, "
                f"got shape {value.shape[2:]} and dtype {value.dtype}"
            )
    for f in keymap.root_flags:
        if get((f,)).any():
            raise errors.InvalidArgumentError(f"data[{f!r}]: expected False (a step never starts from an ended state), got True")
    flag = {f: get(("next", f)).reshape(shape).astype(bool, copy=False) for f in keymap.next_flags}
    traj = values.get(keymap.name_of(traj_key) or "")
    traj = None if traj is None else traj.reshape(shape)
    term = flag.get("terminated", flag.get("done", np.zeros(shape, bool)))
    trunc = flag.get("truncated", np.zeros(shape, bool))
    if "done" in flag:
        trunc = trunc | (flag["done"] & ~term)
    if "done" not in flag and "terminated" not in flag:  # no episode flags
        trunc = np.ones(shape, bool)
        if traj is not None:  # the last row stays open: the next batch may go on with its id
            trunc[:, :-1], trunc[:, -1] = traj[:, 1:] != traj[:, :-1], False
    if priority_key in found and buf.priorities is not None:
        values[PRIORITY] = get(priority_key).reshape(shape + (-1,)).max(-1)
    return values, term | trunc, trunc, traj


def to_tensordict(
    b: Batch, keymap: KeyMap, spec: samplers.Sampler, *, flatten: bool, open_rows: np.ndarray | None = None
) -> Any:
    """A sampled batch in TorchRL's layout (see :mod:`mmbuffer.torchrl`); ``open_rows``:
    rows whose episode end is provisional (not truncated for TorchRL: the episode goes on)."""
    from tensordict import TensorDict

    shape = tuple(b.indices.shape)
    out = TensorDict({}, batch_size=shape)
    for name, key in keymap.columns.items():
        out.set(key, b.data[name][..., None] if name in keymap.squeezed else b.data[name])
    for name in keymap.derived:
        out.set(("next", *keymap.columns[name]), b.data[f"next_{name}"])
    term, trunc = b.data["terminated"], b.data["truncated"]
    if open_rows is not None and open_rows.size and not spec.slices:
        provisional = (b.indices.numpy()[..., None] == open_rows).any(-1)  # a few open rows: no sort
        trunc = trunc & ~torch.from_numpy(provisional)
    if spec.slices:  # as SliceSampler marks them: each window ends truncated
        trunc = trunc.clone()
        last = (b.mask.sum(1) - 1) if b.mask is not None else torch.full((shape[0],), shape[1] - 1)
        trunc[torch.arange(shape[0]), last] = True
        if b.mask is not None and not getattr(spec, "strict", True):
            out.set(("collector", "mask"), b.mask)
    flags = {"terminated": term, "truncated": trunc, "done": term | trunc}
    fshape = shape + keymap.flag_shape
    for f in keymap.next_flags:
        out.set(("next", f), flags[f].reshape(fshape))
    for f in keymap.root_flags:
        out.set((f,), torch.zeros(fshape, dtype=torch.bool))
    out.set("index", b.indices)
    if spec.prioritized:
        out.set(WEIGHT_KEY, b.weights[:, None].expand(shape).contiguous() if spec.slices else b.weights)
    if spec.slices and flatten:
        out = out.reshape(-1)
        out.set("index", out.get("index")[:, None])  # [B * L, 1], as SliceSampler returns it
    return out


def create_store(
    path: Path, keymap: KeyMap, columns: Columns, num_streams: int, capacity: int | None, *,
    compression: str | None, priorities: PriorityConfig | None,
) -> Buffer:
    """The store of a first batch: ``capacity`` rows (rounded down to a multiple of
    ``num_streams``), the key map kept in its ``attrs``."""
    if capacity is None:
        raise errors.InvalidArgumentError(f"capacity: expected the row capacity of the new store at {path}, got None")
    rows = capacity // num_streams * num_streams
    if rows == 0:
        raise errors.InvalidArgumentError(f"capacity: expected at least num_streams={num_streams} rows, got {capacity}")
    return create_buffer(path, columns, rows, num_streams=num_streams, compression=compression, priorities=priorities,
                         next_keys=keymap.derived, attrs={ATTR: keymap.to_json()})
