"""Shrinking a failure that does not recur on every replay.

Each candidate is judged on one replay, so a flaky failure would let a lucky replay accept a candidate. The
project below fails only every other time it sees the bad row (a counter kept outside the recorded state, as a
random generator outside ``state.extra`` would be): shrink must refuse it, never write a bundle that claims to
reproduce.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from rk_testing import bundle_of, record

import reprokit
from reprokit.shrink import FlakyFailure, shrink

PROJECT = '''\
import torch
from torch import nn

import reprokit

SEEN = [{start}]  # outside the recorded state: a replay cannot put it back


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    x = batch["x"]
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    if (x.abs() > 100).any():
        SEEN[0] += {step}
        if SEEN[0] % 2 == 1:
            raise ValueError("a value beyond 100")
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss
'''


def _batches(n=6, bad_step=4, bad_row=5):
    g = torch.Generator().manual_seed(0)
    for k in range(n):
        x = torch.randn(16, 4, generator=g)
        if k == bad_step:
            x[bad_row, 1] = 1e3
        yield {"x": x, "y": x.sum(-1)}


def _record(tmp_path, monkeypatch, start, step):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "rk_shrink_flaky.py").write_text(PROJECT.format(start=start, step=step))
    monkeypatch.syspath_prepend(str(proj))
    monkeypatch.delitem(sys.modules, "rk_shrink_flaky", raising=False)
    mod = importlib.import_module("rk_shrink_flaky")
    _, exc = record(mod, {}, _batches(), tmp_path / "r", snapshot_every=2)
    assert isinstance(exc, ValueError)
    monkeypatch.delitem(sys.modules, "rk_shrink_flaky", raising=False)
    return bundle_of(exc)


def test_a_failure_that_recurs_only_every_other_replay_is_refused_not_shrunk(tmp_path, monkeypatch):
    bundle = _record(tmp_path, monkeypatch, start=0, step=1)
    assert reprokit.replay(bundle, times=2).verdict == "flaky"
    with pytest.raises(FlakyFailure, match="on one replay but not on the next .*it passed.*--times") as info:
        shrink(bundle, tmp_path / "small")
    assert isinstance(info.value, reprokit.DidNotReproduce) and info.value.exit_code == 1
    assert not (tmp_path / "small").exists()


def test_a_deterministic_failure_is_confirmed_and_written(tmp_path, monkeypatch):
    # The same project with the counter stepping by 2 from -1: it stays odd, every replay fails.
    bundle = _record(tmp_path, monkeypatch, start=-1, step=2)
    r = shrink(bundle, tmp_path / "small", passes=["steps", "rows"])
    assert r.kept_rows == [5] and r.after["steps"] == 1
    assert r.confirm_runs == 3 and r.to_json()["confirm_runs"] == 3, "1 for the original, 2 for the result"
    assert reprokit.open_bundle(r.output).run["provenance"]["confirm_runs"] == 3
    assert reprokit.replay(r.output, times=3).verdict == "deterministic"
