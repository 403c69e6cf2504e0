"""Prioritized replay: the importance-weighted TD loss and the new priorities
(:func:`per_weighted_loss`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ._common import align, as_tensor


def per_weighted_loss(pred: torch.Tensor, target: Any, weights: Any, kind: str = "mse",
                      delta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance-weighted TD loss and the new priorities.

    ``loss = mean(weights * l(pred - target))`` over every element of ``pred``,
    ``l(x) = x**2`` (``"mse"``) or Huber: ``0.5 x**2`` for ``|x| <= delta``, else
    ``delta * (|x| - 0.5 delta)`` (``"huber"``, as ``F.huber_loss``).
    ``new_priorities = |pred - target|``, detached and averaged over the dims of
    ``pred`` that ``weights`` lacks (or has as 1): it has the shape of
    ``weights``, i.e. of the batch's ``indices``, ready for
    ``buf.update_priorities(indices, new_priorities)``.

    ``target`` and ``weights`` are aligned to ``pred`` on the leading dims
    (:mod:`mmbuffer.losses`): ``[B]`` weights with ``[B, 1]`` or ``[B, L, 1]`` preds,
    ``[B, 1]`` targets with ``[B]`` preds. Gradients flow into ``pred`` (and
    ``target``, if it has any: compute it under no_grad), never ``weights``.

    Parameters
    ----------
    pred : torch.Tensor ``[B, ...]``
    target : tensor-like
    weights : tensor-like ``[B]`` (or any leading-dims prefix of ``pred``'s shape)
    kind : {"mse", "huber"}
    delta : float > 0
        Huber threshold.

    Returns
    -------
    loss : 0-d tensor
    new_priorities : tensor with the shape of ``weights``

    Raises
    ------
    InvalidArgumentError
        Unknown ``kind``, ``delta <= 0``, misaligned shapes.

    Examples
    --------
    >>> import torch
    >>> from mmbuffer.losses import per_weighted_loss
    >>> pred = torch.tensor([[1.0], [3.0]])
    >>> loss, prio = per_weighted_loss(pred, torch.zeros(2), torch.tensor([1.0, 0.5]))
    >>> loss, prio
    (tensor(2.7500), tensor([1., 3.]))
    """
    if kind not in ("mse", "huber"):
        raise InvalidArgumentError(f"kind: expected 'mse' or 'huber'; got {kind!r}")
    try:
        d = float(delta)
    except (TypeError, ValueError):
        d = float("nan")
    if not d > 0 or math.isinf(d):
        raise InvalidArgumentError(f"delta: expected a finite number > 0; got {delta!r}")
    p = as_tensor(pred, "pred")
    if p.dim() == 0:
        raise InvalidArgumentError("pred: expected shape [B, ...] with a batch dim; got 0-d")
    if not p.dtype.is_floating_point:
        raise InvalidArgumentError(f"pred: expected a floating dtype; got {p.dtype}")
    t = align(as_tensor(target, "target"), p.shape, "target", "pred").to(p.dtype)
    w_in = as_tensor(weights, "weights").detach()
    w = align(w_in, p.shape, "weights", "pred")
    w = w.to(torch.promote_types(w.dtype, p.dtype))
    diff = p - t
    if kind == "mse":
        elem = diff.square()
    else:
        elem = torch.nn.functional.huber_loss(p, t.expand_as(p), reduction="none", delta=d)
    loss = (w * elem).mean()
    with torch.no_grad():
        td = diff.detach().abs()
        # the weights' own dims: extra trailing size-1 dims (beyond pred's) dropped
        w_eff = w_in
        while w_eff.dim() > p.dim() and w_eff.shape[-1] == 1:
            w_eff = w_eff.squeeze(-1)
        if td.dim() > w_eff.dim():
            td = td.mean(dim=tuple(range(w_eff.dim(), td.dim())))
        # average over dims where the weights are size 1 but pred is not ([B, 1] vs [B, 5])
        squash = tuple(i for i in range(td.dim()) if w_eff.shape[i] == 1 and td.shape[i] != 1)
        if squash:
            td = td.mean(dim=squash, keepdim=True)
        new_prio = td.reshape(w_in.shape)
    return loss, new_prio
