"""Transforms that change data on its way in: TorchRL's ``MultiStepTransform``
(n-step returns), applied at ``extend`` as TorchRL's ``ReplayBuffer`` applies it.

TorchRL calls a buffer's transforms backwards (``Transform.inv``) on every batch
given to ``extend``; ``MultiStepTransform`` is the one that matters there: it keeps
the last ``n_steps`` rows of each environment in its own buffer, and returns the
rows before them, each with ``("next", <key>)`` taken ``n_steps`` ahead (or at the
episode's end), ``("next", "reward")`` the discounted sum over those steps, and
``("next", "original_reward")``, ``"gamma"``, ``"nonterminal"`` and
``"steps_to_next_obs"`` added. The drop-in calls the same ``inv`` on the same
batch, and stores what it returns: the rows stored are TorchRL's, bit for bit.

One store rule follows: ``("next", obs)`` is then no longer the following row's
``obs``, so a store written through an n-step transform keeps it in its own
column (``next/<key>``) instead of deriving it; a store created without one
derives it, and an n-step transform on it is refused (``InvalidArgumentError``),
before anything is written. Other transforms with an inverse (``in_keys_inv``)
are refused too: transform the batch before ``extend``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import errors
from .keys import KeyMap


def expand(transform: Any) -> list[Any]:
    """``transform`` as a flat list: a ``Compose`` (TorchRL's container) gives its parts.

    >>> expand(None), expand([abs, len])
    ([], [<built-in function abs>, <built-in function len>])
    """
    items = list(transform) if isinstance(transform, (list, tuple)) else [] if transform is None else [transform]
    out: list[Any] = []
    for t in items:
        parts = getattr(t, "transforms", None) if type(t).__name__ == "Compose" else None
        out += expand(list(parts)) if parts is not None else [t]
    return out


def is_nstep(t: Any) -> bool:
    """Whether ``t`` is a ``MultiStepTransform`` (or a subclass).

    >>> is_nstep(abs)
    False
    """
    return any(c.__name__ == "MultiStepTransform" for c in type(t).__mro__)


def check_transform(t: Any) -> None:
    """Refuse what is neither a transform of sampled data nor an n-step transform."""
    if not callable(t):
        raise errors.InvalidArgumentError(f"transform: expected a torchrl Transform or a callable, got {t!r}")
    if getattr(t, "in_keys_inv", None) and not is_nstep(t):
        raise errors.InvalidArgumentError(
            f"transform: expected a transform of sampled data or a MultiStepTransform, got {type(t).__name__}, "
            "which changes data on its way in (TorchRL applies its inverse at extend; apply it to the batch before extend)"
        )


def inverse(transforms: list[Any], td: Any) -> Any:
    """The batch ``extend`` stores: the n-step transforms' ``inv`` applied, last
    first, as TorchRL's ``Compose.inv``; None when they hold every row back (the
    first ``n_steps`` of a stream)."""
    for t in reversed(transforms):
        if is_nstep(t):
            td = t.inv(td)
            if td is None:
                return None
    return td


def check_store(transforms: list[Any], layout: KeyMap | None, path: Path) -> None:
    """Refuse an n-step transform on a store that derives ``("next", ...)`` from the
    following row (it was created without one): its n-step ``("next", obs)`` would be
    lost."""
    if layout is None or not layout.derived or not any(is_nstep(t) for t in transforms):
        return
    keys = [("next", *layout.columns[c]) for c in layout.derived]
    raise errors.InvalidArgumentError(
        f"transform: expected no MultiStepTransform on the store at {path}, which derives {keys} from the following "
        "row (it was created without one); n-step data keeps them in their own columns: use a new store"
    )
