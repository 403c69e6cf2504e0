"""What the loss helpers share: nested batches flattened to tensor leaves, tensors
from tensor-likes, alignment on the leading dims (see :mod:`mmbuffer.losses`), and
checks of scalar arguments."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError


def flatten(tree: Any, name: str) -> tuple[list[Any], Any]:
    """Flatten a nested dict / tuple / list of leaves into (leaves, spec)."""
    if isinstance(tree, (Mapping, tuple, list)):
        keys = list(tree.keys()) if isinstance(tree, Mapping) else list(range(len(tree)))
        leaves: list[Any] = []
        specs = []
        for k in keys:
            sub, spec = flatten(tree[k], f"{name}[{k!r}]")
            leaves.extend(sub)
            specs.append(spec)
        if isinstance(tree, Mapping):
            return leaves, ("dict", keys, specs)
        return leaves, ("seq", type(tree), specs)
    if tree is None:
        return [], ("none",)
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        return [tree], ("leaf",)
    raise InvalidArgumentError(
        f"{name}: expected a tensor, a numpy array, None, or a dict/tuple/list of them; "
        f"got {type(tree).__name__}"
    )


def unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    it = iter(leaves)

    def build(s: Any) -> Any:
        kind = s[0]
        if kind == "leaf":
            return next(it)
        if kind == "none":
            return None
        if kind == "dict":
            return {k: build(sub) for k, sub in zip(s[1], s[2])}
        typ, items = s[1], [build(sub) for sub in s[2]]
        return typ(*items) if hasattr(typ, "_fields") else typ(items)  # namedtuple or not

    return build(spec)


def as_tensor(x: Any, name: str) -> torch.Tensor:
    """Convert to a tensor without copying tensors; copies read-only numpy arrays."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        x = np.array(x)  # torch warns on non-writable arrays (read-only memmaps)
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"{name}: expected a tensor, numpy array or nested sequence of numbers; "
            f"got {type(x).__name__} ({exc})"
        ) from None


def align(x: torch.Tensor, shape: Sequence[int], name: str, ref: str) -> torch.Tensor:
    """Align ``x`` on the leading dims to ``shape`` and broadcast it there.

    Extra trailing size-1 dims of ``x`` are dropped, missing trailing dims are
    added as size 1, then ``x`` is broadcast to ``shape``. The leading dim must
    match exactly (it is the batch or time dim, never broadcast).
    """
    shape = tuple(shape)
    orig = tuple(x.shape)
    while x.dim() > len(shape) and x.shape[-1] == 1:
        x = x.squeeze(-1)
    if x.dim() <= len(shape) and (not shape or (x.dim() >= 1 and x.shape[0] == shape[0])):
        x = x.reshape(tuple(x.shape) + (1,) * (len(shape) - x.dim()))
        try:
            return x.expand(shape)
        except RuntimeError:
            pass
    raise InvalidArgumentError(
        f"{name}: expected a shape aligned on the leading dims with {ref} {list(shape)} "
        f"(same leading dim; extra trailing dims only of size 1, fewer trailing dims are "
        f"broadcast); got {list(orig)}"
    )


def float_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Promoted dtype of ``dtypes``, or the default float dtype if that is not floating."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out if out.is_floating_point else torch.get_default_dtype()


def check_unit(value: float, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not 0.0 <= v <= 1.0:
        raise InvalidArgumentError(f"{name}: expected a number in [0, 1]; got {value!r}")
    return v


def check_size(size: Any, name: str) -> int:
    n = 0
    if not isinstance(size, bool) and hasattr(size, "__index__"):
        n = int(size.__index__())
    if n < 1:
        raise InvalidArgumentError(f"{name}: expected an integer >= 1; got {size!r}")
    return n
