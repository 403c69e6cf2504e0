"""Minari's JSON spaces: read them (leaves, images) and build them for an export."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import numpy as np

from ...errors import ConversionError

__all__ = ["box_space", "decode_jpeg", "is_image", "leaf_names", "parse_space", "space_for", "space_leaves"]


def space_leaves(space: dict[str, Any] | None, prefix: str) -> dict[str, dict[str, Any]]:
    """Leaf path -> serialized leaf space (Minari's JSON space format)."""
    if space is None:
        return {}
    kind = space.get("type")
    if kind == "Dict":
        out: dict[str, dict[str, Any]] = {}
        for k, sub in space.get("subspaces", {}).items():
            out.update(space_leaves(sub, f"{prefix}/{k}"))
        return out
    if kind == "Tuple":
        out = {}
        for i, sub in enumerate(space.get("subspaces", [])):
            out.update(space_leaves(sub, f"{prefix}/_index_{i}"))
        return out
    return {prefix: space}


def parse_space(meta: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``meta[key]`` as a JSON space (Minari writes them as JSON strings), or ``None``."""
    value = meta.get(key)
    if isinstance(value, str):
        try:
            parsed: dict[str, Any] | None = json.loads(value)
            return parsed
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def is_image(space: dict[str, Any]) -> bool:
    """Whether a leaf space is a uint8 image Box (Minari JPEG-encodes those)."""
    if space.get("type") != "Box" or space.get("dtype") != "uint8":
        return False
    shape = space.get("shape", [])
    if len(shape) not in (2, 3) or shape[0] < 32 or shape[1] < 32:
        return False
    low, high = np.asarray(space.get("low")), np.asarray(space.get("high"))
    return bool(np.all(low == 0) and np.all(high == 255))


def decode_jpeg(frames: Any, where: str) -> np.ndarray:
    """Decode JPEG frames into a uint8 array (needs Pillow)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ConversionError(f"{where}: JPEG-encoded images need Pillow (pip install pillow)") from exc
    images = [np.array(Image.open(io.BytesIO(bytes(np.asarray(f, dtype=np.uint8)))), dtype=np.uint8) for f in frames]
    return np.stack(images) if images else np.zeros((0,), np.uint8)


def box_space(shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
    """A Minari JSON ``Box`` space of ``shape`` and ``dtype`` spanning the dtype's range."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        low, high = -np.inf, np.inf
    elif dt.kind == "b":
        dt, low, high = np.dtype(np.int8), 0, 1
    else:
        info = np.iinfo(dt)
        low, high = info.min, info.max
    lo = np.full(shape, low, dtype=np.float64 if dt.kind == "f" else dt)
    hi = np.full(shape, high, dtype=np.float64 if dt.kind == "f" else dt)
    return {"type": "Box", "dtype": str(dt), "shape": list(shape), "low": lo.tolist(), "high": hi.tolist()}


def space_for(buf: Any, prefix: str) -> dict[str, Any] | None:
    """A Minari JSON space for the columns ``prefix`` / ``prefix/...`` of ``buf``."""
    leaves = {n: c for n, c in buf.columns.items() if n == prefix or n.startswith(prefix + "/")}
    if not leaves:
        return None
    if prefix in leaves:
        c = leaves[prefix]
        return box_space(tuple(c.shape), c.dtype)
    tree: dict[str, Any] = {}
    for name, c in leaves.items():
        node = tree
        parts = name[len(prefix) + 1 :].split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = box_space(tuple(c.shape), c.dtype)

    def build(node: dict[str, Any]) -> dict[str, Any]:
        if "type" in node and isinstance(node.get("type"), str):
            return node
        items = {k: build(v) for k, v in node.items()}
        if items and all(re.fullmatch(r"_index_\d+", k) for k in items):
            return {"type": "Tuple", "subspaces": [items[f"_index_{i}"] for i in range(len(items))]}
        return {"type": "Dict", "subspaces": items}

    return build(tree)


def leaf_names(space: dict[str, Any], prefix: str) -> set[str]:
    """The column names of ``space``'s leaves under ``prefix``."""
    return set(space_leaves(space, prefix))
