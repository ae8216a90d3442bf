"""rk_lightning's module under torchrun (DDP, gloo, 2 CPU processes): rank 1's data holds a sample without labels."""

from __future__ import annotations

import os
import sys

import torch
from rk_lightning import TinyLit, Tokens, trainer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from reprokit.integrations.lightning import ReprokitCallback


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    t = trainer([ReprokitCallback(out_dir=out_dir, snapshot_every=3, incident_wait_s=20)], strategy="ddp", devices=2,
                use_distributed_sampler=False)
    data = Tokens(n=48, ignored=41)  # not shuffled: rank 1 gets the odd samples, and its batch 5 starts with 41
    sampler = DistributedSampler(data, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                                 shuffle=False)
    t.fit(TinyLit(), DataLoader(data, batch_size=4, sampler=sampler))


if __name__ == "__main__":
    main(sys.argv[1])
