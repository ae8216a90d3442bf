"""A tiny seeded project whose step fails when a marker value is in its batch.

As recorded, the step raises a RuntimeError there. The replay tests point ``--code`` at a copy with ``ON_MARKER``
changed, whose step dies instead: a segfault (a null read through ctypes), ``os.abort()``, a SIGKILL of its own
process, a ``SystemExit`` out of the step, a hang, or nothing at all (``"clean"``: the marker is ignored).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch

import reprokit

ON_MARKER = "raise"
MARKER = 1234.5
ROWS = 8


def build(config):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


def _at_marker():
    if ON_MARKER == "segv":
        ctypes.string_at(0)
    elif ON_MARKER == "abort":
        os.abort()
    elif ON_MARKER == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif ON_MARKER == "exit":
        raise SystemExit("the step gave up")
    elif ON_MARKER == "hang":
        time.sleep(600)
    elif ON_MARKER != "clean":
        raise RuntimeError(f"marker {MARKER} in the batch")


def train_step(state, batch):
    x = batch["x"]
    if (x == MARKER).any():
        _at_marker()
        x = torch.where(x == MARKER, torch.zeros_like(x), x)
    loss = torch.nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, marker_step, marker_row=5):
    """``steps`` seeded batches of :data:`ROWS` rows; the marker in row ``marker_row`` of step ``marker_step``."""
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        x, y = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, generator=g)
        if k == marker_step:
            x[marker_row, 2] = MARKER
        yield {"x": x, "y": y, "index": torch.arange(k * ROWS, (k + 1) * ROWS)}
