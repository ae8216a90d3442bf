"""A tiny seeded run recorded with durable=True that dies in step CRASH_STEP when the marker is in the batch.

``python rk_durable_die.py OUT CRASH_STEP`` (CRASH_STEP -1: no marker). Environment:
DIE_HOW   kill (SIGKILL itself, default), segv (a null read through ctypes) or abort (``os.abort()``)
STEPS     steps to run (60)
PAUSE     seconds to sleep after each step (0)
READY     a file written when step READY_AT (2) has run: the test knows the run is under way
HOLD      seconds to sleep after writing READY (0): the test kills the run from outside meanwhile
DEVICE    cpu (default) or cuda: model and batches there (a CUDA batch's record is written by the flight log's
          writer thread once its copy to the host has landed)
"""

import ctypes
import os
import signal
import sys
import time

import torch

import reprokit

MARKER = 12345.0


def build(config):
    torch.manual_seed(config["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(
        config.get("device", "cpu"))
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    x = batch["x"]
    if bool((x == MARKER).any()):
        how = os.environ.get("DIE_HOW", "kill")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segv":
            ctypes.string_at(0)
        elif how == "abort":
            os.abort()
    loss = torch.nn.functional.mse_loss(state.model(x), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


if __name__ == "__main__":
    out, crash_step = sys.argv[1], int(sys.argv[2])
    steps = int(os.environ.get("STEPS", "60"))
    pause = float(os.environ.get("PAUSE", "0"))
    ready_at = int(os.environ.get("READY_AT", "2"))
    device = os.environ.get("DEVICE", "cpu")
    cfg = {"seed": 0, "device": device}
    state = build(cfg)
    g = torch.Generator().manual_seed(1)
    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=out, snapshot_every=10,
                            durable=True)
    most = 0
    for step in range(steps):
        x = torch.randn(16, 4, generator=g)
        if step == crash_step:
            x[3, 2] = MARKER
        rec.step({"x": x.to(device), "y": torch.randn(16, 1, generator=g).to(device)})
        most = max(most, len(rec._flight.windows_on_disk()))
        if step == ready_at and os.environ.get("READY"):
            open(os.environ["READY"], "w").close()
            time.sleep(float(os.environ.get("HOLD", "0")))
        time.sleep(pause)
    flight = rec._flight.folder
    rec.close()
    print(f"windows at most {most}; after close {flight.exists()}")
