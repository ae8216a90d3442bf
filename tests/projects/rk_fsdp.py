"""An FSDP2 project (``fully_shard``) for torchrun with gloo on the CPU: rank 1 feeds a NaN at a chosen step.

Every rank holds only its own shards of the parameters and of AdamW's state, so each rank's bundle carries its
shards and replay must put them back on a mesh of as many ranks.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6: FSDP2 is not public yet
    from torch.distributed._composable.fsdp import fully_shard

import reprokit


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(config.get("device", "cpu"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).sum(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def main(out_dir: str, device: str = "cpu", fail_step: int = 6) -> None:
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    config = {"device": device}
    state = build(config)
    rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=out_dir, snapshot_every=4,
                            incident_wait_s=30)
    g = torch.Generator().manual_seed(rank)
    for step in range(12):
        x = torch.randn(8, 8, generator=g)
        if rank == 1 and step == fail_step:
            x[0, 0] = float("nan")
        rec.step({"x": x.to(device), "y": x.sum(1).to(device)})


if __name__ == "__main__":
    main(*sys.argv[1:3])
