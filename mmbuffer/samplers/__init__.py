"""Samplers as objects: frozen specs that map a snapshot of the store to indices.

``buf.sample(n, sampler=...)``, ``mb.stream(buf, n, sampler=...)`` and
``mb.data.BufferDataset(path, n, sampler=...)`` take them; the flags of
``sample``/``sample_slices`` (``prioritized=``, ``strict=``, ``weighting=``) build
the same specs. One file per sampler (``base.py`` holds the contract).

>>> import mmbuffer as mb
>>> mb.samplers.PrioritizedSlices(slice_len=16, beta=0.4)
PrioritizedSlices(slice_len=16, beta=0.4, strict=True)
"""

from .base import Draw, Sampler
from .epoch import Epoch
from .prioritized import Prioritized, PrioritizedSlices
from .recent import Recent
from .slices import Slices
from .uniform import Uniform

__all__ = ["Draw", "Epoch", "Prioritized", "PrioritizedSlices", "Recent", "Sampler", "Slices", "Uniform", "from_flags", "resolve"]


def from_flags(
    slice_len: int | None = None,
    *,
    prioritized: bool = False,
    beta: float = 0.4,
    strict: bool = True,
    weighting: str = "windows",
) -> Sampler:
    """The spec that the ``sample``/``sample_slices`` flags stand for.

    >>> from_flags(16, prioritized=True)
    PrioritizedSlices(slice_len=16, beta=0.4, strict=True)
    """
    from .. import errors

    if slice_len is None:
        return Prioritized(beta) if prioritized else Uniform()
    if prioritized:
        if weighting != "windows":
            raise errors.InvalidArgumentError(
                "weighting: prioritized slices weight windows by start priority; got 'episodes'"
            )
        return PrioritizedSlices(slice_len, beta, strict)
    return Slices(slice_len, strict, weighting)


def resolve(sampler: object, *, prioritized: bool = False, beta: float = 0.4) -> Sampler:
    """``sampler``, or the spec the ``prioritized``/``beta`` flags stand for; a value
    that is not a spec, or a spec and flags at once, is refused.

    >>> resolve(None, prioritized=True)
    Prioritized(beta=0.4)
    """
    from .. import errors

    if sampler is None:
        return from_flags(None, prioritized=prioritized, beta=beta)
    if not isinstance(sampler, Sampler):
        raise errors.InvalidArgumentError(f"sampler: expected an mb.samplers spec (Uniform(), Slices(16), ...), got {sampler!r}")
    if prioritized or beta != 0.4:
        raise errors.InvalidArgumentError(
            f"sampler: expected either sampler= or prioritized=/beta=, got both (sampler={sampler!r}, prioritized={prioritized})"
        )
    return sampler
