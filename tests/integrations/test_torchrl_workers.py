"""Importing torchrl makes every later ``DataLoader`` spawn its workers, and
``multiprocessing_context="fork"`` keeps them forked (README, "From TorchRL")."""

from __future__ import annotations

import textwrap

import pytest
import warm

pytest.importorskip("torchrl")

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, warnings
    import numpy as np, torch
    import mmbuffer as mb
    before = mp.get_start_method(allow_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchrl
    print(before, mp.get_start_method())
    path, seen = sys.argv[1] + "/s", sys.argv[1] + "/workers"
    os.makedirs(seen)
    with mb.create(path, {"obs": ((4,), "float32")}, capacity=1_000) as buf:
        buf.extend({"obs": np.random.randn(400, 4), "truncated": np.arange(400) % 100 == 99},
                   final_obs={"obs": np.zeros((4, 4))})

    def note_how_i_started(worker):
        with open(f"{seen}/{worker}", "wb") as f:
            f.write(open("/proc/self/cmdline", "rb").read())

    loader = torch.utils.data.DataLoader(mb.data.BufferDataset(path, 32, slice_len=4, epoch=True), batch_size=None,
                                         num_workers=2, multiprocessing_context="fork",
                                         worker_init_fn=note_how_i_started)
    print(sum(len(b.indices) for b in loader))
    """
)


def test_torchrl_sets_spawn_and_a_fork_context_keeps_buffer_dataset_workers_forked(tmp_path):
    out = warm.run(SCRIPT, [str(tmp_path)], timeout=300, check=True).stdout.split()
    assert out[:2] == ["None", "spawn"]  # torchrl's import set it for the whole process
    assert int(out[2]) == 4 * (100 - 3)  # every 4-step window of the epoch once, from the two workers
    cmdlines = [p.read_bytes() for p in sorted((tmp_path / "workers").iterdir())]
    assert len(cmdlines) == 2 and not any(b"spawn_main" in c for c in cmdlines)  # forked: the parent's command line
