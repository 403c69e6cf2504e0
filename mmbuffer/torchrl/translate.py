"""TorchRL sampler objects as mmbuffer specs (``ReplayBuffer(sampler=SliceSampler(...))``).

==============================  ================================================
TorchRL                         mmbuffer
==============================  ================================================
``RandomSampler()``             ``Uniform()``
``PrioritizedSampler(N, a, b,   ``Prioritized(beta=b)``; a created store gets
eps)``                          ``PriorityConfig(alpha=a, eps=eps)`` (an existing
                                one must have them)
``SliceSampler(num_slices |     ``Slices(L, strict=strict_length,
slice_len, strict_length)``     weighting="episodes")``: TorchRL draws the
                                trajectory first, then a start in it
``PrioritizedSliceSampler``     ``PrioritizedSlices(L, beta, strict)``
``SamplerWithoutReplacement``   ``Epoch(name="torchrl")``: every transition once
                                per epoch (seed 0; the position is kept in the store)
``SliceSamplerWithout           ``Epoch(L, name="torchrl")``: every strict window
Replacement``                   once per epoch (TorchRL: every trajectory once)
==============================  ================================================

``num_slices`` (``L = batch_size // num_slices`` at each sample) or ``slice_len``.
``end_key``: ``("next", "done")`` (the default; the store's episode ends are
``done``). ``traj_key``: the trajectory-id key that cuts ``[T]`` batches into
streams (default ``("collector", "traj_ids")``; with no episode flags in the data,
a change of id ends an episode). ``strict_length=False`` pads windows to ``L``
(``("collector", "mask")`` marks the real steps), as ``pad_output=True``.
New rows get the live maximum priority (``max_priority_within_buffer=True``'s
rule; TorchRL's default keeps the historical maximum). Anything else that would
change what is drawn (``span``, ``fragmented``, ``ends``, ``trajectories``,
another ``end_key`` or ``truncated_key``, ``shuffle=False``, ``drop_last=True``,
``reduction`` other than ``"max"``) is refused with ``InvalidArgumentError`` naming
the argument; ``compile``, ``use_gpu``, ``cache_values``, ``dtype``, ``device`` and
``max_capacity`` are accepted and have no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import errors, samplers
from ..buffer import Buffer
from ..schema import PriorityConfig
from .keys import Key, as_key


@dataclass(frozen=True, slots=True)
class Translated:
    """An mmbuffer spec and what else the TorchRL sampler said."""

    spec: samplers.Sampler
    num_slices: int | None = None  # windows per batch: slice_len = batch_size // num_slices
    priorities: PriorityConfig | None = None
    traj_key: Key | None = None


def check_store(t: Translated, buf: Buffer) -> None:
    """Refuse a store ``t`` cannot sample: no priorities for a prioritized spec, or
    others than the TorchRL sampler's ``alpha`` and ``eps``."""
    if t.spec.prioritized and buf.priorities is None:
        raise errors.InvalidArgumentError(f"sampler: {t.spec!r} needs priorities; the store at {buf.path} has none")
    want, have = t.priorities, buf.priorities
    if want is not None and have is not None and (want.alpha, want.eps) != (have.alpha, have.eps):
        raise errors.InvalidArgumentError(
            f"sampler: alpha={want.alpha}, eps={want.eps}: expected the store's alpha={have.alpha}, eps={have.eps} at {buf.path}"
        )


def _refuse(sampler: Any, name: str, expected: str, got: Any) -> None:
    raise errors.InvalidArgumentError(
        f"sampler: {type(sampler).__name__}({name}=...): expected {expected}, got {got!r} (not translated to mmbuffer)"
    )


def translate(sampler: Any, batch_size: int | None = None) -> Translated:
    """The spec of a TorchRL sampler object (see the module docstring); ``batch_size``:
    the buffer's preset one."""
    if isinstance(sampler, samplers.Sampler):
        return Translated(sampler)
    try:
        from torchrl.data.replay_buffers import samplers as trs
    except ImportError:  # pragma: no cover - torchrl is installed where tests run
        raise errors.InvalidArgumentError(f"sampler: expected an mb.samplers spec, got {sampler!r}") from None
    if type(sampler) is trs.RandomSampler:
        return Translated(samplers.Uniform())
    if type(sampler) is trs.SamplerWithoutReplacement:
        _without_replacement(sampler)
        return Translated(samplers.Epoch(name="torchrl"))
    if isinstance(sampler, trs.SliceSampler) and type(sampler) in (
        trs.SliceSampler, trs.PrioritizedSliceSampler, trs.SliceSamplerWithoutReplacement
    ):
        return _slices(trs, sampler, batch_size)
    if type(sampler) is trs.PrioritizedSampler:
        return Translated(samplers.Prioritized(beta=float(sampler.beta)), priorities=_priorities(sampler))
    raise errors.InvalidArgumentError(
        f"sampler: expected an mb.samplers spec or one of TorchRL's RandomSampler, PrioritizedSampler, SliceSampler, "
        f"PrioritizedSliceSampler, SamplerWithoutReplacement, SliceSamplerWithoutReplacement, got {type(sampler).__name__}"
    )


