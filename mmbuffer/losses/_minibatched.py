"""A no-grad function over a large batch, one chunk of rows at a time: :func:`minibatched`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ._common import as_tensor, check_size, flatten, unflatten


class _Accumulator:
    """One output leaf, filled in place when chunk outputs keep the chunk's rows.

    The result is then allocated once and never held twice; otherwise (an ``fn``
    changing the row count) chunk outputs are kept and concatenated at the end.
    """

    def __init__(self, first: torch.Tensor, stop: int, total: int) -> None:
        self.parts: list[torch.Tensor] = [first]
        self.out: torch.Tensor | None = None
        if first.shape[0] == stop:
            self.out = first.new_empty((total, *first.shape[1:]))
            self.out[:stop].copy_(first)
            self.parts = []

    def add(self, x: torch.Tensor, start: int, stop: int) -> None:
        out = self.out
        if out is not None and x.shape[0] == stop - start and x.shape[1:] == out.shape[1:] \
                and x.dtype == out.dtype and x.device == out.device:
            out[start:stop].copy_(x)
            return
        if out is not None:
            self.parts, self.out = [out[:start]], None
        self.parts.append(x)

    def result(self) -> torch.Tensor:
        try:
            return self.out if self.out is not None else torch.cat(self.parts, dim=0)
        except RuntimeError as exc:
            raise InvalidArgumentError(
                f"fn output: expected chunk outputs that concatenate along dim 0; got shapes "
                f"{[list(p.shape) for p in self.parts[:3]]}...: {exc}"
            ) from None


def _output_leaves(out: Any) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = flatten(out, "fn output")
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise InvalidArgumentError(
                f"fn output leaf {i}: expected a torch.Tensor; got {type(leaf).__name__}")
        if leaf.dim() == 0:
            raise InvalidArgumentError(f"fn output leaf {i}: expected a tensor with a leading "
                                       f"dim to concatenate along; got a 0-d tensor")
    return leaves, spec


def minibatched(fn: Callable[[Any], Any], batch: Any, size: int) -> Any:
    """Apply a no-grad function over a large batch in chunks and concatenate.

    ``fn`` runs under :func:`torch.no_grad` on consecutive slices ``[i : i +
    size]`` along dim 0 of every leaf of ``batch`` (the last may be shorter); the
    outputs are concatenated along dim 0. For an ``fn`` that treats rows
    independently the result equals ``fn(batch)`` (up to float reassociation
    inside ``fn``). Peak memory is one chunk's activations plus the result,
    which is allocated once and filled in place.

    Parameters
    ----------
    fn : callable
        Takes a chunk of the structure of ``batch`` (tensor leaves); returns a
        tensor, a tuple/list/namedtuple or (nested) dict of tensors (``None``
        entries pass through), each with the chunk's rows on dim 0.
    batch : tensor, numpy array, or nested dict / tuple / list of them
        Leaves share the leading dim ``N``. Numpy leaves (memmaps too) are
        converted one chunk at a time, so a mapped column is never read whole.
    size : int
        Rows per chunk, ``>= 1``.

    Returns
    -------
    The structure of ``fn``'s output, ``N`` rows per leaf, no autograd history.

    Raises
    ------
    InvalidArgumentError
        ``size < 1``; leaves with different leading dims or no leading dim; an
        output that is not a tensor or is 0-d.

    Examples
    --------
    >>> import torch
    >>> from mmbuffer.losses import minibatched
    >>> net = torch.nn.Linear(3, 2)
    >>> x = torch.randn(10, 3)
    >>> out = minibatched(net, x, size=4)
    >>> out.shape, out.requires_grad
    (torch.Size([10, 2]), False)
    >>> torch.allclose(out, net(x), atol=1e-6)
    True
    >>> d = minibatched(lambda b: {"s": b["a"] + b["b"]}, {"a": x, "b": x}, 3)
    >>> torch.equal(d["s"], 2 * x)
    True
    """
    size = check_size(size, "size")
    leaves, spec = flatten(batch, "batch")
    if not leaves:
        raise InvalidArgumentError("batch: expected at least one tensor leaf; got none")
    n = int(leaves[0].shape[0]) if leaves[0].ndim else -1
    for i, leaf in enumerate(leaves):
        if leaf.ndim == 0 or int(leaf.shape[0]) != n:
            raise InvalidArgumentError(
                f"batch leaf {i}: expected leading dim {n} (that of the first leaf); "
                f"got shape {list(leaf.shape)}"
            )

    def chunk(start: int, stop: int) -> Any:
        return unflatten(spec, [as_tensor(leaf[start:stop], "batch") for leaf in leaves])

    with torch.no_grad():
        if n == 0:
            return fn(chunk(0, 0))
        stop = min(size, n)
        first, out_spec = _output_leaves(fn(chunk(0, stop)))
        accs = [_Accumulator(x, stop, n) for x in first]
        del first
        for start in range(stop, n, size):
            stop = min(start + size, n)
            outs, s = _output_leaves(fn(chunk(start, stop)))
            if s != out_spec:
                raise InvalidArgumentError(f"fn output for rows [{start}:{stop}]: expected the "
                                           f"structure of the first chunk's; got another")
            for acc, x in zip(accs, outs):
                acc.add(x, start, stop)
            del outs
        return unflatten(out_spec, [acc.result() for acc in accs])
