"""Every refusal mmbuffer makes, as a typed exception.

All errors derive from :class:`MMBufferError`; each leaf also derives from the
builtin exception a caller would reach for (``ValueError``, ``FileNotFoundError``,
...), so ``except ValueError`` keeps working for code that does not know mmbuffer.
Messages name the thing at fault (column, argument, file), the expected and the
received value. A refused call changes nothing on disk.

>>> import mmbuffer as mb
>>> issubclass(mb.errors.SchemaError, ValueError)
True
"""

from __future__ import annotations

__all__ = [
    "MMBufferError",
    "SchemaError",
    "InvalidArgumentError",
    "ReadOnlyError",
    "LockedError",
    "StoreNotFoundError",
    "StoreExistsError",
    "FormatVersionError",
    "CorruptStoreError",
    "EmptyBufferError",
    "CapacityError",
    "DiskFullError",
    "InvalidPriorityError",
    "NoValidSliceError",
    "RowNotLiveError",
    "ConversionError",
    "RemoteAccessError",
    "CacheError",
]


class MMBufferError(Exception):
    """Base class of every error mmbuffer raises on purpose."""


class SchemaError(MMBufferError, ValueError):
    """A column set, shape or dtype differs from the store's schema."""


class InvalidArgumentError(MMBufferError, ValueError):
    """An argument is out of its allowed range or of the wrong kind."""


class ReadOnlyError(MMBufferError, PermissionError):
    """A write was attempted on a store opened with ``mode="r"``."""


class LockedError(MMBufferError, BlockingIOError):
    """Another process holds the store's writer lock."""


class StoreNotFoundError(MMBufferError, FileNotFoundError):
    """No mmbuffer store (or no manifest) at the given path."""


class StoreExistsError(MMBufferError, FileExistsError):
    """``create`` (or a converter) was pointed at a path that already exists."""


class FormatVersionError(MMBufferError, ValueError):
    """The manifest names a format version this mmbuffer does not read."""


class CorruptStoreError(MMBufferError, OSError):
    """A file of the store is truncated, missing or disagrees with the manifest."""


class EmptyBufferError(MMBufferError, LookupError, RuntimeError):
    """Sampling was asked of a store with nothing to sample (also a ``RuntimeError``:
    what TorchRL raises there, so a TorchRL user's ``except RuntimeError`` catches it)."""


class CapacityError(MMBufferError, ValueError):
    """A write does not fit the ring it is written to (e.g. an episode longer than a lane)."""


class DiskFullError(MMBufferError, OSError):
    """The filesystem has no space left (``ENOSPC``, or ``EDQUOT``: quota) for a write.

    ``errno`` is the filesystem's error number, so ``exc.errno == errno.ENOSPC``
    still holds. The refused call changed nothing a reader or a reopen sees; free
    space and call it again.
    """


class InvalidPriorityError(MMBufferError, ValueError):
    """A priority is NaN, infinite or negative, or priorities are not enabled."""


class NoValidSliceError(MMBufferError, LookupError, RuntimeError):
    """No live episode is long enough for the requested slice length (also a
    ``RuntimeError``, as TorchRL's ``SliceSampler`` raises there)."""


class RowNotLiveError(MMBufferError, IndexError):
    """An index names a row that holds no live data (never written, or evicted)."""


class ConversionError(MMBufferError, ValueError):
    """A dataset file is not of the declared format, or is inconsistent."""


class RemoteAccessError(MMBufferError, OSError):
    """Object storage could not be reached or refused the request: an endpoint that does
    not answer, missing or wrong credentials, no permission on the bucket. The message
    names the URL and what the server (or the network) said; nothing was changed."""


class CacheError(MMBufferError, OSError):
    """The local cache of a remote store (``cache_dir``) cannot take what a read needs:
    the directory is unwritable, or ``cache_limit`` is below the bytes that must be held
    at once. The message names ``cache_dir`` and the bytes needed. (A full disk there
    is a :class:`DiskFullError`.)"""
