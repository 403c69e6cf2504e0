"""Value objects of a store's schema: a column's row shape and dtype, prioritized replay settings."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import errors


@dataclass(frozen=True, slots=True)
class Column:
    """Schema of one column: the shape of a row, its dtype and its codec.

    ``codec=None`` stores the column raw (memory-mapped; the store-wide
    ``compression=`` of ``mb.create`` applies); ``"zstd"``, ``"zstd:<level>"``
    (1-22, default 3) or ``"lz4"`` (blosc-lz4) stores it as Zarr shards of small zstd chunks, decoded at
    sample time (docs/format.md, "Columns with a codec"); the lossy ``"jpeg"`` /
    ``"jpeg:<quality>"`` (1-100, default 95; extra ``images``) stores uint8 camera frames
    ``(H, W[, 1|3])`` as one JPEG image each, only when named. A column unpacks as
    ``shape, dtype``.

    >>> Column((17,), "float32")
    Column(shape=(17,), dtype='float32')
    >>> shape, dtype = Column((84, 84), "uint8", codec="zstd"); shape
    (84, 84)
    """

    shape: tuple[int, ...]
    dtype: str
    codec: str | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.shape, self.dtype))

    def __repr__(self) -> str:
        codec = "" if self.codec is None else f", codec={self.codec!r}"
        return f"Column(shape={self.shape!r}, dtype={self.dtype!r}{codec})"


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    """Prioritized replay settings (Schaul et al. 2016).

    A row's stored priority is ``(p + eps) ** alpha``. A new row gets the largest
    priority live in the buffer (TorchRL's and the PER paper's running max), and 1
    when the buffer holds no positive priority. ``max_priority`` only guards
    against overflow (a new row's stored priority is at most ``max_priority **
    alpha``): its default, 1e6, does not bind on ordinary TD errors.

    >>> PriorityConfig(alpha=0.6).max_priority
    1000000.0
    """

    alpha: float = 0.6
    eps: float = 1e-6
    max_priority: float = 1e6

    def to_json(self) -> dict[str, float]:
        return {"alpha": self.alpha, "eps": self.eps, "max_priority": self.max_priority}

    def __post_init__(self) -> None:
        for name in ("alpha", "eps", "max_priority"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise errors.InvalidArgumentError(
                    f"PriorityConfig.{name}: expected a finite number >= 0, got {value!r}"
                )
        if self.max_priority <= 0:
            raise errors.InvalidArgumentError(
                f"PriorityConfig.max_priority: expected > 0, got {self.max_priority!r}"
            )
