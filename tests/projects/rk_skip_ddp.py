"""DDP on two CPU ranks (gloo) for ``on_failure="skip"``: rank 1's data holds one poisoned sample. ``skip`` trains
under a Recorder that skips it; ``clean`` trains the same batches without a Recorder, that sample left out of its
batch; ``rank0-raises`` skips on rank 1 only (rank 0 records with ``on_failure="raise"``, and stays up after its
failure until the launcher ends it). Each rank that finishes writes its final model, optimizer and RNG state to
``OUT/final-rank<k>.safetensors``."""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import reprokit

DIM, BATCH, STEPS, POISON_STEP, POISON_ROW = 8, 8, 40, 23, 3


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    if dist.is_available() and dist.is_initialized():
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    return loss


def poisoned_index() -> int:
    """Rank 1's poisoned sample: row POISON_ROW of its batch at POISON_STEP (indices are global: rank * 10**6 + i)."""
    return 10**6 + POISON_STEP * BATCH + POISON_ROW


def batches(rank: int, drop=()):
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(DIM, generator=torch.Generator().manual_seed(7))
    x = torch.randn(STEPS * BATCH, DIM, generator=g)
    y = x @ w
    base = rank * 10**6
    if rank == 1:
        x[POISON_STEP * BATCH + POISON_ROW, 2] = float("nan")
    for s in range(STEPS):
        rows = [i for i in range(s * BATCH, (s + 1) * BATCH) if base + i not in drop]
        idx = torch.tensor(rows)
        yield {"x": x[idx], "y": y[idx], "index": idx + base}


def main(out_dir: str, mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)  # dropout draws from each rank's own global generator
    state = build({})
    if mode in ("skip", "rank0-raises"):
        on_failure = "raise" if mode == "rank0-raises" and rank == 0 else "skip"
        rec = reprokit.Recorder(state, train_step, build=build, config={}, out_dir=out_dir, snapshot_every=10,
                                incident_wait_s=60 if mode == "skip" else 5, on_failure=on_failure)
        try:
            for batch in batches(rank):
                rec.step(batch)
        except reprokit.TrainingFailure:
            if mode == "rank0-raises" and rank == 0:
                # Stay up (the launcher ends every rank when one exits with an error): what rank 1 says is seen,
                # however long it takes to come to its decision.
                time.sleep(120)
            raise
        rec.close()
    else:
        for batch in batches(rank, drop={poisoned_index()}):
            train_step(state, batch)
    tensors = {f"model/{k}": v.contiguous() for k, v in state.model.state_dict().items()}
    for i, st in state.optimizer.state_dict()["state"].items():
        tensors.update({f"optimizer/{i}/{k}": v.reshape(-1).contiguous() for k, v in st.items()})
    tensors["rng/torch"] = torch.get_rng_state()
    save_file(tensors, str(Path(out_dir) / f"final-rank{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
