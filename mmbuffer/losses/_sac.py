"""Soft actor-critic TD targets: :func:`sac_targets`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ._common import align, as_tensor, check_unit, flatten, float_dtype, unflatten


def _min_q(q_fns: Any, obs: Any, action: torch.Tensor) -> list[torch.Tensor]:
    if callable(q_fns):
        out = q_fns(obs, action)
        if isinstance(out, (tuple, list)):
            return [as_tensor(q, "q_fns output") for q in out]
        return [as_tensor(out, "q_fns output")]
    if isinstance(q_fns, Sequence) and len(q_fns) > 0 and all(callable(q) for q in q_fns):
        return [as_tensor(q(obs, action), f"q_fns[{i}] output") for i, q in enumerate(q_fns)]
    raise InvalidArgumentError(
        f"q_fns: expected a callable or a non-empty sequence of callables; got "
        f"{type(q_fns).__name__}"
    )


def sac_targets(reward: Any, next_obs: Any, done: Any, policy: Callable[[Any], Any], q_fns: Any,
                gamma: float, alpha: float | torch.Tensor, skip_done_states: bool = False,
                terminated: Any = None) -> torch.Tensor:
    """Soft actor-critic TD targets, optionally skipping terminal next states.

    ``a', logp = policy(next_obs)``, then ``y = reward + gamma * (1 - terminated)
    * (min_i q_i(next_obs, a') - alpha * logp)``, under :func:`torch.no_grad`.
    The bootstrap of a terminated row is removed with ``torch.where`` (not a
    multiplication by 0), so a NaN computed from a terminal observation never
    leaks into the target.

    Shape contract: **the target has exactly the shape of** ``reward``, ``R = [B,
    *r]``. ``done``, ``terminated``, the Q values and ``logp`` (each separately)
    are aligned to ``R`` on the leading dims (:mod:`mmbuffer.losses`): done ``[B, 1]``
    with reward ``[B]``, Q ``[B, 1]`` with logp ``[B]``, multi-agent done / Q /
    logp ``[B, n_agents, 1]`` or ``[B, n_agents]`` with reward ``[B, n_agents,
    1]`` all work; anything else raises instead of silently forming ``[B, B]``.
    A shared team reward must be expanded to the per-agent shape by the caller.

    ``skip_done_states=True``: the networks run only on the batch rows (dim 0)
    where some element of ``done`` is False, gathered with that mask, so they
    see ``[K, ...]`` inputs of their usual layout (never a flattened ``[K *
    n_agents, ...]``), and not at all when ``K == 0``. Rows entirely done get
    ``target = reward``. In a row where only some agents are done, each
    ``next_obs`` leaf shaped ``[B, n_agents, ...]`` (``done``'s shape without
    trailing 1s) has the done agents' entries zero-filled before the call and
    their outputs discarded, so a terminal observation never reaches a network;
    a leaf of another layout (a shared per-row observation) is passed as is.

    Parameters
    ----------
    reward : tensor-like ``[B, *r]``
    next_obs : tensor, or (nested) dict / tuple of tensors with leading dim ``B``
    done : tensor-like of bool
        Rows whose next observation is not fed to the networks when skipping;
        also the rows that do not bootstrap unless ``terminated`` is given.
    policy : callable
        ``policy(next_obs) -> (action, log_prob, ...)``.
    q_fns : callable or sequence of callables
        ``q(next_obs, action) -> Q``; the minimum over the sequence is taken. A
        single callable may return a tuple/list of Q tensors (e.g.
        ``tuple(ensemble.unbind(0))``); a single tensor is used as is.
    gamma : float in ``[0, 1]``
    alpha : float or tensor
        One element, or broadcastable to the per-row shape ``r``.
    skip_done_states : bool, default False
    terminated : tensor-like of bool, optional
        Rows that do not bootstrap; defaults to ``done``. With a stored final
        observation pass ``done=terminated`` so truncated rows bootstrap; pass
        ``done=terminated | truncated, terminated=terminated`` only if truncated
        rows have no usable next observation (skipped rows get ``reward``).

    Returns
    -------
    torch.Tensor
        Shape ``R``, floating dtype, no autograd history.

    Raises
    ------
    InvalidArgumentError
        Misaligned shapes, ``gamma`` outside ``[0, 1]``, a policy not returning a
        pair, ``next_obs`` without leading dim ``B``.

    Examples
    --------
    >>> import torch
    >>> from mmbuffer.losses import sac_targets
    >>> policy = lambda o: (torch.zeros(len(o), 1), torch.zeros(len(o)))
    >>> q1 = lambda o, a: o.sum(-1, keepdim=True)
    >>> q2 = lambda o, a: o.sum(-1, keepdim=True) + 1
    >>> obs = torch.tensor([[1.0], [float("nan")]])  # row 1 is terminal
    >>> done = torch.tensor([[False], [True]])
    >>> sac_targets(torch.ones(2), obs, done, policy, [q1, q2], 0.5, 0.1,
    ...             skip_done_states=True)
    tensor([1.5000, 1.0000])
    """
    g = check_unit(gamma, "gamma")
    with torch.no_grad():
        r = as_tensor(reward, "reward")
        if r.dim() == 0:
            raise InvalidArgumentError("reward: expected shape [B, ...]; got a 0-d value")
        shape = tuple(r.shape)
        b = shape[0]
        done_t = align(as_tensor(done, "done").to(torch.bool), shape, "done", "reward")
        term_t = (
            done_t
            if terminated is None
            else align(as_tensor(terminated, "terminated").to(torch.bool), shape,
                        "terminated", "reward")
        )
        leaves, spec = flatten(next_obs, "next_obs")
        leaves = [as_tensor(x, "next_obs") for x in leaves]
        if not leaves:
            raise InvalidArgumentError("next_obs: expected at least one tensor; got none")
        for i, x in enumerate(leaves):
            if x.dim() == 0 or x.shape[0] != b:
                raise InvalidArgumentError(f"next_obs leaf {i}: expected leading dim {b} "
                                           f"(reward's); got shape {list(x.shape)}")
        if isinstance(alpha, torch.Tensor) and alpha.numel() == 1:
            alpha = alpha.reshape(())

        def next_value(obs: Any, k: int) -> torch.Tensor:
            out = policy(obs)
            if not isinstance(out, (tuple, list)) or len(out) < 2:
                raise InvalidArgumentError(
                    f"policy: expected to return (action, log_prob); got {type(out).__name__}")
            action, logp = out[0], as_tensor(out[1], "policy log_prob")
            row_shape = (k, *shape[1:])
            qs = [align(q, row_shape, "q_fns output", "the per-row target shape")
                  for q in _min_q(q_fns, obs, action)]
            q = qs[0]
            for other in qs[1:]:
                q = torch.minimum(q, other)
            logp = align(logp, row_shape, "policy log_prob", "the per-row target shape")
            v = q - alpha * logp
            if tuple(v.shape) != row_shape:
                raise InvalidArgumentError(
                    f"alpha: expected a scalar or a tensor broadcastable to the per-row "
                    f"target shape {list(shape[1:])}; got shape "
                    f"{list(torch.as_tensor(alpha).shape)}"
                )
            return v

        if not skip_done_states:
            nv = next_value(unflatten(spec, leaves), b)
        else:
            # per-row "core" shape of done: trailing size-1 dims stripped
            core = list(shape)
            while len(core) > 1 and core[-1] == 1:
                core.pop()
            done_core = done_t.reshape(core)
            live = ~done_core.reshape(b, -1).all(1)
            keep = torch.nonzero(live).reshape(-1)
            k = int(keep.shape[0])
            nv = torch.zeros(shape, dtype=float_dtype(r.dtype), device=r.device)
            if k > 0:
                kept_done = done_core[keep]
                partial = len(core) > 1 and bool(kept_done.any())
                gathered = []
                for x in leaves:
                    xk = x[keep]
                    if partial and tuple(x.shape[: len(core)]) == tuple(core):
                        m = kept_done.reshape(tuple(kept_done.shape)
                                              + (1,) * (x.dim() - len(core)))
                        xk = torch.where(m, torch.zeros((), dtype=x.dtype, device=x.device), xk)
                    gathered.append(xk)
                v = next_value(unflatten(spec, gathered), k)
                nv = nv.to(float_dtype(nv.dtype, v.dtype))
                nv[keep] = v.to(nv.dtype)
        dtype = float_dtype(r.dtype, nv.dtype)
        boot = torch.where(term_t, torch.zeros((), dtype=dtype), nv.to(dtype))
        if skip_done_states:
            boot = torch.where(done_t, torch.zeros((), dtype=dtype), boot)
        return r.to(dtype) + g * boot
