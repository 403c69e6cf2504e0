"""Samplers as objects: frozen specs that map a snapshot of the store to indices.

``buf.sample(n, sampler=...)``, ``mb.stream(buf, n, sampler=...)`` and
``mb.data.BufferDataset(path, n, sampler=...)`` take them; the flags of
``sample``/``sample_slices`` (``prioritized=``, ``strict=``, ``weighting=``) build
the same specs. One file per sampler (``base.py`` holds the contract).

>>> import mmbuffer as mb
>>> mb.samplers.PrioritizedSlices(slice_len=16, beta=0.4)
PrioritizedSlices(slice_len=16, beta=0.4, strict=True)
"""

from .. import errors
from .._ledger.snapshot import Draw
from .base import Sampler, SamplerState
from .epoch import Epoch
from .prioritized import Prioritized, PrioritizedSlices
from .recent import Recent
from .slices import Slices
from .uniform import Uniform

_UNIFORM = Uniform()  # a value: one serves every call
_PRIORITIZED: dict[float, Sampler] = {}  # Prioritized(beta) by beta: values too (a PER step's fixed cost)

__all__ = ["Draw", "Epoch", "SamplerState", "Prioritized", "PrioritizedSlices", "Recent", "Sampler", "Slices", "Uniform", "from_flags", "resolve"]


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
    if slice_len is None:
        if not prioritized:
            return _UNIFORM
        spec = _PRIORITIZED.get(beta) if type(beta) is float else None
        if spec is None:
            spec = Prioritized(beta)  # checks beta
            if type(beta) is float and len(_PRIORITIZED) < 64:
                _PRIORITIZED[beta] = spec
        return spec
    if prioritized:
        if weighting != "windows":
            raise errors.InvalidArgumentError(
                "weighting: prioritized slices weight windows by start priority; got 'episodes'"
            )
        return PrioritizedSlices(slice_len, beta, strict)
    return Slices(slice_len, strict, weighting)


def resolve(
    sampler: object = None,
    slice_len: int | None = None,
    *,
    prioritized: bool = False,
    beta: float = 0.4,
    strict: bool = True,
    weighting: str = "windows",
) -> Sampler:
    """The one place flags become a spec: ``sampler`` itself, or the spec the flags
    stand for (:func:`from_flags`). A value that is not a spec, or a spec together
    with flags off their defaults, is refused. ``buf.sample``, ``mb.stream``,
    ``BufferDataset`` and the remote buffer all resolve through here.

    >>> resolve(None, prioritized=True)
    Prioritized(beta=0.4)
    >>> resolve(Uniform())
    Uniform()
    """
    if sampler is None and slice_len is None and prioritized is False:
        return _UNIFORM  # what from_flags gives: ``sample``'s default, at every call
    flags = (slice_len, prioritized, beta, strict, weighting)
    if sampler is None:
        return from_flags(slice_len, prioritized=prioritized, beta=beta, strict=strict, weighting=weighting)
    if not isinstance(sampler, Sampler):
        raise errors.InvalidArgumentError(f"sampler: expected an mb.samplers spec (Uniform(), Slices(16), ...), got {sampler!r}")
    if flags != (None, False, 0.4, True, "windows"):
        raise errors.InvalidArgumentError(
            f"sampler: expected either sampler= or the flags, got both (sampler={sampler!r}, slice_len={slice_len!r}, "
            f"prioritized={prioritized!r}, beta={beta!r}, strict={strict!r}, weighting={weighting!r})"
        )
    return sampler
