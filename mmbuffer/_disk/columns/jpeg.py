"""The lossy image codec ``"jpeg"`` (``mb.Column((H, W, 3), "uint8", codec="jpeg:95")``).

One JPEG image per row (libjpeg-turbo through imagecodecs, the ``images`` extra:
``pip install 'mmbuffer[images]'``). In ``zarr.json`` the inner chunks of such a
column (one row each) are ``[numcodecs.imagecodecs_jpeg {level}, crc32c]``: the
name zarr-python gives imagecodecs' numcodecs codec ``imagecodecs_jpeg``, so any
Zarr v3 reader with a JPEG codec under that name reads the column.
:func:`register_zarr_codecs` registers one with zarr-python::

    import mmbuffer as mb, zarr
    mb.register_zarr_codecs()
    frames = zarr.open_array("store/columns/cam", mode="r")[:10]

The codec is lossy: a frame reads back close to, not equal to, what was written
(``tolerance``), and the same bytes every time it is decoded. mmbuffer never picks it:
only a user naming it does (``mmbuffer copy`` keeps it, or converts to it on
``--codec COL=jpeg:Q``).

>>> meta(90)
{'name': 'numcodecs.imagecodecs_jpeg', 'configuration': {'level': 90}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from ... import errors

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["NAME", "imagecodecs", "meta", "register_zarr_codecs", "roundtrip", "tolerance"]

NAME: Final = "numcodecs.imagecodecs_jpeg"
EXTRA: Final = "images"


def imagecodecs(column: str) -> ModuleType:
    """The imagecodecs module, or ``SchemaError`` naming ``column`` and the extra."""
    try:
        import imagecodecs as ic
    except ImportError:
        ic = None  # type: ignore[assignment]
    if ic is None or not getattr(ic.JPEG8, "available", False):
        raise errors.SchemaError(
            f"column {column!r}: codec 'jpeg': expected imagecodecs with JPEG installed "
            f"(pip install 'mmbuffer[{EXTRA}]'), got none"
        )
    return ic


def meta(quality: int) -> dict[str, Any]:
    """The ``zarr.json`` entry of the JPEG codec at ``quality``."""
    return {"name": NAME, "configuration": {"level": int(quality)}}


def tolerance(quality: int) -> float:
    """The promise on loss: the mean absolute error per frame (in uint8 levels) of a
    frame read back against the frame written, at ``quality``, for natural (camera-like)
    frames. Measured (worst frame of 100-300 per set: photographs panned at 224x224 and
    48x56, grayscale too; benchmarks/HISTORY.md, 2026-11-25, "Where jpeg.tolerance comes
    from"): 1.5-4.6 at quality 95, 3.7-7.9 at 75, 9.8-16.9 at 10. Hard synthetic edges lose more (upscaled Atari frames: 6.7 at 95,
    JPEG is the wrong codec for them): store those with a lossless codec.

    >>> tolerance(95), tolerance(75), tolerance(100)
    (6.0, 9.0, 6.0)
    """
    return 6.0 + 0.15 * max(0, 95 - int(quality))


def roundtrip(column: str, frames: np.ndarray, quality: int) -> np.ndarray:
    """``frames`` (``[n, *row]`` uint8) encoded at ``quality`` and decoded, as a shard
    stores and a read returns them (encoding and decoding are deterministic): what
    ``mmbuffer copy`` compares a lossy column's read-back with."""
    from ...kernels import images

    imagecodecs(column)  # or the typed error naming the column
    return images.roundtrip(frames, quality)


def register_zarr_codecs() -> None:
    """Register the JPEG codec of mmbuffer's image columns (``numcodecs.imagecodecs_jpeg``)
    with zarr-python, so that ``zarr.open_array`` reads such a column. Needs imagecodecs
    (the ``images`` extra). Idempotent.

    >>> register_zarr_codecs()
    >>> import zarr.registry
    >>> zarr.registry.get_codec_class(NAME).__name__
    'JpegCodec'
    """
    import zarr.registry

    imagecodecs("any")
    zarr.registry.register_codec(NAME, _codec_class())


_CLASS: list[type[Any]] = []


def _codec_class() -> type[Any]:
    """The zarr-python ``ArrayBytesCodec`` (built once, on first use: zarr is imported then)."""
    if _CLASS:
        return _CLASS[0]
    from zarr.abc.codec import ArrayBytesCodec
    from zarr.core.common import parse_named_configuration

    @dataclass(frozen=True)
    class JpegCodec(ArrayBytesCodec):
        """One JPEG image per chunk of shape ``(1, H, W[, C])`` (imagecodecs, libjpeg-turbo)."""

        is_fixed_size = False
        level: int = 95

        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> JpegCodec:
            _, conf = parse_named_configuration(data, NAME, require_configuration=False)
            level: Any = (conf or {}).get("level", 95)
            return cls(level=int(level))

        def to_dict(self) -> dict[str, Any]:
            return meta(self.level)

        async def _decode_single(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
            import asyncio

            ic = imagecodecs("zarr")
            raw = chunk_bytes.to_bytes()
            out = await asyncio.to_thread(ic.jpeg8_decode, raw)
            return chunk_spec.prototype.nd_buffer.from_ndarray_like(np.asarray(out).reshape(chunk_spec.shape))

        async def _encode_single(self, chunk_array: Any, chunk_spec: Any) -> Any:
            from ...kernels import images

            imagecodecs("zarr")
            frame = np.asarray(chunk_array.as_ndarray_like())[0]  # an inner chunk is one row
            return chunk_spec.prototype.buffer.from_bytes(images.encode_frame(frame, self.level))

        def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
            raise NotImplementedError

    _CLASS.append(JpegCodec)
    return JpegCodec
