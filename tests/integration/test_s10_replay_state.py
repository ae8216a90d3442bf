"""Adversarial replay checks: every replay of a bundle must start from the state the recording had at the snapshot,
however the last replay (or the recorded run) left the live objects. A state that leaks from one replay into the
next turns a deterministic failure into a "flaky" one; a state left out of the snapshot makes the replay run other
numbers than the recording did."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from rk_testing import bundle_of, record

import reprokit
from reprokit.replay import session


@pytest.fixture
def project(tmp_path, monkeypatch):
    """Write a user module into its own folder and import it (a fresh module name per test)."""
    made: list[str] = []

    def make(name: str, source: str) -> Any:
        folder = tmp_path / f"src_{name}"
        folder.mkdir()
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(folder))
        made.append(name)
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)


def batches(n: int, dim: int = 4, rows: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, dim, generator=g) * 3 + 1, "i": torch.tensor(i)} for i in range(n)]


def record_bundle(mod: Any, config: dict, n: int, out: Path, snapshot_every: int = 3) -> Path:
    _, exc = record(mod, config, batches(n), out, snapshot_every=snapshot_every)
    return bundle_of(exc)


SCALER = """
import torch
from torch import nn
import reprokit

def build(config):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                               scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4))

def train_step(state, batch):
    loss = (state.model(batch["x"]) ** 2).mean()
    state.scaler.scale(loss).backward()
    state.scaler.unscale_(state.optimizer)
    if int(batch["i"]) == 4:
        raise ValueError("the step's own check fails between unscale_ and update")
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    return loss
"""


def test_a_step_that_raises_after_unscale_is_deterministic_over_times(project, tmp_path):
    # The GradScaler notes "unscale_ was called" until update(); a replay that raised before update() left that note,
    # and load_state_dict keeps it: the next replay's unscale_ raised "already been called" (verdict: flaky).
    mod = project("s10_scaler", SCALER)
    bundle = record_bundle(mod, {}, 8, tmp_path / "repros")
    report = reprokit.replay(bundle, times=3)
    assert [r.verdict for r in report.runs] == ["reproduced"] * 3, [r.failure and r.failure.message for r in report.runs]
    assert report.verdict == "deterministic" and report.fidelity["runs_bit_identical"]
