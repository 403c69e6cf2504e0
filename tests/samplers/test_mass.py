"""``Sampler.mass``: the total weight a spec gives a store, what a writer group
(``mmbuffer.groups``) splits its batches by, against naive counts over the episodes."""

from __future__ import annotations

import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer import errors, samplers


@pytest.fixture
def store(tmp_path):
    """Episodes of 3, 7, 12 and 5 rows, the last one open, and random priorities."""
    lengths = [3, 7, 12, 5]
    n = sum(lengths)
    ends = np.cumsum(lengths) - 1
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=64, next_keys=(), priorities=mb.PriorityConfig())
    done = np.isin(np.arange(n), ends[:-1])
    buf.extend({"x": np.arange(n), "terminated": done})
    buf.update_priorities(np.arange(n), np.random.default_rng(0).uniform(0.1, 2.0, n))
    buf.commit()
    yield buf, lengths
    buf.close()


def test_every_spec_weighs_a_store_as_it_draws(store):
    buf, lengths = store
    state, view = samplers.SamplerState(), buf.view()
    leaves = buf.leaf_priorities(np.arange(sum(lengths))).astype(np.float64)
    starts = np.cumsum([0] + lengths[:-1])
    assert samplers.Uniform().mass(view, state) == sum(lengths)  # next_keys=(): every row, the open one's too
    for L in (1, 4, 6):
        windows = sum(max(0, n - L + 1) for n in lengths)
        assert samplers.Slices(L).mass(view, state) == windows
        assert samplers.Slices(L, weighting="episodes").mass(view, state) == sum(n >= L for n in lengths)
        assert samplers.Slices(L, strict=False).mass(view, state) == sum(lengths)
        valid = np.concatenate([np.arange(s, s + max(0, n - L + 1)) for s, n in zip(starts, lengths)])
        assert samplers.PrioritizedSlices(L).mass(view, state) == pytest.approx(leaves[valid].sum(), rel=1e-6)
    assert samplers.Prioritized().mass(view, state) == pytest.approx(leaves.sum(), rel=1e-6)


def test_a_spec_with_its_own_state_refuses_to_be_weighed(store):
    buf, _ = store
    with pytest.raises(errors.InvalidArgumentError, match="union of stores"):
        samplers.Recent(2).mass(buf.view(), samplers.SamplerState())
