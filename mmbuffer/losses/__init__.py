"""Loss helpers between the store and the optimizer.

Pure torch; the store is only reached through its public API (duck typing).

One module each (re-exported here): ``_minibatched``, ``_gae``, ``_sac`` and
``_per``; ``_common`` holds what they share.

- :func:`minibatched`: a no-grad function over a large batch in chunks, peak
  memory bounded by the chunk (Tianshou #1164: ``logp_old`` over a whole batch).
- :func:`gae`, :func:`gae_from_buffer`: GAE over concatenated episodes with a
  log-depth parallel scan over time; over every live episode of a store.
- :func:`sac_targets`: SAC targets, optionally skipping terminal next states.
- :func:`per_weighted_loss`: importance-weighted TD loss and new priorities.

Shape rule used throughout ("aligned on the leading dims"): when two tensors that
describe the same rows have different numbers of dims, extra *trailing* dims of
size 1 are dropped from the longer one and missing trailing dims are added to the
shorter one as size 1, then ordinary broadcasting applies. So ``[B]`` and
``[B, 1]`` describe the same rows (never the ``[B, B]`` outer product that plain
right-aligned broadcasting gives), and ``[B]`` done flags broadcast over
``[B, n_agents]`` rewards.
"""

from __future__ import annotations

from ._gae import gae, gae_from_buffer
from ._minibatched import minibatched
from ._per import per_weighted_loss
from ._sac import sac_targets

__all__ = ["minibatched", "gae", "gae_from_buffer", "sac_targets", "per_weighted_loss"]