def _priorities(sampler: Any) -> PriorityConfig:
    if getattr(sampler, "reduction", "max") != "max":
        _refuse(sampler, "reduction", "'max'", sampler.reduction)
    return PriorityConfig(alpha=float(sampler.alpha), eps=float(vars(sampler)["_eps"]))  # TorchRL has no public eps


def _without_replacement(sampler: Any) -> None:
    if getattr(sampler, "drop_last", False):
        _refuse(sampler, "drop_last", "False (batches always hold batch_size items)", True)
    if not getattr(sampler, "shuffle", True):
        _refuse(sampler, "shuffle", "True", False)


def _slices(trs: Any, sampler: Any, batch_size: int | None) -> Translated:
    if sampler.span not in (False, (False, False), (0, 0)):
        _refuse(sampler, "span", "False", sampler.span)
    if getattr(sampler, "fragmented", False):
        _refuse(sampler, "fragmented", "False", True)
    if "static-stop-and-length" in vars(sampler).get("_cache", {}):  # ends= or trajectories= given
        _refuse(sampler, "ends/trajectories", "None (the store knows its episodes)", "tensors")
    if getattr(sampler, "end_keys", None) is not None:
        _refuse(sampler, "end_keys", "None", sampler.end_keys)
    if sampler.end_key is not None and as_key(sampler.end_key) != ("next", "done"):
        _refuse(sampler, "end_key", "('next', 'done') (the store's episode ends)", sampler.end_key)
    if sampler.truncated_key is None or as_key(sampler.truncated_key) != ("next", "truncated"):
        _refuse(sampler, "truncated_key", "('next', 'truncated')", sampler.truncated_key)
    num, length = sampler.num_slices, sampler.slice_len
    if (num is None) == (length is None):
        _refuse(sampler, "num_slices/slice_len", "exactly one of them", (num, length))
    traj = None if sampler.traj_key is None else as_key(sampler.traj_key)
    strict = bool(sampler.strict_length)
    # the spec's slice_len is a placeholder with num_slices: sample() sets batch_size // num_slices
    L = int(length) if length is not None else 1
    if isinstance(sampler, trs.SliceSamplerWithoutReplacement):
        _without_replacement(sampler)
        if not strict:
            _refuse(sampler, "strict_length", "True (an epoch of strict windows)", False)
        if num is not None:  # an epoch's windows have one length: fixed by the preset batch size
            if not batch_size or batch_size % num:
                _refuse(sampler, "num_slices", f"a divisor of the buffer's batch_size, {batch_size}", num)
            L = batch_size // num
        return Translated(samplers.Epoch(L, name="torchrl"), None, None, traj)
    if isinstance(sampler, trs.PrioritizedSliceSampler):
        spec: samplers.Sampler = samplers.PrioritizedSlices(L, beta=float(sampler.beta), strict=strict)
        return Translated(spec, num, _priorities(sampler), traj)
    return Translated(samplers.Slices(L, strict=strict, weighting="episodes"), num, None, traj)


def storage_path(storage: Any, path: Any, capacity: int | None) -> tuple[Any, int | None]:
    """``storage=`` (TorchRL's ``LazyMemmapStorage(N, scratch_dir=...)`` or
    ``LazyTensorStorage(N)``) as the store's path and capacity: ``N`` rows, kept
    at ``scratch_dir`` unless ``path`` is given. Other storages, more than one
    storage dimension, or no path at all are refused, naming the argument."""
    if storage is None:
        return path, capacity
    kind = type(storage).__name__
    if kind not in ("LazyMemmapStorage", "LazyTensorStorage"):
        raise errors.InvalidArgumentError(
            f"storage: expected TorchRL's LazyMemmapStorage or LazyTensorStorage (the store replaces it), got {kind}"
        )
    if getattr(storage, "ndim", 1) != 1:
        raise errors.InvalidArgumentError(f"storage: expected ndim=1 (rows; [E, T] batches go to streams), got ndim={storage.ndim}")
    size = int(storage.max_size)
    if capacity is not None and capacity != size:
        raise errors.InvalidArgumentError(f"capacity: expected storage's max_size {size} or None, got {capacity}")
    where = path if path is not None else getattr(storage, "scratch_dir", None)
    if where is None:
        raise errors.InvalidArgumentError(
            f"path: expected the store's directory (or {kind}(..., scratch_dir=...)), got None"
        )
    return where, size
