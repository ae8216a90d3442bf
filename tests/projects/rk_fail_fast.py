"""A DDP project for torchrun (gloo on the CPU, NCCL on GPUs) written as users write one: rank 1 raises inside its
forward at a chosen step, and the script's ``finally`` destroys the process group.

``python -m torch.distributed.run --nproc-per-node 2 rk_fail_fast.py OUT_DIR ON_INCIDENT [DEVICE] [EXIT_PATH]
[FAILURE] [STEP]`` (ON_INCIDENT: ``abort``, ``wait`` or ``default`` for the Recorder's own default; EXIT_PATH: ``destroy``,
the script's ``finally`` destroys the process group, or ``barrier``, it waits for every rank first, as scripts that
save a final checkpoint do. Under gloo a destroy never waits for a peer, a barrier does; under NCCL both can.
FAILURE: ``raise`` (the default), or ``kill``: rank 1's forward SIGKILLs its own process instead, as the OOM killer
would, and the Recorder is durable, so that its peer can tell it died and ``reprokit recover`` finds its window;
``kill-between``: the same while rank 0 spends 4 s loading its batch for that step, outside any collective. STEP:
the step rank 1 fails at, 17 by default; snapshots are taken every 8 steps.)
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import reprokit


class Net(nn.Module):
    def __init__(self, failure: str = "raise") -> None:
        super().__init__()
        self.failure = failure
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, boom: torch.Tensor) -> torch.Tensor:
        if bool(boom):
            if self.failure.startswith("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            raise IndexError("index 99 is out of bounds for dimension 0 with size 16")
        return self.body(x)


def build(config):
    torch.manual_seed(0)
    device = config.get("device", "cpu")
    model: nn.Module = Net(config.get("failure", "raise")).to(device)
    if dist.is_available() and dist.is_initialized():
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"], batch["boom"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


FAIL_STEP = 17


def main(out_dir: str, on_incident: str, device: str = "cpu", exit_path: str = "destroy", failure: str = "raise",
         fail_step: str = str(FAIL_STEP)) -> None:
    at = int(fail_step)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # A long timeout, as labs set one so that slow checkpoints do not trip it: only reprokit can end this job early.
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=600))
    try:
        rank = dist.get_rank()
        config = {"device": device, "failure": failure}
        state = build(config)
        options = {} if on_incident == "default" else {"on_incident": on_incident}
        rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=out_dir, snapshot_every=8,
                                incident_wait_s=20, durable=failure.startswith("kill"), **options)
        print(f"rank {rank} runs as pid {os.getpid()}", flush=True)
        g = torch.Generator().manual_seed(rank)
        for step in range(40):
            x = torch.randn(8, 8, generator=g)
            batch = {"x": x, "y": x.sum(1), "boom": torch.tensor(rank == 1 and step == at)}
            if device == "cuda":
                batch = {k: v.to(device) for k, v in batch.items()}
            if rank == 1 and step == at:
                how = "raises" if failure == "raise" else "is killed"
                print(f"rank 1 {how} at step {step} at t={time.time():.3f}", flush=True)
            if rank == 0 and step == at and failure == "kill-between":
                time.sleep(4.0)  # a slow data loader: rank 1 dies meanwhile, and no collective of rank 0's breaks
            try:
                rec.step(batch)
            except reprokit.PeerFailure:
                print(f"rank {rank} raises PeerFailure at t={time.time():.3f}", flush=True)
                raise
    finally:
        if exit_path == "barrier":
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:7])
