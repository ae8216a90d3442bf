"""Shrinking a loss spike keeps the rows that make it.

A spike compares a loss to the median of earlier whole-batch losses. One ordinary but hard row alone has a loss
far above that median, so a candidate of that row alone "spikes" at the same step with the same signature, while
the corrupt row that made the recorded spike is gone. A candidate counts only when the rows it dropped do not
spike on their own.
"""

from __future__ import annotations

import importlib
import sys

import torch
from rk_testing import bundle_of, record

import reprokit
from reprokit.shrink import shrink

PROJECT = '''\
import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    with torch.no_grad():
        m.weight.fill_(1.0)
        m.bias.zero_()
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.0))


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss
'''


def _batches(steps=16, n=16, spike_step=14):
    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        x = torch.randn(n, 4, generator=g)
        y = x.sum(-1) + torch.randn(n, generator=g)  # residual ~ N(0, 1): a batch's mse is about 1
        if k == spike_step:
            y[10] += 6.0  # a hard row: 36 alone, about 3 over the batch, no spike
            y[11] += 40.0  # the corrupt label: 1600 alone, about 100 over the batch
        yield {"x": x, "y": y, "index": torch.arange(k * n, (k + 1) * n)}


def test_a_hard_row_that_spikes_alone_is_not_taken_for_the_corrupt_one(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "rk_shrink_spike.py").write_text(PROJECT)
    monkeypatch.syspath_prepend(str(proj))
    monkeypatch.delitem(sys.modules, "rk_shrink_spike", raising=False)
    mod = importlib.import_module("rk_shrink_spike")
    _, exc = record(mod, {}, _batches(), tmp_path / "r", snapshot_every=4, spike_factor=20.0, spike_window=10)
    monkeypatch.delitem(sys.modules, "rk_shrink_spike", raising=False)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.kind == "loss_spike" and exc.failure.step == 14
    r = shrink(bundle_of(exc), tmp_path / "small", passes=["steps", "rows"])
    assert r.kept_rows == [11] and r.dataset_indices == [14 * 16 + 11], r.kept_rows
    assert r.origin_changed >= 1, "the hard row alone spiked, and the corrupt one without it too"
    assert reprokit.replay(r.output).reproduced
