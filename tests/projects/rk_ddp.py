"""A DDP project for torchrun (gloo on the CPU, NCCL on GPUs): rank 1 fails at a chosen step: a NaN input, an
exception, or an out-of-range index (``assert``: on a GPU a device-side assert, which poisons that rank's CUDA
context; ``assert_with``: the same inside ``with Recorder(...)``; ``assert_durable``: the same with ``durable=True``)."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import reprokit


def build(config):
    torch.manual_seed(0)
    device = config.get("device", "cpu")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    if dist.is_available() and dist.is_initialized():
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


def train_step(state, batch):
    if bool(batch["boom"]):
        raise IndexError("index 99 is out of bounds on this rank")
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    if "idx" in batch:  # an index out of range: an IndexError on the CPU, a device-side assert on a GPU
        loss = loss * torch.ones(4, device=loss.device)[batch["idx"]].sum()  # a 1-d index: no host read of it
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def main(out_dir: str, mode: str, device: str = "cpu", replicated: str = "auto", budget: str = "",
         fail_step: int = 6) -> None:
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    config = {"device": device}
    state = build(config)
    small = budget.split(":") if budget else None  # "RANK:BYTES": a small host-memory budget on that rank only
    bytes_ = int(small[1]) if small and int(small[0]) == rank else None
    rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=out_dir, snapshot_every=4,
                            incident_wait_s=30, host_memory_budget=bytes_, durable=mode == "assert_durable",
                            replicated_state={"auto": "auto", "1": True, "0": False}[replicated])
    g = torch.Generator().manual_seed(rank)
    with rec if mode == "assert_with" else contextlib.nullcontext():
        for step in range(12):
            x = torch.randn(8, 8, generator=g)
            batch = {"x": x, "y": x.sum(1), "boom": torch.tensor(False)}
            if mode.startswith("assert"):
                batch["idx"] = torch.tensor([99 if rank == 1 and step == fail_step else 0])
            batch = {k: v.to(device) for k, v in batch.items()} if device == "cuda" else batch
            if rank == 1 and step == fail_step:
                if mode == "nan":
                    batch["x"][0, 0] = float("nan")
                elif mode == "raise":
                    batch["boom"] = torch.tensor(True)
            rec.step(batch)


if __name__ == "__main__":
    main(*sys.argv[1:6])
